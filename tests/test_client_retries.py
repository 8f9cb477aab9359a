"""The SDK's retries and failures against a fake server (tests/fake_generation_server.py): only UNAVAILABLE
and RESOURCE_EXHAUSTED are retried, with jittered exponential backoff, at most `max_retries` times, and a
stream never after its first chunk (no duplicated output); a server that dies mid-stream raises a typed
error at once instead of hanging."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from client import AsyncClient, Client, InvalidRequestError, OverloadedError, ServerUnavailableError
from client import sync_client
from client.channel import CHANNEL_OPTIONS
from client.retry import RetryBudget, RetryPolicy
from pagedserve.testing.server_harness import REPO_ROOT, free_port
from tests.fake_generation_server import FakeServer


@pytest.fixture(scope="module")
def server():
    fake_server = FakeServer()
    yield fake_server
    fake_server.stop()


@pytest.fixture()
def fake(server):
    return server.reset()


def _attempts(fake, text: str) -> int:
    return sum(request.text == text for request in fake.requests)


def test_unavailable_is_retried_until_the_server_answers(server, fake):
    with Client(server.target) as client:
        assert client.generate("unavailable twice").text == "Hello world"
    assert _attempts(fake, "unavailable twice") == 3


def test_retries_stop_after_max_retries_with_the_typed_error(server, fake):
    with Client(server.target, max_retries=2) as client:
        with pytest.raises(ServerUnavailableError, match="starting"):
            client.generate("unavailable")
        with pytest.raises(OverloadedError):
            client.generate("overloaded")
    assert (_attempts(fake, "unavailable"), _attempts(fake, "overloaded")) == (3, 3)


def test_other_errors_are_never_retried(server, fake):
    with Client(server.target) as client, pytest.raises(InvalidRequestError):
        client.generate("invalid")
    assert _attempts(fake, "invalid") == 1


def test_a_stream_that_failed_after_a_chunk_is_not_retried(server, fake):
    received = []
    with Client(server.target) as client, pytest.raises(ServerUnavailableError, match="worker rank 0"):
        for chunk in client.generate_stream("dies after a chunk"):
            received.append(chunk.text)
    assert received == ["once"]
    assert _attempts(fake, "dies after a chunk") == 1


def test_the_async_client_retries_the_same_way(server, fake):
    async def scenario():
        async with AsyncClient(server.target) as client:
            assert (await client.generate("unavailable twice")).text == "Hello world"
            with pytest.raises(ServerUnavailableError):
                async for _ in client.generate_stream("dies after a chunk"):
                    pass

    asyncio.run(scenario())
    assert (_attempts(fake, "unavailable twice"), _attempts(fake, "dies after a chunk")) == (3, 1)


def test_backoff_grows_exponentially_to_its_cap_with_full_jitter():
    policy = RetryPolicy(max_retries=9, initial_backoff=0.1, max_backoff=1.0)
    assert [policy.backoff(n, draw=lambda: 1.0) for n in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert policy.backoff(3, draw=lambda: 0.25) == pytest.approx(0.2)


def test_no_retry_starts_after_the_call_timeout():
    budget = RetryBudget(RetryPolicy(initial_backoff=10.0, max_backoff=10.0), timeout=1.0)
    error = ServerUnavailableError(grpc.StatusCode.UNAVAILABLE, "the server is starting")
    pauses = [budget.next_pause(error) for _ in range(50)]
    assert all(pause is None or pause < 1.0 for pause in pauses)


@contextlib.contextmanager
def fake_server_process(options: tuple = ()):
    """A FakeServer in a process of its own (so a test can kill or stop it); yields (process, target)."""
    port = free_port()
    code = ("import time; from tests.fake_generation_server import FakeServer; "
            f"server = FakeServer({port}, {options!r}); print('up', flush=True); time.sleep(600)")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE)
    try:
        assert process.stdout.readline() == b"up\n"
        yield process, f"127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def _raises_unavailable_within(stream, seconds: float) -> None:
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError):
        for _ in stream:
            pass
    assert time.monotonic() - started < seconds


def test_a_server_killed_mid_stream_raises_unavailable_promptly_instead_of_hanging():
    # resume_timeout=0: the loss itself is what is timed here (waiting for a restart is test_scheduler_restart's).
    with fake_server_process() as (process, target), Client(target, resume_timeout=0) as client:
        stream = client.generate_stream("endless")
        next(stream)
        os.kill(process.pid, signal.SIGKILL)
        _raises_unavailable_within(stream, 5.0)


def test_a_frozen_server_is_noticed_by_keepalive_pings(monkeypatch):
    """SIGSTOP keeps the connection open: only the keepalive ping notices (timings shortened for the test)."""
    short = {"grpc.keepalive_time_ms": 500, "grpc.keepalive_timeout_ms": 1000, "grpc.http2.ping_timeout_ms": 1000}
    monkeypatch.setattr(sync_client, "CHANNEL_OPTIONS", tuple((k, short.get(k, v)) for k, v in CHANNEL_OPTIONS))
    server_options = (("grpc.http2.min_recv_ping_interval_without_data_ms", 100),)
    with fake_server_process(server_options) as (process, target), Client(target, resume_timeout=0) as client:
        stream = client.generate_stream("endless")
        next(stream)
        os.kill(process.pid, signal.SIGSTOP)
        _raises_unavailable_within(stream, 10.0)


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_grpcs_own_message_size_refusal_is_an_invalid_request_and_not_retried():
    """RESOURCE_EXHAUSTED is "not now" (retried) unless gRPC says the message was over its limit: that request
    can never succeed (a message over twice the server's --max-message-bytes, or over a client send limit)."""
    from client.errors import from_rpc_error
    too_large = from_rpc_error(_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         "Received message larger than max (9000000 vs. 8388608)"))
    assert isinstance(too_large, InvalidRequestError)
    assert RetryBudget(RetryPolicy(), None).next_pause(too_large) is None
    busy = from_rpc_error(_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "1024 sequences are already queued"))
    assert isinstance(busy, OverloadedError) and RetryBudget(RetryPolicy(), None).next_pause(busy) is not None
