"""The scheduler's bookkeeping: every unfinished request, the three queues, and what the worker holds.

Who owns it: one `Scheduler`, on the scheduler thread. Two parts of it write here and nothing else does: the
`Scheduler` itself (requests in and out, applying results) and its `StepPlanner` (admission, preemption and
the plan of each step). Splitting the state from both keeps each of them one concept; the invariants below are
theirs to keep together.

- Every unfinished request is in `requests` and in exactly one queue, the one its status names.
- `worker_rows`: the running requests the worker holds a row for (a forked child is running, holding shared
  blocks, before it first reaches the worker). A request loses its row when preempted or finished.
- `unsent_token_ids`: tokens the engine appended (`Scheduler.append_token`) to a row the worker holds, not yet
  sent in a ScheduledRequestData.
- `reporting_in_flight`: fan-out roots and beam rows planned to complete in a step whose result is not back;
  they are not preempted (for at most one step), so the engine finds them as computed when they are reported.
- `awaiting_engine`: requests reported to the engine that cannot go on until it acts (a fan-out root to be
  forked and released, a beam row until its next token is appended). They are idle: no tokens to compute, even
  after a recompute preemption.
- `lora_slots`: the GPU slot of each adapter the workers hold; a running request's adapter keeps its slot.
- `plain_decode_entries`: a cache of immutable plan entries, at most one per unfinished request.
- `held`: requests the engine keeps out of every step for now (suspects of a worker loss waiting for their
  turn to be recomputed). Idle as well; set only after a worker loss, when every request is waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.lora_slots import LoraSlots
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.request_queue import RequestQueue
from scheduler_svc.core.scheduler_limits import SchedulerLimits
from scheduler_svc.core.scheduler_output import ScheduledRequestData


@dataclass
class SchedulerState:
    limits: SchedulerLimits
    block_manager: BlockManager
    requests: dict[str, Request] = field(default_factory=dict)
    waiting: RequestQueue = field(default_factory=RequestQueue)  # hold no KV blocks
    running: RequestQueue = field(default_factory=RequestQueue)  # hold GPU blocks; most hold a worker row
    swapped: RequestQueue = field(default_factory=RequestQueue)  # hold swap blocks
    worker_rows: set[str] = field(default_factory=set)
    unsent_token_ids: dict[str, list[int]] = field(default_factory=dict)
    awaiting_engine: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)
    # Fan-out roots and beam rows whose completing step is planned but not applied: never preempted until
    # their result is reported (the engine forks from what they computed).
    reporting_in_flight: set[str] = field(default_factory=set)
    num_preemptions: int = 0
    # Request id -> the ScheduledRequestData of its plain decode (one token into the last block it holds, nothing
    # else): the same every step, so the planner's fast path reuses it (step_planner.py). Dropped when the
    # request leaves.
    plain_decode_entries: dict[str, ScheduledRequestData] = field(default_factory=dict)
    # Multi-LoRA: which adapter sits in which of the workers' GPU slots (emptied after a worker loss).
    lora_slots: LoraSlots = field(init=False)

    def __post_init__(self) -> None:
        self.lora_slots = LoraSlots(self.limits.max_loras)

    def queue_of(self, request: Request) -> RequestQueue:
        return {
            RequestStatus.WAITING: self.waiting,
            RequestStatus.RUNNING: self.running,
            RequestStatus.SWAPPED: self.swapped,
        }[request.status]

    def num_tokens_to_compute(self, request: Request) -> int:
        """Tokens the request still has to compute before it can sample or be reported (0: idle).

        A token in flight (`num_pending_tokens`) counts as known, so a running decode has one more to
        compute while its previous step runs; but it is idle while that token may be its last (max_tokens
        or max_model_len), and while preempted until the token is back (a resumed row carries every token).
        None while its draft tokens are in flight: how many it keeps is known only from the result.
        """
        if request.request_id in self.awaiting_engine or request.request_id in self.held or request.draft_token_ids:
            return 0
        if request.prefill_only:
            return max(0, request.num_prompt_tokens - 1 - request.num_computed_tokens)
        pending = request.num_pending_tokens
        num_tokens = request.num_tokens + pending
        if pending and (
            request.status is not RequestStatus.RUNNING
            or request.num_output_tokens + pending >= request.sampling_params.max_tokens
            or num_tokens >= self.limits.max_model_len
        ):
            return 0
        return num_tokens - request.num_computed_tokens

    def is_idle(self, request: Request) -> bool:
        """Waiting on the engine: nothing to compute and no result of its own in flight."""
        return (
            not self.num_tokens_to_compute(request)
            and not request.num_pending_tokens
            and request.request_id not in self.reporting_in_flight
        )

    def has_free_worker_row(self) -> bool:
        return len(self.worker_rows) < self.limits.max_num_seqs
