"""/v1/completions with echo, logprobs and max_tokens 0 (lm-evaluation-harness's log-likelihood request):
each choice opens with the prompt's tokens and their logprobs (the first None); and vLLM's prompt_logprobs
field; against the in-process
stand-in for the scheduler, whose prompt ids are 0..6 ("t<id>", logprob -id) and whose output is
"Hello world" (5 tokens)."""

from __future__ import annotations

import openai
import pytest

from pagedserve.testing.server_harness import http_json, running_gateway

PROMPT_TOKENS = ["t0", "t1", "t2", "t3", "t4", "t5", "t6"]


@pytest.fixture(scope="module")
def gateway_url(fake_server, tmp_path_factory):
    with running_gateway(tmp_path_factory.mktemp("logs"), fake_server.target) as url:
        yield url


def complete(gateway_url: str, **body) -> dict:
    status, _, reply = http_json(f"{gateway_url}/v1/completions", {"prompt": "one two", **body})
    assert status == 200, reply
    return reply


def test_max_tokens_0_returns_the_prompt_tokens_and_logprobs_alone(fake, gateway_url):
    reply = complete(gateway_url, echo=True, logprobs=1, max_tokens=0, temperature=0)
    sent = fake.requests[0]
    # max_tokens 0 reaches the scheduler as is: it samples nothing (no token to drop here).
    assert sent.sampling.prompt_logprobs == 1 and sent.sampling.max_tokens == 0 and sent.return_prompt
    choice = reply["choices"][0]
    assert choice["text"] == "one two" and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == PROMPT_TOKENS
    assert logprobs["token_logprobs"] == [None, -1, -2, -3, -4, -5, -6]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][2] == {"t2": -2, "a0": -0.5}
    assert logprobs["text_offset"] == [0, 2, 4, 6, 8, 10, 12]
    assert reply["usage"]["completion_tokens"] == 0


def test_echo_with_logprobs_and_output_lists_prompt_then_generated_tokens(fake, gateway_url):
    reply = complete(gateway_url, echo=True, logprobs=0, max_tokens=5)
    choice = reply["choices"][0]
    assert choice["text"] == "one twoHello world"
    tokens = choice["logprobs"]["tokens"]
    assert tokens[:7] == PROMPT_TOKENS and len(tokens) == 7 + 5
    assert choice["logprobs"]["top_logprobs"][1] == {"t1": -1}  # logprobs 0: the token alone
    # The generated tokens' offsets count from the start of the echoed text.
    assert choice["logprobs"]["text_offset"][7] == len("one two")


def test_streamed_echo_with_logprobs_opens_with_the_prompt_tokens(fake, gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0) as api:
        chunks = list(api.completions.create(model="fake-model", prompt=[3, 4], echo=True, logprobs=1,
                                             max_tokens=0, stream=True))
    assert chunks[0].choices[0].text == "t3 t4"  # token ids echoed as the tokenizer decodes them
    assert chunks[0].choices[0].logprobs.tokens == PROMPT_TOKENS
    assert "".join(chunk.choices[0].text for chunk in chunks) == "t3 t4"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_echo_without_logprobs_asks_for_no_prompt_logprobs(fake, gateway_url):
    reply = complete(gateway_url, echo=True, max_tokens=0)
    assert not fake.requests[0].sampling.HasField("prompt_logprobs")
    assert reply["choices"][0]["text"] == "one two" and reply["choices"][0]["logprobs"] is None


def test_max_tokens_0_without_echo_returns_an_empty_choice(fake, gateway_url):
    reply = complete(gateway_url, max_tokens=0)
    assert fake.requests[0].sampling.max_tokens == 0
    assert reply["choices"][0]["text"] == "" and reply["choices"][0]["finish_reason"] == "length"


def test_prompt_logprobs_field_returns_vllms_shape_per_choice(fake, gateway_url):
    reply = complete(gateway_url, prompt_logprobs=1, max_tokens=5)
    assert fake.requests[0].sampling.prompt_logprobs == 1
    entries = reply["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 7
    assert entries[2] == {"2": {"logprob": -2, "rank": 2, "decoded_token": "t2"},
                          "100": {"logprob": -0.5, "rank": 1, "decoded_token": "a0"}}
    assert reply["choices"][0]["text"] == "Hello world"  # no echo: the prompt's text is not prepended
