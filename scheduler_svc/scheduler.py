"""The scheduler: which requests run each step, how many tokens each computes, and who is preempted.

Who owns what: the scheduler (on the engine's scheduler thread, never shared) owns the queues and, through
its `BlockManager`, every block table. The engine loop calls, per step: `schedule()`, converts the
`SchedulerOutput` to a StepPlan, sends it, and passes the worker's sampled tokens to `update_from_output`;
between steps it may call `add_request`, `abort_request` and `finish_request` (stop strings).

Policy (DESIGN.md "Scheduling"), FCFS with two budgets per step, max_num_seqs (requests holding a worker row)
and max_num_batched_tokens (tokens in the forward pass):

1. Running requests, in arrival order: each gets min(tokens left to compute, token budget left). When one
   cannot get a block, the latest-arrived running request is preempted (possibly itself) until it can.
   Preemption by recompute frees the blocks and requeues the request in waiting with its generated tokens;
   by swap it moves the blocks to the swap pool (recompute when the swap pool is full).
2. Swapped requests back in, in arrival order, only if nothing was preempted in this step (the worker runs
   swap-outs before swap-ins, and a block just swapped out may be the one a swap-in would reuse).
3. Waiting requests, in arrival order, only if nothing was preempted and nobody is swapped out (no
   overtaking of earlier arrivals). A prompt longer than the token budget left is chunked.

The running, waiting and swapped queues are all kept sorted by arrival: a preempted request goes back before
every request that arrived after it, which with recompute alone is the front of the waiting queue. So the
earliest-arrived unfinished request is always first in line and, once running, is never preempted: a request
that fits the pool alone always progresses (`add_request` refuses one that cannot).

Why counts advance in `update_from_output`, not at schedule time: each output that scheduled tokens must come
back through `update_from_output` before the next `schedule()` (enforced; one that scheduled none may be
passed or not), so `num_computed_tokens` never counts work the worker has not done. Planning step N+1 while
step N runs (DESIGN.md, performance principle 4) will need vLLM V1's way instead: advance when scheduling.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.request import FinishReason, Request, RequestStatus
from scheduler_svc.scheduler_output import NewRequestData, ScheduledRequestData, SchedulerOutput

__all__ = [
    "NewRequestData",
    "ScheduledRequestData",
    "Scheduler",
    "SchedulerLimits",
    "SchedulerOutput",
]


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str = "recompute"  # "recompute" | "swap"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")


@dataclass
class _StepDraft:
    """The output of the `schedule()` call in progress; lives only inside that call."""

    token_budget: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled_requests: list[ScheduledRequestData] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


def _insert_by_arrival(queue: deque[Request], request: Request) -> None:
    """Insert before the first request that arrived later; preempted requests land near the front, so the
    scan from the left is short."""
    for index, queued in enumerate(queue):
        if queued.arrival_seq > request.arrival_seq:
            queue.insert(index, request)
            return
    queue.append(request)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager) -> None:
        self.limits = limits
        self.block_manager = block_manager
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        # All three queues are sorted by arrival_seq (see the module docstring).
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # hold GPU blocks and a worker row
        self._swapped: deque[Request] = deque()
        self._finished_ids_to_report: list[str] = []
        self._unapplied_step_id: int | None = None  # a step whose output has not come back yet
        self._next_arrival_seq = 0
        self._num_steps = 0
        self._num_preemptions = 0
        self._num_finished_requests = 0

    # ---- counters ----------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def num_finished_requests(self) -> int:
        return self._num_finished_requests

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None (unknown or already finished)."""
        return self._requests.get(request_id)

    # ---- requests in and out -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (FCFS). Raises ValueError for one that could never run: an empty prompt, a
        prompt over max_model_len, max_tokens < 1, a live duplicate id, or more K/V than the whole GPU pool."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id} is already queued")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"request {request.request_id} is not a fresh request")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id} has an empty prompt")
        if request.num_prompt_tokens > self.limits.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {request.num_prompt_tokens} tokens exceeds "
                f"max_model_len {self.limits.max_model_len}"
            )
        if request.sampling_params.max_tokens < 1:
            raise ValueError(f"request {request.request_id}: max_tokens must be >= 1")
        num_blocks = self.block_manager.num_blocks_for(request.max_kv_tokens(self.limits.max_model_len))
        if num_blocks > self.block_manager.num_gpu_blocks:
            raise ValueError(
                f"request {request.request_id} needs {num_blocks} KV blocks, the pool has "
                f"{self.block_manager.num_gpu_blocks}"
            )
        request.arrival_seq = self._next_arrival_seq
        self._next_arrival_seq += 1
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Remove an unfinished request from whichever queue holds it and free its blocks (GPU and swap).
        Returns False if it is unknown or already finished."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT)
        return True

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """Finish an unfinished request for a reason found outside the scheduler (the engine's stop-string
        check). Returns False if it is unknown or already finished (e.g. by a token-level stop)."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish(request, reason)
        return True

    def _finish(self, request: Request, reason: FinishReason) -> None:
        queue = {
            RequestStatus.WAITING: self._waiting,
            RequestStatus.RUNNING: self._running,
            RequestStatus.SWAPPED: self._swapped,
        }[request.status]
        queue.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.finished_by(reason)
        request.finish_reason = reason
        del self._requests[request.request_id]
        self._finished_ids_to_report.append(request.request_id)
        self._num_finished_requests += 1

    # ---- one step ----------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring for the policy).

        Raises RuntimeError if the previous output that scheduled tokens has not been passed to
        `update_from_output` yet.
        """
        if self._unapplied_step_id is not None:
            raise RuntimeError(f"step {self._unapplied_step_id} was not passed to update_from_output")
        step_id = self._num_steps
        self._num_steps += 1
        draft = _StepDraft(token_budget=self.limits.max_num_batched_tokens)
        self._schedule_running(draft)
        if not draft.preempted_request_ids:
            self._schedule_swapped(draft)
            if not self._swapped:
                self._schedule_waiting(draft)
        output = SchedulerOutput(
            step_id=step_id,
            new_requests=tuple(draft.new_requests),
            scheduled_requests=tuple(draft.scheduled_requests),
            finished_request_ids=tuple(self._finished_ids_to_report),
            preempted_request_ids=tuple(draft.preempted_request_ids),
            swap_out=tuple(draft.swap_out),
            swap_in=tuple(draft.swap_in),
            copy=(),
            total_num_scheduled_tokens=self.limits.max_num_batched_tokens - draft.token_budget,
        )
        self._finished_ids_to_report = []
        if output.total_num_scheduled_tokens:
            self._unapplied_step_id = step_id
        return output

    def _schedule_running(self, draft: _StepDraft) -> None:
        running = self._running
        index = 0
        while index < len(running) and draft.token_budget > 0:
            request = running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, draft.token_budget)
            new_block_ids = self.block_manager.allocate_slots(request, num_new_tokens)
            while new_block_ids is None:
                victim = running.pop()  # the latest-arrived running request
                self._preempt(victim, draft)
                if victim is request:
                    return  # every request after it is preempted too
                new_block_ids = self.block_manager.allocate_slots(request, num_new_tokens)
            draft.scheduled_requests.append(
                ScheduledRequestData(request.request_id, tuple(new_block_ids), num_new_tokens)
            )
            draft.token_budget -= num_new_tokens
            index += 1

    def _preempt(self, request: Request, draft: _StepDraft) -> None:
        request.num_preemptions += 1
        self._num_preemptions += 1
        draft.preempted_request_ids.append(request.request_id)
        if self.limits.preemption_mode == "swap" and self.block_manager.can_swap_out(request.request_id):
            draft.swap_out.extend(self.block_manager.swap_out(request.request_id))
            request.status = RequestStatus.SWAPPED
            _insert_by_arrival(self._swapped, request)
        else:
            self.block_manager.free(request.request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            _insert_by_arrival(self._waiting, request)

    def _schedule_swapped(self, draft: _StepDraft) -> None:
        # The max_num_seqs test is defensive: waiting requests are admitted only while nobody is swapped
        # and preemption only moves requests out of running, so running + swapped <= max_num_seqs already.
        while self._swapped and draft.token_budget > 0 and len(self._running) < self.limits.max_num_seqs:
            request = self._swapped[0]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, draft.token_budget)
            num_kv_tokens = request.num_computed_tokens + num_new_tokens
            if not self.block_manager.can_swap_in(request.request_id, num_kv_tokens):
                return
            self._swapped.popleft()
            draft.swap_in.extend(self.block_manager.swap_in(request.request_id))
            self.block_manager.allocate_slots(request, num_new_tokens)  # room checked by can_swap_in
            self._start_running(request, num_new_tokens, draft)

    def _schedule_waiting(self, draft: _StepDraft) -> None:
        while self._waiting and draft.token_budget > 0 and len(self._running) < self.limits.max_num_seqs:
            request = self._waiting[0]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, draft.token_budget)
            if self.block_manager.allocate_slots(request, num_new_tokens) is None:
                return
            self._waiting.popleft()
            self._start_running(request, num_new_tokens, draft)

    def _start_running(self, request: Request, num_new_tokens: int, draft: _StepDraft) -> None:
        request.status = RequestStatus.RUNNING
        bisect.insort(self._running, request, key=_arrival_seq)
        draft.new_requests.append(
            NewRequestData(
                request_id=request.request_id,
                token_ids=tuple(request.all_token_ids),
                sampling_params=request.sampling_params,
                block_ids=tuple(self.block_manager.block_table(request.request_id)),
                num_computed_tokens=request.num_computed_tokens,
                num_scheduled_tokens=num_new_tokens,
            )
        )
        draft.token_budget -= num_new_tokens

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Apply a step the worker ran: advance each scheduled request's computed tokens, append the token
        sampled for each request that reached the end of its known tokens, and finish those that hit a
        token-level stop (EOS unless ignore_eos, a stop token id: STOP; max_tokens or max_model_len: LENGTH).
        Finished requests are freed now and reported in the next output.

        Requests aborted or finished since `output` was planned are skipped, and so are their tokens.
        Returns the requests that got a new token, finished or not, in plan order.
        """
        if output.total_num_scheduled_tokens == 0:
            return []
        if output.step_id != self._unapplied_step_id:
            raise ValueError(f"expected the output of step {self._unapplied_step_id}, got step {output.step_id}")
        live = self._check_sampled(output, sampled)  # raises before anything changes
        self._unapplied_step_id = None
        updated = []
        for request, num_tokens in live:
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that did not reach the end
            token_id = sampled[request.request_id]
            request.output_token_ids.append(token_id)
            reason = self._token_stop_reason(request, token_id)
            if reason is not None:
                self._finish(request, reason)
            updated.append(request)
        return updated

    def _check_sampled(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[tuple[Request, int]]:
        """The (request, num_scheduled_tokens) pairs of `output` still running, after checking that the
        worker sampled a token for exactly those whose computed tokens reach their known tokens."""
        num_scheduled = output.num_scheduled_tokens()
        unexpected = sampled.keys() - num_scheduled.keys()
        if unexpected:
            raise ValueError(f"tokens sampled for requests not in step {output.step_id}: {sorted(unexpected)}")
        live = []
        for request_id, num_tokens in num_scheduled.items():
            request = self._requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # left (and maybe came back under the same id) since the plan was made
            should_sample = request.num_computed_tokens + num_tokens == request.num_tokens
            if should_sample != (request_id in sampled):
                raise ValueError(
                    f"request {request_id}: a token was {'not ' if should_sample else ''}sampled after "
                    f"{request.num_computed_tokens + num_tokens} of {request.num_tokens} tokens"
                )
            live.append((request, num_tokens))
        return live

    def _token_stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling_params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in request.eos_token_ids):
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.limits.max_model_len:
            return FinishReason.LENGTH
        return None


def _arrival_seq(request: Request) -> int:
    return request.arrival_seq
