"""A step with prefill replayed from its token-count bucket's piecewise CUDA graphs, attention run eagerly
between the pieces (worker_svc/mixed_graphs.py), gives the hidden states the eager forward computes on the same
inputs: decodes (their input tokens pending, taken on the device as the worker takes them) beside prefill
chunks that start mid-context, at token counts that pad a bucket and one that fills it, one step after
another."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
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
from worker_svc.decode_graphs import take_pending_tokens
from worker_svc.host_to_device import to_device
from worker_svc.layers.attention import Attention
from worker_svc.mixed_graphs import BUCKET, MixedGraphs, supports_mixed_graphs

NUM_BLOCKS = 256
# (context lengths, query lengths) of each step: decodes first, then chunks; then its bucket.
STEPS = [
    ([40, 7, 90, 20], [1, 1, 1, 100], 128),  # 103 tokens: pads 128
    ([0, 33], [64, 64], 128),  # exactly one bucket, no decodes
    ([5, 60, 120, 3, 11, 0, 100], [1, 1, 1, 1, 1, 300, 397], 768),  # 702 tokens (positions < 512, the model's)
    ([70, 16], [1, 40], 128),  # small after large
]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    model, config = load_cuda_model(make_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=6))
    attention = [module for module in model.modules() if isinstance(module, Attention)]
    assert supports_mixed_graphs(model, 1, attention[0].backend)
    kv_caches = random_kv_caches(config, NUM_BLOCKS, seed=2)
    graphs = MixedGraphs(model, kv_caches, attention, attention[0].backend, BLOCK_SIZE, DEVICE)
    graphs.capture()
    return model, config, kv_caches, graphs


def test_each_replay_gives_the_eager_forwards_hidden_states(captured):
    """Bitwise against the eager forward over the same padded token count (the pieces run the kernels the
    eager forward runs on those shapes, attention over the same metadata), and within float32 rounding of the
    eager forward over the real tokens alone (what the worker runs without graphs)."""
    model, config, kv_caches, graphs = captured
    rng = np.random.default_rng(0)
    for contexts, queries, bucket in STEPS:
        decodes = [row for row, query in enumerate(queries) if query == 1]
        step = build_step(contexts, queries, pending=decodes[::2], num_blocks=NUM_BLOCKS,
                          vocab_size=config.vocab_size, rng=rng)
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
            replayed = graphs.run(input_ids, inputs.positions, metadata, inputs.slot_mapping, bucket).clone()
        padded = eager_hidden(model, kv_caches, step, num_tokens=bucket)
        assert replayed.shape == (num_tokens, config.hidden_size)
        assert_replay_is_eager(replayed, padded, eager_hidden(model, kv_caches, step),
                               f"{num_tokens} tokens in bucket {bucket}")


def test_steps_past_the_largest_bucket_run_eagerly(captured):
    graphs = captured[3]
    assert graphs.bucket_for(graphs.sizes[-1]) == graphs.sizes[-1]
    assert graphs.bucket_for(graphs.sizes[-1] + 1) is None
    assert graphs.bucket_for(1) == BUCKET
