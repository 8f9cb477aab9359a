"""The scheduler's end of the ZeroMQ link to its workers.

One ROUTER socket, bound by the scheduler; each worker rank connects a DEALER whose identity is its rank.
Every frame is one serialized `WorkerToScheduler` / `SchedulerToWorker` envelope (protobuf, never pickle),
so neither side imports the other's package. The link is used by the engine loop only, one step at a time:
`execute` sends the same plan to every rank and waits for every rank's result, which keeps tensor-parallel
ranks in lockstep.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from protos.pagedserve.v1 import worker_pb2

logger = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A worker reported an error or sent something the protocol does not allow."""


@dataclass(frozen=True)
class WorkerPool:
    """What the connected workers hold, agreed across ranks (the smallest pool wins)."""

    model_name: str
    vocab_size: int
    max_position_embeddings: int
    num_kv_blocks: int
    num_swap_blocks: int


class WorkerLink:
    def __init__(self, address: str, num_workers: int):
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._num_workers = num_workers
        self._identities: dict[int, bytes] = {}

    async def connect_workers(
        self, make_setup: Callable[[worker_pb2.WorkerHello], worker_pb2.WorkerSetup], timeout: float
    ) -> WorkerPool:
        """Waits for every rank's hello, sends each the setup made from rank 0's hello, and waits for every
        rank's KV pool size."""
        hellos: dict[int, worker_pb2.WorkerHello] = {}
        async with asyncio.timeout(timeout):
            while len(hellos) < self._num_workers:
                identity, message = await self._receive()
                if message.WhichOneof("kind") != "hello":
                    raise WorkerFailure(f"expected a hello from a new worker, got {message.WhichOneof('kind')}")
                hello = message.hello
                if hello.world_size != self._num_workers or hello.rank >= self._num_workers:
                    raise WorkerFailure(
                        f"worker rank {hello.rank} of {hello.world_size} does not fit {self._num_workers} workers"
                    )
                hellos[hello.rank] = hello
                self._identities[hello.rank] = identity
            setup = make_setup(hellos[0])
            for rank in sorted(self._identities):
                await self._send(rank, worker_pb2.SchedulerToWorker(setup=setup))
            readies: dict[int, worker_pb2.WorkerReady] = {}
            while len(readies) < self._num_workers:
                _, message = await self._receive()
                self._raise_if_error(message)
                if message.WhichOneof("kind") != "ready":
                    raise WorkerFailure(f"expected ready, got {message.WhichOneof('kind')}")
                readies[message.ready.rank] = message.ready
        first = hellos[0]
        return WorkerPool(
            model_name=first.model_name,
            vocab_size=first.vocab_size,
            max_position_embeddings=first.max_position_embeddings,
            num_kv_blocks=min(r.num_kv_blocks for r in readies.values()),
            num_swap_blocks=min(r.num_swap_blocks for r in readies.values()),
        )

    async def execute(self, plan: worker_pb2.SchedulerToWorker) -> worker_pb2.StepResult:
        """Runs one step on every rank; returns rank 0's result (the ranks sample identically)."""
        await self.send_plan(plan)
        return await self.receive_result(plan.plan.step_id)

    async def send_plan(self, plan: worker_pb2.SchedulerToWorker) -> None:
        """Sends a step to every rank without waiting for it: a worker runs plans in the order they arrive,
        so the next one can be sent while this one runs (async scheduling)."""
        for rank in sorted(self._identities):
            await self._send(rank, plan)

    async def receive_result(self, step_id: int) -> worker_pb2.StepResult:
        """Waits for every rank's result of `step_id`, the oldest step sent and not received; returns rank 0's."""
        results: dict[int, worker_pb2.StepResult] = {}
        while len(results) < self._num_workers:
            identity, message = await self._receive()
            self._raise_if_error(message)
            if message.WhichOneof("kind") != "result" or message.result.step_id != step_id:
                raise WorkerFailure(f"expected the result of step {step_id}")
            rank = next(r for r, i in self._identities.items() if i == identity)
            results[rank] = message.result
        return results[0]

    async def shutdown_workers(self) -> None:
        for rank in sorted(self._identities):
            await self._send(rank, worker_pb2.SchedulerToWorker(shutdown=worker_pb2.Shutdown()))

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    async def _send(self, rank: int, message: worker_pb2.SchedulerToWorker) -> None:
        await self._socket.send_multipart([self._identities[rank], message.SerializeToString()])

    async def _receive(self) -> tuple[bytes, worker_pb2.WorkerToScheduler]:
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 2:
                logger.warning("dropped a worker message of %d frames", len(frames))
                continue
            message = worker_pb2.WorkerToScheduler()
            try:
                message.ParseFromString(frames[1])
            except Exception:  # protobuf raises DecodeError; anything else malformed is dropped too
                logger.warning("dropped a malformed worker message (%d bytes)", len(frames[1]))
                continue
            return frames[0], message

    @staticmethod
    def _raise_if_error(message: worker_pb2.WorkerToScheduler) -> None:
        if message.WhichOneof("kind") == "error":
            error = message.error
            raise WorkerFailure(f"worker rank {error.rank} failed at step {error.step_id}: {error.message}")
