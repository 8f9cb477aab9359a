"""The scheduler: the engine's one handle on requests, block tables and step plans.

Who owns what: the scheduler (on the engine's scheduler thread, never shared) owns every unfinished request
(`SchedulerState`), and through its `BlockManager` every block table. The engine loop calls, per step:
`schedule()`, converts the `SchedulerOutput` to a StepPlan, sends it, and passes the worker's sampled tokens to
`update_from_output`; between steps it may call `add_request`, `fork_request`, `append_token`,
`abort_request`, `finish_request` and `release_request`. The policy of each step (order, budgets, chunking,
preemption, priorities, and why nothing starves) lives in `step_planner.py`.

Parallel sampling and beam search are the engine's; the scheduler only offers the pieces. A fan-out root
(`Request.prefill_only`) computes its prompt but the last token and is returned once by `update_from_output`;
the engine forks its n children (`fork_request`: they share its blocks, copy-on-write for the partial one) and
frees it with `release_request` (not counted as finished). A beam row (`Request.num_beam_candidates`) is
returned whenever its last known token was computed (the worker sent candidates instead of a token); the engine
then appends the chosen token (`append_token`), forks siblings, or releases it. Both wait, idle, until the
engine acts.

Counts advance when a step is scheduled, as in vLLM V1, so step N+1 can be planned while step N runs
(DESIGN.md, performance principle 4): a request that samples in step N has its token counted as pending
(`Request.num_pending_tokens`) and is planned a decode in step N+1, whose input token the worker takes from
its own row. Up to `max_steps_in_flight` outputs may be planned before the oldest comes back through
`update_from_output` (enforced, in order). What the scheduler cannot know yet costs at most one wasted token
per request: a request that stops on EOS or a stop string in step N was already planned in step N+1; its
token from N+1 is dropped. A request is never planned past its length limit (its pending token may be its
last), and one preempted while its token is in flight keeps that token and resumes only once it is back.
"""

from __future__ import annotations

from collections import deque

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.draft_outlook import DraftOutlook
from scheduler_svc.core.lost_work import LostWork
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.scheduler_limits import SchedulerLimits
from scheduler_svc.core.scheduler_output import NewRequestData, ScheduledRequestData, SchedulerOutput
from scheduler_svc.core.scheduler_state import SchedulerState
from scheduler_svc.core.spec_decode_stats import SpecDecodeStats
from scheduler_svc.core.step_planner import StepPlanner
from scheduler_svc.core.speculative_config import SpeculativeConfig

__all__ = [
    "NewRequestData",
    "ScheduledRequestData",
    "Scheduler",
    "SchedulerLimits",
    "SchedulerOutput",
]


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager, max_steps_in_flight: int = 1,
                 speculative: SpeculativeConfig | None = None, plain_decode_run: bool = True) -> None:
        """`plain_decode_run` False plans every running request through the planner's general loop, never its
        fast path for plain decodes (step_planner.py): the reference that path is tested against."""
        if limits.enable_prefix_caching != block_manager.enable_prefix_caching:
            raise ValueError("SchedulerLimits and BlockManager disagree on enable_prefix_caching")
        self.limits = limits
        self.block_manager = block_manager
        self._state = SchedulerState(limits, block_manager)
        self.speculative = speculative
        self._draft_outlook = None if speculative is None else DraftOutlook(speculative)
        self._plain_decode_run = plain_decode_run
        self._planner = StepPlanner(self._state, speculative, plain_decode_run)
        self.spec_decode_stats = SpecDecodeStats()
        self._finished_ids_to_report: list[str] = []
        if max_steps_in_flight < 1:
            raise ValueError("max_steps_in_flight must be at least 1")
        self.max_steps_in_flight = max_steps_in_flight
        # Planned steps that scheduled tokens, oldest first, with the requests that complete in each (by
        # identity: an id may finish and come back before its old step's result does).
        self._unapplied: deque[tuple[SchedulerOutput, dict[str, Request]]] = deque()
        # Aborted requests whose rows the worker may drop from the steps in flight (`take_worker_cancels`).
        self._worker_cancels: list[str] = []
        self._next_arrival_seq = 0
        self._next_fork_seq = 1
        self._num_steps = 0
        self._num_finished_requests = 0

    # ---- counters (the stats RPC) ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._state.running)

    @property
    def num_waiting(self) -> int:
        return len(self._state.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self._state.swapped)

    @property
    def num_preemptions(self) -> int:
        return self._state.num_preemptions

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def num_finished_requests(self) -> int:
        """Requests finished or aborted (released ones are not counted)."""
        return self._num_finished_requests

    @property
    def num_used_gpu_blocks(self) -> int:
        return self.block_manager.num_used_gpu_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prefix-cache hit tokens / queried tokens over the scheduler's life (0.0 before any query)."""
        return self.block_manager.prefix_cache_hit_rate

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.block_manager.prefix_cache_hit_tokens

    @property
    def prefix_cache_query_tokens(self) -> int:
        return self.block_manager.prefix_cache_query_tokens

    def has_unfinished_requests(self) -> bool:
        return bool(self._state.requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None (unknown or already finished)."""
        return self._state.requests.get(request_id)

    def num_tokens_to_compute(self, request: Request) -> int:
        """Tokens the request still has to compute (0: idle, waiting on the engine)."""
        return self._state.num_tokens_to_compute(request)

    # ---- requests in and out -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError for one that could never run: an empty prompt, a prompt over
        max_model_len, max_tokens < 1, a live duplicate id, or more K/V than the whole GPU pool. A request may
        come with output tokens (a stream resumed after a scheduler loss): it then starts like one preempted
        by recompute, its prompt and output prefilled before it samples the next token."""
        self._check_new(request)
        if request.output_token_ids and request.num_output_tokens >= request.sampling_params.max_tokens:
            raise ValueError(f"request {request.request_id} has no max_tokens left")
        request.arrival_seq = self._next_arrival_seq
        self._next_arrival_seq += 1
        self._state.requests[request.request_id] = request
        self._state.waiting.add(request)

    def fork_request(self, parent_id: str, child: Request, num_shared_tokens: int) -> None:
        """Start `child` (built by the caller, its first `num_shared_tokens` tokens equal to the parent's) from
        the K/V the parent computed.

        A running parent shares its first ceil(num_shared_tokens / block_size) blocks (copy-on-write for a
        partial last one) and the child starts RUNNING with num_shared_tokens computed; it reaches the worker as
        a NewRequestData the next time it is scheduled. A parent holding no GPU blocks (waiting, swapped, or
        num_shared_tokens 0) shares nothing: the child starts WAITING with none computed (its admission still
        takes whatever the prefix cache holds). Either way the child takes the parent's priority and arrival, so
        it sorts right after the parent (and after the parent's earlier forks), before any later arrival.
        Raises ValueError for an unknown parent, a child whose first tokens differ from the parent's, a share
        beyond what the parent computed, or a child `add_request` would refuse.
        """
        parent = self._state.requests.get(parent_id)
        if parent is None:
            raise ValueError(f"fork of unknown or finished request {parent_id}")
        self._check_new(child)
        if not 0 <= num_shared_tokens <= min(parent.num_computed_tokens, child.num_tokens):
            raise ValueError(
                f"fork of {parent_id}: {num_shared_tokens} shared tokens, parent computed "
                f"{parent.num_computed_tokens}, child has {child.num_tokens}"
            )
        if child.token_ids_between(0, num_shared_tokens) != parent.token_ids_between(0, num_shared_tokens):
            raise ValueError(f"fork of {parent_id}: the child's first {num_shared_tokens} tokens differ")
        if num_shared_tokens == child.num_tokens and not child.num_beam_candidates:
            raise ValueError(f"fork of {parent_id}: the child has nothing left to compute")
        child.priority = parent.priority
        child.arrival_seq = parent.arrival_seq
        child.fork_seq = self._next_fork_seq
        self._next_fork_seq += 1
        self._state.requests[child.request_id] = child
        if parent.status is RequestStatus.RUNNING and num_shared_tokens > 0:
            self.block_manager.fork(parent_id, child.request_id, num_shared_tokens)
            child.num_computed_tokens = num_shared_tokens
            child.status = RequestStatus.RUNNING
            self._state.running.add(child)
        else:
            self._state.waiting.add(child)

    def _check_new(self, request: Request) -> None:
        request_id = request.request_id
        if request_id in self._state.requests:
            raise ValueError(f"request {request_id} is already queued")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request_id} is not a fresh request")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request_id} has an empty prompt")
        if request.num_tokens > self.limits.max_model_len:
            raise ValueError(
                f"request {request_id}: {request.num_tokens} tokens exceed max_model_len {self.limits.max_model_len}"
            )
        if request.sampling_params.max_tokens < (0 if request.prefill_only else 1):
            # max_tokens 0 (prompt_only.py) samples nothing: only a prefill-only request may ask for it.
            raise ValueError(f"request {request_id}: max_tokens must be >= 1")
        if request.prefill_only and request.num_beam_candidates:
            raise ValueError(f"request {request_id}: a fan-out root cannot be a beam row")
        num_blocks = self.block_manager.num_blocks_for(request.max_kv_tokens(self.limits.max_model_len))
        if num_blocks > self.block_manager.num_gpu_blocks:
            raise ValueError(
                f"request {request_id} needs {num_blocks} KV blocks, the pool has {self.block_manager.num_gpu_blocks}"
            )

    def append_token(self, request_id: str, token_id: int) -> None:
        """Append the token the engine chose for a beam row (no stop checks: the beam search decides when a
        beam ends). The worker gets it in the row's next ScheduledRequestData (`new_token_ids`), or with all
        the other tokens in a NewRequestData. Raises ValueError for an unknown request, one that is not a beam
        row, or one at max_tokens or max_model_len (the engine must end such a beam instead)."""
        request = self._state.requests.get(request_id)
        if request is None or request.num_beam_candidates == 0:
            raise ValueError(f"request {request_id} is not a live beam row")
        if request.num_output_tokens >= request.sampling_params.max_tokens or (
            request.num_tokens >= self.limits.max_model_len
        ):
            raise ValueError(f"request {request_id} is at its length limit")
        request.output_token_ids.append(token_id)
        self._state.awaiting_engine.discard(request_id)
        if request_id in self._state.worker_rows:
            self._state.unsent_token_ids.setdefault(request_id, []).append(token_id)

    def hold(self, request_ids: set[str]) -> None:
        """Keeps these waiting requests out of every step until a later `hold` leaves them out (the engine's
        poison-request isolation after a worker loss: worker_loss_suspects.py). Replaces the previous set."""
        self._state.held = set(request_ids)

    def abort_request(self, request_id: str) -> bool:
        """Remove an unfinished request from whichever queue holds it and free (or drop its share of) its
        blocks, GPU and swap. Returns False if it is unknown or already finished.

        A request scheduled in steps already planned (async scheduling plans up to `max_steps_in_flight` ahead:
        a long prompt's next chunks) is also offered to the worker to drop from those steps
        (`take_worker_cancels`), so an abort costs at most the step running now, not every planned chunk."""
        request = self._state.requests.get(request_id)
        if request is None:
            return False
        self._offer_worker_cancel(request)
        self._finish(request, FinishReason.ABORT)
        return True

    def take_worker_cancels(self) -> list[str]:
        """Aborted requests the worker may drop from every plan it has not started (a `CancelRequests`
        message, sent at once); each is listed in a later plan's finished ids, as every finished request is."""
        cancels, self._worker_cancels = self._worker_cancels, []
        return cancels

    def _offer_worker_cancel(self, request: Request) -> None:
        """Whether the worker may skip `request`'s rows in the steps in flight. Their blocks were registered in
        the prefix cache when planned, before the worker wrote them: the keys of every block those tokens reach
        are evicted (a later request must not hit K/V that may never be written). Not offered when another
        request holds one of those blocks (a prefix hit or fork planned behind it reads them)."""
        request_id = request.request_id
        in_flight = sum(output.num_scheduled_tokens().get(request_id, 0) for output, _ in self._unapplied)
        if in_flight and self.block_manager.forget_unwritten(request_id, request.num_computed_tokens - in_flight):
            self._worker_cancels.append(request_id)

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """Finish an unfinished request for a reason found outside the scheduler (a stop string, an abort).
        Returns False if it is unknown or already finished (e.g. by a token-level stop)."""
        request = self._state.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, reason)
        return True

    def release_request(self, request_id: str) -> bool:
        """Free a request the client never sees end (a fan-out root once its children are forked, a dropped
        beam): like an abort, but not counted in `num_finished_requests`. Returns False if it is unknown."""
        request = self._state.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT, counted=False)
        return True

    def _finish(self, request: Request, reason: FinishReason, counted: bool = True) -> None:
        request_id = request.request_id
        self._state.queue_of(request).remove(request)
        self.block_manager.free(request_id)
        self._state.worker_rows.discard(request_id)
        self._state.unsent_token_ids.pop(request_id, None)
        self._state.awaiting_engine.discard(request_id)
        self._state.reporting_in_flight.discard(request_id)
        self._state.plain_decode_entries.pop(request_id, None)
        request.num_pending_tokens = 0  # any token still in flight for it is dropped
        request.draft_token_ids = ()
        request.status = RequestStatus.finished_by(reason)
        request.finish_reason = reason
        del self._state.requests[request_id]
        self._finished_ids_to_report.append(request_id)  # the worker ignores ids it holds no row for
        if counted:
            self._num_finished_requests += 1

    # ---- one step ----------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (`step_planner.py` has the policy); it reports every request finished since the
        last plan.

        Raises RuntimeError if `max_steps_in_flight` outputs that scheduled tokens have not been passed to
        `update_from_output` yet.
        """
        if len(self._unapplied) >= self.max_steps_in_flight:
            raise RuntimeError(f"step {self._unapplied[0][0].step_id} was not passed to update_from_output")
        step_id = self._num_steps
        self._num_steps += 1
        output = self._planner.plan(step_id, tuple(self._finished_ids_to_report))
        self._finished_ids_to_report = []
        if output.total_num_scheduled_tokens:
            requests = self._state.requests
            self._unapplied.append((output, {rid: requests[rid] for rid in output.completing_request_ids}))
        return output

    def recover_from_worker_loss(self, block_manager: BlockManager) -> list[LostWork]:
        """The workers were replaced (worker crash recovery): every KV and swap block they held is gone, and
        so is every step in flight. Each unfinished request goes back to waiting, to be recomputed from the
        tokens it knows (prompt and the outputs whose results came back; tokens of lost steps are dropped),
        on the new workers' empty pool `block_manager`. Returns, for each unfinished request scheduled in the
        lost steps (planned, results not applied), what it had in them."""
        state = self._state
        samples: dict[str, int] = {}
        joined: set[str] = set()
        for output, completing in self._unapplied:
            for request_id in output.num_scheduled_tokens():
                samples[request_id] = samples.get(request_id, 0) + (request_id in completing)
            joined.update(data.request_id for data in output.new_requests)
        lost_work = [LostWork(request_id, state.requests[request_id].num_output_tokens, count, request_id in joined)
                     for request_id, count in samples.items() if request_id in state.requests]
        for request in [*state.running, *state.swapped]:
            state.queue_of(request).remove(request)
            request.status = RequestStatus.WAITING
            state.waiting.add(request)
        for request in state.requests.values():
            request.num_computed_tokens = 0
            request.num_pending_tokens = 0
            request.draft_token_ids = ()
        state.worker_rows.clear()
        state.unsent_token_ids.clear()
        state.reporting_in_flight.clear()
        state.lora_slots.forget()  # the new workers hold no adapter: every slot assigned from now on is loaded
        self._unapplied.clear()
        self._finished_ids_to_report = []
        self._worker_cancels = []
        self.block_manager = state.block_manager = block_manager
        self._planner = StepPlanner(state, self.speculative, self._plain_decode_run)
        return lost_work

    def max_steps_ahead(self) -> int:
        """How many planned steps may wait for their results now: `max_steps_in_flight`, but 1 (plan, wait,
        apply, plan) while speculation is on, at most its disable_by_batch_size requests run and some of them
        would get drafts, since drafts are proposed only from a request's newest token (draft_outlook.py)."""
        speculative = self.speculative
        if (speculative is not None and speculative.is_on_for(self.num_running)
                and self._draft_outlook.expected(self._state.running)):
            return 1
        return self.max_steps_in_flight

    @property
    def num_steps_in_flight(self) -> int:
        """Planned steps that scheduled tokens and whose results have not been applied yet."""
        return len(self._unapplied)

    # ---- results -----------------------------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int], accepted_drafts: dict[str, int] | None = None,
        proposed_drafts: dict[str, tuple[int, ...]] | None = None,
    ) -> list[Request]:
        """Apply a step the worker ran (the oldest planned one): append the token sampled for each request that
        completed in it and finish those that hit a token-level stop (EOS unless ignore_eos, a stop token id:
        STOP; max_tokens or max_model_len: LENGTH). Finished requests are freed now and reported in the next
        output. A request preempted since the plan keeps its token (it resumes with it).

        Speculative decoding: `accepted_drafts` (request id -> a, absent: 0) says how many of a request's draft
        tokens the worker kept; it gains those a drafts then its sampled token, each checked for the stops
        above (a stop inside the run drops the rest), its computed tokens lose the rejected drafts, the blocks
        held only for them are freed and the full blocks the accepted ones completed are cached.
        `proposed_drafts` (a draft model's, request id -> tokens): what the workers proposed to follow each
        request's tokens as of this result; kept on the request for its next decode (step_planner.py).

        Returns, in plan order, the requests that got a new token (finished or not), the beam rows whose last
        known token was computed (their candidates are in the worker's result; no token is expected), and the
        fan-out roots that reached num_prompt_tokens - 1 computed tokens in this step (the engine forks their
        children and releases them). Requests aborted or finished since `output` was planned are skipped, and
        so are their tokens.
        """
        if output.total_num_scheduled_tokens == 0:
            return []
        if not self._unapplied or output.step_id != self._unapplied[0][0].step_id:
            expected = self._unapplied[0][0].step_id if self._unapplied else None
            raise ValueError(f"expected the output of step {expected}, got step {output.step_id}")
        accepted_drafts = accepted_drafts or {}
        live = self._check_sampled(output, self._unapplied[0][1], sampled)  # raises before anything changes
        self._check_accepted(output, live, accepted_drafts)
        self._unapplied.popleft()
        updated = []
        for request in live:
            if request.prefill_only or request.num_beam_candidates:
                self._state.reporting_in_flight.discard(request.request_id)
                self._state.awaiting_engine.add(request.request_id)
                updated.append(request)
                continue
            request.num_pending_tokens -= 1
            if request.draft_token_ids:
                reason = self._apply_drafts(request, sampled[request.request_id],
                                            accepted_drafts.get(request.request_id, 0))
            else:
                token_id = sampled[request.request_id]
                request.output_token_ids.append(token_id)
                reason = self._token_stop_reason(request, token_id)
            if reason is not None:
                self._finish(request, reason)
            elif proposed_drafts and request.request_id in proposed_drafts:
                request.proposed_draft_token_ids = proposed_drafts[request.request_id]
                request.proposed_after = request.num_tokens
            updated.append(request)
        return updated

    def _apply_drafts(self, request: Request, token_id: int, num_accepted: int) -> FinishReason | None:
        """Append a verified request's accepted drafts then its sampled token, up to a token-level stop, and
        give back the slots of the rejected drafts. Returns the stop's reason, if one was met."""
        drafts, request.draft_token_ids = request.draft_token_ids, ()
        first_draft_position = request.num_computed_tokens - len(drafts)
        self.spec_decode_stats.count(len(drafts), num_accepted)
        request.num_computed_tokens -= len(drafts) - num_accepted
        reason = None
        for token_id in (*drafts[:num_accepted], token_id):
            request.output_token_ids.append(token_id)
            reason = self._token_stop_reason(request, token_id)
            if reason is not None:
                break
        self.block_manager.keep_accepted_slots(request, first_draft_position)
        return reason

    def _check_accepted(self, output: SchedulerOutput, live: list[Request], accepted_drafts: dict[str, int]) -> None:
        """Every accepted count is for a live request of this step, at most its drafts."""
        if not accepted_drafts:  # no row kept a draft (always, with speculation off)
            return
        drafts = {request.request_id: len(request.draft_token_ids) for request in live}
        for request_id, num_accepted in accepted_drafts.items():
            if request_id in drafts and not 0 <= num_accepted <= drafts[request_id]:
                raise ValueError(f"request {request_id}: {num_accepted} drafts accepted of {drafts[request_id]} "
                                 f"in step {output.step_id}")

    def _check_sampled(
        self, output: SchedulerOutput, completing: dict[str, Request], sampled: dict[str, int]
    ) -> list[Request]:
        """The requests of `completing` still unfinished (the same objects), after checking that the worker
        sampled a token for exactly the completing requests that sample (one aborted since the plan may lack
        it: the worker dropped its row, `take_worker_cancels`)."""
        unexpected = sampled.keys() - completing.keys()
        if unexpected:
            raise ValueError(f"tokens sampled for requests not completing in step {output.step_id}: {sorted(unexpected)}")
        live = []
        for request_id, request in completing.items():
            # Else it left since the plan was made (and maybe came back under its id).
            is_live = self._state.requests.get(request_id) is request
            samples = not request.prefill_only and not request.num_beam_candidates
            if samples != (request_id in sampled) and (is_live or not samples):
                raise ValueError(
                    f"request {request_id}: a token was {'not ' if samples else ''}sampled in step {output.step_id}"
                )
            if is_live:
                live.append(request)
        return live

    def _token_stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        # Called for every token of every step: counts taken once, no property calls.
        params = request.sampling_params
        num_output_tokens = len(request.output_token_ids)
        # Before min_tokens the worker masks stop ids; they would not stop the request either.
        if num_output_tokens >= params.min_tokens and (
            token_id in params.stop_token_ids or (not params.ignore_eos and token_id in request.eos_token_ids)
        ):
            return FinishReason.STOP
        if num_output_tokens >= params.max_tokens or (
            len(request.prompt_token_ids) + num_output_tokens >= self.limits.max_model_len
        ):
            return FinishReason.LENGTH
        return None
