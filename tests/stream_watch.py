"""Observers for fault and shutdown tests: generation streams and a health watch, each on its own thread,
recording how and when they ended, so a test can kill or signal processes and then check every stream."""

from __future__ import annotations

import re
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import Client, PagedServeError, ServerUnavailableError
from pagedserve.launcher import SERVICE_MODULES
from pagedserve.testing.server_harness import assert_all_gone

FAULT_BOUND_S = 10.0
# How long a fault that comes inside the server (at a step) may take to come: the steps before it, which a
# loaded 2-core machine can slow far more than the fault's handling.
FAULT_COMES_WITHIN_S = 180.0


class StreamWatch:
    """One `generate_stream` call on its own thread: its chunks, the typed error that ended it (if any) and
    when it ended (time.monotonic)."""

    def __init__(self, target: str, prompt, **sampling) -> None:
        self.chunks: list = []
        self.error: PagedServeError | None = None
        self.ended_at: float | None = None
        self.first_chunk = threading.Event()  # also set when the stream ends without any chunk
        self._thread = threading.Thread(target=self._run, args=(target, prompt, sampling), daemon=True)
        self._thread.start()

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1].finish_reason if self.chunks else None

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"a stream still runs {timeout} s later"

    def _run(self, target: str, prompt, sampling: dict) -> None:
        try:
            with Client(target, max_retries=0) as client:
                for chunk in client.generate_stream(prompt, **sampling):
                    self.chunks.append(chunk)
                    self.first_chunk.set()
        except PagedServeError as error:
            self.error = error
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()


def start_streams(target: str, count: int, max_tokens: int, timeout: float = 120.0) -> list[StreamWatch]:
    """`count` streams of distinct prompts, returned once each has had its first chunk (or ended)."""
    streams = [StreamWatch(target, [1, 2, 3, 4 + i], max_tokens=max_tokens, ignore_eos=True) for i in range(count)]
    for stream in streams:
        assert stream.first_chunk.wait(timeout), "a stream got no first chunk"
    return streams


class HealthWatch:
    """The gRPC health Watch stream of the Generation service: every status it reported, until it ended."""

    def __init__(self, target: str) -> None:
        self.statuses: list[str] = []
        self._channel = grpc.insecure_channel(target)
        self._call = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def wait_for(self, status: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while status not in self.statuses and time.monotonic() < deadline:
            time.sleep(0.02)
        return status in self.statuses

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()

    def _run(self) -> None:
        try:
            for response in self._call:
                self.statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
        except grpc.RpcError:
            pass


def rank_pid(pids: list[int], rank: int) -> int:
    """The pid among `pids` of the worker started with `--rank RANK`."""
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        if b"worker_svc" in argv and b"--rank" in argv and argv[argv.index(b"--rank") + 1] == str(rank).encode():
            return pid
    raise LookupError(f"no worker rank {rank} among {pids}")


def process_with_role(pids: list[int], role: str) -> int:
    """The pid among `pids` running the service ROLE (`python -m scheduler_svc ...`, as the launcher starts it)."""
    module = SERVICE_MODULES[role].encode()
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        if b"-m" in argv and argv[argv.index(b"-m") + 1] == module:
            return pid
    raise LookupError(f"no {role} among {pids}")


def assert_fault_handled(server, streams: list[StreamWatch], health: HealthWatch, fault_at: float | None,
                         reason: str | re.Pattern) -> None:
    """What a worker fault must do to a server: every stream ends UNAVAILABLE naming `reason` (a substring or
    a pattern) within FAULT_BOUND_S of the fault (fault_at None: the fault came inside the server, at a step;
    the first stream to end marks it), health turns NOT_SERVING, a new request is refused, the server exits
    non-zero with the scheduler's exit 1, and no process is left.

    Why the fault at a step is waited for first: the streams' joins used to count from when they started, so
    the steps before --fail-at-step came out of the handling's 30 s; on a loaded machine "a stream still runs
    30 s later" then said nothing about the fault."""
    if fault_at is None:
        deadline = time.monotonic() + FAULT_COMES_WITHIN_S
        while all(stream.ended_at is None for stream in streams) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(stream.ended_at is not None for stream in streams), \
            f"no stream ended within {FAULT_COMES_WITHIN_S:g} s: the fault did not come"
    for stream in streams:
        stream.join(FAULT_BOUND_S + 20)
    errors = [stream.error for stream in streams]
    assert all(isinstance(error, ServerUnavailableError) for error in errors), errors
    matches = reason.search if isinstance(reason, re.Pattern) else (lambda details: reason in details)
    assert all(matches(error.details) for error in errors), [error.details for error in errors]
    ends = [stream.ended_at for stream in streams]
    slowest = max(ends) - (min(ends) if fault_at is None else fault_at)
    assert slowest <= FAULT_BOUND_S, f"the last stream ended {slowest:.1f} s after the fault"
    assert health.wait_for("NOT_SERVING", 5), health.statuses
    with Client(server.target, max_retries=0) as client, pytest.raises(ServerUnavailableError):
        client.generate([1, 2, 3], max_tokens=4)
    assert server.process.wait(timeout=30) != 0, server.log()[-3000:]
    assert "pagedserve: scheduler exit code 1" in server.log(), server.log()[-3000:]
    assert_all_gone(server.children, timeout=2.0)
