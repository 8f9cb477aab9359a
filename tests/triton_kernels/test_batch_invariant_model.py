"""A whole tiny model on the batch-invariant Triton set (layer ops + attention backend): a request's logits at
every step are bitwise the same served alone or batched with others, prefilled whole or in chunks.

Why at the model level too: the kernels' tests prove each op invariant; this proves the model calls nothing
else that reduces over rows (every linear layer and the LM head through `ops.linear`, the norms, attention),
and that the ops compose (the residual stream, the MoE's routing). CPU interpreter, fp32 and bf16. The same test on
the regular Triton set (triton_layer_ops() and TritonAttentionBackend, split-KV or not) fails: the logits
differ by up to 5e-6 (measured on the tiny Llama when this was written).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kernels.batch_invariant_layer_ops import batch_invariant_triton_layer_ops
from kernels.triton_batch_invariant_attention import BatchInvariantTritonBackend
from pagedserve.testing.paged_runner import build_metadata, make_kv_caches, shuffled_block_tables
from pagedserve.testing.tiny_models import make_tiny_model
from worker_svc.models.model_loader import load_model


def greedy_step_logits(model, config, prompts, max_new_tokens, prefill_chunk=None, seed=0, block_size=16):
    """Per prompt, the logits [steps, vocab] of each token it generated greedily, all prompts batched each step
    (at most `prefill_chunk` new tokens a sequence a step: chunked prefills beside decodes), on the model's
    device (tests/gpu/test_batch_invariance_gpu.py runs this on a GPU)."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    capacity = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]
    tables = shuffled_block_tables(capacity, sum(capacity) + 3, rng)
    kv_caches = [cache.to(device) for cache in
                 make_kv_caches(config, sum(capacity) + 3, block_size, next(model.parameters()).dtype)]
    tokens = [list(p) for p in prompts]
    num_computed = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(rows) < max_new_tokens for rows in logits):
        active = [i for i, rows in enumerate(logits) if len(rows) < max_new_tokens]
        query_lens = [min(len(tokens[i]) - num_computed[i], prefill_chunk or len(tokens[i])) for i in active]
        input_ids = [t for i, q in zip(active, query_lens) for t in tokens[i][num_computed[i]: num_computed[i] + q]]
        positions = [p for i, q in zip(active, query_lens) for p in range(num_computed[i], num_computed[i] + q)]
        seq_lens = [num_computed[i] + q for i, q in zip(active, query_lens)]
        metadata = build_metadata([tables[i] for i in active], seq_lens, query_lens, block_size)
        metadata = dataclasses.replace(metadata, **{field: getattr(metadata, field).to(device) for field in
                                                    ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
        with torch.no_grad():
            hidden = model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), kv_caches,
                           metadata)
            step_logits = model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1])
        for row, (i, query_len) in enumerate(zip(active, query_lens)):
            num_computed[i] += query_len
            if num_computed[i] == len(tokens[i]):
                tokens[i].append(int(step_logits[row].argmax()))
                logits[i].append(step_logits[row])
    return [torch.stack(rows) for rows in logits]


# Gemma 2: sliding-window and global layers alternate (its tiny config fixes 3), attention and final logit
# soft-caps (the final one through ops.per_row), Gemma's (1 + w) norms and GELU-and-mul.
@pytest.mark.parametrize("arch,num_layers,dtype", [
    ("llama", 2, torch.float32), ("qwen3_moe", 2, torch.float32), ("gemma2", 3, torch.float32),
    ("llama", 2, torch.bfloat16),
])
def test_a_requests_logits_do_not_depend_on_its_batch_or_chunking(arch, num_layers, dtype, tmp_path):
    assert_logits_alone_batched_and_chunked_agree(arch, num_layers, dtype, tmp_path, "cpu")


def assert_logits_alone_batched_and_chunked_agree(arch, num_layers, dtype, tmp_path, device) -> None:
    """A request's greedy-step logits alone, among two others, and prefilled in chunks among them: the same bits
    (on the CPU under the interpreter, and on a GPU in tests/gpu/test_batch_invariance_gpu.py)."""
    path = make_tiny_model(tmp_path, arch=arch, seed=0, num_hidden_layers=num_layers)
    model, config = load_model(path, dtype, device, attention_backend=BatchInvariantTritonBackend(),
                               layer_ops=batch_invariant_triton_layer_ops(device))
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=generator).tolist() for n in (19, 33, 6)]
    alone = greedy_step_logits(model, config, prompts[:1], max_new_tokens=3)[0]
    batched = greedy_step_logits(model, config, prompts, max_new_tokens=3, seed=1)[0]
    chunked = greedy_step_logits(model, config, prompts[::-1], max_new_tokens=3, prefill_chunk=7, seed=2)[-1]
    assert torch.equal(batched, alone)
    assert torch.equal(chunked, alone)
