"""The worker's end of the ZeroMQ link to the scheduler, owned by one IO thread.

Why a thread: the main thread spends whole seconds in a forward pass, the memory profile or CUDA graph
capture, and must still look alive to the scheduler; and while it waits for a plan it must notice a
scheduler that is gone. ZeroMQ sockets are not thread-safe, so the IO thread alone touches the DEALER
socket: it sends a heartbeat every interval, drops frames that do not parse, keeps heartbeats to itself,
records cancelled requests at once (cancelled_requests.py: they must overtake the plans queued before them),
hands every other scheduler message to the main thread through a queue, and sends whatever the main thread
puts on an inproc pipe.

When the scheduler has sent nothing for 3 of its announced intervals (its own interval until the first
heartbeat says otherwise), `receive` raises `SchedulerLost` and the worker exits. A main thread stuck in a
forward pass (say, a collective waiting for a rank that died) never gets there, so if the main thread has not
closed the link `_EXIT_GRACE_S` later, the IO thread ends the process itself.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time

import zmq

from protos.pagedserve.v1 import worker_pb2
from service_runtime.worker_link_auth import LinkKeys, secure_worker_socket
from worker_svc.cancelled_requests import CancelledRequests

logger = logging.getLogger(__name__)

MISSED_HEARTBEATS = 3
_EXIT_GRACE_S = 5.0
_STOP = b""  # on the pipe: the main thread closes the link (a real envelope is never empty: it has a kind)


class SchedulerLost(RuntimeError):
    """The scheduler stopped sending anything for 3 of its heartbeat intervals."""


class SchedulerLink:
    def __init__(self, address: str, identity: bytes, heartbeat_interval: float, keys: LinkKeys | None = None,
                 cancelled: CancelledRequests | None = None):
        self._context = zmq.Context()
        self._pipe_address = f"inproc://scheduler-link-{id(self)}"
        self._pipe = self._context.socket(zmq.PAIR)
        self._pipe.bind(self._pipe_address)
        self._inbox: queue.Queue[worker_pb2.SchedulerToWorker | SchedulerLost] = queue.Queue()
        self._interval = heartbeat_interval
        self._keys = keys  # CURVE keys of the shared secret (service_runtime/worker_link_auth.py), if any
        self._cancelled = cancelled  # None: CancelRequests are ignored (tensor-parallel ranks)
        self._thread = threading.Thread(target=self._run, args=(address, identity), name="scheduler-link",
                                        daemon=True)
        self._thread.start()

    def send(self, message: worker_pb2.WorkerToScheduler) -> None:
        self._pipe.send(message.SerializeToString())

    def receive(self) -> worker_pb2.SchedulerToWorker:
        """The next scheduler message other than a heartbeat; raises SchedulerLost once it went silent."""
        item = self._inbox.get()
        if isinstance(item, SchedulerLost):
            raise item
        return item

    def poll(self, timeout: float) -> worker_pb2.SchedulerToWorker | None:
        """The next scheduler message if one arrives within `timeout` seconds, else None."""
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, SchedulerLost):
            raise item
        return item

    def close(self) -> None:
        """Flushes what was sent (up to a second) and stops the IO thread."""
        self._pipe.send(_STOP)
        self._thread.join(timeout=5.0)
        self._pipe.close(linger=0)
        self._context.term()

    # -- the IO thread -------------------------------------------------------------------------------------

    def _run(self, address: str, identity: bytes) -> None:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, identity)
        dealer.setsockopt(zmq.LINGER, 1000)
        if self._keys is not None:
            secure_worker_socket(dealer, self._keys)
        dealer.connect(address)
        pipe = self._context.socket(zmq.PAIR)
        pipe.connect(self._pipe_address)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pipe, zmq.POLLIN)
        heartbeat = worker_pb2.WorkerToScheduler(
            heartbeat=worker_pb2.Heartbeat(interval_ms=round(self._interval * 1000))).SerializeToString()
        peer_interval = self._interval
        # No heartbeat before the worker's first message (its hello): the scheduler knows a peer only from
        # its hello, and would log an earlier heartbeat as coming from a stranger.
        last_heard = last_awake = time.monotonic()
        next_beat = math.inf
        lost_at = None
        try:
            while True:
                events = dict(poller.poll(timeout=min(max(0.0, next_beat - time.monotonic()), self._interval) * 1000))
                awake = time.monotonic()
                if awake - last_awake > 2 * self._interval:
                    # This process was not running (stopped, or starved): the scheduler's messages of that
                    # time may not even have reached ZeroMQ's queue yet. Its silence counts from now.
                    last_heard = max(last_heard, awake)
                last_awake = awake
                if pipe in events:
                    frame = pipe.recv()
                    if frame == _STOP:
                        return
                    dealer.send(frame)
                    next_beat = min(next_beat, time.monotonic() + self._interval)
                if dealer in events:
                    message = _parse(dealer.recv())
                    if message is not None:
                        last_heard = time.monotonic()
                        kind = message.WhichOneof("kind")
                        if kind == "heartbeat":
                            peer_interval = message.heartbeat.interval_ms / 1000 or self._interval
                        elif kind == "cancel":
                            if self._cancelled is not None:
                                self._cancelled.add(message.cancel.request_ids)
                        else:
                            self._inbox.put(message)
                now = time.monotonic()
                if now - awake > 2 * self._interval:  # stopped between the poll and here: the same as above
                    last_heard = max(last_heard, now)
                if now >= next_beat:
                    _send_unless_full(dealer, heartbeat)
                    next_beat = now + self._interval
                silent = now - last_heard
                if lost_at is None and silent > MISSED_HEARTBEATS * peer_interval:
                    lost_at = now
                    self._inbox.put(SchedulerLost(f"the scheduler sent nothing for {silent:.1f} s"))
                if lost_at is not None and now - lost_at > _EXIT_GRACE_S:
                    logger.error("the scheduler is gone and the main thread did not exit; exiting now")
                    os._exit(1)
        finally:
            pipe.close(linger=0)
            dealer.close()


def _send_unless_full(dealer: zmq.Socket, frame: bytes) -> None:
    """A heartbeat never blocks the IO thread: with the scheduler gone its queue may fill up."""
    try:
        dealer.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass


def _parse(frame: bytes) -> worker_pb2.SchedulerToWorker | None:
    """The scheduler's message, or None (logged) for a frame that is no valid envelope."""
    message = worker_pb2.SchedulerToWorker()
    try:
        message.ParseFromString(frame)
    except Exception:  # protobuf raises DecodeError; anything else malformed is dropped too
        logger.warning("dropped a malformed scheduler frame (%d bytes)", len(frame))
        return None
    if message.WhichOneof("kind") is None:
        logger.warning("dropped a scheduler frame of no known kind (%d bytes)", len(frame))
        return None
    return message
