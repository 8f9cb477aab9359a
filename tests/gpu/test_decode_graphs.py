"""A decode step replayed from its bucket's CUDA graph (worker_svc/decode_graphs.py) gives the hidden states
the eager forward computes on the same inputs: the pending tokens taken from the step in flight's sampled ids
on the device, at batch sizes that fill a bucket and that pad one, one step after another (each replay must
see its own inputs, none of the last step's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.testing.tiny_models import make_tiny_model
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

MAX_NUM_SEQS = 32  # buckets 1, 2, 4, 8, 16, 32
MAX_MODEL_LEN = 160
MAX_BLOCKS_PER_SEQ = MAX_MODEL_LEN // BLOCK_SIZE
NUM_BLOCKS = MAX_NUM_SEQS * MAX_BLOCKS_PER_SEQ + 8
# (rows, bucket): a bucket filled (1, 4, 32) and padded (3 of 4, 13 of 16, 27 of 32), large after small.
STEPS = [(13, 16), (1, 1), (32, 32), (3, 4), (27, 32), (4, 4)]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    model, config = load_cuda_model(make_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=5))
    kv_caches = random_kv_caches(config, NUM_BLOCKS, seed=1)
    graphs = DecodeGraphs(model, kv_caches, MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ, BLOCK_SIZE, DEVICE)
    graphs.capture()
    return model, config, kv_caches, graphs


def test_each_replay_gives_the_eager_forwards_hidden_states(captured):
    """Bitwise against the eager forward over the same padded bucket (the same kernels on the same shapes:
    a difference can only be the replay's), and within float32 rounding of the eager forward over the real
    rows alone (what the worker runs without graphs). Every other row's input token is pending."""
    model, config, kv_caches, graphs = captured
    rng = np.random.default_rng(0)
    for num_seqs, bucket in STEPS:
        contexts = rng.integers(0, MAX_MODEL_LEN - 1, size=num_seqs).tolist()
        step = build_step(contexts, [1] * num_seqs, pending=list(range(0, num_seqs, 2)), num_blocks=NUM_BLOCKS,
                          vocab_size=config.vocab_size, rng=rng)
        assert graphs.bucket_for(step.inputs) == bucket
        with torch.inference_mode():
            replayed = graphs.run(step.inputs, bucket, step.previous_sampled).clone()
        padded = eager_hidden(model, kv_caches, step, num_tokens=bucket, num_seqs=bucket,
                              table_width=MAX_BLOCKS_PER_SEQ)
        assert_replay_is_eager(replayed, padded, eager_hidden(model, kv_caches, step),
                               f"{num_seqs} rows in bucket {bucket}")


def test_a_step_with_prefill_or_too_many_rows_replays_no_graph(captured):
    config, graphs = captured[1], captured[3]
    rng = np.random.default_rng(1)
    chunk = build_step([0, 5], [1, 7], pending=[0], num_blocks=NUM_BLOCKS, vocab_size=config.vocab_size, rng=rng)
    assert graphs.bucket_for(chunk.inputs) is None
    many = build_step([3] * (MAX_NUM_SEQS + 1), [1] * (MAX_NUM_SEQS + 1), pending=[], num_blocks=NUM_BLOCKS,
                      vocab_size=config.vocab_size, rng=rng)
    assert graphs.bucket_for(many.inputs) is None
