"""Overload through the real processes (scheduler, worker and HTTP gateway): past --max-queued-requests a
request gets RESOURCE_EXHAUSTED before any token and nobody hangs, the gateway turns that into a 429 with
Retry-After, a queued stream gets its 200 and SSE headers while it waits (a bad one still its 400), and a pool
smaller than the model's context caps max_model_len to it."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from client import InvalidRequestError, OverloadedError
from client.request_builder import build_generate_request
from pagedserve.testing.server_harness import http_json, running_server
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import generate_pb2_grpc

NUM_KV_BLOCKS = 20  # 320 tokens of KV: less than the model's 512 positions, so max_model_len is capped to 320
RETRY_AFTER_S = 1  # the gateway's default
LONG = dict(max_tokens=150, temperature=0.0, ignore_eos=True)  # ~150 steps: still running when the rest arrive
HOLD_TOKENS = NUM_KV_BLOCKS * 16 - 3  # a 3-token prompt and as many tokens as the pool holds


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=5)
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model),
                        "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "1", "--max-queued-requests", "2",
                        http=True) as running:
        yield running


pytestmark = pytest.mark.usefixtures("no_block_leaks")


def test_past_the_queue_bound_requests_are_refused_before_any_token_and_none_hangs(server):
    start = threading.Barrier(10)

    def one(index: int):
        chunks = []
        with server.client(timeout=120, max_retries=0) as client:  # the SDK would retry RESOURCE_EXHAUSTED
            client.model_info()  # connected before the barrier: a lazy connect after it could come late
            start.wait()
            try:
                for chunk in client.generate_stream([1, 2, index + 3], **LONG):
                    chunks.append(chunk)
            except OverloadedError as refused:
                return "refused", len(chunks), refused.code
        # Tokens, not chunks: a stream that fell behind gets several tokens in one message.
        return chunks[-1].finish_reason, sum(len(chunk.token_ids) for chunk in chunks), None

    with ThreadPoolExecutor(10) as pool:
        outcomes = list(pool.map(one, range(10)))
    refused = [outcome for outcome in outcomes if outcome[0] == "refused"]
    completed = [outcome for outcome in outcomes if outcome[0] == "length"]
    assert len(completed) == 3, "one running and two queued are served in full"
    assert len(refused) == 7
    assert all(num_chunks == 0 and code == grpc.StatusCode.RESOURCE_EXHAUSTED for _, num_chunks, code in refused)
    assert all(num_tokens == 150 for _, num_tokens, _ in completed)


def _wait_for(server, predicate, timeout: float = 60.0) -> None:
    with server.client() as client:
        deadline = time.monotonic() + timeout
        while not predicate(client.stats()):
            assert time.monotonic() < deadline, "the server did not reach the expected state"
            time.sleep(0.02)


def test_the_gateway_answers_a_full_queue_with_429_and_retry_after(server):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    with grpc.insecure_channel(server.target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        # An idle server first: the previous test's requests may still be leaving it (a stream ends with its last
        # token, a moment before the scheduler drops the request), and one still counted would fill the queue.
        _wait_for(server, lambda stats: stats.num_running == 0 and stats.num_waiting == 0)
        # One runs, two wait. The running one asks for as many tokens as the pool holds (they are cancelled
        # below): on a loaded machine 150 steps could end before the third request has arrived.
        holders = [stub.Generate(build_generate_request([4, 5, index], **{**LONG, "max_tokens": HOLD_TOKENS}))
                   for index in range(3)]
        _wait_for(server, lambda stats: stats.num_running == 1 and stats.num_waiting == 2)
        status, headers, answer = http_json(f"{server.http_url}/v1/completions", body)
        for holder in holders:
            holder.cancel()
    assert status == 429, answer
    assert headers["Retry-After"] == str(RETRY_AFTER_S)
    assert answer["error"]["type"] == "rate_limit_error"
    server.wait_all_blocks_free()
    status, _, answer = http_json(f"{server.http_url}/v1/completions", body)
    assert status == 200, answer


def test_a_queued_stream_gets_its_200_and_sse_headers_while_it_waits_and_a_bad_one_its_400(server):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "stream": True}
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    with grpc.insecure_channel(server.target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        _wait_for(server, lambda stats: stats.num_running == 0 and stats.num_waiting == 0)  # idle, as above
        # One runs and one waits, each for as many tokens as the pool holds: the stream queues behind both.
        holders = [stub.Generate(build_generate_request([4, 5, index], **{**LONG, "max_tokens": HOLD_TOKENS}))
                   for index in range(2)]
        _wait_for(server, lambda stats: stats.num_running == 1 and stats.num_waiting == 1)
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()  # the status line and headers only
        # Still queued behind both (first come, first served): so the headers came before it could run.
        _wait_for(server, lambda stats: stats.num_running == 1 and stats.num_waiting == 2, timeout=10)
        for holder in holders:
            holder.cancel()
    assert response.status == 200
    assert response.getheader("Content-Type").startswith("text/event-stream")
    events = response.read().decode()
    connection.close()
    assert '"finish_reason":"length"' in events and events.endswith("data: [DONE]\n\n")
    # The scheduler's validation still answers before any 200: out of the vocabulary is a 400 with a JSON body.
    status, headers, answer = http_json(f"{server.http_url}/v1/completions", {**body, "prompt": [10**6]})
    assert status == 400 and headers["Content-Type"] == "application/json", answer
    assert "prompt.token_ids" in answer["error"]["message"]
    server.wait_all_blocks_free()


def test_a_pool_smaller_than_the_model_caps_max_model_len_so_every_request_fits_it(server):
    """(tests/test_kv_pool_fit.py has the rest: an explicit --max-model-len the pool cannot hold stops the server.)"""
    with server.client(timeout=10) as client:
        assert client.model_info().max_model_len == NUM_KV_BLOCKS * 16
