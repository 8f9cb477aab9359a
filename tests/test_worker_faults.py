"""A worker that dies, raises, or stops answering, through real `pagedserve serve` processes with worker restarts
off (--max-worker-restarts 0): every stream in flight ends with UNAVAILABLE saying why within 10 s, health turns NOT_SERVING, new requests are refused, the
server exits non-zero (so a restart policy brings it back), and no process is left behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagedserve.testing.server_harness import launched_server
from pagedserve.testing.tiny_models import make_tiny_model
from tests.stream_watch import HealthWatch, assert_fault_handled, process_with_role, start_streams

NUM_STREAMS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=5)


def _serve_args(model, *extra: str) -> list[str]:
    # Without worker restarts: these tests are about what a lost worker does to the stack when nothing
    # replaces it (tests/test_worker_recovery.py has the replacements).
    return ["--model", str(model), "--num-kv-blocks", "256", "--max-worker-restarts", "0", *extra]


def test_a_killed_worker_ends_every_stream_unavailable_and_the_server_exits_nonzero(model, tmp_path):
    with launched_server(tmp_path, *_serve_args(model)) as server:
        health = HealthWatch(server.target)
        streams = start_streams(server.target, NUM_STREAMS, max_tokens=400)
        os.kill(process_with_role(server.children, "worker"), signal.SIGKILL)
        assert_fault_handled(server, streams, health, time.monotonic(), "worker rank 0 disconnected")
        health.close()


def test_a_forward_pass_that_raises_ends_every_stream_unavailable_naming_the_error(model, tmp_path):
    # Step 60: every stream is running by then, well before its 400th token. (At step 10 the last stream
    # sometimes had not connected yet on a loaded machine, and found the server gone.)
    with launched_server(tmp_path, *_serve_args(model, "--fail-at-step", "60")) as server:
        health = HealthWatch(server.target)
        streams = start_streams(server.target, NUM_STREAMS, max_tokens=400)
        assert_fault_handled(server, streams, health, None, "failed on purpose (--fail-at-step)")
        health.close()


def test_a_stopped_worker_misses_its_heartbeats_and_is_killed_with_the_stack(model, tmp_path):
    with launched_server(tmp_path, *_serve_args(model, "--heartbeat-interval", "1", "--heartbeat-grace", "0")) as server:
        health = HealthWatch(server.target)
        streams = start_streams(server.target, NUM_STREAMS, max_tokens=400)
        worker = process_with_role(server.children, "worker")
        os.kill(worker, signal.SIGSTOP)
        try:
            assert_fault_handled(server, streams, health, time.monotonic(), "worker rank 0 missed 3 heartbeats")
        finally:
            if os.path.exists(f"/proc/{worker}"):
                os.kill(worker, signal.SIGKILL)
        health.close()


def test_a_stopped_worker_that_resumes_within_the_grace_is_not_killed_and_every_stream_completes(model, tmp_path):
    with launched_server(tmp_path, *_serve_args(model, "--heartbeat-interval", "0.5", "--heartbeat-grace", "30")) as server:
        health = HealthWatch(server.target)
        streams = start_streams(server.target, 4, max_tokens=200)
        worker = process_with_role(server.children, "worker")
        time.sleep(0.5)
        os.kill(worker, signal.SIGSTOP)
        time.sleep(4.0)  # eight heartbeat intervals: past the three that make it unresponsive
        os.kill(worker, signal.SIGCONT)
        for stream in streams:
            stream.join(timeout=120)
        assert all(stream.error is None and stream.num_tokens == 200 for stream in streams), \
            [(stream.error, stream.num_tokens) for stream in streams]
        assert "NOT_SERVING" not in health.statuses
        assert server.process.poll() is None
        log = server.log()
    assert "worker rank 0 is unresponsive" in log and "worker rank 0 answered again after" in log
    health.close()


def test_a_worker_lost_while_draining_still_ends_the_streams_unavailable_and_exits_nonzero(model, tmp_path):
    with launched_server(tmp_path, *_serve_args(model, "--shutdown-timeout", "30")) as server:
        health = HealthWatch(server.target)
        streams = start_streams(server.target, NUM_STREAMS, max_tokens=400)
        server.process.send_signal(signal.SIGTERM)
        assert health.wait_for("NOT_SERVING", 10), health.statuses
        os.kill(process_with_role(server.children, "worker"), signal.SIGKILL)
        assert_fault_handled(server, streams, health, time.monotonic(), "worker rank 0 disconnected")
        health.close()
