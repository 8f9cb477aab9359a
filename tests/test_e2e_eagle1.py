"""EAGLE-1 heads through the real processes (`pagedserve serve --speculative-config '{"method": "eagle", ...}'`):
concurrent greedy requests with prefix-cache hits and preemption give exactly transformers' greedy tokens (those of
speculation off), with a head whose proposals come true (most drafts kept) and with a random head of two layers
(nearly none kept); and `serve` refuses, in one line before any process starts, what it does not serve."""

from __future__ import annotations

import json

import pytest

from pagedserve.testing.tiny_eagle1 import make_echo_eagle1_head, make_tiny_eagle1_head
from pagedserve.testing.tiny_eagle3 import make_tiny_eagle3_head
from pagedserve.testing.tiny_models import make_repeater_model, make_tiny_model
from tests.test_e2e_eagle3 import check_echo_and_random_heads_give_the_tokens_of_no_speculation, check_serve_refuses


def _eagle_flag(head, k=3) -> list[str]:
    return ["--speculative-config", json.dumps({"method": "eagle", "model": str(head), "num_speculative_tokens": k})]


@pytest.fixture(scope="module")
def repeater(tmp_path_factory):
    return make_repeater_model(tmp_path_factory.mktemp("repeater"), "qwen2", seed=4)


def test_an_eagle1_head_gives_the_tokens_of_no_speculation(repeater, tmp_path):
    """The echo head (the target's embeddings and LM head) keeps most drafts; a random two-layer head with its own
    embeddings keeps few."""
    echo = make_echo_eagle1_head(tmp_path / "heads", repeater)
    head = make_tiny_eagle1_head(tmp_path / "heads", repeater, seed=2, num_layers=2, own_embeddings=True)
    check_echo_and_random_heads_give_the_tokens_of_no_speculation(repeater, tmp_path, _eagle_flag(echo),
                                                                  _eagle_flag(head, k=2))


def test_serve_refuses_an_eagle1_head_it_cannot_serve_naming_why(repeater, tmp_path):
    head = make_tiny_eagle1_head(tmp_path, repeater)
    gemma = make_tiny_model(tmp_path, "gemma", seed=1)
    check_serve_refuses((
        (repeater, (*_eagle_flag(head), "-tp", "2"), "--tensor-parallel-size 1 only"),
        (gemma, _eagle_flag(head), "needs a Llama-family target"),
        (repeater, _eagle_flag(repeater), "not an EAGLE-1 Llama head"),
        (repeater, _eagle_flag(make_tiny_eagle3_head(tmp_path, repeater)), "an EAGLE-3 head (method eagle3)")))
