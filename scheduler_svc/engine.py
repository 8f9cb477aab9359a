"""The scheduler service's engine loop.

Ownership: the `Engine` owns the `Scheduler` (and through it every request and block table), every request's
`OutputStream`, and the `WorkerLink`. It runs as one task on the asyncio loop the gRPC server shares, so
nothing here needs a lock: gRPC handlers only append to the inbox (`submit`, `abort`) and read the queue
`submit` returned them. Each iteration: drain the inbox, schedule, send the plan, receive the sampled tokens,
update, publish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from dataclasses import dataclass

from scheduler_svc.output_stream import OutputDelta, OutputStream
from scheduler_svc.plan_codec import decode_sampled_tokens, encode_step_plan
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.request_validation import InvalidRequestError, ValidatedRequest
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.worker_link import WorkerLink

logger = logging.getLogger(__name__)

# What a request's queue carries: the next delta, or the exception that ended the whole engine.
StreamItem = OutputDelta | BaseException


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_swap_blocks: int
    num_free_swap_blocks: int
    num_steps: int
    num_finished_requests: int
    num_swapped_out_blocks: int


@dataclass(frozen=True)
class _Admission:
    request: Request
    queue: asyncio.Queue


@dataclass(frozen=True)
class _Abort:
    request_id: str


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        link: WorkerLink,
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...],
        num_kv_blocks: int,
        num_swap_blocks: int,
    ):
        self._scheduler = scheduler
        self._link = link
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._num_kv_blocks = num_kv_blocks
        self._num_swap_blocks = num_swap_blocks
        self._inbox: list[_Admission | _Abort] = []
        self._wake = asyncio.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._streams: dict[str, OutputStream] = {}
        self._seed_source = random.Random()
        self._num_finished = 0
        self._num_swapped_out_blocks = 0
        self._failure: BaseException | None = None

    # -- called by gRPC handlers -------------------------------------------------------------------------

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._queues

    def submit(self, request_id: str, validated: ValidatedRequest) -> asyncio.Queue:
        """Admits a validated request; its deltas arrive on the returned queue, the last with a finish reason."""
        if self._failure is not None:
            raise RuntimeError(f"the engine has stopped: {self._failure}")
        sampling = validated.sampling_params
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=self._seed_source.getrandbits(63))
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(validated.prompt_token_ids),
            sampling_params=sampling,
            eos_token_ids=self._eos_token_ids,
        )
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._inbox.append(_Admission(request, queue))
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Drops a request whose client went away; its queue gets nothing more."""
        if self._queues.pop(request_id, None) is not None:
            self._inbox.append(_Abort(request_id))
            self._wake.set()

    def stats(self) -> EngineStats:
        scheduler = self._scheduler
        blocks = scheduler.block_manager
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_swapped=scheduler.num_swapped,
            num_preemptions=scheduler.num_preemptions,
            num_kv_blocks=self._num_kv_blocks,
            num_free_kv_blocks=blocks.num_free_gpu_blocks,
            num_swap_blocks=self._num_swap_blocks,
            num_free_swap_blocks=blocks.num_free_cpu_blocks,
            num_steps=scheduler.num_steps,
            num_finished_requests=self._num_finished,
            num_swapped_out_blocks=self._num_swapped_out_blocks,
        )

    # -- the loop ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Runs until cancelled; a worker failure ends every stream with the exception and is re-raised."""
        try:
            while True:
                self._drain_inbox()
                output = self._scheduler.schedule()
                if output.total_num_scheduled_tokens == 0 and not _carries_block_work(output):
                    await self._idle(self._scheduler.has_unfinished_requests())
                    continue
                self._num_swapped_out_blocks += len(output.swap_out)
                result = await self._link.execute(encode_step_plan(output))
                updated = self._scheduler.update_from_output(output, decode_sampled_tokens(result))
                self._publish(updated)
        except asyncio.CancelledError:
            raise
        except BaseException as failure:
            self._fail_all(failure)
            raise

    def abort_all(self) -> None:
        """Server-side abort of everything in flight (shutdown): each stream ends with finish_reason abort."""
        for request_id in list(self._queues):
            request = self._scheduler.get_request(request_id)
            queue = self._queues.pop(request_id)
            stream = self._streams.pop(request_id, None)
            if request is not None and stream is not None:
                queue.put_nowait(stream.final_abort_delta(request))
            else:
                queue.put_nowait(OutputDelta(text="", token_ids=(), finish_reason=FinishReason.ABORT))
            self._scheduler.abort_request(request_id)

    async def _idle(self, has_work: bool) -> None:
        self._wake.clear()
        if self._inbox:
            return
        if has_work:  # blocked on blocks held by nobody scheduled this step: look again shortly
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.005)
            except TimeoutError:
                pass
        else:
            await self._wake.wait()

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for command in inbox:
            if isinstance(command, _Admission):
                request = command.request
                if self._queues.get(request.request_id) is not command.queue:
                    continue  # aborted before admission
                try:
                    self._scheduler.add_request(request)
                except ValueError as refusal:  # validation at the edge should have caught it already
                    self._queues.pop(request.request_id).put_nowait(InvalidRequestError("request", str(refusal)))
                    continue
                self._streams[request.request_id] = OutputStream(request, self._tokenizer)
            else:
                self._streams.pop(command.request_id, None)
                if self._scheduler.abort_request(command.request_id):
                    self._num_finished += 1

    def _publish(self, updated: list[Request]) -> None:
        for request in updated:
            stream = self._streams.get(request.request_id)
            if stream is None:
                continue
            delta, stopped_by_string = stream.advance(request)
            if stopped_by_string:  # no-op when the same token already ended it by length: STOP wins here
                self._scheduler.finish_request(request.request_id, FinishReason.STOP)
            if delta.finish_reason is not None:
                self._streams.pop(request.request_id, None)
                self._num_finished += 1
                queue = self._queues.pop(request.request_id, None)
            else:
                queue = self._queues.get(request.request_id)
            if queue is not None and (delta.text or delta.token_ids or delta.finish_reason is not None):
                queue.put_nowait(delta)

    def _fail_all(self, failure: BaseException) -> None:
        self._failure = failure
        logger.error("engine stopped: %s", failure)
        for queue in self._queues.values():
            queue.put_nowait(failure)
        self._queues.clear()
        self._streams.clear()


def _carries_block_work(output) -> bool:
    return bool(output.swap_out or output.swap_in or output.copy or output.finished_request_ids
                or output.preempted_request_ids)
