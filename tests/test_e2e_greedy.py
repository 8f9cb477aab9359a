"""End to end through the real processes (client -> gRPC -> scheduler -> ZeroMQ -> worker -> back): greedy
output equals transformers' token for token on tiny random models of each architecture family (Llama, Qwen2,
Qwen3, Gemma 1/2/3, OPT; the Gemma 2/3 ones with an 8-token sliding window, far shorter than the prompts), alone,
concurrently, from prefix-cache hits with chunked prefill, and under preemption by recompute and by swap."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.testing.hf_reference import hf_greedy
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model

MAX_TOKENS = 24
# Lengths around and between block boundaries (block size 16), none of the concurrent ones a multiple.
PROMPT_LENGTHS = [5, 17, 31, 40, 9, 23, 15, 33, 47, 3, 29, 12, 50, 7, 35, 21]


def _prompts(count: int, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])] for i in range(count)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "opt"])
def tiny_model(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), request.param, seed=3)


def _generate_all(server, prompts: list[list[int]]) -> list:
    def one(prompt):
        with server.client() as client:
            return client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _assert_matches_transformers(model_dir, prompts, results):
    for prompt, result in zip(prompts, results):
        expected = hf_greedy(model_dir, prompt, MAX_TOKENS)
        assert list(result.token_ids) == expected
        assert result.finish_reason == "length"
        assert result.completion_tokens == MAX_TOKENS and result.prompt_tokens == len(prompt)


def test_greedy_matches_transformers_alone_and_concurrently(tiny_model, tmp_path):
    prompts = _prompts(9, seed=1)
    references = [hf_greedy(tiny_model, p, MAX_TOKENS) for p in prompts]
    assert len({t for ref in references for t in ref}) > MAX_TOKENS, "the model must not repeat one token"
    with running_server(tmp_path, "--model", str(tiny_model)) as server:
        with server.client() as client:
            alone = client.generate(prompts[0], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        _assert_matches_transformers(tiny_model, prompts[:1], [alone])
        concurrent = _generate_all(server, prompts[1:])
        _assert_matches_transformers(tiny_model, prompts[1:], concurrent)
        stats = server.wait_all_blocks_free()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_prefix_cache_hits_and_chunked_prefill_match_transformers(tiny_model, tmp_path):
    """Prompts sharing a 35-token prefix after one that cached it, in chunks of at most 12 tokens (each chunk
    crosses the 8-token window of the windowed layers, and the cached prefix is longer than the window)."""
    rng = random.Random(4)
    shared = [rng.randrange(512) for _ in range(35)]
    prompts = [shared + [rng.randrange(512) for _ in range(n)] for n in (4, 11, 1, 19)]
    with running_server(tmp_path, "--model", str(tiny_model), "--max-num-batched-tokens", "12") as server:
        first = _generate_all(server, prompts[:1])
        rest = _generate_all(server, prompts[1:])
        stats = server.wait_all_blocks_free()
    _assert_matches_transformers(tiny_model, prompts, first + rest)
    assert stats.prefix_cache_hit_tokens >= 3 * 32, "the later prompts must reuse the first one's full blocks"


# Both preemption modes on the two main families; one each, alternating, on the rest (the modes' code is shared
# by every architecture; the architecture only decides what the KV blocks hold). Fewer server runs keep
# `make test` within its time on 2 cores.
PREEMPTION_CASES = [("llama", "recompute"), ("llama", "swap"), ("qwen2", "recompute"), ("qwen2", "swap"),
                    ("qwen3", "swap"), ("gemma", "recompute"), ("gemma2", "swap"), ("gemma3", "recompute"),
                    ("opt", "swap")]


@pytest.mark.parametrize("arch, mode", PREEMPTION_CASES)
def test_greedy_matches_transformers_under_preemption(arch, mode, tmp_path):
    tiny_model = make_tiny_model(tmp_path / "model", arch, seed=3)
    prompts = _prompts(16, seed=2)
    # 10 blocks of 16 tokens hold any one request (at most 50 + 24 tokens) but nowhere near all 16 at once.
    with running_server(tmp_path, "--model", str(tiny_model), "--num-kv-blocks", "10",
                        "--preemption-mode", mode, "--swap-space", "0.01") as server:
        results = _generate_all(server, prompts)
        stats = server.wait_all_blocks_free()
    _assert_matches_transformers(tiny_model, prompts, results)
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks == 10
    assert stats.num_free_swap_blocks == stats.num_swap_blocks
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0, "swap mode must swap blocks out, not fall back to recompute"
    else:
        assert stats.num_swapped_out_blocks == 0
