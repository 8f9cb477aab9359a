"""The HTTP gateway's contract at its edges, against an in-process stand-in for the scheduler (no model):
every failure in OpenAI's error shape with the status the official client acts on (400, 401, 404, 429 with
Retry-After, 503), a streamed request refused before any byte is sent, and an HTTP client that goes away
cancelling its gRPC stream, streamed or not."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from contextlib import closing

import openai
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.testing.server_harness import free_port, http_json, running_gateway
from tests.fake_generation_server import STATS

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}
BODY_LIMIT = 100_000


@pytest.fixture(scope="module")
def gateway_url(fake_server, tmp_path_factory):
    with running_gateway(tmp_path_factory.mktemp("logs"), fake_server.target, "--api-key", API_KEY,
                         "--retry-after", "3", "--max-request-body-bytes", str(BODY_LIMIT)) as url:
        yield url


@pytest.fixture
def openai_client(gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


def post(gateway_url: str, path: str, body, headers=AUTH):
    return http_json(f"{gateway_url}{path}", body, headers)


def test_relays_the_scheduler_stream_as_a_completion_with_usage(fake, openai_client):
    completion = openai_client.completions.create(model="fake-model", prompt="hello", max_tokens=5)
    assert completion.choices[0].text == "Hello world"
    assert completion.choices[0].finish_reason == "stop"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (7, 5, 12)
    sent = fake.requests[-1]
    assert sent.text == "hello" and sent.sampling.max_tokens == 5
    assert sent.request_id.startswith(completion.id)


def test_scheduler_invalid_argument_is_a_400_naming_the_field(fake, gateway_url, openai_client):
    status, _, body = post(gateway_url, "/v1/completions", {"prompt": "invalid"})
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == "temperature"
    assert "sampling.temperature" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model="fake-model", prompt="invalid")


def test_scheduler_overload_is_a_429_with_retry_after(fake, gateway_url, openai_client):
    status, headers, body = post(gateway_url, "/v1/completions", {"prompt": "overloaded"})
    assert status == 429 and headers["Retry-After"] == "3"
    assert "overloaded" in body["error"]["message"]
    with pytest.raises(openai.RateLimitError):
        openai_client.completions.create(model="fake-model", prompt="overloaded")


def test_a_body_over_the_limit_is_a_final_413_and_never_reaches_the_scheduler(fake, gateway_url):
    big = {"model": "fake-model", "prompt": "word " * BODY_LIMIT}
    status, headers, body = post(gateway_url, "/v1/completions", big)
    assert status == 413 and "Retry-After" not in headers
    assert body["error"]["type"] == "invalid_request_error" and "--max-request-body-bytes" in body["error"]["message"]
    # Without a Content-Length (chunked), the bytes are counted as they arrive.
    host, port = gateway_url.removeprefix("http://").split(":")
    with closing(http.client.HTTPConnection(host, int(port), timeout=30)) as connection:
        connection.request("POST", "/v1/completions", body=iter([json.dumps(big).encode()]),
                           headers={**JSON_AUTH, "Transfer-Encoding": "chunked"}, encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 413
        assert json.loads(response.read())["error"]["code"] == "request_too_large"
    assert fake.requests == []
    status, _, _ = post(gateway_url, "/v1/completions", {"model": "fake-model", "prompt": "hello"})
    assert status == 200  # the server keeps serving


@pytest.mark.parametrize("prompt, says", [("over the limit", "--max-message-bytes"), ("oversized", "larger than max")])
def test_a_request_over_the_schedulers_message_limit_is_a_413_not_a_429(fake, gateway_url, openai_client, prompt,
                                                                         says):
    """The scheduler's INVALID_ARGUMENT naming its limit, or past twice it gRPC's own RESOURCE_EXHAUSTED."""
    status, headers, body = post(gateway_url, "/v1/completions", {"prompt": prompt})
    assert status == 413 and "Retry-After" not in headers
    assert body["error"]["code"] == "request_too_large" and says in body["error"]["message"]
    with pytest.raises(openai.APIStatusError) as raised:
        openai_client.completions.create(model="fake-model", prompt="oversized")
    assert raised.value.status_code == 413


def test_a_streamed_request_refused_by_the_scheduler_gets_the_status_not_a_stream(fake, gateway_url, openai_client):
    status, headers, body = post(gateway_url, "/v1/completions", {"prompt": "overloaded", "stream": True})
    assert status == 429 and headers["Retry-After"] == "3"
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model="fake-model", prompt="invalid", stream=True)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1.0}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
])
def test_bad_bodies_are_400s_naming_the_field_and_never_reach_the_scheduler(fake, gateway_url, path, body, param):
    status, _, reply = post(gateway_url, path, body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["param"] == param
    assert fake.requests == []


def test_malformed_json_is_a_400(fake, gateway_url):
    status, _, reply = post(gateway_url, "/v1/completions", b"{not json")
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404(fake, gateway_url, openai_client):
    status, _, reply = post(gateway_url, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    assert "gpt-4" not in reply["error"]["message"], "error bodies never echo the input"
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


def test_runtime_lora_updates_refused_by_the_scheduler_are_a_404_as_an_unknown_path(fake, gateway_url):
    # vLLM registers /v1/load_lora_adapter and /v1/unload_lora_adapter only with VLLM_ALLOW_RUNTIME_LORA_UPDATING;
    # the stand-in scheduler refuses both (FAILED_PRECONDITION), as one without --allow-runtime-lora-updating.
    unknown_path = post(gateway_url, "/v1/no_such_route", {"lora_name": "sql"})
    assert unknown_path[0] == 404
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/sql"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "sql"})):
        status, _, reply = post(gateway_url, path, body)
        assert (status, reply) == (404, unknown_path[2])
    assert [request.lora_name for request in fake.requests] == ["sql", "sql"]


def test_a_missing_or_wrong_key_is_a_401_but_probes_need_none(fake, gateway_url):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, response_headers, reply = post(gateway_url, "/v1/completions", {"prompt": "hi"}, headers)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
        assert response_headers["WWW-Authenticate"] == "Bearer"
    assert http_json(f"{gateway_url}/v1/models")[0] == 401
    assert http_json(f"{gateway_url}/health")[0] == 200
    assert fake.requests == []
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_health_follows_the_scheduler_health(fake_server, fake, gateway_url):
    fake_server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    status, headers, reply = http_json(f"{gateway_url}/health")
    assert status == 503 and headers["Retry-After"] == "3"
    fake_server.set_health(health_pb2.HealthCheckResponse.SERVING)
    assert http_json(f"{gateway_url}/health")[0] == 200


def test_an_unreachable_scheduler_is_a_503_and_metrics_say_it_is_down(tmp_path):
    with running_gateway(tmp_path, f"127.0.0.1:{free_port()}") as url:
        status, headers, reply = http_json(f"{url}/v1/completions", {"prompt": "hi"})
        assert status == 503 and "Retry-After" in headers
        assert reply["error"]["code"] == "service_unavailable"
        assert http_json(f"{url}/health")[0] == 503
        with closing(open_http(url)) as connection:
            connection.request("GET", "/metrics")
            text = connection.getresponse().read().decode()
    values = {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}
    assert values == {"pagedserve_scheduler_up": 0.0}


def test_metrics_render_the_scheduler_stats(fake, gateway_url):
    with closing(open_http(gateway_url)) as connection:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        text = response.read().decode()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain")
    families = {family.name: family for family in text_string_to_metric_families(text)}
    value = {sample.name: sample.value for family in families.values() for sample in family.samples
             if not sample.labels}
    assert value["pagedserve_scheduler_up"] == 1
    assert value["pagedserve_num_requests_running"] == STATS.num_running
    assert value["pagedserve_num_preemptions_total"] == STATS.num_preemptions
    assert value["pagedserve_generation_tokens_total"] == STATS.num_generation_tokens
    assert value["pagedserve_kv_cache_usage_ratio"] == pytest.approx(
        (STATS.num_kv_blocks - STATS.num_free_kv_blocks) / STATS.num_kv_blocks)
    ttft = families["pagedserve_time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    buckets = {sample.labels["le"]: sample.value for sample in ttft.samples if sample.name.endswith("_bucket")}
    assert buckets == {"0.5": 1.0, "1.0": 1.0, "+Inf": 1.0}  # cumulative
    # vLLM's families, labelled with the model's own name when the gateway has no --served-model-name.
    vllm = {family.name: family for family in families.values() if family.name.startswith("vllm:")}
    assert {sample.labels["model_name"] for family in vllm.values() for sample in family.samples} == {"fake-model"}
    success = {sample.labels["finished_reason"]: sample.value for sample in vllm["vllm:request_success"].samples}
    assert success == {"stop": STATS.num_finished_stop, "length": STATS.num_finished_length,
                       "abort": STATS.num_finished_abort}


def test_a_client_leaving_a_stream_cancels_the_grpc_stream(fake, gateway_url):
    with closing(open_http(gateway_url)) as connection:
        connection.request("POST", "/v1/completions", json.dumps({"prompt": "endless", "stream": True}), JSON_AUTH)
        response = connection.getresponse()
        assert response.status == 200
        first = response.readline()
        assert first.startswith(b"data: ") and json.loads(first[6:])["choices"][0]["text"] == "x"
    assert fake.cancelled.wait(5), "the gRPC stream went on after the HTTP client left"


def test_a_client_leaving_before_a_whole_answer_cancels_the_grpc_stream(fake, gateway_url):
    connection = open_http(gateway_url)
    connection.request("POST", "/v1/completions", json.dumps({"prompt": "endless"}), JSON_AUTH)
    deadline = time.monotonic() + 5
    while not fake.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.requests, "the request never reached the scheduler"
    connection.close()
    assert fake.cancelled.wait(5), "the gRPC stream went on after the HTTP client left"


def open_http(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=10)


def test_an_idle_event_stream_stops_when_the_client_leaves():
    """Starlette alone notices a vanished client only when its next write fails; a stream waiting for a
    token that is slow to come (a queued request) must stop at once all the same."""
    from gateway.streaming import EventStreamResponse

    stopped = asyncio.Event()

    async def one_event_then_silence():
        try:
            yield "data: first\n\n"
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    async def scenario() -> bool:
        sent_first = asyncio.Event()

        async def receive():
            await sent_first.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message.get("body"):
                sent_first.set()

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        await asyncio.wait_for(EventStreamResponse(one_event_then_silence())(scope, receive, send), timeout=5)
        return stopped.is_set()

    assert asyncio.run(scenario())
