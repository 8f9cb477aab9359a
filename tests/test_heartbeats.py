"""Both ends of the heartbeat protocol without a model: the scheduler's `WorkerHealth` bookkeeping, and the
worker's `SchedulerLink` against a bare ROUTER standing in for the scheduler (heartbeats out, junk dropped,
a silent scheduler reported as lost)."""

from __future__ import annotations

import time

import pytest
import zmq

from pagedserve.testing.server_harness import free_port
from protos.pagedserve.v1 import worker_pb2
from scheduler_svc.worker_io.worker_health import WorkerHealth
from worker_svc.scheduler_link import SchedulerLink, SchedulerLost

# -- WorkerHealth ----------------------------------------------------------------------------------------


def test_a_worker_is_dead_after_three_of_its_announced_intervals_of_silence():
    health = WorkerHealth(default_interval=1.0)
    health.joined(rank=0, connection_fd=7, now=100.0)
    assert health.first_silent(102.9) is None  # held to the scheduler's 1 s until it announces its own
    health.heard(0, now=102.9, interval=0.5)
    assert health.first_silent(104.3) is None
    assert "worker rank 0 missed 3 heartbeats" in health.first_silent(104.5)
    health.heard(0, now=104.5)  # any message is a sign of life
    assert health.first_silent(105.9) is None


def test_within_the_grace_a_silent_worker_is_reported_once_and_not_dead():
    health = WorkerHealth(default_interval=1.0, grace=10.0)
    health.joined(rank=0, connection_fd=7, now=100.0)
    assert health.newly_unresponsive(103.5) == [(0, 3.5)]
    assert health.newly_unresponsive(105.0) == []  # once per silence
    assert health.first_silent(109.9) is None
    assert health.heard(0, now=109.9) == pytest.approx(9.9)  # back: how long it was silent
    assert health.heard(0, now=110.0) is None
    assert "worker rank 0 missed 10 heartbeats" in health.first_silent(120.5)


def test_only_a_worker_connection_maps_to_a_rank():
    health = WorkerHealth(default_interval=1.0)
    health.joined(rank=1, connection_fd=12, now=0.0)
    assert health.rank_of_connection(12) == 1
    assert health.rank_of_connection(13) is None
    health.heard(5, now=1.0)  # an unknown rank changes nothing
    assert health.first_silent(2.0) is None


# -- SchedulerLink (the worker's end) -------------------------------------------------------------------


@pytest.fixture()
def scheduler_socket():
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{free_port()}"
    router.bind(address)
    yield router, address
    router.close()
    context.term()


def _receive(router, timeout: float = 5.0) -> tuple[bytes, worker_pb2.WorkerToScheduler]:
    assert router.poll(timeout * 1000), "nothing from the worker"
    identity, frame = router.recv_multipart()
    return identity, worker_pb2.WorkerToScheduler.FromString(frame)


def _heartbeat(interval_ms: int) -> bytes:
    return worker_pb2.SchedulerToWorker(heartbeat=worker_pb2.Heartbeat(interval_ms=interval_ms)).SerializeToString()


def test_the_worker_heartbeats_while_its_main_thread_is_busy(scheduler_socket):
    router, address = scheduler_socket
    link = SchedulerLink(address, b"rank-0", heartbeat_interval=0.1)
    try:
        # Heartbeats start after the worker's first message, its hello (tests/test_log_noise.py says why).
        link.send(worker_pb2.WorkerToScheduler(hello=worker_pb2.WorkerHello(rank=0, world_size=1)))
        assert _receive(router)[1].WhichOneof("kind") == "hello"
        kinds = [_receive(router)[1] for _ in range(4)]  # the main thread never calls receive meanwhile
        assert {m.WhichOneof("kind") for m in kinds} == {"heartbeat"}
        assert kinds[0].heartbeat.interval_ms == 100
    finally:
        link.close()


def test_junk_from_the_scheduler_side_is_dropped_and_heartbeats_are_kept_from_the_main_thread(scheduler_socket):
    router, address = scheduler_socket
    link = SchedulerLink(address, b"rank-0", heartbeat_interval=0.1)
    try:
        link.send(worker_pb2.WorkerToScheduler(hello=worker_pb2.WorkerHello(rank=0, world_size=1)))
        identity, message = _receive(router)
        while message.WhichOneof("kind") != "hello":
            identity, message = _receive(router)
        setup = worker_pb2.SchedulerToWorker(setup=worker_pb2.WorkerSetup(block_size=16))
        for frame in (b"\xff\xff\xff", b"", worker_pb2.SchedulerToWorker().SerializeToString(), _heartbeat(100),
                      setup.SerializeToString()):
            router.send_multipart([identity, frame])
        assert link.receive() == setup
    finally:
        link.close()


def test_a_silent_scheduler_is_reported_lost_after_three_of_its_intervals(scheduler_socket):
    router, address = scheduler_socket
    link = SchedulerLink(address, b"rank-0", heartbeat_interval=0.1)
    try:
        link.send(worker_pb2.WorkerToScheduler(hello=worker_pb2.WorkerHello(rank=0, world_size=1)))
        identity, _ = _receive(router)
        router.send_multipart([identity, _heartbeat(300)])  # the scheduler announces 0.3 s: lost after ~0.9 s
        started = time.monotonic()
        with pytest.raises(SchedulerLost, match="sent nothing"):
            link.receive()
        assert 0.8 <= time.monotonic() - started <= 5.0
    finally:
        link.close()
