"""The scheduling policy: which requests run in one step, how many tokens each computes, who is preempted.

Who owns it: the `Scheduler`, which calls `plan` once per step; it reads and writes the `SchedulerState` the
scheduler shares with it, and the `BlockManager` in it. The plan it returns is the step's `SchedulerOutput`.

Every queue (waiting, running, swapped) is kept in one fixed total order, (priority, arrival_seq, fork_seq)
(`request_queue.py`): "earlier" below means earlier in that order. Budgets per step: max_num_seqs (requests
holding a worker row) and max_num_batched_tokens (tokens in the forward pass). A request "has work" when it
has tokens to compute: a fan-out root up to its prompt but the last token, anyone else up to its known tokens.
A request without work ("idle") is waiting on the engine: a fan-out root reported to be forked, a beam row
reported with its candidates, until the engine appends its next token. It stays idle even if preempted by
recompute (it would recompute for nothing, and could push aside the sibling it waits for).

Policy, per step:
0. Room for the first in line. If the earliest waiting or swapped request with work could not start now (no
   free worker row, or too few free blocks for a full-budget chunk), running requests of strictly worse
   priority are preempted, last first, until it could (priority preemption). If it is the earliest request
   with work of all, idle running requests are preempted too: they may be waiting on it (a beam waits for its
   siblings' candidates), and holding on would deadlock.
1. Running requests, in order. Each gets min(tokens to compute, budget left), but a prefill chunk (more than
   one token to compute) leaves one token of budget for every decode after it, so decodes never stall behind
   a long prompt. A request that cannot get blocks preempts the last running request after it, else an idle
   running request before it, else itself, until it can. A forked child not yet on the worker needs a worker
   row: it preempts a row holder the same way (never itself), or waits. Preemption by recompute frees the
   blocks and requeues the request in waiting with its generated tokens; by swap it moves the blocks to the
   swap pool (recompute when the swap pool is full).
2. Only if nothing was preempted in this step (the worker never swaps in and out in one step): waiting and
   swapped requests, merged in order, are admitted or swapped in until the first that cannot start (no
   overtaking). An admission first takes every cached full block of its tokens (`find_cached_prefix`), but
   always leaves at least one token to compute. Prompts are chunked to the budget left; with chunked prefill
   off a prompt is scheduled whole or waits.
   Why no overtaking, even when a long request at the head waits for blocks that shorter ones behind it would
   fit in: a steady stream of short requests could then hold the blocks forever and starve it. Without
   overtaking the head waits only until the requests ahead of it drain, and those behind it only until it
   runs: no head-of-line deadlock, no starvation (tests/test_scheduler_head_of_line.py).
   Multi-LoRA: a request of a LoRA adapter starts only if the running requests then hold at most max_loras
   distinct adapters (the base model does not count); one that would exceed it cannot start, so it waits at
   the head like one without blocks (the same argument: the running requests of other adapters only drain,
   and (0) preempts idle ones in its way), and the adapters of the running requests bound every step's.
   A request getting a worker row runs in its adapter's GPU slot, loaded by the plan if the workers do not hold
   it (`lora_slots.py`: a free slot, else the least recently used one no running request uses; one always
   exists, by the bound above).

3. Speculative decoding (with a SpeculativeConfig, and only while at most disable_by_batch_size requests run):
   last, with the budget nobody above took, each plain decode planned in (1) for a row the worker holds gets
   up to num_speculative_tokens draft tokens, computed with its token in one forward: n-gram ones
   (`ngram_proposer.py`), or those the workers' draft model proposed after the request's newest token (the
   plan then asks for the next proposals: `propose_draft_tokens`); slots for 1 + d tokens, d capped so that
   even if all are accepted the request stays within max_tokens and max_model_len, and 0 when the pool has no
   free block for them (drafts never preempt).
   Only a request whose newest token is known (no token in flight) and that samples plainly gets drafts: no
   penalties, bad words, grammar, logprobs or stop strings, min_tokens reached (the worker verifies drafts by sampling at
   each position: docs/speculative_decoding.md). A request with drafts in flight is neither
   planned nor preempted until its result is applied (for at most the one step that verifies them).

A request is preempted only before it is scheduled in the step (the victims of (1) come after the request
being scheduled, or are idle): a scheduled step is never undone, which the prefix cache relies on (a block is
cached as soon as it is allocated for tokens that fill it).

Why nobody starves and nothing livelocks. Preemption only ever moves from earlier to later, or takes idle
requests: in (1) a request evicts requests after it, or idle ones; in (0) strictly worse priorities, or idle
ones. Let H be the earliest request with work. Everything else either comes after H or is idle, so H can always
take the blocks and the worker row it needs (a request that fits the pool alone is the only kind `add_request`
and `fork_request` accept) and is never preempted. If H is running it computes at least one token every step:
it is first in line for the budget, and its reservation for decodes is at most max_num_seqs - 1 tokens (so
this needs max_num_batched_tokens >= max_num_seqs, the usual setting). If H is waiting or swapped nobody
overtakes it (2), idle requests in its way are preempted (0) and stay idle, and the others holding what it needs
all come after it and only drain (nothing is admitted past H), each needing at most max_model_len tokens of
work; priority victims of (0) sort after H, so they cannot come back before it. So H starts within a bounded
number of steps and finishes, and the next request becomes H: every request finishes, whatever the engine
forks, as long as the engine acts on what it is reported.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from scheduler_svc.core.block_manager import SlotAllocation
from scheduler_svc.core.lora_slots import LoraLoadData
from scheduler_svc.core.ngram_proposer import propose_ngram_drafts
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.request_queue import scheduling_key
from scheduler_svc.core.scheduler_output import NewRequestData, ScheduledRequestData, SchedulerOutput
from scheduler_svc.core.scheduler_state import SchedulerState
from scheduler_svc.core.speculative_config import SpeculativeConfig


@dataclass
class _PlanInProgress:
    """The plan in progress; lives only inside one `plan` call."""

    token_budget: int
    num_preempted: int = 0  # including forked children the worker held no row for
    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled_requests: list[ScheduledRequestData] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy: list[tuple[int, int]] = field(default_factory=list)
    completing_request_ids: list[str] = field(default_factory=list)
    # Scheduled in this step: never a victim later in the pass (their counts already advanced, so one whose
    # pending token may be its last looks idle).
    scheduled_ids: set[str] = field(default_factory=set)
    # Plain decodes of rows the worker holds, newest token known: (request, index in scheduled_requests), the
    # candidates for draft tokens (3).
    decodes: list[tuple[Request, int]] = field(default_factory=list)
    lora_loads: list[LoraLoadData] = field(default_factory=list)


class StepPlanner:
    def __init__(self, state: SchedulerState, speculative: SpeculativeConfig | None = None,
                 plain_decode_run: bool = True) -> None:
        self._state = state
        self._limits = state.limits
        self._blocks = state.block_manager
        self._speculative = speculative
        # False plans every running request through the general loop: the reference the fast path is tested
        # against (`_schedule_plain_decodes`).
        self._plain_decode_run = plain_decode_run

    def plan(self, step_id: int, finished_request_ids: tuple[str, ...]) -> SchedulerOutput:
        in_progress = _PlanInProgress(token_budget=self._limits.max_num_batched_tokens)
        self._make_room_for_first_in_line(in_progress)
        self._schedule_running(in_progress)
        if not in_progress.num_preempted:
            self._schedule_inactive(in_progress)
        propose_draft_tokens = 0
        if self._speculative is not None and self._speculative.is_on_for(len(self._state.running)):
            self._add_drafts(in_progress, self._speculative)
            if self._speculative.uses_draft_model:
                propose_draft_tokens = self._speculative.num_speculative_tokens
        return SchedulerOutput(
            step_id=step_id,
            new_requests=tuple(in_progress.new_requests),
            scheduled_requests=tuple(in_progress.scheduled_requests),
            finished_request_ids=finished_request_ids,
            preempted_request_ids=tuple(in_progress.preempted_request_ids),
            swap_out=tuple(in_progress.swap_out),
            swap_in=tuple(in_progress.swap_in),
            copy=tuple(in_progress.copy),
            total_num_scheduled_tokens=self._limits.max_num_batched_tokens - in_progress.token_budget,
            completing_request_ids=tuple(in_progress.completing_request_ids),
            propose_draft_tokens=propose_draft_tokens,
            lora_loads=tuple(in_progress.lora_loads),
        )

    # ---- (0) room for the first in line ------------------------------------------------------------------

    def _make_room_for_first_in_line(self, in_progress: _PlanInProgress) -> None:
        state = self._state
        first = self._first_inactive_with_work()
        if first is None:
            return
        running = state.running
        for index in range(len(running) - 1, -1, -1):  # worst priority first
            if running[index].priority <= first.priority or self._could_start(first):
                break
            if running[index].request_id not in state.reporting_in_flight and not running[index].draft_token_ids:
                self._preempt(running.pop(index), in_progress)
        first_key = scheduling_key(first)
        if self._could_start(first) or any(
            scheduling_key(r) < first_key and not state.is_idle(r) for r in running
        ):
            return  # it can start, or someone earlier is still working: idle requests may be waiting on that one
        for index in range(len(running) - 1, -1, -1):
            if self._could_start(first):
                return
            if state.is_idle(running[index]):
                self._preempt(running.pop(index), in_progress)

    def _first_inactive_with_work(self) -> Request | None:
        state = self._state
        heads = [
            next((request for request in queue if state.num_tokens_to_compute(request)), None)
            for queue in (state.waiting, state.swapped)
        ]
        return min((head for head in heads if head is not None), key=scheduling_key, default=None)

    def _could_start(self, request: Request) -> bool:
        """Whether a waiting or swapped request would find a worker row, room for its LoRA adapter and blocks
        for a full-budget chunk now (ignoring prefix-cache hits: an over-estimate, so priority preemption may
        take one victim more)."""
        if not self._state.has_free_worker_row() or not self._adapter_fits(request):
            return False
        num_tokens = min(self._state.num_tokens_to_compute(request), self._limits.max_num_batched_tokens)
        if request.status is RequestStatus.SWAPPED:
            return self._blocks.can_swap_in(request.request_id, request.num_computed_tokens + num_tokens)
        return self._blocks.can_allocate(num_tokens)

    # ---- (1) running requests ----------------------------------------------------------------------------

    def _schedule_running(self, in_progress: _PlanInProgress) -> None:
        state = self._state
        running = state.running
        index = self._schedule_plain_decodes(in_progress) if self._plain_decode_run else 0
        if index == len(running) or in_progress.token_budget <= 0:
            return  # every running request was a plain decode (or idle): steady decode
        # Each request's tokens to compute, once: nothing in this pass changes another request's count.
        to_compute = {request.request_id: state.num_tokens_to_compute(request)
                      for request in itertools.islice(running, index, None)}
        # One token of budget held back for each decode not yet scheduled in this pass.
        num_decodes_after = sum(1 for num in to_compute.values() if num == 1)
        while index < len(running) and in_progress.token_budget > 0:
            request = running[index]
            num_to_compute = to_compute[request.request_id]
            if num_to_compute == 1:
                num_decodes_after -= 1
            reserved = num_decodes_after if num_to_compute > 1 else 0
            num_new_tokens = self._chunk(num_to_compute, in_progress.token_budget - reserved)
            if num_new_tokens == 0:
                index += 1
                continue
            num_preempted = in_progress.num_preempted
            while request.request_id not in state.worker_rows and not state.has_free_worker_row():
                victim = self._pick_victim(request, in_progress, needs_row=True)
                if victim is None:
                    break
                num_decodes_after -= self._preempt(victim, in_progress)
            if request.request_id not in state.worker_rows and not state.has_free_worker_row():
                index = running.index(request) + 1  # a forked child waits for a worker row
                continue
            allocation = self._blocks.allocate_slots(request, num_new_tokens)
            while allocation is None:
                victim = self._pick_victim(request, in_progress, needs_row=False)
                if victim is None:
                    running.remove(request)
                    self._preempt(request, in_progress)
                    return  # nobody after it was left
                num_decodes_after -= self._preempt(victim, in_progress)
                allocation = self._blocks.allocate_slots(request, num_new_tokens)
            self._record_scheduled(request, num_new_tokens, allocation, in_progress, num_to_compute)
            if in_progress.num_preempted == num_preempted:
                index += 1
            else:
                index = running.index(request) + 1  # an idle victim before it may have shifted it

    def _schedule_plain_decodes(self, in_progress: _PlanInProgress) -> int:
        """(1) for the leading run of the running queue made of plain decodes, in one tight loop; returns the
        index of the first request it leaves to the general loop of `_schedule_running` (len(running) when it
        took them all, as in steady decode).

        Why: in steady decode every step plans hundreds of running requests that each compute one token into
        the last block they hold, and the general loop's per-request bookkeeping (tokens to compute of
        everyone up front, the decode reservation, the worker-row and victim loops, a new ScheduledRequestData)
        was most of `schedule()`'s host time. A plain decode: a sampling request (no fan-out root, no beam row,
        no drafts in flight, not held or awaiting the engine) that holds a worker row and has exactly one token
        to compute, whose slot `allocate_slots` finds without preempting anyone. What the general loop would do
        for such a request, and for an idle one (skipped), is done here the same way: it preempts nobody, and
        the decode reservation is zero for a decode, so stopping at any request and handing the rest to the
        general loop yields the very plan the general loop alone would (tests/test_scheduler_plain_decodes.py
        drives both over random workloads and compares every plan). A decode that computes into its last block
        in place, as most do, reuses the request's one `ScheduledRequestData` of that shape
        (`SchedulerState.plain_decode_entries`: it is frozen and depends only on the request id)."""
        state = self._state
        worker_rows, engine_side = state.worker_rows, state.awaiting_engine or state.held
        entries = state.plain_decode_entries
        allocate_slots = self._blocks.allocate_slots
        max_model_len = self._limits.max_model_len
        scheduled, completing = in_progress.scheduled_requests, in_progress.completing_request_ids
        scheduled_ids, copies = in_progress.scheduled_ids, in_progress.copy
        draft_candidates = in_progress.decodes if self._speculative is not None else None
        budget = in_progress.token_budget
        index = 0
        for request in state.running:
            if budget <= 0 or request.prefill_only or request.num_beam_candidates or request.draft_token_ids:
                break
            request_id = request.request_id
            if engine_side and (request_id in state.awaiting_engine or request_id in state.held):
                break
            # SchedulerState.num_tokens_to_compute, for a running sampling request.
            pending = request.num_pending_tokens
            num_output_tokens = len(request.output_token_ids)
            num_tokens = len(request.prompt_token_ids) + num_output_tokens + pending
            if pending and (num_output_tokens + pending >= request.sampling_params.max_tokens
                            or num_tokens >= max_model_len):
                index += 1  # idle while its token in flight may be its last: the general loop skips it too
                continue
            if num_tokens - request.num_computed_tokens != 1 or request_id not in worker_rows:
                break
            allocation = allocate_slots(request, 1)
            if allocation is None:
                break  # someone must be preempted: the general loop's call finds the same and picks the victim
            if allocation.new_block_ids or allocation.copies:
                copies.extend(allocation.copies)
                entry = ScheduledRequestData(request_id, allocation.new_block_ids, 1,
                                             replaced_blocks=allocation.replaced_blocks)
            else:
                entry = entries.get(request_id)
                if entry is None:
                    entry = entries[request_id] = ScheduledRequestData(request_id, (), 1)
            budget -= 1
            scheduled_ids.add(request_id)
            scheduled.append(entry)
            # _record_scheduled: the request completes (its token is pending until the result applies it).
            request.num_computed_tokens += 1
            completing.append(request_id)
            if draft_candidates is not None and not pending:
                draft_candidates.append((request, len(scheduled) - 1))
            request.num_pending_tokens = pending + 1
            index += 1
        in_progress.token_budget = budget
        return index

    def _pick_victim(self, request: Request, in_progress: _PlanInProgress, needs_row: bool) -> Request | None:
        """Remove from the running queue whom `request` should preempt to get blocks (or a worker row, with
        `needs_row`): the last request after it, else an idle one before it (not scheduled in this step);
        None if neither."""
        state = self._state
        running = state.running
        position = running.index(request)
        for index in range(len(running) - 1, -1, -1):
            candidate = running[index]
            if index == position or (needs_row and candidate.request_id not in state.worker_rows):
                continue
            if candidate.request_id in in_progress.scheduled_ids or candidate.request_id in state.reporting_in_flight:
                continue
            if candidate.draft_token_ids:  # its result decides its computed tokens
                continue
            if index > position or state.is_idle(candidate):
                return running.pop(index)
        return None

    def _chunk(self, num_to_compute: int, capacity: int) -> int:
        """Tokens to schedule for a request with `num_to_compute` left, given `capacity` tokens of budget."""
        if num_to_compute <= capacity:
            return max(num_to_compute, 0)
        return max(capacity, 0) if self._limits.enable_chunked_prefill else 0

    def _preempt(self, request: Request, in_progress: _PlanInProgress) -> int:
        """Preempt a request already removed from the running queue. Returns 1 if it was a decode (one token
        to compute), else 0, for the decode reservation of `_schedule_running`."""
        state = self._state
        was_decode = int(state.num_tokens_to_compute(request) == 1)
        request_id = request.request_id
        request.num_preemptions += 1
        state.num_preemptions += 1
        in_progress.num_preempted += 1
        if request_id in state.worker_rows:
            state.worker_rows.remove(request_id)
            in_progress.preempted_request_ids.append(request_id)
        state.unsent_token_ids.pop(request_id, None)  # a NewRequestData will carry every token
        if self._limits.preemption_mode == "swap" and self._blocks.can_swap_out(request_id):
            in_progress.swap_out.extend(self._blocks.swap_out(request_id))
            request.status = RequestStatus.SWAPPED
            state.swapped.add(request)
        else:
            self._blocks.free(request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            state.waiting.add(request)
        return was_decode

    # ---- (2) waiting and swapped requests ----------------------------------------------------------------

    def _schedule_inactive(self, in_progress: _PlanInProgress) -> None:
        """Admit waiting and swap in swapped requests, merged in queue order, until one cannot start."""
        state = self._state
        waiting, swapped = state.waiting, state.swapped
        next_waiting = next_swapped = 0  # idle requests are passed over and stay in their queues
        while in_progress.token_budget > 0 and state.has_free_worker_row():
            candidates = []
            if next_waiting < len(waiting):
                candidates.append(waiting[next_waiting])
            if next_swapped < len(swapped):
                candidates.append(swapped[next_swapped])
            if not candidates:
                return
            request = min(candidates, key=scheduling_key)
            is_swapped = request.status is RequestStatus.SWAPPED
            if state.num_tokens_to_compute(request) == 0:
                next_swapped += is_swapped
                next_waiting += not is_swapped
                continue
            if not self._adapter_fits(request):
                return  # its adapter waits for the running ones of other adapters to drain: nobody overtakes
            started = self._swap_in(request, in_progress) if is_swapped else self._admit(request, in_progress)
            if not started:
                return

    def _adapter_fits(self, request: Request) -> bool:
        """Whether the running requests would hold at most max_loras distinct adapters with `request` too."""
        if request.lora_name is None:
            return True
        running = {r.lora_key for r in self._state.running if r.lora_name is not None}
        return request.lora_key in running or len(running) < self._limits.max_loras

    def _admit(self, request: Request, in_progress: _PlanInProgress) -> bool:
        assert request.num_computed_tokens == 0, "waiting requests hold no K/V"
        num_to_compute = self._state.num_tokens_to_compute(request)
        # Prompt logprobs need the logits of every prompt position: such a request computes them all.
        needs_all_logits = request.sampling_params.prompt_logprobs is not None
        prefix = self._blocks.find_cached_prefix(request, 0 if needs_all_logits else num_to_compute - 1)
        num_new_tokens = self._chunk(num_to_compute - prefix.num_tokens, in_progress.token_budget)
        if num_new_tokens == 0:
            return False
        allocation = self._blocks.allocate_slots(request, num_new_tokens, cached_prefix=prefix)
        if allocation is None:
            return False
        request.num_computed_tokens = prefix.num_tokens
        self._state.waiting.remove(request)
        self._start_running(request)
        self._record_scheduled(request, num_new_tokens, allocation, in_progress)
        return True

    def _swap_in(self, request: Request, in_progress: _PlanInProgress) -> bool:
        num_new_tokens = self._chunk(self._state.num_tokens_to_compute(request), in_progress.token_budget)
        num_kv_tokens = request.num_computed_tokens + num_new_tokens
        if num_new_tokens == 0 or not self._blocks.can_swap_in(request.request_id, num_kv_tokens):
            return False
        in_progress.swap_in.extend(self._blocks.swap_in(request.request_id))
        allocation = self._blocks.allocate_slots(request, num_new_tokens)
        assert allocation is not None, "room checked by can_swap_in"
        self._state.swapped.remove(request)
        self._start_running(request)
        self._record_scheduled(request, num_new_tokens, allocation, in_progress)
        return True

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self._state.running.add(request)

    # ---- the plan ----------------------------------------------------------------------------------------

    def _record_scheduled(
        self, request: Request, num_new_tokens: int, allocation: SlotAllocation, in_progress: _PlanInProgress,
        num_to_compute: int | None = None,
    ) -> None:
        state = self._state
        request_id = request.request_id
        in_progress.copy.extend(allocation.copies)
        in_progress.token_budget -= num_new_tokens
        in_progress.scheduled_ids.add(request_id)
        self._record_row(request, num_new_tokens, allocation, in_progress)
        # Counts advance now, not when the result is back, so the next step can be planned while this one
        # runs. A request that reaches its end samples a token (pending until the result applies it) or is
        # reported to the engine (a fan-out root, a beam row).
        if num_to_compute is None:
            num_to_compute = state.num_tokens_to_compute(request)
        completes = num_to_compute == num_new_tokens
        request.num_computed_tokens += num_new_tokens
        if completes:
            in_progress.completing_request_ids.append(request_id)
            if request.prefill_only or request.num_beam_candidates:
                state.reporting_in_flight.add(request_id)
            else:
                if self._speculative is not None and num_new_tokens == 1 and not request.num_pending_tokens and (
                    in_progress.scheduled_requests and in_progress.scheduled_requests[-1].request_id == request_id
                ):
                    in_progress.decodes.append((request, len(in_progress.scheduled_requests) - 1))
                request.num_pending_tokens += 1

    # ---- (3) draft tokens ---------------------------------------------------------------------------------

    def _add_drafts(self, in_progress: _PlanInProgress, speculative: SpeculativeConfig) -> None:
        """Give the step's plain decodes their draft tokens, in plan order, from the budget left."""
        max_model_len = self._limits.max_model_len
        for request, index in in_progress.decodes:
            if in_progress.token_budget <= 0:
                return
            params = request.sampling_params
            if not samples_plainly(request):
                continue
            # The step yields up to d + 1 tokens: never past max_tokens or max_model_len.
            room = min(params.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens) - 1
            num_drafts = min(speculative.num_speculative_tokens, in_progress.token_budget, room)
            if num_drafts < 1:
                continue
            drafts = _proposed_drafts(request, speculative, num_drafts)
            if not drafts:
                continue
            allocation = self._blocks.allocate_slots(request, len(drafts))
            if allocation is None:
                continue  # drafts never preempt anyone
            in_progress.copy.extend(allocation.copies)
            in_progress.token_budget -= len(drafts)
            request.num_computed_tokens += len(drafts)
            request.draft_token_ids = tuple(drafts)
            scheduled = in_progress.scheduled_requests[index]
            in_progress.scheduled_requests[index] = dataclasses.replace(
                scheduled,
                new_block_ids=scheduled.new_block_ids + allocation.new_block_ids,
                num_scheduled_tokens=scheduled.num_scheduled_tokens + len(drafts),
                replaced_blocks=scheduled.replaced_blocks + allocation.replaced_blocks,
                draft_token_ids=request.draft_token_ids,
            )

    def _record_row(
        self, request: Request, num_new_tokens: int, allocation: SlotAllocation, in_progress: _PlanInProgress
    ) -> None:
        """The step's data for the worker: a diff for a row it holds, else a whole new row."""
        state = self._state
        request_id = request.request_id
        if request_id in state.worker_rows:
            in_progress.scheduled_requests.append(
                ScheduledRequestData(
                    request_id=request_id,
                    new_block_ids=allocation.new_block_ids,
                    num_scheduled_tokens=num_new_tokens,
                    new_token_ids=tuple(state.unsent_token_ids.pop(request_id, ())),
                    replaced_blocks=allocation.replaced_blocks,
                )
            )
            return
        state.worker_rows.add(request_id)
        state.unsent_token_ids.pop(request_id, None)
        if request.lora_name is not None:
            self._assign_lora_slot(request, in_progress)
        in_progress.new_requests.append(
            NewRequestData(
                request_id=request_id,
                token_ids=tuple(request.all_token_ids),
                sampling_params=request.sampling_params,
                block_ids=tuple(self._blocks.block_table(request_id)),
                num_computed_tokens=request.num_computed_tokens,
                num_scheduled_tokens=num_new_tokens,
                num_beam_candidates=request.num_beam_candidates,
                num_prompt_tokens=request.num_prompt_tokens,
                eos_token_ids=request.eos_token_ids,
                lora_slot=request.lora_slot,
            )
        )

    def _assign_lora_slot(self, request: Request, in_progress: _PlanInProgress) -> None:
        """The slot of the adapter of a request getting a worker row (lora_slots.py), and its load if the
        workers do not hold it yet: a free slot, else the LRU one no running request uses."""
        in_use = {r.lora_key for r in self._state.running if r.lora_name is not None}
        request.lora_slot, load = self._state.lora_slots.assign(request.lora_key, in_use)
        if load is not None:
            in_progress.lora_loads.append(load)


def _proposed_drafts(request: Request, speculative: SpeculativeConfig, num_drafts: int) -> list[int]:
    """Up to `num_drafts` drafts for a request's next decode: the n-gram proposer's, or what the draft model
    proposed after exactly its current tokens (none if its proposal is for older tokens, or missing)."""
    if not speculative.uses_draft_model:
        return propose_ngram_drafts(request.all_token_ids, speculative.prompt_lookup_min,
                                    speculative.prompt_lookup_max, num_drafts)
    if request.proposed_after != request.num_tokens:
        return []
    return list(request.proposed_draft_token_ids[:num_drafts])


def samples_plainly(request: Request) -> bool:
    """Whether the worker's verification of drafts is exactly its plain sampling for this request: no state
    that depends on the tokens before each position beyond the model's input (penalties, bad words, a grammar),
    no per-token logprobs to report, no masked stop ids (min_tokens reached), not a beam row. Nor stop strings:
    they are found on the text after the step is applied, too late to drop the accepted tokens after one
    (the stream would cut its text there, but token_ids and completion_tokens would keep them)."""
    params = request.sampling_params
    return (
        not request.num_beam_candidates
        and not request.prefill_only
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.bad_words_token_ids
        and not params.structured_grammar
        and not params.stop
        and params.logprobs is None
        and request.num_output_tokens >= params.min_tokens
    )
