"""LoRA under CUDA graphs (worker_svc/decode_graphs.py `with_lora`): a decode graph captured with the adapters'
delta, replayed over steps mixing three adapters' rows (ranks 4, 8, 16) and base rows, gives the eager forward's
hidden states (bit for bit over the same padded bucket, within float32 rounding over the real rows alone); a step
without adapter rows through the same graphs is the base model's, bit for bit (the delta kernels skip slot -1); a
slot loaded again after the capture (on the load stream, in place) is what the next replay reads. Steps with prefill
through the piecewise graphs captured with LoRA (worker_svc/mixed_graphs.py) likewise."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from pagedserve.testing.tiny_lora import write_random_adapter
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from tests.gpu.graph_steps import (
    BLOCK_SIZE,
    DEVICE,
    assert_replay_is_eager,
    build_step,
    eager_hidden,
    load_cuda_model,
    random_kv_caches,
)
from kernels.attention_metadata import AttentionMetadata
from worker_svc.decode_graphs import DecodeGraphs, take_pending_tokens
from worker_svc.graph_dispatcher import BASE_ONLY_DECODE_ROWS, GraphDispatcher
from worker_svc.host_to_device import to_device
from worker_svc.layers.attention import Attention
from worker_svc.lora_adapters import LoraAdapterSlots
from worker_svc.mixed_graphs import MixedGraphs

MAX_NUM_SEQS = 16  # buckets 1, 2, 4, 8, 16
MAX_MODEL_LEN = 160
MAX_BLOCKS_PER_SEQ = MAX_MODEL_LEN // BLOCK_SIZE
NUM_BLOCKS = MAX_NUM_SEQS * MAX_BLOCKS_PER_SEQ + 8
RANKS = (4, 8, 16)
STEPS = [(13, 16), (1, 1), (3, 4), (16, 16), (6, 8)]  # (rows, bucket)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-graphs")
    model_dir = make_tiny_model(root / "model", "llama", seed=5)
    model, config = load_cuda_model(model_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())
    adapters = [write_random_adapter(hf_config, root / f"adapter{index}", rank, seed=index)
                for index, rank in enumerate(RANKS)]
    slots = LoraAdapterSlots(model, len(RANKS), max(RANKS), len(RANKS) + 1, DEVICE, torch.float32)
    slots.load([worker_pb2.LoraLoad(slot=index + 1, name=f"adapter{index}", path=str(path))
                for index, path in enumerate(adapters)])
    slots.wait_for_loads(np.arange(len(RANKS)))
    kv_caches = random_kv_caches(config, NUM_BLOCKS, seed=1)
    graphs = DecodeGraphs(model, kv_caches, MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ, BLOCK_SIZE, DEVICE, with_lora=True)
    graphs.capture()
    return model, config, hf_config, kv_caches, graphs, slots, root


def lora_step(config, rng, num_seqs: int, with_adapters: bool):
    contexts = rng.integers(0, MAX_MODEL_LEN - 1, size=num_seqs).tolist()
    step = build_step(contexts, [1] * num_seqs, pending=list(range(0, num_seqs, 2)), num_blocks=NUM_BLOCKS,
                      vocab_size=config.vocab_size, rng=rng)
    if not with_adapters:
        return step, None
    token_slots = rng.integers(-1, len(RANKS), size=num_seqs)  # every adapter and the base model mixed
    token_slots[: min(num_seqs, len(RANKS) + 1)] = np.arange(-1, len(RANKS))[: num_seqs]
    return dataclasses.replace(step, inputs=dataclasses.replace(step.inputs, lora_token_slots=token_slots)), token_slots


def replay_against_eager(captured, step, token_slots, bucket: int, what: str) -> None:
    model, _, _, kv_caches, graphs, _, _ = captured
    assert graphs.bucket_for(step.inputs) == bucket
    with torch.inference_mode():
        replayed = graphs.run(step.inputs, bucket, step.previous_sampled).clone()
    padded = eager_hidden(model, kv_caches, step, num_tokens=bucket, num_seqs=bucket, table_width=MAX_BLOCKS_PER_SEQ,
                          lora_token_slots=token_slots)
    alone = eager_hidden(model, kv_caches, step, lora_token_slots=token_slots)
    assert_replay_is_eager(replayed, padded, alone, what)


def test_replays_with_adapter_and_base_rows_give_the_eager_forwards_hidden_states(captured):
    config = captured[1]
    rng = np.random.default_rng(0)
    for num_seqs, bucket in STEPS:
        step, token_slots = lora_step(config, rng, num_seqs, with_adapters=True)
        replay_against_eager(captured, step, token_slots, bucket, f"{num_seqs} rows in bucket {bucket}")
        adapter_rows = torch.as_tensor(token_slots >= 0, device=DEVICE)
        if adapter_rows.any():
            base = eager_hidden(captured[0], captured[3], step)[adapter_rows]
            with_adapters = eager_hidden(captured[0], captured[3], step, lora_token_slots=token_slots)[adapter_rows]
            assert not torch.allclose(base, with_adapters), "the adapters changed nothing"


def test_a_step_without_adapter_rows_replays_the_base_model(captured):
    config = captured[1]
    rng = np.random.default_rng(1)
    for num_seqs, bucket in STEPS:
        step, _ = lora_step(config, rng, num_seqs, with_adapters=False)
        replay_against_eager(captured, step, None, bucket, f"base step of {num_seqs} rows")


def test_a_slot_loaded_again_after_the_capture_is_what_the_replay_reads(captured):
    _, config, hf_config, _, _, slots, root = captured
    other = write_random_adapter(hf_config, root / "other", 16, seed=9)
    slots.load([worker_pb2.LoraLoad(slot=2, name="other", path=str(other))])
    rng = np.random.default_rng(2)
    step, token_slots = lora_step(config, rng, 5, with_adapters=True)
    slots.wait_for_loads(token_slots)  # as the model runner does before the forward
    replay_against_eager(captured, step, token_slots, 8, "slot 2 reloaded")


# (context lengths, query lengths) of steps with prefill, decodes first; then the bucket.
MIXED_STEPS = [([40, 7, 90, 20], [1, 1, 1, 100], 128), ([5, 60, 0, 33], [1, 1, 64, 64], 256)]


def test_steps_with_prefill_through_the_piecewise_graphs_with_adapter_rows_give_the_eager_forwards(captured):
    model, config, _, kv_caches, _, _, _ = captured
    attention = [module for module in model.modules() if isinstance(module, Attention)]
    graphs = MixedGraphs(model, kv_caches, attention, attention[0].backend, BLOCK_SIZE, DEVICE, with_lora=True)
    graphs.capture()
    rng = np.random.default_rng(3)
    for contexts, queries, bucket in MIXED_STEPS:
        decodes = [row for row, query in enumerate(queries) if query == 1]
        step = build_step(contexts, queries, pending=decodes[::2], num_blocks=NUM_BLOCKS,
                          vocab_size=config.vocab_size, rng=rng)
        row_slots = np.arange(len(queries)) % (len(RANKS) + 1) - 1  # base, adapter 0, 1, 2, base, ...
        token_slots = np.repeat(row_slots, queries)
        inputs, num_tokens = step.inputs, sum(queries)
        assert graphs.bucket_for(num_tokens) == bucket
        with torch.inference_mode():
            input_ids = to_device(inputs.input_ids, DEVICE, torch.long)
            take_pending_tokens(input_ids, inputs, step.previous_sampled)
            metadata = AttentionMetadata(
                slot_mapping=to_device(inputs.slot_mapping, DEVICE, torch.long),
                query_start_loc=to_device(inputs.query_start_loc, DEVICE, torch.int32),
                seq_lens=to_device(inputs.seq_lens, DEVICE, torch.int32),
                block_tables=to_device(inputs.block_tables, DEVICE, torch.int32),
                block_size=BLOCK_SIZE, num_decode_seqs=inputs.num_decode_seqs)
            replayed = graphs.run(input_ids, inputs.positions, metadata, inputs.slot_mapping, bucket,
                                  token_slots).clone()
        padded = eager_hidden(model, kv_caches, step, num_tokens=bucket, lora_token_slots=token_slots)
        alone = eager_hidden(model, kv_caches, step, lora_token_slots=token_slots)
        assert_replay_is_eager(replayed, padded, alone, f"{num_tokens} tokens with adapters in bucket {bucket}")


def test_the_dispatcher_replays_base_only_decode_steps_without_the_delta_kernels(captured):
    """GraphDispatcher.captured with LoRA: a small step without adapter rows takes the decode graphs captured without
    the delta (and gives the eager base forward), a step with adapter rows the graphs captured with it, and a base
    step above BASE_ONLY_DECODE_ROWS the LoRA graphs too."""
    model, config, _, kv_caches, _, _, _ = captured
    dispatcher = GraphDispatcher.captured(model, kv_caches, BLOCK_SIZE, DEVICE, 2 * BASE_ONLY_DECODE_ROWS,
                                          MAX_BLOCKS_PER_SEQ, 1, 0, with_lora=True)
    rng = np.random.default_rng(3)
    for num_seqs, bucket in ((1, 1), (6, 8), (BASE_ONLY_DECODE_ROWS, BASE_ONLY_DECODE_ROWS)):
        step, _ = lora_step(config, rng, num_seqs, with_adapters=False)
        path, size = dispatcher.choose(step.inputs)
        assert (path.name, path.graphs.with_lora, size) == ("decode graph", False, bucket)
        with torch.inference_mode():
            replayed = dispatcher.forward(step.inputs, step.previous_sampled).clone()
        padded = eager_hidden(model, kv_caches, step, num_tokens=bucket, num_seqs=bucket,
                              table_width=MAX_BLOCKS_PER_SEQ)
        assert_replay_is_eager(replayed, padded, eager_hidden(model, kv_caches, step), f"base step of {num_seqs}")
        with_adapters, _ = lora_step(config, rng, num_seqs, with_adapters=True)
        path, size = dispatcher.choose(with_adapters.inputs)
        assert (path.name, path.graphs.with_lora, size) == ("decode graph", True, bucket)
    above, _ = lora_step(config, rng, BASE_ONLY_DECODE_ROWS + 1, with_adapters=False)
    path, _ = dispatcher.choose(above.inputs)
    assert path.graphs.with_lora
