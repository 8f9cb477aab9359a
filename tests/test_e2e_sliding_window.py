"""End to end through the real processes, models whose attention slides: greedy output equals transformers' token
for token for tiny Mistral (window 20, every layer) and Qwen2 (window 12 from layer 1 on) on prompts and
generations longer than the window, alone and concurrently, on a prefix-cache hit, and under preemption by
recompute and by swap. One server per (model, preemption mode) serves every case of this module; its pool of 10
blocks of 16 tokens holds any one request but not 16 at once. The scheduler keeps every block of a request,
also those wholly before every window (no freeing of out-of-window blocks yet).
"""

from __future__ import annotations

import random

import pytest

from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import QWEN2_SLIDING_WINDOW, make_tiny_model
from tests.test_e2e_greedy import MAX_TOKENS, _assert_matches_transformers, _generate_all, _prompts

SERVERS = {"mistral-recompute": ("mistral", {}, "recompute"), "qwen2-swap": ("qwen2", QWEN2_SLIDING_WINDOW, "swap")}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def served(request, tmp_path_factory):
    """(model dir, preemption mode, running server)."""
    arch, overrides, mode = SERVERS[request.param]
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), arch, seed=3, **overrides)
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model_dir), "--num-kv-blocks", "10",
                        "--preemption-mode", mode, "--swap-space", "0.01") as server:
        yield model_dir, mode, server


@pytest.fixture
def server(served):
    return served[2]


pytestmark = pytest.mark.usefixtures("no_block_leaks")


def test_greedy_past_the_window_matches_transformers_alone_and_concurrently(served):
    model_dir, _, server = served
    prompts = _prompts(4, seed=1)
    with server.client() as client:
        alone = client.generate(prompts[0], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    _assert_matches_transformers(model_dir, prompts[:1], [alone])
    _assert_matches_transformers(model_dir, prompts[1:], _generate_all(server, prompts[1:]))


def test_prefix_cache_hit_past_the_window_matches_transformers(served):
    """The second prompt shares the first's 40 tokens (two full blocks, past every window) and goes on."""
    model_dir, _, server = served
    rng = random.Random(7)
    first = [rng.randrange(512) for _ in range(40)]
    second = first + [rng.randrange(512) for _ in range(9)]
    with server.client() as client:
        before = client.stats().prefix_cache_hit_tokens
        results = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for p in (first, second)]
        hits = client.stats().prefix_cache_hit_tokens - before
    assert hits >= 32, "the second request was meant to reuse the first's two full blocks"
    _assert_matches_transformers(model_dir, [first, second], results)


def test_greedy_past_the_window_matches_transformers_under_preemption(served):
    model_dir, mode, server = served
    prompts = _prompts(16, seed=2)
    with server.client() as client:
        before = client.stats()
    results = _generate_all(server, prompts)
    after = server.wait_all_blocks_free()
    _assert_matches_transformers(model_dir, prompts, results)
    assert after.num_preemptions > before.num_preemptions, "the pool was meant to force preemption"
    swapped = after.num_swapped_out_blocks > before.num_swapped_out_blocks
    assert swapped == (mode == "swap")
