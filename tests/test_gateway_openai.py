"""The official `openai` package against the whole stack (HTTP -> gateway -> gRPC -> scheduler -> worker) on
the embedded SmolLM2: the same greedy text as the gRPC API for completions and chats, streamed and not, with
n=2, logprobs that add up to the sequence's cumulative logprob, the chat template applied, OpenAI errors for
bad input, 401 without the key, and a vanished HTTP client aborting its request on the scheduler."""

from __future__ import annotations

import http.client
import json
import time
from contextlib import closing

import openai
import pytest

from pagedserve.testing.server_harness import http_json, running_server

API_KEY = "sk-pagedserve-test"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("logs"), "--max-model-len", "1024", "--cpu-kv-cache-space", "0.25",
                        "--swap-space", "0.05", "--api-key", API_KEY, http=True,
                        client_options=dict(api_key=API_KEY)) as running:  # the key guards gRPC too
        yield running


@pytest.fixture(autouse=True)
def no_block_leaks(server):
    yield
    stats = server.wait_all_blocks_free()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "a test leaked KV blocks"


@pytest.fixture
def api(server):
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


def test_models_list_names_the_served_model(server, api):
    models = api.models.list().data
    with server.client() as client:
        info = client.model_info()
    assert [model.id for model in models] == [MODEL] == [info.model_name]


def test_completion_equals_the_grpc_greedy_text_streamed_and_not(server, api):
    with server.client() as client:
        expected = client.generate(PROMPT, max_tokens=12, temperature=0.0)
    whole = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, n=2, logprobs=0)
    assert [choice.index for choice in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
        logprobs = choice.logprobs
        assert "".join(logprobs.tokens) == choice.text
        assert len(logprobs.token_logprobs) == expected.completion_tokens
        assert sum(logprobs.token_logprobs) == pytest.approx(expected.outputs[0].cumulative_logprob, abs=1e-3)
        assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert whole.usage.prompt_tokens == expected.prompt_tokens
    assert whole.usage.completion_tokens == 2 * expected.completion_tokens

    texts, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, n=2,
                                        logprobs=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            assert choice.logprobs.tokens == [choice.text] or choice.logprobs.tokens == []
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert texts == {0: expected.text, 1: expected.text}
    assert reasons == {0: expected.finish_reason, 1: expected.finish_reason}
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected.prompt_tokens, 2 * expected.completion_tokens)


def test_chat_completion_uses_the_chat_template_and_equals_grpc_streamed_and_not(server, api):
    with server.client() as client:
        expected = client.generate(messages=QUESTION, max_tokens=24, temperature=0.0)
    assert "Paris" in expected.text
    whole = api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, n=2, logprobs=True)
    assert len(whole.choices) == 2
    for choice in whole.choices:
        assert choice.message.role == "assistant"
        assert choice.message.content == expected.text and choice.finish_reason == expected.finish_reason
        tokens = choice.logprobs.content
        assert "".join(token.token for token in tokens) == expected.text
        assert sum(token.logprob for token in tokens) == pytest.approx(expected.outputs[0].cumulative_logprob, abs=1e-3)
    assert whole.usage.prompt_tokens == expected.prompt_tokens

    texts, roles = {0: "", 1: ""}, set()
    for chunk in api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, n=2,
                                             stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add((choice.index, choice.delta.role))
    assert texts == {0: expected.text, 1: expected.text}
    assert roles == {(0, "assistant"), (1, "assistant")}


def test_top_logprobs_penalties_and_logit_bias_reach_the_scheduler(server, api):
    with server.client() as client:
        expected = client.generate(PROMPT, max_tokens=8, temperature=0.0, logprobs=3, frequency_penalty=1.0,
                                   presence_penalty=0.5)
        paris = client.generate(PROMPT, max_tokens=1, temperature=0.0).token_ids[0]
    completion = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                        frequency_penalty=1.0, presence_penalty=0.5)
    choice = completion.choices[0]
    assert choice.text == expected.text
    entries = expected.outputs[0].token_logprobs
    for top, entry in zip(choice.logprobs.top_logprobs, entries):
        assert {text: round(lp, 4) for text, lp in top.items()}.items() >= {
            alt.decoded_token: round(alt.logprob, 4) for alt in entry.top}.items()
    chat = api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    assert all(len(token.top_logprobs) == 2 for token in chat.choices[0].logprobs.content)
    banned = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                    logit_bias={str(paris): -100})
    with server.client() as client:
        assert banned.choices[0].text != client.generate(PROMPT, max_tokens=1, temperature=0.0).text


def test_sampling_fields_reach_the_scheduler(server, api):
    with server.client() as client:
        expected = client.generate(PROMPT, max_tokens=16, temperature=0.8, top_p=0.9, seed=7, stop=[" and"])
    completion = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.8, top_p=0.9,
                                        seed=7, stop=[" and"])
    assert completion.choices[0].text == expected.text
    assert completion.choices[0].finish_reason == expected.finish_reason


def test_invalid_requests_get_the_matching_openai_errors(api):
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert refused.value.status_code == 400 and refused.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as too_long:
        api.completions.create(model=MODEL, prompt="Paris " * 2000, max_tokens=4)
    assert too_long.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=MODEL, messages=QUESTION, top_p=1.5)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt=PROMPT)


def test_a_request_without_the_key_gets_401(server):
    for key in ("wrong-key", ""):
        with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=key or "-", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as refused:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert refused.value.status_code == 401


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_disconnect_aborts_the_request_and_frees_its_blocks(server, stream):
    with server.client() as client:
        before = client.stats()
    host, port = server.http_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": stream}
    with closing(connection):
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        if stream:
            response = connection.getresponse()
            assert response.status == 200 and response.readline().startswith(b"data: ")
        else:
            _wait_for(lambda: _running(server) == 1, "the request never started")
    left = time.monotonic()
    stats = server.wait_all_blocks_free(timeout=10)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == 0
    assert time.monotonic() - left < 10
    # Aborted, not finished: 900 tokens take far longer, and an aborted request's latency is not observed.
    assert stats.num_finished_requests == before.num_finished_requests + 1
    assert stats.e2e_request_latency.count == before.e2e_request_latency.count
    assert stats.num_generation_tokens - before.num_generation_tokens < 900


def _running(server) -> int:
    with server.client() as client:
        return client.stats().num_running


def _wait_for(condition, message: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def test_tokenize_counts_the_prompt_tokens_a_chat_reads_and_detokenize_inverts_it(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    status, _, tokenized = http_json(f"{server.http_url}/tokenize", {"model": MODEL, "messages": QUESTION,
                                                                     "return_token_strs": True}, headers)
    assert status == 200, tokenized
    with server.client() as client:
        generated = client.generate(messages=QUESTION, max_tokens=1, temperature=0.0, return_prompt=True)
        assert client.tokenize(messages=QUESTION).token_ids == tokenized["tokens"]
    assert tokenized["tokens"] == list(generated.prompt_token_ids)
    assert tokenized["count"] == generated.prompt_tokens and tokenized["max_model_len"] == 1024
    assert len(tokenized["token_strs"]) == tokenized["count"]
    status, _, detokenized = http_json(f"{server.http_url}/detokenize", {"model": MODEL, "tokens": tokenized["tokens"]},
                                       headers)
    assert detokenized["prompt"] == generated.prompt


def test_continue_final_message_continues_the_assistant_turn(server, api):
    opened = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    with server.client() as client:
        expected = client.generate(messages=opened, add_generation_prompt=False, continue_final_message=True,
                                   max_tokens=6, temperature=0.0, return_prompt=True)
    assert expected.prompt.endswith("The capital of France is")  # no end-of-turn after it
    chat = api.chat.completions.create(model=MODEL, messages=opened, max_tokens=6, temperature=0,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert chat.choices[0].message.content == expected.text


def test_echo_prepends_the_prompt(server, api):
    with server.client() as client:
        expected = client.generate(PROMPT, max_tokens=4, temperature=0.0)
    echoed = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + expected.text


def test_max_tokens_past_the_context_is_a_400_with_vllms_message(api):
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1020)
    assert refused.value.body["param"] == "max_tokens"
    assert ("This model's maximum context length is 1024 tokens. However, you requested "
            in refused.value.body["message"])
    assert api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0).choices
