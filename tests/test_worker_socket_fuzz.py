"""Hostile bytes on the scheduler's worker socket (the ZeroMQ ROUTER workers connect to), while real requests
stream: raw TCP garbage, ZeroMQ messages of any shape, and well-formed envelopes forged by a peer that is no
worker (a fake error, result, hello or heartbeat, even under the worker's identity). Every one must be dropped:
no request fails (never INTERNAL, never UNAVAILABLE), the server never crashes, and it still serves after."""

from __future__ import annotations

import socket
import threading

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client import Client
from pagedserve.testing.server_harness import free_port, running_server
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2

MAX_TOKENS = 16
FORGED = [
    worker_pb2.WorkerToScheduler(error=worker_pb2.WorkerError(rank=0, step_id=1, message="forged")),
    worker_pb2.WorkerToScheduler(result=worker_pb2.StepResult(step_id=1, sampled=worker_pb2.SampledTokens(request_ids=[""], token_ids=[0], logprobs=[0.0], ranks=[0], num_top=[0]))),
    worker_pb2.WorkerToScheduler(hello=worker_pb2.WorkerHello(rank=0, world_size=1)),
    worker_pb2.WorkerToScheduler(heartbeat=worker_pb2.Heartbeat(interval_ms=1)),
    worker_pb2.WorkerToScheduler(ready=worker_pb2.WorkerReady(num_kv_blocks=1)),
    worker_pb2.WorkerToScheduler(),
]
frames = st.one_of(st.binary(max_size=300), st.sampled_from([m.SerializeToString() for m in FORGED]))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=5)
    address = f"tcp://127.0.0.1:{free_port()}"
    # The link open (no shared secret), as under compose without one: the hostile frames reach the scheduler's
    # own parsing, which is what this file tests (tests/test_worker_link_auth.py has the authenticated link).
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--num-kv-blocks", "64",
                        "--worker-address", address, env={"PAGEDSERVE_WORKER_SECRET": ""}) as running:
        running.worker_address = address
        yield running


class RequestLoop:
    """Generates one request after another on a thread until stopped; keeps every outcome."""

    def __init__(self, target: str) -> None:
        self.outcomes: list[tuple[str | None, int] | Exception] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(target,), daemon=True)
        self._thread.start()

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(120)
        return self.outcomes

    def _run(self, target: str) -> None:
        with Client(target, max_retries=0) as client:
            while not self._stop.is_set():
                try:
                    result = client.generate([1, 2, 3, len(self.outcomes) % 100 + 4], max_tokens=MAX_TOKENS,
                                             ignore_eos=True)
                    self.outcomes.append((result.finish_reason, len(result.token_ids)))
                except Exception as error:  # any failure at all is what this test looks for
                    self.outcomes.append(error)


def test_hostile_bytes_on_the_worker_socket_are_dropped_while_requests_stream(server):
    context = zmq.Context()
    host, port = server.worker_address.removeprefix("tcp://").split(":")
    requests = RequestLoop(server.target)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(message=st.lists(frames, min_size=1, max_size=4), raw_tcp=st.booleans(),
           identity=st.sampled_from([None, b"rank-0", b"rank-1"]))
    def send_hostile(message, raw_tcp, identity):
        if raw_tcp:
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                raw.sendall(b"".join(message))
            return
        peer = context.socket(zmq.DEALER)
        if identity is not None:
            peer.setsockopt(zmq.IDENTITY, identity)
        peer.connect(server.worker_address)
        peer.send_multipart(message)
        peer.close(linger=200)

    try:
        send_hostile()
    finally:
        outcomes = requests.stop()
        context.term()
    assert outcomes, "no request ran during the fuzzing"
    assert outcomes == [("length", MAX_TOKENS)] * len(outcomes), [o for o in outcomes if isinstance(o, Exception)]
    with server.client() as client:
        assert len(client.generate([5, 6, 7], max_tokens=4).token_ids) == 4
    assert "dropped a" in server.log()
