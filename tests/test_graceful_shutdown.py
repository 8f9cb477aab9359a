"""SIGTERM to `pagedserve serve` while streams run: admission stops at once (Generate UNAVAILABLE, health
NOT_SERVING), running requests get `--shutdown-timeout` seconds to finish, the rest end with finish_reason
"abort", and the server exits 0 with no child process left."""

from __future__ import annotations

import contextlib
import signal

import pytest

from client import Client, ServerUnavailableError
from pagedserve.testing.server_harness import assert_all_gone, launched_server
from pagedserve.testing.tiny_models import make_tiny_model
from tests.stream_watch import HealthWatch, start_streams

NUM_STREAMS = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=5)


@contextlib.contextmanager
def _sigterm_during_streams(model, tmp_path, drain_s: int, max_tokens: int):
    """Starts a server and NUM_STREAMS streams, sends SIGTERM, yields (server, streams) once health says
    NOT_SERVING; after the block, checks every stream ended, the exit code 0 and that no child is left."""
    with launched_server(tmp_path, "--model", str(model), "--num-kv-blocks", "256",
                         "--shutdown-timeout", str(drain_s)) as server:
        health = HealthWatch(server.target)
        streams = start_streams(server.target, NUM_STREAMS, max_tokens=max_tokens)
        server.process.send_signal(signal.SIGTERM)
        assert health.wait_for("NOT_SERVING", 10), health.statuses
        health.close()
        yield server, streams
        for stream in streams:
            stream.join(drain_s + 30)
        assert server.process.wait(timeout=drain_s + 30) == 0, server.log()[-3000:]
        assert_all_gone(server.children, timeout=2.0)


def test_sigterm_refuses_new_requests_and_lets_running_ones_finish_within_the_drain(model, tmp_path):
    max_tokens = 48
    with _sigterm_during_streams(model, tmp_path, drain_s=30, max_tokens=max_tokens) as (server, streams):
        with Client(server.target, max_retries=0) as client:
            with pytest.raises(ServerUnavailableError, match="shutting down"):
                client.generate([1, 2, 3], max_tokens=4)
        assert any(stream.ended_at is None for stream in streams), "the streams ended before the refusal"
    assert [stream.error for stream in streams] == [None] * NUM_STREAMS
    assert [(s.finish_reason, s.num_tokens) for s in streams] == [("length", max_tokens)] * NUM_STREAMS


def test_sigterm_with_no_drain_time_aborts_what_runs(model, tmp_path):
    with _sigterm_during_streams(model, tmp_path, drain_s=0, max_tokens=400) as (_, streams):
        pass
    assert [stream.error for stream in streams] == [None] * NUM_STREAMS
    assert [stream.finish_reason for stream in streams] == ["abort"] * NUM_STREAMS
    assert all(stream.num_tokens < 400 for stream in streams)
