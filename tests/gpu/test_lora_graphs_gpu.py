"""LoRA under CUDA graphs (worker_svc/decode_graphs.py `with_lora`): a decode graph captured with the adapters'
delta, replayed over steps mixing three adapters' rows (ranks 4, 8, 16) and base rows, gives the eager forward's
hidden states (bit for bit over the same padded bucket, within float32 rounding over the real rows alone); a step
without adapter rows through the same graphs is the base model's, bit for bit (the delta kernels skip slot -1); a
slot loaded again after the capture (on the load stream, in place) is what the next replay reads."""

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
from worker_svc.decode_graphs import DecodeGraphs
from worker_svc.lora_adapters import LoraAdapterSlots

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
