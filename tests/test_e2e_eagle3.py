"""EAGLE-3 heads through the real processes (`pagedserve serve --speculative-config '{"method": "eagle3", ...}'`):
concurrent greedy requests with prefix-cache hits and preemption give exactly the tokens of a server without
speculation, with a head whose proposals come true (most drafts kept) and with a random head (nearly none kept);
and `serve` refuses, in one line before any process starts, what it does not serve."""

from __future__ import annotations

import json

import pytest

from pagedserve.testing.tiny_eagle3 import make_echo_eagle3_head, make_tiny_eagle3_head
from pagedserve.testing.tiny_models import make_repeater_model, make_tiny_model
from tests.test_e2e_speculative import _prompts, _run, _tokens
from tests.test_model_refusals import _serve


def _greedy_by_transformers(model, prompts, max_tokens) -> list[list[int]]:
    """Speculation off's tokens, from transformers (pagedserve's greedy equals them on the tiny float32 models:
    tests/test_e2e_greedy.py), without a server of its own."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            generated = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                          do_sample=False)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def _eagle3_flag(head, k=3) -> list[str]:
    return ["--speculative-config", json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k})]


@pytest.fixture(scope="module")
def repeater(tmp_path_factory):
    return make_repeater_model(tmp_path_factory.mktemp("repeater"), "qwen2", seed=4)


def check_echo_and_random_heads_give_the_tokens_of_no_speculation(repeater, tmp_path, echo_flag, random_flag):
    """Greedy requests beside the repeater: with `echo_flag`'s head most drafts are kept (swap preemption), with
    `random_flag`'s few (recompute preemption); both give transformers' tokens, with prefix hits. (EAGLE-1's test
    too: tests/test_e2e_eagle1.py.)"""
    prompts = _prompts(5, seed=3)
    plain = _greedy_by_transformers(repeater, prompts, 64)
    drafted, stats, _ = _run(repeater, tmp_path / "echo", prompts, "--preemption-mode", "swap", *echo_flag,
                             temperature=0.0)
    assert _tokens(drafted) == plain
    assert stats.spec_decode_num_draft_tokens > 60, stats
    assert stats.spec_decode_num_accepted_tokens >= 0.8 * stats.spec_decode_num_draft_tokens, stats
    assert stats.prefix_cache_hit_tokens > 0 and stats.num_preemptions > 0, stats

    drafted, stats, _ = _run(repeater, tmp_path / "random", prompts, "--preemption-mode", "recompute",
                             *random_flag, temperature=0.0)
    assert _tokens(drafted) == plain
    assert stats.spec_decode_num_draft_tokens > 60 and stats.num_preemptions > 0, stats
    assert stats.spec_decode_num_accepted_tokens <= 0.2 * stats.spec_decode_num_draft_tokens, stats


def check_serve_refuses(cases) -> None:
    """Each (model, serve's arguments, words): `serve` exits before any process starts, its last line naming why."""
    for model, args, words in cases:
        result = _serve(model, *args, timeout=90)
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        assert words in last and "gRPC listening" not in result.stderr, result.stderr


def test_an_eagle3_head_gives_the_tokens_of_no_speculation(repeater, tmp_path):
    """The echo head keeps most drafts; a random head with a reduced draft vocabulary (d2t) keeps few."""
    echo = make_echo_eagle3_head(tmp_path / "heads", repeater)
    head = make_tiny_eagle3_head(tmp_path / "heads", repeater, seed=2, draft_vocab_size=256)
    check_echo_and_random_heads_give_the_tokens_of_no_speculation(repeater, tmp_path, _eagle3_flag(echo),
                                                                  _eagle3_flag(head, k=2))


def test_serve_refuses_an_eagle3_head_it_cannot_serve_naming_why(repeater, tmp_path):
    head = make_tiny_eagle3_head(tmp_path, repeater)
    gemma = make_tiny_model(tmp_path, "gemma", seed=1)
    check_serve_refuses((
        (repeater, (*_eagle3_flag(head), "-tp", "2"), "--tensor-parallel-size 1 only"),
        (gemma, _eagle3_flag(head), "needs a Llama-family target"),
        (repeater, _eagle3_flag(repeater), "not an EAGLE-3 Llama head")))
