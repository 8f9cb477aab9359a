"""Every request field of /v1/completions and /v1/chat/completions is honoured (it reaches the scheduler's
GenerateRequest) or refused with a 400 naming it, before the scheduler sees anything; unknown fields are 400s
naming them; X-Request-Id / request_id become the request's id and come back in the response header; and the
endpoints beside generation (/v1/models/{id}, /version, /ping, /tokenize, /detokenize), against the in-process
stand-in for the scheduler."""

from __future__ import annotations

import json

import openai
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.testing.server_harness import http_json, running_gateway

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def gateway_url(fake_server, tmp_path_factory):
    with running_gateway(tmp_path_factory.mktemp("logs"), fake_server.target, "--api-key", API_KEY) as url:
        yield url


def post(gateway_url: str, path: str, body, headers=AUTH):
    return http_json(f"{gateway_url}{path}", body, headers)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "max_token": 5}, "max_token"),
    ("/v1/chat/completions", {**CHAT, "temprature": 0.5}, "temprature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "images": []}]}, "messages.0.images"),
    ("/v1/chat/completions", {**CHAT, "structural_tag": {"x": 1}}, "structural_tag"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
     "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "ada"}]}, "messages[0].name"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {**CHAT, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "hi", "request_id": "bad\nid"}, "request_id"),
])
def test_unknown_and_unserved_fields_are_400s_naming_them_and_never_reach_the_scheduler(
        fake, gateway_url, path, body, param):
    status, _, reply = post(gateway_url, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert fake.requests == []


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", '{"prompt": "hi", "max_tokens": true}', "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "n": "2"}', "n"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1099511627776}', "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "seed": 1180591620717411303424}', "seed"),
    ("/v1/completions", '{"prompt": [1099511627776]}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop_token_ids": [8589934592]}', "stop_token_ids"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"8589934592": 1}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\udc00"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "hi"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages"),
], ids=["bool-as-int", "string-as-int", "int32-overflow", "uint64-overflow", "token-id-overflow",
        "stop-token-overflow", "logit-bias-key-overflow", "lone-surrogate-prompt", "lone-surrogate-stop",
        "unknown-role", "no-content", "lone-surrogate-content"])
def test_values_the_wire_cannot_carry_are_400s_naming_the_field(fake, gateway_url, path, raw, param):
    status, _, reply = post(gateway_url, path, raw.encode())
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    assert fake.requests == []
    status, _, _ = post(gateway_url, path, {"prompt": "hi"} if path == "/v1/completions" else CHAT)
    assert status == 200  # and the server keeps serving


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", CHAT)])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(fake, gateway_url, path, body):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it on every request)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    status, _, reply = post(gateway_url, path, {**body, "stream": False, "stream_options": options})
    assert status == 200, reply  # accepted unstreamed too, where the one response carries the usage anyway
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=API_KEY, max_retries=0) as api:
        create = api.completions.create if "prompt" in body else api.chat.completions.create
        events = list(create(model="fake-model", **body, stream=True, stream_options=options))
    completion_tokens = [event.usage.completion_tokens for event in events]
    assert len({event.usage.prompt_tokens for event in events}) == 1
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 5  # the stand-in's tokens
    assert len(events) > 2


def test_chat_fields_reach_the_scheduler_request(fake, gateway_url):
    body = {**CHAT, "add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False}, "documents": [{"title": "t", "text": "x"}],
            "add_special_tokens": True, "priority": 3, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
            "min_tokens": 2, "max_completion_tokens": 9, "stop_token_ids": [4], "bad_words": ["no"],
            # Accepted, no effect by definition (OpenAI's own server does nothing with them either).
            "user": "u-1", "response_format": {"type": "text"}, "tool_choice": "none", "parallel_tool_calls": False}
    status, _, reply = post(gateway_url, "/v1/chat/completions", body)
    assert status == 200, reply
    [request] = fake.requests
    chat = request.chat
    assert (chat.add_generation_prompt, chat.continue_final_message) == (False, True)
    assert json.loads(chat.chat_template_kwargs_json) == {"enable_thinking": False}
    assert json.loads(chat.documents_json) == [{"title": "t", "text": "x"}]
    assert request.add_special_tokens and request.priority == 3 and request.strict_context_length
    sampling = request.sampling
    assert (sampling.top_k, sampling.min_tokens, sampling.max_tokens) == (5, 2, 9)
    assert sampling.min_p == pytest.approx(0.1) and sampling.repetition_penalty == pytest.approx(1.2)
    assert list(sampling.stop_token_ids) == [4] and list(sampling.bad_words) == ["no"]


def test_echo_opens_each_choice_with_its_prompt(fake, gateway_url):
    status, _, reply = post(gateway_url, "/v1/completions", {"prompt": ["one", "two"], "echo": True})
    assert status == 200, reply
    texts = [choice["text"] for choice in reply["choices"]]
    assert texts == ["oneHello world", "twoHello world"]  # the stand-in streams one sequence per prompt
    assert reply["usage"]["completion_tokens"] == 5 * 2
    # Token ids are echoed as the model's tokenizer decodes them (the stand-in's Detokenize: "t<id>"); streamed,
    # the echo opens the choice's first chunk.
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=API_KEY, max_retries=0) as api:
        chunks = list(api.completions.create(model="fake-model", prompt=[4, 5], echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith("t4 t5")
    assert "".join(chunk.choices[0].text for chunk in chunks) == "t4 t5Hello world"


def test_text_content_parts_are_joined(fake, gateway_url):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert post(gateway_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]})[0] == 200
    assert fake.requests[0].chat.messages[0].content == "first\nsecond"


def test_context_checks_are_strict_only_when_max_tokens_is_given(fake, gateway_url):
    assert post(gateway_url, "/v1/chat/completions", CHAT)[0] == 200
    assert post(gateway_url, "/v1/completions", {"prompt": "hi"})[0] == 200  # max_tokens 16, OpenAI's default
    assert post(gateway_url, "/v1/completions", {"prompt": "hi", "max_tokens": None})[0] == 200
    chat, completion, until_full = fake.requests
    assert not chat.strict_context_length and chat.sampling.max_tokens == 2048  # until the context is full
    assert not chat.HasField("add_special_tokens") and chat.chat.add_generation_prompt
    assert completion.strict_context_length and completion.sampling.max_tokens == 16
    assert not until_full.strict_context_length


def test_the_request_id_comes_from_the_header_or_the_body_and_is_echoed(fake, gateway_url):
    status, headers, reply = post(gateway_url, "/v1/chat/completions", CHAT, {**AUTH, "X-Request-Id": "trace-42"})
    assert status == 200 and headers["X-Request-Id"] == "trace-42"
    assert reply["id"] == "chatcmpl-trace-42" and fake.requests[-1].request_id == "chatcmpl-trace-42"
    status, headers, reply = post(gateway_url, "/v1/completions", {"prompt": "hi", "request_id": "body-7"})
    assert headers["X-Request-Id"] == "body-7" and reply["id"] == "cmpl-body-7"
    assert fake.requests[-1].request_id == "cmpl-body-7-0"
    status, headers, _ = post(gateway_url, "/v1/completions", {"prompt": "invalid"}, {**AUTH, "X-Request-Id": "e-1"})
    assert status == 400 and headers["X-Request-Id"] == "e-1"  # echoed on errors too
    status, headers, reply = post(gateway_url, "/v1/completions", {"prompt": "hi"})
    assert reply["id"] == f"cmpl-{headers['X-Request-Id']}"  # a fresh id, still echoed


def test_model_card_version_and_ping(fake_server, fake, gateway_url):
    status, _, listing = http_json(f"{gateway_url}/v1/models", None, AUTH)
    [card] = listing["data"]
    status, _, retrieved = http_json(f"{gateway_url}/v1/models/fake-model", None, AUTH)
    assert status == 200 and {**retrieved, "created": 0} == {**card, "created": 0}
    assert card["id"] == "fake-model" and card["max_model_len"] == 2048 and card["object"] == "model"
    assert card["quantization"] == "awq" and card["kv_cache_dtype"] == "fp8_e4m3"  # what ModelInfo says
    status, _, missing = http_json(f"{gateway_url}/v1/models/gpt-4", None, AUTH)
    assert status == 404 and missing["error"]["code"] == "model_not_found"
    assert http_json(f"{gateway_url}/v1/models/fake-model", None)[0] == 401
    status, _, version = http_json(f"{gateway_url}/version")
    assert status == 200 and version["version"] and version["version"] != "unknown"
    assert http_json(f"{gateway_url}/ping")[0] == 200
    fake_server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        assert http_json(f"{gateway_url}/ping")[0] == 503  # the readiness probe, as /health
    finally:
        fake_server.set_health(health_pb2.HealthCheckResponse.SERVING)


def test_tokenize_and_detokenize_relay_vllms_shapes(fake, gateway_url):
    status, _, reply = post(gateway_url, "/tokenize", {"model": "fake-model", "prompt": "a b c",
                                                        "return_token_strs": True})
    assert status == 200, reply
    assert reply == {"count": 3, "max_model_len": 2048, "tokens": [1, 2, 3], "token_strs": ["t1", "t2", "t3"]}
    status, _, reply = post(gateway_url, "/tokenize", {**CHAT, "add_generation_prompt": False,
                                                        "chat_template_kwargs": {"enable_thinking": True}})
    assert status == 200 and reply["tokens"] == [9] and reply["token_strs"] is None
    text_request, chat_request = fake.requests
    assert not text_request.HasField("add_special_tokens")  # the scheduler's default: true for text
    assert not chat_request.chat.add_generation_prompt
    assert json.loads(chat_request.chat.chat_template_kwargs_json) == {"enable_thinking": True}
    assert post(gateway_url, "/detokenize", {"tokens": [1, 2]})[2] == {"prompt": "t1 t2"}
    status, _, reply = post(gateway_url, "/detokenize", {"tokens": [40000]})
    assert status == 400 and reply["error"]["param"] == "tokens"
    status, _, reply = post(gateway_url, "/tokenize", {"prompt": "x", **CHAT})
    assert status == 400 and reply["error"]["param"] == "prompt"
    assert post(gateway_url, "/tokenize", {"prompt": "x"}, {})[0] == 401
