"""End to end through the real processes on tiny Mixtral and Qwen3-MoE models: greedy output equals
transformers' token for token with concurrent requests, prefix-cache hits, chunked prefill and preemption by
recompute, one server per model shared by the module's cases."""

from __future__ import annotations

import random

import pytest

from pagedserve.testing.hf_reference import hf_greedy
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model
from tests.test_e2e_greedy import MAX_TOKENS, _generate_all  # one server's greedy requests, as there

NUM_KV_BLOCKS = 12  # of 16 tokens: any one request fits (at most 70 + 24 tokens), sixteen at once do not


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def served(request, tmp_path_factory):
    """(model dir, running server): chunked prefill (24-token budget), prefix caching on, a small KV pool."""
    model = make_tiny_model(tmp_path_factory.mktemp("models"), request.param, seed=7)
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--num-kv-blocks",
                        str(NUM_KV_BLOCKS), "--max-num-batched-tokens", "24") as server:
        yield model, server


def _assert_matches_transformers(model, prompts, results) -> None:
    for prompt, result in zip(prompts, results):
        assert list(result.token_ids) == hf_greedy(model, prompt, MAX_TOKENS)
        assert result.finish_reason == "length" and result.completion_tokens == MAX_TOKENS


def test_concurrent_requests_sharing_a_prefix_hit_the_cache_and_equal_transformers(served):
    model, server = served
    rng = random.Random(1)
    prefix = [rng.randrange(512) for _ in range(40)]
    prompts = [prefix + [rng.randrange(512) for _ in range(rng.randrange(1, 20))] for _ in range(5)]
    before = server.wait_all_blocks_free()
    results = _generate_all(server, prompts[:1]) + _generate_all(server, prompts[1:])  # the first fills the cache
    after = server.wait_all_blocks_free()
    _assert_matches_transformers(model, prompts, results)
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens >= 4 * 32
    assert after.num_free_kv_blocks == after.num_kv_blocks


def test_greedy_equals_transformers_under_preemption(served):
    model, server = served
    rng = random.Random(2)
    prompts = [[rng.randrange(512) for _ in range(length)] for length in (5, 17, 31, 40, 9, 23, 15, 33, 47, 3,
                                                                           29, 12, 50, 7, 35, 70)]
    before = server.wait_all_blocks_free()
    results = _generate_all(server, prompts)
    after = server.wait_all_blocks_free()
    _assert_matches_transformers(model, prompts, results)
    assert after.num_preemptions > before.num_preemptions, "the pool was meant to force preemption"
    assert after.num_free_kv_blocks == after.num_kv_blocks == NUM_KV_BLOCKS
