"""Steps over a tiny model on the GPU for the CUDA-graph tests (test_decode_graphs.py, test_mixed_graphs.py):
the model with the kernels a worker runs there (Triton attention and layer ops), a KV pool of random contents,
one step's inputs as the persistent batch builds them, and the eager forward the graphs must reproduce.

Why float32: a graph replay and an eager forward run the same kernels, so what they compute can be held to
bits (over the same padded shapes) or to float32 rounding (the real rows alone, where cuBLAS and the decode
kernel's KV split pick by row count); a lost input, a stale buffer or a skipped piece is off by far more.

Why the pending tokens' host ids hold a wrong but valid token rather than PENDING_TOKEN (-1): a replay that
forgot to take them from the step in flight must show as wrong hidden states, not as an out-of-range
embedding index, whose device-side assert would end the process and every test after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # Linux only: elsewhere the modules that import this are skipped

from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels.layer_ops import triton_layer_ops  # noqa: E402
from kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from worker_svc.models.model_loader import load_model  # noqa: E402
from worker_svc.persistent_batch import StepInputs  # noqa: E402

BLOCK_SIZE = 16
DEVICE = torch.device("cuda")
# Hidden states of the real rows against the eager forward over those rows alone: float32 rounding of sums
# taken in another order (the values are O(1); anything broken is off by O(1)).
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def load_cuda_model(model_dir):
    """(model, model_config) in float32 on the GPU, with the worker's GPU kernels."""
    return load_model(model_dir, torch.float32, DEVICE, attention_backend=TritonAttentionBackend(),
                      layer_ops=triton_layer_ops())


def random_kv_caches(model_config, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """One `[2, num_blocks, BLOCK_SIZE, Hkv, D]` pool per layer of random K/V: every context token attends to
    something, and the same thing in the replay and the eager forward (each writes only its own step's slots,
    the same values, before it reads them)."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (2, num_blocks, BLOCK_SIZE, model_config.num_key_value_heads, model_config.head_dim)
    return [torch.randn(shape, generator=generator, device=DEVICE) for _ in range(model_config.num_hidden_layers)]


@dataclass(frozen=True)
class Step:
    """One scheduled step: `inputs` as the worker gets them (pending tokens' ids not on the host),
    `input_ids` with those filled in, and the step in flight's sampled ids on the device."""

    inputs: StepInputs
    input_ids: np.ndarray
    previous_sampled: torch.Tensor


def build_step(context_lens: list[int], query_lens: list[int], pending: list[int], num_blocks: int,
               vocab_size: int, rng: np.random.Generator) -> Step:
    """Sequence i has `context_lens[i]` tokens in the pool and schedules `query_lens[i]` more (decodes, one
    token, first); the rows in `pending` are decodes whose input token the step in flight samples. Blocks
    are distinct, drawn at random from the pool."""
    seq_lens = np.asarray(context_lens) + np.asarray(query_lens)
    blocks_needed = -(-seq_lens // BLOCK_SIZE)
    pool = rng.permutation(num_blocks)
    width = int(blocks_needed.max())
    tables = np.zeros((len(seq_lens), width), dtype=np.int64)
    start = 0
    for i, count in enumerate(blocks_needed):
        tables[i, :count] = pool[start : start + count]
        start += count
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    token_row = np.repeat(np.arange(len(seq_lens)), query_lens)
    slot_mapping = tables[token_row, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
    input_ids = rng.integers(3, vocab_size, size=len(positions))
    previous_sampled = rng.integers(3, vocab_size, size=len(seq_lens) + 3)
    sources = rng.permutation(len(previous_sampled))[: len(pending)]
    pending_indices = query_start_loc[np.asarray(pending, dtype=np.int64)]
    assert all(query_lens[row] == 1 for row in pending), "only a decode's input token can be pending"
    input_ids[pending_indices] = previous_sampled[sources]
    host_ids = input_ids.copy()
    host_ids[pending_indices] = (input_ids[pending_indices] + 1) % vocab_size  # stale on the host
    num_decodes = int(np.argmax(np.asarray(query_lens) != 1)) if any(q != 1 for q in query_lens) else len(query_lens)
    rows = np.arange(len(seq_lens))
    inputs = StepInputs(
        rows=rows, input_ids=host_ids, positions=positions, slot_mapping=slot_mapping,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=tables, sample_rows=rows,
        sample_offsets=np.zeros(len(rows), dtype=np.int64), logits_indices=query_start_loc[1:] - 1,
        num_draft_tokens=0, num_decode_seqs=num_decodes,
        pending_input_indices=pending_indices, pending_sources=sources)
    return Step(inputs, input_ids, torch.as_tensor(previous_sampled, device=DEVICE))


def eager_hidden(model, kv_caches: list[torch.Tensor], step: Step, num_tokens: int | None = None,
                 num_seqs: int | None = None, table_width: int | None = None,
                 lora_token_slots: np.ndarray | None = None) -> torch.Tensor:
    """The eager forward over the step's tokens (pending ones filled in), as the worker runs it without graphs;
    with `num_tokens`, over that many tokens, the tail padding (token 0, position 0, slot -1); with `num_seqs`
    (decodes), that many sequences, the tail of no context (seq_len 0), as a decode graph's bucket; with
    `table_width`, block tables that wide (the decode graphs' buffer); with `lora_token_slots`, each token's LoRA
    adapter slot (the padding's -1). Returns every token's hidden states."""
    inputs = step.inputs
    tokens = num_tokens or len(step.input_ids)
    seqs = num_seqs or len(inputs.seq_lens)

    def padded(array, length, fill):
        out = np.full(length, fill, dtype=np.int64)
        out[: len(array)] = array
        return torch.as_tensor(out, device=DEVICE)

    real_width = inputs.block_tables.shape[1]
    tables = np.zeros((seqs, table_width or real_width), dtype=np.int64)
    tables[: len(inputs.seq_lens), :real_width] = inputs.block_tables
    query_start_loc = inputs.query_start_loc if num_seqs is None else np.arange(seqs + 1)
    metadata = AttentionMetadata(
        slot_mapping=padded(inputs.slot_mapping, tokens, -1),
        query_start_loc=torch.as_tensor(query_start_loc, dtype=torch.int32, device=DEVICE),
        seq_lens=padded(inputs.seq_lens, seqs, 0).to(torch.int32),
        block_tables=torch.as_tensor(tables, dtype=torch.int32, device=DEVICE),
        block_size=BLOCK_SIZE,
        num_decode_seqs=seqs if num_seqs is not None else inputs.num_decode_seqs,
        lora_token_slots=None if lora_token_slots is None else padded(lora_token_slots, tokens, -1),
    )
    with torch.inference_mode():
        return model(padded(step.input_ids, tokens, 0), padded(inputs.positions, tokens, 0), kv_caches, metadata)


def assert_replay_is_eager(replayed: torch.Tensor, padded: torch.Tensor, alone: torch.Tensor, what: str) -> None:
    """A replay's hidden states against the eager forward's: bit for bit over the same padding (`padded`, the
    replay's token count, of which its real rows come first), within TOLERANCE over the real tokens alone."""
    real = padded[: len(replayed)]
    assert replayed.shape == alone.shape
    assert torch.equal(replayed, real), (
        f"{what}: the replay differs from the eager forward over the same padded bucket by up to "
        f"{(replayed - real).abs().max().item():.3g}")
    torch.testing.assert_close(replayed, alone, **TOLERANCE, msg=lambda message: f"{what}: {message}")
