"""The scheduler service's engine loop.

Ownership: the `Engine` owns the `Scheduler` (and through it every request and block table), every client
request's `RequestGroup` (which owns that request's output streams), and the `WorkerLink`. It runs as one
task on the asyncio loop the gRPC server shares, so nothing here needs a lock: gRPC handlers only append to
the inbox (`submit`, `abort`) and read the queue `submit` returned them. Each iteration: drain the inbox,
schedule, send the plan, receive the step's outcome, update, let the groups publish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections import deque
from dataclasses import dataclass

from scheduler_svc.core.request import FinishReason, Request
from scheduler_svc.core.scheduler import Scheduler, SchedulerOutput
from scheduler_svc.core.validated_request import InvalidRequestError, ValidatedRequest
from scheduler_svc.groups.beam_search import BeamSearch
from scheduler_svc.groups.prompt_only import PromptOnly
from scheduler_svc.groups.request_group import GroupContext, ParallelSampling, RequestGroup, SingleSequence
from scheduler_svc.groups.stream_pacing import streams_to_flush
from scheduler_svc.metrics import ServingMetrics, ServingMetricsSnapshot
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.worker_io.plan_codec import StepPlanEncoder, decode_step_result
from scheduler_svc.worker_io.worker_link import WorkerFailure, WorkerLink
from scheduler_svc.worker_loss_suspects import WorkerLossSuspects
from service_runtime.step_timer import StepTimer

logger = logging.getLogger(__name__)


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
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()


# A request blamed for this many worker losses (no other sharing the blame) is failed instead of recomputed
# again: a poison request (worker_loss_suspects.py).
MAX_WORKER_LOSSES_PER_REQUEST = 2


class RequestFailedError(RuntimeError):
    """The engine gave this one request up while the others go on (gRPC INTERNAL, naming why)."""


@dataclass(frozen=True)
class _Abort:
    request_id: str
    notify: bool  # an explicit Abort RPC: the stream ends with finish_reason abort


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        link: WorkerLink,
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...],
        plan_log=None,
        max_messages_per_step: int = 64,
        seed: int | None = None,
    ):
        self._scheduler = scheduler
        self._link = link
        self._eos_token_ids = eos_token_ids
        self._plan_log = plan_log
        self._max_messages_per_step = max_messages_per_step
        self._num_published = 0
        self._inbox: list[RequestGroup | _Abort] = []
        self._wake = asyncio.Event()
        self._groups: dict[str, RequestGroup] = {}  # client request id -> group
        self._context = GroupContext(scheduler, tokenizer, owners={})
        # The seeds of requests that carry none, drawn in admission order: with a fixed `seed` (--seed) the
        # k-th unseeded request gets the same seed in every run, and a seeded request samples the same tokens
        # whatever else is in its batch, so the same requests in the same order give the same tokens.
        self._seed_source = random.Random(seed)
        self._num_finished = 0
        self._num_swapped_out_blocks = 0
        self._failure: BaseException | None = None
        # Poison requests: which requests worker losses are blamed on, and which of them wait for their turn.
        self._suspects = WorkerLossSuspects(MAX_WORKER_LOSSES_PER_REQUEST)
        self._sent: deque[SchedulerOutput] = deque()  # the running loop's plans whose results are not back
        # A result applied, not yet published (`run`): updated requests, outcome, appended drafts (`_publish`).
        self._applied: tuple[list[Request], object, list[str]] | None = None
        self._aborting: asyncio.Future | None = None  # `_abort_during_step`, while it runs
        self.step_timer = StepTimer("scheduler")
        self._plan_encoder = StepPlanEncoder()  # keeps the wire bytes of each running request's plain decode row
        self._metrics = ServingMetrics(scheduler.limits.max_model_len)  # metrics: counters, histograms (GetStats)

    # -- called by gRPC handlers -------------------------------------------------------------------------

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._groups

    def submit(self, request_id: str, validated: ValidatedRequest, priority: int = 0) -> tuple[asyncio.Queue, int]:
        """Admits a validated request. Returns its queue, which carries OutputDelta items (one final delta per
        returned sequence), then StreamEnd; or the exception that stopped the engine. And its seed: the one it
        gave, or the one drawn for it (a client needs it to resume the stream exactly: resume_validation.py).
        A resumed request starts with the output its client already received, recomputed like a preemption's."""
        if self._failure is not None:
            raise RuntimeError(f"the engine has stopped: {self._failure}")
        sampling = validated.sampling_params
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=self._seed_source.getrandbits(63))
        root = Request(
            request_id=request_id,
            prompt_token_ids=list(validated.prompt_token_ids),
            sampling_params=sampling,
            eos_token_ids=self._eos_token_ids,
            priority=priority,
            lora_name=validated.lora_name,
            lora_path=validated.lora_path,
            lora_generation=validated.lora_generation,
        )
        if validated.resume is not None:
            root.output_token_ids = list(validated.resume.token_ids)
        if sampling.max_tokens == 0:
            group = PromptOnly(request_id, root, self._context)
        elif sampling.use_beam_search:
            group = BeamSearch(request_id, root, self._context)
        elif sampling.num_sequences > 1:
            group = ParallelSampling(request_id, root, self._context)
        else:
            group = SingleSequence(request_id, root, self._context, validated.resume)
        self._metrics.on_admitted(request_id, root.num_prompt_tokens, sampling.n, sampling.max_tokens)  # metrics
        self._groups[request_id] = group
        self._inbox.append(group)
        self._wake.set()
        return group.queue, sampling.seed

    def num_queued(self) -> int:
        """Sequences waiting for a step: the scheduler's waiting queue (preempted ones included) and the
        requests submitted since the loop last drained its inbox (the admission bound of grpc_server)."""
        return self._scheduler.num_waiting + sum(isinstance(command, RequestGroup) for command in self._inbox)

    def abort(self, request_id: str, notify: bool = False) -> bool:
        """Ends a request in flight. notify=False: its client went away (nothing more is sent);
        notify=True: an explicit abort (the stream ends with finish_reason abort)."""
        if request_id not in self._groups:
            return False
        self._inbox.append(_Abort(request_id, notify))
        self._wake.set()
        if self._sent and self._aborting is None:  # the loop waits for a step: act now, not after it
            self._aborting = asyncio.ensure_future(self._abort_during_step())
        return True

    def stats(self) -> EngineStats:
        scheduler = self._scheduler
        blocks = scheduler.block_manager
        spec = scheduler.spec_decode_stats
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_swapped=scheduler.num_swapped,
            num_preemptions=scheduler.num_preemptions,
            num_kv_blocks=blocks.num_gpu_blocks,
            num_free_kv_blocks=blocks.num_free_gpu_blocks,
            num_swap_blocks=blocks.num_cpu_blocks,
            num_free_swap_blocks=blocks.num_free_cpu_blocks,
            num_steps=scheduler.num_steps,
            num_finished_requests=self._num_finished,
            num_swapped_out_blocks=self._num_swapped_out_blocks,
            prefix_cache_hit_rate=scheduler.prefix_cache_hit_rate,
            prefix_cache_hit_tokens=scheduler.prefix_cache_hit_tokens,
            prefix_cache_query_tokens=scheduler.prefix_cache_query_tokens,
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos),
        )

    def serving_metrics(self) -> ServingMetricsSnapshot:  # metrics
        return self._metrics.snapshot()

    # -- the loop ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Runs until cancelled; a worker failure ends every stream with the exception and is re-raised.

        Async scheduling: with `max_steps_in_flight` 2 the loop plans and sends step N+1 before it waits for
        step N's result, so the worker finds its next plan waiting when it finishes a step, and the
        scheduler's own work (applying results, streaming, planning) runs while the GPU computes. Step N's
        result is applied to the requests at once but published to the streams (detokenizing, stop strings,
        beam rounds, forks) only after the next plan is sent: the plan after a result is what the GPU waits
        for, the streams are not (vLLM's engine core likewise leaves detokenization to another process). A
        stop string found then ends its request one plan later: one more token computed and dropped.
        While speculative decoding is on and at most its disable_by_batch_size requests run, nothing is
        planned ahead (`Scheduler.max_steps_ahead`): the n-gram proposer needs each request's newest token.
        """
        sent = self._sent = deque()  # plans sent, results not received, oldest first
        timer = self.step_timer
        try:
            while True:
                self._drain_inbox()
                await self._send_worker_cancels()
                depth = self._scheduler.max_steps_ahead()  # 1 while a small batch speculates
                if len(sent) < depth:
                    timer.resume()
                    output = self._scheduler.schedule()
                    timer.mark("schedule")
                    if output.total_num_scheduled_tokens or _carries_block_work(output):
                        await self._send(output)
                        sent.append(output)
                        self._publish_applied()
                        if len(sent) < depth:
                            continue  # fill the pipeline before waiting
                    elif self._publish_applied():
                        continue  # publishing may fork or end requests: plan again
                    elif not sent:
                        await self._idle(self._scheduler.has_unfinished_requests())
                        continue
                self._publish_applied()
                await self._apply_result(sent.popleft())
                if depth == 1:  # nothing planned ahead: stream before planning, as without async scheduling
                    self._publish_applied()
        except (asyncio.CancelledError, WorkerFailure):
            self._publish_applied()  # requests that ended in the last result end their streams
            raise  # a lost worker: the service decides between recovery and `fail_all`
        except BaseException as failure:
            self.fail_all(failure)
            raise

    async def _abort_during_step(self) -> None:
        """An abort while steps are in flight takes effect now rather than after the step running: the inbox
        is drained as between steps (the loop is parked at an await, with its plans and the scheduler's
        `_unapplied` in step), and the worker told to drop the aborted requests' rows from the plans it has
        not started. Without this a cancelled long prompt ran every chunk already planned (up to
        max_steps_in_flight steps of max_num_batched_tokens each) while new requests waited behind it."""
        try:
            self._drain_inbox()
            await self._send_worker_cancels()
        except Exception:  # a lost link: the loop sees it too and the service acts on it
            logger.exception("sending aborts to the worker failed")
        finally:
            self._aborting = None

    async def _send_worker_cancels(self) -> None:
        cancels = self._scheduler.take_worker_cancels()
        if cancels:
            await self._link.send_cancels(cancels)

    async def _send(self, output: SchedulerOutput) -> None:
        timer = self.step_timer
        timer.start_step()
        self._num_swapped_out_blocks += len(output.swap_out)
        plan = self._plan_encoder.encode(output)
        if self._plan_log is not None:
            self._plan_log.write(plan.plan)
        timer.mark("encode")
        await self._link.send_plan(plan)
        timer.mark("send")
        self._metrics.on_scheduled([data.request_id for data in output.new_requests],  # metrics
                                   output.total_num_scheduled_tokens, self._context.owners)

    async def _apply_result(self, output: SchedulerOutput) -> None:
        """Waits for `output`'s result and applies it to the requests; its publishing waits (see `run`)."""
        timer = self.step_timer
        timer.resume()
        result = await self._link.receive_result(output.step_id)
        timer.mark("wait_for_result")
        timer.add("of_which_read_not_taken", self._link.last_result_wait_s)
        outcome = decode_step_result(result)
        scheduler = self._scheduler
        # Rows with accepted drafts: how many output tokens each had, to count those it actually appended.
        drafted = [(request, request.num_output_tokens) for request_id in outcome.accepted_drafts
                   if (request := scheduler.get_request(request_id)) is not None]
        updated = scheduler.update_from_output(output, outcome.sampled, outcome.accepted_drafts,
                                               outcome.proposed_drafts)
        # A stop inside an accepted run drops the rest (the sampled token included); a request that left
        # before its result appends nothing. Its sampled token counts as without speculation, once.
        appended_drafts = [request.request_id for request, before in drafted
                           for _ in range(request.num_output_tokens - before - 1)]
        self._applied = (updated, outcome, appended_drafts)
        timer.mark("update")

    def _publish_applied(self) -> bool:
        """Publishes the applied result not yet published, if any; returns whether there was one."""
        if self._applied is None:
            return False
        (updated, outcome, appended_drafts), self._applied = self._applied, None
        timer = self.step_timer
        timer.resume()
        self._publish(updated, outcome, appended_drafts)
        timer.mark("publish")
        return True

    def recover_from_worker_loss(self, block_manager, failure: BaseException, restarts_left: int = 0) -> int:
        """New workers replace lost ones (the loop is stopped): every request in flight stays open and is
        recomputed from its known tokens on `block_manager`, the new workers' empty pool. The loss is blamed on
        the requests in the steps it lost; the one blamed for MAX_WORKER_LOSSES_PER_REQUEST losses or more, with
        no other sharing that evidence, ends with RequestFailedError instead (a request that crashes its worker
        would otherwise crash every new one), and the other suspects are recomputed in turns
        (worker_loss_suspects.py says why; `restarts_left`: how many more losses can be recovered, which decides
        how much evidence is asked of a request that shared its losses with others). Returns how many requests
        were failed."""
        lost = self._scheduler.recover_from_worker_loss(block_manager)
        self._sent = deque()
        owners = self._context.owners
        failed = 0
        for member_id, losses in self._suspects.on_worker_loss((w for w in lost if w.request_id in owners),
                                                                  restarts_left).items():
            group = owners[member_id]
            if group.finished:
                continue
            if self._end_with_error(group, RequestFailedError(
                    f"the worker failed {losses} times while running this request (last: {failure}); it is not "
                    "retried")):
                failed += 1
        self._scheduler.hold(self._suspects.held(self._group_of))
        return failed

    def _fail(self, member_id: str, reason: str) -> None:
        """Ends the request owning `member_id` with RequestFailedError(reason) (gRPC INTERNAL): a failure of
        this request alone, reported by the worker, which goes on with the others."""
        group = self._context.owners.get(member_id)
        if group is None or group.finished:
            return
        self._end_with_error(group, RequestFailedError(reason))

    def _end_with_error(self, group: RequestGroup, error: Exception) -> bool:
        """Ends `group`'s stream with `error` after what it held back for stream pacing: the client gets every
        token that publishing each step would have streamed before the error. Returns False when that ended
        the request first (a stop string found late): it stopped, no error is sent."""
        request = group.publish()
        if group.finished:
            self._forget(group, request.finish_reason or FinishReason.STOP)
            return False
        group.queue.put_nowait(error)  # before the StreamEnd that abort queues
        group.abort(notify=False)
        self._forget(group)
        return True

    def abort_all(self) -> None:
        """Server-side abort of everything in flight (shutdown): each stream ends with finish_reason abort."""
        self._publish_applied()  # the loop may be parked with a result applied: its tokens come before the end
        for group in list(self._groups.values()):
            self._forget(group, group.abort(notify=True))

    async def _idle(self, has_work: bool) -> None:
        for group in list(self._groups.values()):  # nothing runs: nothing held back for pacing may wait longer
            self._publish_held(group)
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
        if any(isinstance(command, _Abort) and command.notify for command in inbox):
            # An explicit abort streams every token computed before it, with its step's outcome (logprobs):
            # a result applied but not yet published (`run`) is published first.
            self._publish_applied()
        for command in inbox:
            if isinstance(command, _Abort):
                group = self._groups.get(command.request_id)
                if group is not None:
                    self._forget(group, group.abort(command.notify))
                continue
            if self._groups.get(command.request_id) is not command or command.finished:
                continue  # aborted before admission
            try:
                command.start()
            except ValueError as refusal:  # validation at the edge should have caught it already
                command.abort(notify=False)
                command.queue.put_nowait(InvalidRequestError("request", str(refusal)))
                self._forget(command)
                continue
            if command.finished:  # a group with nothing to compute (prompt_only.py: a one-token prompt)
                self._forget(command, FinishReason.LENGTH)

    def _publish(self, updated: list[Request], outcome, appended_drafts: list[str]) -> None:
        """`appended_drafts`: a request's id once per accepted draft token it appended."""
        owners = self._context.owners
        suspects_changed = False
        for member_id, reason in outcome.failed.items():  # first: their last token is not to be streamed
            self._fail(member_id, f"structured output failed: {reason}")
        self._metrics.on_step([*outcome.sampled, *appended_drafts, *outcome.beam_candidates], owners)  # one per token
        for member_id, chunk in outcome.prompt_logprobs.items():  # prefill chunks are not in `updated`
            group = owners.get(member_id)
            if group is not None:
                group.on_prompt_logprobs(member_id, chunk)
        for request in updated:
            group = owners.get(request.request_id)
            if group is None:
                continue
            if self._suspects and self._suspects.on_token(request.request_id, len(request.output_token_ids)):
                suspects_changed = True  # past where the lost worker may have died: not what killed it
            group.on_step(request, outcome)
            if group.finished:  # the request that ended it says why (a beam row may not: STOP)
                self._forget(group, request.finish_reason or FinishReason.STOP)
        if suspects_changed or (self._suspects and self._suspects.drop_gone(self._is_gone)):
            self._scheduler.hold(self._suspects.held(self._group_of))  # the next wave of suspects, once one is cleared
        self._flush_streams()

    def _flush_streams(self) -> None:
        """Hands buffered deltas to the streams' handlers: all of them while few streams run, else a
        staggered share each step (stream_pacing.py)."""
        self._num_published += 1
        k, turn = streams_to_flush(len(self._groups), self._num_published, self._max_messages_per_step)
        groups = list(self._groups.values())
        for index in range(turn, len(groups), k):
            self._publish_held(groups[index])

    def _publish_held(self, group: RequestGroup) -> None:
        """Lets a group publish what it held back (request_group.py: SingleSequence), then flushes its queue."""
        request = group.publish()
        if request is not None and group.finished:  # a stop string found now ended it
            self._forget(group, request.finish_reason or FinishReason.STOP)
        group.queue.flush()

    def _forget(self, group: RequestGroup, finish_reason: FinishReason = FinishReason.ABORT) -> None:
        if self._groups.get(group.request_id) is group:
            del self._groups[group.request_id]
            if self._suspects and self._suspects.drop_gone(self._is_gone):
                self._scheduler.hold(self._suspects.held(self._group_of))
            self._num_finished += 1
            self._metrics.on_request_end(group.request_id, finish_reason)  # metrics

    def _group_of(self, member_id: str) -> str:
        group = self._context.owners.get(member_id)
        return group.request_id if group is not None else member_id

    def _is_gone(self, request_id: str) -> bool:
        return self._scheduler.get_request(request_id) is None

    def fail_all(self, failure: BaseException) -> None:
        """Ends every request in flight with `failure` (gRPC: UNAVAILABLE) and refuses new ones, each stream after
        what stream pacing held back of it (the tokens publishing each step would have streamed)."""
        self._failure = failure
        logger.error("engine stopped: %s", failure)
        for group in self._groups.values():
            try:
                group.publish()
            except Exception:  # the engine is stopping on an error of its own: the failure still ends the stream
                logger.exception("publishing held-back tokens of %s failed", group.root.request_id)
            if not group.finished:  # else what it held back ended it (a stop string): its stream is complete
                group.queue.put_nowait(failure)
        self._groups.clear()


def _carries_block_work(output: SchedulerOutput) -> bool:
    return bool(output.swap_out or output.swap_in or output.copy or output.finished_request_ids
                or output.preempted_request_ids)
