"""A structured-output constraint with a reasoning end (structured_outputs.reasoning_end, what the gateway sends
for its --reasoning-parser's `</think>`) through the real processes, on a tiny random Llama with SmolLM2's
tokenizer: the output is free until it holds the end token, and constrained from the token after it.

The end "thought" is chosen from the model itself: greedy, the unconstrained output's k-th token (its first
occurrence) is taken as the end marker, so a constrained greedy request must repeat the first k + 1 tokens
exactly (a constraint applied from the first token would change them) and then answer one of the choices (a
constraint never applied would go on with the free output). A prompt that already holds the end token is
constrained from the first token (the thought ended in the prompt)."""

from __future__ import annotations

import pytest

from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import add_embedded_tokenizer, make_tiny_model

PROMPT = "Think it over, then answer"
CHOICES = ["yes", "no", "maybe so"]
EOS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = add_embedded_tokenizer(make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=3,
                                                   vocab_size=49216, eos_token_id=EOS))
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--max-model-len", "256") as running:
        yield running


def _end_marker(client, prompt_ids: list[int], free: list[int]) -> tuple[int, str]:
    """The position k and text of the first token of the free output that is one token on its own, new there."""
    for k in range(2, len(free)):
        token = free[k]
        if token in free[:k] or token in prompt_ids or token == EOS:
            continue
        text = client.detokenize([token])
        if list(client.tokenize(text, add_special_tokens=False).token_ids) == [token]:
            return k, text
    raise AssertionError(f"no usable end token in {free}")


def test_the_constraint_applies_after_the_reasoning_end_and_not_before(server):
    with server.client() as client:
        prompt_ids = list(client.tokenize(PROMPT).token_ids)
        free = list(client.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids)
        k, marker = _end_marker(client, prompt_ids, free)
        constrained = client.generate(PROMPT, max_tokens=k + 12, temperature=0.0,
                                      structured_outputs=dict(choice=CHOICES, reasoning_end=marker))
        ids = list(constrained.token_ids)
        assert ids[: k + 1] == free[: k + 1]  # the thought, up to and with its end, is the free output's
        answer_ids = ids[k + 1 :]
        assert constrained.finish_reason == "stop" and answer_ids[-1] == EOS
        answer = client.detokenize(answer_ids[:-1])
        assert answer in CHOICES and answer_ids[:-1] != free[k + 1 : len(ids) - 1]

        # The end token already in the prompt: constrained from the first token.
        ended = client.generate(prompt_ids + [free[k]], max_tokens=12, temperature=0.0,
                                structured_outputs=dict(choice=CHOICES, reasoning_end=marker))
        assert ended.finish_reason == "stop" and client.detokenize(list(ended.token_ids)[:-1]) in CHOICES


def test_a_reasoning_end_of_several_tokens_is_refused_naming_the_field(server):
    from client import InvalidRequestError

    with server.client() as client, pytest.raises(InvalidRequestError, match="reasoning_end"):
        client.generate(PROMPT, max_tokens=4, structured_outputs=dict(choice=CHOICES, reasoning_end="</think> and more"))
