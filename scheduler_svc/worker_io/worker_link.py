"""The scheduler's end of the ZeroMQ link to its workers.

One ROUTER socket, bound by the scheduler; each worker rank connects a DEALER whose identity is its rank.
Every frame is one serialized `WorkerToScheduler` / `SchedulerToWorker` envelope (protobuf, never pickle),
so neither side imports the other's package. The engine loop uses the link one step at a time: `execute`
sends the same plan to every rank and waits for rank 0's result. Why one answer for N ranks: tensor-parallel
ranks run every step together (their collectives keep them in lockstep) and sample identically (seeded
requests, logits gathered to every rank), so the other ranks' results would repeat rank 0's; they send only
heartbeats, and a WorkerError if a step fails. A rank that dies or falls silent is seen by the socket monitor
or its heartbeats like rank 0, so any rank's death fails the link.

Ownership: one pump task alone receives. It drops every frame that is not a valid envelope from a worker
that said hello (logged, never raised: anyone who reaches the port can send bytes), keeps heartbeats and the
socket monitor's disconnects to the `WorkerHealth` watch, sends the scheduler's own heartbeats, and queues
the rest for `connect_workers` / `execute`. The first sign that a worker is gone or failed (its WorkerError,
its connection closing, its heartbeats stopping) becomes the link's one `WorkerFailure`: raised by every
later call and returned by `wait_failed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from protos.pagedserve.v1 import worker_pb2
from scheduler_svc.worker_io.worker_health import WorkerHealth
from service_runtime.worker_link_auth import LinkKeys, OnlyWorkers

logger = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A worker failed, went away, or sent something the protocol does not allow."""


@dataclass(frozen=True)
class WorkerPool:
    """What the connected workers hold, agreed across ranks (the smallest pool wins)."""

    model_name: str
    vocab_size: int
    max_position_embeddings: int
    num_kv_blocks: int
    num_swap_blocks: int
    batch_invariant: bool = False  # every rank said so in its hello
    quantization: str = ""  # rank 0's hello (every rank loads the same checkpoint with the same flags)
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class _Arrival:
    identity: bytes
    connection_fd: int
    message: worker_pb2.WorkerToScheduler
    read_at: float = 0.0  # time.perf_counter() when the pump read it off the socket


class WorkerLink:
    def __init__(self, address: str, num_workers: int, heartbeat_interval: float = 2.0, heartbeat_grace: float = 0.0,
                 keys: LinkKeys | None = None):
        self._context = zmq.asyncio.Context()
        self.last_result_wait_s = 0.0  # see receive_result
        self._authenticator = None
        if keys is not None:  # only workers holding the shared secret get through (worker_link_auth.py)
            self._authenticator = AsyncioAuthenticator(self._context)
            self._authenticator.start()
            self._authenticator.configure_curve_callback("*", credentials_provider=OnlyWorkers(keys))
        self._socket = self._context.socket(zmq.ROUTER)
        if keys is not None:
            self._socket.curve_server = True
            self._socket.curve_secretkey = keys.server_secret
            self._socket.curve_publickey = keys.server_public
        self._socket.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: a second peer claiming a connected worker's identity gets no voice. A restarted
        # worker reuses its rank's identity only once its predecessor's connection is gone (the launcher stops
        # the whole rank set first).
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._socket.bind(address)
        self._num_workers = num_workers
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_grace = heartbeat_grace
        self._identities: dict[int, bytes] = {}  # rank -> ZeroMQ identity
        self._ranks: dict[bytes, int] = {}  # ZeroMQ identity -> rank
        self._greeted: set[bytes] = set()  # identities whose hello is queued, not yet taken by connect_workers
        self._shutdown_sent = False  # after it, a worker's disconnect is its expected exit, not a failure
        self._health = WorkerHealth(heartbeat_interval, heartbeat_grace)
        self._arrivals: asyncio.Queue[_Arrival | WorkerFailure] = asyncio.Queue()
        self._failure: WorkerFailure | None = None
        self._failed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._pump_task = asyncio.ensure_future(self._pump())

    async def connect_workers(
        self, make_setup: Callable[[worker_pb2.WorkerHello], worker_pb2.WorkerSetup], timeout: float
    ) -> WorkerPool:
        """Waits for every rank's hello, sends each the setup made from rank 0's hello, and waits for every
        rank's KV pool size."""
        hellos: dict[int, worker_pb2.WorkerHello] = {}
        async with asyncio.timeout(timeout):
            while len(hellos) < self._num_workers:
                arrival = await self._next()
                hello = arrival.message.hello
                if hello.world_size != self._num_workers or hello.rank >= self._num_workers or hello.rank in hellos:
                    raise WorkerFailure(
                        f"worker rank {hello.rank} of {hello.world_size} does not fit {self._num_workers} workers"
                    )
                hellos[hello.rank] = hello
                self._identities[hello.rank] = arrival.identity
                self._ranks[arrival.identity] = hello.rank
                self._health.joined(hello.rank, arrival.connection_fd, self._loop.time())
            setup = make_setup(hellos[0])
            for rank in sorted(self._identities):
                await self._send(rank, worker_pb2.SchedulerToWorker(setup=setup))
            readies: dict[int, worker_pb2.WorkerReady] = {}
            while len(readies) < self._num_workers:
                arrival = await self._next()
                self._expect(arrival, "ready")
                readies[self._ranks[arrival.identity]] = arrival.message.ready
        first = hellos[0]
        return WorkerPool(
            model_name=first.model_name,
            vocab_size=first.vocab_size,
            max_position_embeddings=first.max_position_embeddings,
            num_kv_blocks=min(r.num_kv_blocks for r in readies.values()),
            num_swap_blocks=min(r.num_swap_blocks for r in readies.values()),
            batch_invariant=all(hello.batch_invariant for hello in hellos.values()),
            quantization=first.quantization,
            kv_cache_dtype=first.kv_cache_dtype or "auto",
        )

    async def execute(self, plan: worker_pb2.SchedulerToWorker) -> worker_pb2.StepResult:
        """Runs one step on every rank; returns rank 0's result (the only rank that answers a step)."""
        await self.send_plan(plan)
        return await self.receive_result(plan.plan.step_id)

    async def send_plan(self, plan: worker_pb2.SchedulerToWorker) -> None:
        """Sends a step to every rank without waiting for it: a worker runs plans in the order they arrive,
        so the next one can be sent while this one runs (async scheduling)."""
        for rank in sorted(self._identities):
            await self._send(rank, plan)

    async def send_cancels(self, request_ids: list[str]) -> None:
        """Tells every rank to drop these aborted requests' rows from the plans it has not started (it reads
        them on its IO thread, ahead of the plans queued before them; see worker.proto's CancelRequests)."""
        message = worker_pb2.SchedulerToWorker(cancel=worker_pb2.CancelRequests(request_ids=request_ids))
        for rank in sorted(self._identities):
            await self._send(rank, message)

    async def receive_result(self, step_id: int) -> worker_pb2.StepResult:
        """Waits for rank 0's result of `step_id`, the oldest step sent and not received (the other ranks run
        the step and answer nothing unless it fails)."""
        arrival = await self._next()
        self._expect(arrival, "result")
        rank = self._ranks[arrival.identity]
        if rank != 0:
            raise WorkerFailure(f"worker rank {rank} sent a step result; only rank 0 answers steps")
        if arrival.message.result.step_id != step_id:
            raise WorkerFailure(f"expected the result of step {step_id}, got step {arrival.message.result.step_id}")
        # How long the result sat read but untaken: the event loop's other work (stream writers) in the way.
        self.last_result_wait_s = time.perf_counter() - arrival.read_at
        return arrival.message.result

    async def replace_workers(
        self, make_setup: Callable[[worker_pb2.WorkerHello], worker_pb2.WorkerSetup], timeout: float
    ) -> WorkerPool:
        """After a failure: tells the ranks still connected to exit (a tensor-parallel group lives and dies
        whole), forgets every rank, and waits for a new full set to say hello and report its pool, as
        `connect_workers` (their supervisor, the launcher or compose, starts them)."""
        await self.shutdown_workers()
        self._pump_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump_task
        self._identities.clear()
        self._ranks.clear()
        self._greeted.clear()
        self._shutdown_sent = False
        self._health = WorkerHealth(self._heartbeat_interval, self._heartbeat_grace)
        self._arrivals = asyncio.Queue()
        self._failure = None
        self._failed = asyncio.Event()
        self._pump_task = asyncio.ensure_future(self._pump())
        return await self.connect_workers(make_setup, timeout)

    async def wait_failed(self) -> WorkerFailure:
        """Returns once a worker failed or went away: why."""
        await self._failed.wait()
        return self._failure

    async def shutdown_workers(self) -> None:
        self._shutdown_sent = True
        for rank in sorted(self._identities):
            await self._send(rank, worker_pb2.SchedulerToWorker(shutdown=worker_pb2.Shutdown()))

    async def close(self) -> None:
        """Stops the pump and closes the socket, giving messages already sent (shutdown) half a second."""
        self._pump_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump_task
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=500)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    # -- receiving ---------------------------------------------------------------------------------------

    async def _next(self) -> _Arrival:
        item = await self._arrivals.get()
        if isinstance(item, WorkerFailure):
            self._arrivals.put_nowait(item)  # every later call fails the same way
            raise item
        return item

    def _expect(self, arrival: _Arrival, kind: str) -> None:
        got = arrival.message.WhichOneof("kind")
        if got != kind:
            raise WorkerFailure(f"worker rank {self._ranks[arrival.identity]} sent {got}, expected {kind}")

    async def _pump(self) -> None:
        try:
            await self._pump_until_failed()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a bug or a ZeroMQ error here must not leave the engine waiting forever
            logger.exception("the worker link's receive loop failed")
            self._fail(f"the worker link failed: {type(error).__name__}: {error}")

    async def _pump_until_failed(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        heartbeat = worker_pb2.SchedulerToWorker(
            heartbeat=worker_pb2.Heartbeat(interval_ms=round(self._heartbeat_interval * 1000)))
        next_beat = self._loop.time()
        while self._failure is None:
            events = dict(await poller.poll(timeout=max(0.0, next_beat - self._loop.time()) * 1000))
            if self._socket in events:
                self._on_frames(await self._socket.recv_multipart(copy=False))
            if self._monitor in events:
                event = parse_monitor_message(await self._monitor.recv_multipart())
                # A worker's last words (its WorkerError) come before its disconnect: read them first.
                while self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._on_frames(await self._socket.recv_multipart(copy=False))
                self._on_monitor_event(event)
            now = self._loop.time()
            if now >= next_beat:
                for rank in sorted(self._identities):
                    await self._send(rank, heartbeat)
                next_beat = now + self._heartbeat_interval
            # Judge silence only with nothing left to read: after a stall of this loop, heartbeats that did
            # arrive in time may still wait in the socket.
            if not self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                silent = self._health.first_silent(now)
                if silent is not None:
                    self._fail(silent)
                for rank, seconds in self._health.newly_unresponsive(now):
                    logger.warning("worker rank %d is unresponsive (nothing for %.1f s); it counts as dead if still "
                                   "silent after the --heartbeat-grace", rank, seconds)

    def _on_monitor_event(self, event: dict) -> None:
        if event["event"] == zmq.EVENT_DISCONNECTED:
            rank = self._health.rank_of_connection(event["value"])
            if rank is not None and self._shutdown_sent:
                logger.debug("worker rank %d exited after its shutdown", rank)
            elif rank is not None:
                self._fail(f"worker rank {rank} disconnected: its process exited or its connection broke")

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            logger.warning("dropped a worker message of %d frames", len(frames))
            return
        identity, payload = frames[0].bytes, frames[1].bytes
        message = worker_pb2.WorkerToScheduler()
        try:
            message.ParseFromString(payload)
        except Exception:  # protobuf raises DecodeError; anything else malformed is dropped too
            logger.warning("dropped a malformed worker message (%d bytes)", len(payload))
            return
        kind = message.WhichOneof("kind")
        rank = self._ranks.get(identity)
        if rank is None:
            if kind == "hello" and len(self._identities) < self._num_workers:
                self._greeted.add(identity)
                self._arrivals.put_nowait(_Arrival(identity, frames[1].get(zmq.SRCFD), message, time.perf_counter()))
            elif kind == "heartbeat" and identity in self._greeted:
                logger.debug("a heartbeat from %r before its hello was taken (health starts at the hello)", identity)
            else:
                logger.warning("dropped a %s message from a peer that is no worker (%d bytes)", kind, len(payload))
            return
        announced = message.heartbeat.interval_ms / 1000 if kind == "heartbeat" else None
        back_after = self._health.heard(rank, self._loop.time(), announced)
        if back_after is not None:
            logger.warning("worker rank %d answered again after %.1f s of silence", rank, back_after)
        if kind == "error":
            error = message.error
            self._fail(f"worker rank {error.rank} failed at step {error.step_id}: {error.message}")
        elif kind is None:
            logger.warning("dropped a message of no known kind from worker rank %d", rank)
        elif kind != "heartbeat":
            self._arrivals.put_nowait(_Arrival(identity, frames[1].get(zmq.SRCFD), message, time.perf_counter()))

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            logger.error("worker failure: %s", reason)
            self._failure = WorkerFailure(reason)
            self._arrivals.put_nowait(self._failure)
            self._failed.set()

    async def _send(self, rank: int, message: worker_pb2.SchedulerToWorker) -> None:
        await self._socket.send_multipart([self._identities[rank], message.SerializeToString()])
