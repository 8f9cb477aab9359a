"""Speculative decoding (n-gram, and with a draft model) through the real processes (`pagedserve serve --speculative-config`): concurrent
greedy and seeded requests give exactly the tokens of a server without speculation, with drafts proposed and
accepted (the spec_decode counters in the stats and /metrics), beside prefix-cache hits and preemption, and at
`-tp 2`; refusals of what is not served.

Why copy-heavy prompts and 64 tokens: the n-gram proposer then always finds matches. A random tiny model's
greedy output keeps only a handful of drafts, and which ones depends on the steps' timing, so the greedy case
runs a repeater (the same model with its layers' output projections zero: it repeats its last token, and the
drafts of that run are kept); seeded sampling on the random model keeps few. Every kept and every rejected draft
must leave the output exactly as it is without speculation. A draft model's drafts for seeded sampling are drawn
from its distribution and verified by exact rejection sampling: the same tokens for the same seed, run to run,
and those of no speculation only where the draft equals the target."""

from __future__ import annotations

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_repeater_model, make_tiny_model
from tests.test_model_refusals import _serve

SPECULATIVE = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1})]
# 16 blocks of 16 tokens: the prompts' shared prefix is cached, and all of them at once do not fit (preemption).
SMALL_POOL = ["--num-kv-blocks", "16", "--max-num-batched-tokens", "64", "--swap-space", "0.01"]


def _prompts(count: int, seed: int) -> list[list[int]]:
    """A shared prefix, then a short pattern repeated (what the model tends to go on with)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(20)]
    prompts = []
    for _ in range(count):
        pattern = [rng.randrange(3, 512) for _ in range(rng.randrange(2, 5))]
        prompts.append(prefix + pattern * rng.randrange(3, 6))
    return prompts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "qwen2", seed=4)


@pytest.fixture(scope="module")
def repeater(tmp_path_factory):
    return make_repeater_model(tmp_path_factory.mktemp("repeater"), "qwen2", seed=4)


def _run(model, logs, prompts, *flags, **sampling):
    """Each prompt's output (CompletionOutput) from concurrent requests, the stats after, and the gateway's
    /metrics text."""
    logs.mkdir(parents=True, exist_ok=True)
    with running_server(logs, "--model", str(model), *SMALL_POOL, *flags, http=True) as server:
        def one(prompt):
            with server.client() as client:
                return client.generate(prompt, max_tokens=64, ignore_eos=True, **sampling)

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, prompts))
        stats = server.wait_all_blocks_free()
        with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
    return [result.outputs[0] for result in results], stats, metrics


def _tokens(outputs) -> list[list[int]]:
    return [list(output.token_ids) for output in outputs]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_speculation_gives_the_tokens_of_no_speculation_and_keeps_drafts(model, repeater, tmp_path, sampling):
    greedy = sampling["temperature"] == 0.0
    model = repeater if greedy else model
    prompts = _prompts(6, seed=1)
    plain, plain_stats, _ = _run(model, tmp_path / "plain", prompts, "--preemption-mode", "swap", **sampling)
    speculative, stats, metrics = _run(model, tmp_path / "spec", prompts, "--preemption-mode", "swap",
                                              *SPECULATIVE, **sampling)
    assert _tokens(speculative) == _tokens(plain)
    # Each message's logprobs (one per token, as the SDK assembles them) and the cumulative logprob: the kept
    # drafts' come back too, each computed in a chunk instead of alone (float rounding only).
    for spec_output, plain_output in zip(speculative, plain):
        assert len(spec_output.logprobs) == len(plain_output.logprobs) == 64
        assert spec_output.logprobs == pytest.approx(plain_output.logprobs, abs=1e-5)
        # A float on the wire: one step of a float32 near -165 is 1.5e-5, hence relative.
        assert spec_output.cumulative_logprob == pytest.approx(plain_output.cumulative_logprob, rel=1e-6, abs=1e-5)
    assert plain_stats.spec_decode_num_drafts == 0
    assert stats.spec_decode_num_drafts > 0, stats
    if greedy:  # the repeater: its runs of one token are drafted and kept
        assert stats.spec_decode_num_accepted_tokens > 0.5 * stats.spec_decode_num_draft_tokens, stats
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    assert stats.prefix_cache_hit_tokens > 0
    assert f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="{model.name}"}} ' in metrics


def test_speculation_over_two_ranks_with_recompute_preemption_gives_the_single_rank_tokens(model, tmp_path):
    prompts = _prompts(6, seed=2)
    plain, _, _ = _run(model, tmp_path / "plain", prompts, "--preemption-mode", "recompute", temperature=0.0)
    speculative, stats, _ = _run(model, tmp_path / "spec", prompts, "--preemption-mode", "recompute", "-tp", "2",
                                 *SPECULATIVE, temperature=0.0)
    assert _tokens(speculative) == _tokens(plain)
    # Drafts verified over two ranks; how many are kept depends on which steps carried them (a handful of this
    # random model's), so kept drafts over two ranks are shown with the target as its own draft (below).
    assert stats.spec_decode_num_drafts > 0 and stats.num_preemptions > 0, stats


def _draft_model_flag(draft) -> list[str]:
    return ["--speculative-config", json.dumps({"method": "draft_model", "model": str(draft),
                                                "num_speculative_tokens": 3})]


def test_a_draft_model_gives_the_tokens_of_no_speculation_itself_as_draft_keeping_most(model, tmp_path):
    """Draft models: the target itself (its proposals are its own greedy tokens: nearly all kept) at -tp 2 with
    recompute preemption, and another random model of the same vocabulary (nearly none kept) with swap
    preemption; both beside prefix hits and preemption, with the exact greedy tokens of a server without
    speculation."""
    prompts = _prompts(6, seed=3)
    plain, _, _ = _run(model, tmp_path / "plain", prompts, "--preemption-mode", "swap", temperature=0.0)
    itself, stats, metrics = _run(model, tmp_path / "itself", prompts, "--preemption-mode", "recompute", "-tp", "2",
                                  *_draft_model_flag(model), temperature=0.0)
    assert _tokens(itself) == _tokens(plain)
    assert stats.spec_decode_num_draft_tokens > 60, stats
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens, stats
    assert stats.prefix_cache_hit_tokens > 0 and stats.num_preemptions > 0, stats
    assert f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="{model.name}"}} ' in metrics
    other = make_tiny_model(tmp_path / "draft", "llama", seed=9, num_hidden_layers=2)
    drafted, stats, _ = _run(model, tmp_path / "other", prompts, "--preemption-mode", "swap",
                             *_draft_model_flag(other), temperature=0.0)
    assert _tokens(drafted) == _tokens(plain)
    assert stats.spec_decode_num_draft_tokens > 60 and stats.num_preemptions > 0, stats
    assert stats.spec_decode_num_accepted_tokens <= 0.2 * stats.spec_decode_num_draft_tokens, stats


def test_a_draft_model_with_seeded_sampling_keeps_drafts_by_the_rejection_rule_and_repeats(tmp_path):
    """Seeded sampling with the target itself as the draft: it draws its drafts from its distribution q (with the
    request's seeded noise) and the workers verify them by exact rejection sampling, which keeps nearly all of
    them (q = p). The model's small weights make its distributions flat, so greedy drafts, matched against seeded
    draws, would keep almost none. A lone request sent twice gets the same tokens both times (every draw is
    keyed by the seed and position). (A random draft's rejections and residual draws repeating, the target as
    its own draft giving the seeded tokens of no speculation, and the rule's distribution:
    tests/test_worker_draft_model.py, tests/test_rejection_sampler.py.)"""
    flat = make_tiny_model(tmp_path / "flat", "llama", seed=11, num_hidden_layers=2, initializer_range=0.02)
    prompt = _prompts(1, seed=5)[0]
    with running_server(tmp_path, "--model", str(flat), *_draft_model_flag(flat)) as server:
        with server.client() as client:
            runs = [list(client.generate(prompt, max_tokens=48, ignore_eos=True, temperature=1.0, top_p=0.9,
                                         seed=7).outputs[0].token_ids) for _ in range(2)]
        stats = server.wait_all_blocks_free()
    assert runs[0] == runs[1] and len(runs[0]) == 48
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens > 40, stats


def test_serve_refuses_other_methods_and_batch_invariant_speculation_naming_why(model):
    medusa = json.dumps({"method": "medusa", "model": "x", "num_speculative_tokens": 3})
    for args, words in (((("--speculative-config", medusa)), "medusa"),
                        ((*SPECULATIVE, "--batch-invariant"), "--batch-invariant")):
        result = _serve(model, *args, timeout=90)
        last = result.stderr.strip().splitlines()[-1]  # argparse's usage, then its error line; or one line
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert words in last and "gRPC listening" not in result.stderr, result.stderr
