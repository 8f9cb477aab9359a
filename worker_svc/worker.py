"""The worker: applies the scheduler's plans to its rows and runs them as steps; answers with the sampled tokens.

It never decides anything: each `StepPlan` says which rows to drop, which blocks to move, which tokens to
compute; the worker executes it and answers with the sampled tokens. Its state is a pure function of the
plans received, so a plan log replays a bug. Who owns what: the worker owns the persistent batch of rows
(persistent_batch.py, with the rows' grammar matchers), the step's bookkeeping (which rows sample, their
pending tokens, the overlap of step N+1's launch with step N) and the results; the model runner
(model_runner.py) owns everything on the device: the model, the KV pools, the graphs, the sampling kernels.
The process's loop around it (the link to the scheduler, overlapping steps, failures) is serving_loop.py.

Tensor parallel (`--world-size N`, one process per rank): every rank receives every plan and runs every step
the same way: the same row updates, block moves and forward pass (whose layers talk to the other ranks
through the `TensorParallel` group, which the runner joins before the model loads), and the same sampling. Why every
rank samples instead of rank 0 broadcasting its tokens: the logits are gathered whole to every rank by the
model's vocab-parallel head and every request's randomness is keyed by its (seed, position), which the
scheduler always sets, so each rank draws the same tokens without a collective; the persistent batch's next
input token (a decode's own last sample, on the device, possibly still in flight) is therefore already on
every rank, and draft tokens are verified alike on every rank (the same sampled ids against the same drafts),
so the rows stay the same. So only rank 0 sends each step's result; the other ranks send nothing per step
but heartbeats, and a WorkerError if a step fails on them. The ranks agree on one KV pool size (the smallest)
at setup.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import numpy as np
import torch

from protos.pagedserve.v1 import worker_pb2
from service_runtime.step_timer import BackToBackClock, StepTimer
from worker_svc.config import WorkerConfig
from worker_svc.fault_injection import FaultInjectingRunner, wants_faults
from worker_svc.grammar_matchers import GrammarMatchers, mask_threads
from worker_svc.launched_step import LaunchedStep
from worker_svc.model_runner import ModelRunner
from worker_svc.persistent_batch import PersistentBatch, StepInputs
from worker_svc.sampling.sampling_inputs import build_sampling_tensors

logger = logging.getLogger(__name__)

# A step whose launch takes longer is logged (its host work, not its GPU time).
_SLOW_LAUNCH_S = 0.25


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        runner = ModelRunner(config)
        # Tests that ask for faults get them around the runner (fault_injection.py); serving runs it bare.
        self.runner = FaultInjectingRunner(runner, config) if wants_faults(config) else runner
        self.model_name, self.model_config = runner.model_name, runner.model_config
        # Made at setup, always with its grammar matchers (which take no constrained row without a tokenizer).
        self.batch: PersistentBatch | None = None
        self.step_timer = StepTimer(f"worker rank {config.rank}")
        self.gpu_clock = BackToBackClock()
        # Whether the step launched last asks the draft model for proposals (until it is finished): no plan is
        # launched behind it (`can_overlap`).
        self._proposing_in_flight = False

    def setup(self, setup: worker_pb2.WorkerSetup) -> worker_pb2.WorkerReady:
        """Allocates the pools and graphs (the runner's `allocate`) and the rows."""
        kv_cache = self.runner.allocate(setup)
        grammars = GrammarMatchers(setup.structured_output_tokenizer if setup.HasField("structured_output_tokenizer")
                                   else None, self.model_config.vocab_size, setup.max_num_seqs,
                                   pin_memory=self.runner.on_gpu,
                                   num_threads=mask_threads(self.config.world_size),
                                   limits=setup.structured_output_limits
                                   if setup.HasField("structured_output_limits") else None)
        self.batch = PersistentBatch(setup.max_num_seqs, setup.max_model_len, setup.block_size, grammars)
        return worker_pb2.WorkerReady(rank=self.config.rank, num_kv_blocks=kv_cache.num_blocks,
                                      num_swap_blocks=kv_cache.num_swap_blocks)

    @torch.inference_mode()
    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        """Runs one step and returns its result (`launch`, then `finish`)."""
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: worker_pb2.StepPlan, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Applies a plan to the rows and queues the step's work on the device without waiting for it.

        `previous`, a step launched and not finished yet: the GPU runs the two back to back, and this step's
        inputs that are tokens `previous` samples are taken from its sampled ids on the device (the rows hold
        them as PENDING_TOKEN until `finish(previous)`). The caller finishes `previous` first when
        `can_overlap(plan)` is False.
        """
        runner, timer = self.runner, self.step_timer
        if previous is not None and previous.masks is None:
            self.complete(previous)  # a deferred draw reads its rows' matchers: before this plan changes them
        timer.start_step()
        started = time.perf_counter()
        rows = self._apply(plan)
        self._proposing_in_flight = plan.propose_draft_tokens > 0
        step = LaunchedStep(worker_pb2.StepResult(step_id=plan.step_id), behind_another=previous is not None,
                            started=runner.device_busy.step_started(),
                            propose_draft_tokens=plan.propose_draft_tokens)
        if not rows:
            return step
        inputs = self._step_inputs(plan, rows)
        step.kind = ("decode" if inputs.num_decode_seqs == len(inputs.rows) else
                     "verify" if inputs.is_verification else "with prefill")
        # The timers split constrained steps from the others: what a grammar costs a step, in one engine.
        constrained = self.batch.grammars.constrained[inputs.sample_rows].any()
        step.timed_as = step.kind + (" constrained" if constrained else "")
        timer.set_kind(step.timed_as)
        timer.mark("prepare")
        if previous is not None and previous.draw_pending:
            self.complete(previous)  # its draw goes on the stream before this forward pass
            timer.mark("draw_behind")  # mostly the wait for its grammar masks
        previous_sampled = previous.sampled.token_ids if previous is not None and previous.sampled else None
        output = runner.execute(self.batch, inputs, previous_sampled)
        timer.mark("forward_launch")
        step.result.prompt_logprobs.extend(output.prompt_logprobs)
        self._launch_draw(step, inputs, output.logits, behind_another=previous is not None)
        timer.mark("sample_launch")
        elapsed = time.perf_counter() - started
        # On a GPU a launch only queues kernels, so a slow one means the host was slow (a compile of a kernel
        # variant seen first?); on the CPU the launch is the computation itself, slow by nature: not logged.
        if runner.on_gpu and elapsed > _SLOW_LAUNCH_S:
            logger.info("slow step launch: %.2f s for %d tokens, %d decodes, %d chunks", elapsed,
                        len(inputs.input_ids), inputs.num_decode_seqs, len(inputs.rows) - inputs.num_decode_seqs)
        return step

    def _apply(self, plan: worker_pb2.StepPlan) -> list[int]:
        """Drops the finished and preempted rows, moves the plan's blocks, adds and updates rows; returns the
        scheduled rows in plan order."""
        batch = self.batch
        for request_id in plan.finished_request_ids:
            batch.remove(request_id)
        for request_id in plan.preempted_request_ids:
            batch.remove(request_id)
        self.runner.move_blocks(plan)
        self.runner.load_loras(plan)
        batch.grammars.prepare([new.sampling.structured_grammar for new in plan.new_requests
                                if new.sampling.structured_grammar])
        rows = [batch.add(new) for new in plan.new_requests]
        rows += [batch.update(scheduled) for scheduled in plan.scheduled_requests]
        if batch.num_rows_with_drafts and not plan.has_draft_tokens:  # `can_overlap` reads the flag
            raise ValueError(f"step {plan.step_id}: draft tokens in a plan without has_draft_tokens")
        return rows

    def _step_inputs(self, plan: worker_pb2.StepPlan, rows: list[int]) -> StepInputs:
        """The step's model inputs, decodes (one token) first: attention backends run them with their own
        kernel over a leading range."""
        num_scheduled = [n.num_scheduled_tokens for n in plan.new_requests]
        num_scheduled += [s.num_scheduled_tokens for s in plan.scheduled_requests]
        rows_array, scheduled_array = np.asarray(rows, dtype=np.int64), np.asarray(num_scheduled, dtype=np.int64)
        order = np.argsort(scheduled_array != 1, kind="stable")
        return self.batch.build_inputs(rows_array[order], scheduled_array[order])

    def _launch_draw(self, step: LaunchedStep, inputs: StepInputs, logits: torch.Tensor | None,
                     behind_another: bool) -> None:
        """Queues the draw of the rows that sample (or defers it: see below), marks their next tokens pending
        in the rows, and scores the beam rows' candidates. A row with drafts is drawn at each of its sampling
        entries (`StepInputs.sample_offsets`) and verified in `finish`."""
        batch = self.batch
        is_beam = batch.num_beam_candidates[inputs.sample_rows] > 0
        step.draw_rows = inputs.sample_rows[~is_beam]
        step.sampled_rows = step.draw_rows
        if inputs.num_draft_tokens:
            step.draw_offsets = inputs.sample_offsets[~is_beam]
            step.sampled_rows = step.draw_rows[step.draw_offsets == 0]
        if len(step.sampled_rows):
            # Who sampled, as of now: a row may be handed to another request before the step finishes.
            step.request_ids = [batch.request_id_of(row) for row in step.sampled_rows.tolist()]
            step.num_logprobs = batch.num_logprobs[step.sampled_rows].copy()
            # The sampling inputs as of now (a row's seed position is its token count before begin_step).
            tensors = build_sampling_tensors(batch, step.draw_rows, self.runner.device, step.draw_offsets)
            # Drafts a draft model sampled (with their q): verified by the rejection rule, the others by matching.
            drafts = (self.runner.sampled_drafts(batch, step.draw_rows, step.draw_offsets)
                      if step.draw_offsets is not None else None)
            draw = partial(self._draw, self.runner.select_rows(logits, np.flatnonzero(~is_beam)), step, tensors,
                           drafts)
            if behind_another and batch.grammars.follows_sampled_tokens(step.draw_rows):
                # A grammar's mask needs the token the step in flight samples (a waiting grammar: whether it
                # starts): queued forward first, the mask and the draw once that step is finished (`complete`),
                # still while this step's forward runs.
                step.deferred_sample = draw
            else:
                draw()
        pending = batch.begin_step(inputs, step.sampled_rows)
        step.pending = pending if len(step.sampled_rows) else None
        if is_beam.any():
            step.result.beam_candidates.extend(self._beam_candidates(
                self.runner.select_rows(logits, np.flatnonzero(is_beam)), inputs.sample_rows[is_beam]))

    def _draw(self, logits: torch.Tensor, step: LaunchedStep, tensors, drafts) -> None:
        step.sampled = self.runner.sample(logits, tensors, self._grammar_masks(step), drafts)

    def _grammar_masks(self, step: LaunchedStep) -> tuple[np.ndarray, torch.Tensor] | None:
        """The constrained sampled rows' bitmasks: filled in the background while the queued forward pass ran
        (from `begin_masks`, if called), else now."""
        if step.masks is None:
            return self.batch.grammars.bitmask(step.draw_rows)
        waited = time.perf_counter()
        masks, step.masks = step.masks.result(), None
        if masks is not None:
            self.batch.grammars.timing.add("wait", len(masks[0]), time.perf_counter() - waited)
        return masks

    def begin_masks(self, step: LaunchedStep) -> None:
        """Starts filling the grammar masks of a step's deferred draw on llguidance's threads (see `launch`);
        call it once the step it was launched behind is finished. The caller prepares the next step
        meanwhile, and `complete` (the next `launch` calls it before its forward pass) takes the masks."""
        if step.deferred_sample is not None and step.masks is None:
            step.masks = self.batch.grammars.bitmask_in_background(step.draw_rows)

    @torch.inference_mode()
    def complete(self, step: LaunchedStep) -> None:
        """Launches a step's deferred draw (constrained rows launched behind another step: see `launch`); call it
        once the step it was launched behind is finished. Nothing to do for any other step."""
        if step.deferred_sample is not None:
            deferred, step.deferred_sample = step.deferred_sample, None
            deferred()

    def finish(self, step: LaunchedStep) -> worker_pb2.StepResult:
        """Waits for a launched step's sampled tokens, writes them into the rows, returns its result."""
        self.complete(step)
        if step.propose_draft_tokens:
            self._proposing_in_flight = False
        timer = self.step_timer
        timer.resume(step.timed_as)
        sampled = step.sampled.wait() if step.sampled is not None else None
        self.runner.device_busy.on_finished(step.kind, step.started,
                                            step.sampled.copied if step.sampled is not None else None)
        if step.pending is not None:
            self.gpu_clock.on_finished(step.timed_as, step.behind_another)
            num_accepted = kept_logprobs = None
            if step.draw_offsets is not None:  # each row's token: its first sampled one that differs from a draft
                taken, num_accepted = self.batch.accepted_drafts(step.draw_rows, step.draw_offsets,
                                                                 sampled[:, 0].astype(np.int64))
                # A kept draft's entries come first in its row's: offsets below the row's kept count.
                num_entries = np.diff(taken - num_accepted, append=len(sampled))
                kept_logprobs = sampled[step.draw_offsets < np.repeat(num_accepted, num_entries), 1]
                sampled = sampled[taken]
            step.result.failed_requests.extend(self.batch.fill(step.pending, sampled[:, 0].astype(np.int64),
                                                               num_accepted))
            timer.mark("wait_for_gpu")
            step.result.sampled.CopyFrom(step.sampled_tokens(sampled, num_accepted, kept_logprobs))
        self.runner.after_sampling(self.batch)  # an EAGLE head's K/V of the step: it needs the tokens
        if step.pending is not None and step.propose_draft_tokens:
            self._propose_drafts(step)
            timer.mark("propose")
        timer.mark("result")
        return step.result

    def _propose_drafts(self, step: LaunchedStep) -> None:
        """The draft model's proposals for the rows that sampled in `step`, now that their tokens are written:
        for rows still held by the same requests that may take drafts (the scheduler ignores the others'), 0
        tokens for the rest (SampledTokens.num_proposed_draft_tokens, parallel to its rows)."""
        batch, pending = self.batch, step.pending
        rows = pending.rows
        eligible = (batch.generation[rows] == pending.generations) & batch.may_take_drafts(rows)
        counts = np.zeros(len(rows), dtype=np.int64)
        counts[eligible], tokens = self.runner.propose_drafts(batch, rows[eligible], step.propose_draft_tokens)
        step.result.sampled.num_proposed_draft_tokens.extend(counts.tolist())
        step.result.sampled.proposed_draft_token_ids.extend(tokens.tolist())

    def grammar_summary(self) -> str:
        """The grammar masks' timing (`GrammarTiming`) for the shutdown log, '' without constrained rows."""
        summary = self.batch.grammars.timing.summary() if self.batch is not None else ""
        return f"; {summary}" if summary else ""

    def can_overlap(self, plan: worker_pb2.StepPlan) -> bool:
        """Whether `plan` may be launched before the step in flight finishes: not when a row it samples reads
        its own earlier tokens on the host (penalties, bad words, logit bias or min_tokens masks), since the
        token in flight is not there yet. A grammar's row may: its draw waits for that token (`complete`).
        Speculative decoding is never overlapped: a row's drafts follow its newest token on the host, a step
        with drafts is verified on the host (`finish`) before any other plan touches the rows, and a draft model
        proposes from the rows once their tokens are written (`finish` again)."""
        batch = self.batch
        if plan.has_draft_tokens or batch.num_rows_with_drafts:  # the latter: the step in flight's, until verified
            return False
        if plan.propose_draft_tokens or self._proposing_in_flight or not self.runner.allows_overlap:
            return False
        for scheduled in plan.scheduled_requests:
            row = batch.row_of(scheduled.request_id)
            if batch.reads_history(row):
                return False
        return True

    def _beam_candidates(self, logits: torch.Tensor, rows: np.ndarray) -> list[worker_pb2.BeamCandidates]:
        """Top log_softmax candidates of each beam row (`logits`: theirs, in `rows` order)."""
        batch = self.batch
        counts = batch.num_beam_candidates[rows]
        values, indices = self.runner.top_logprobs(logits, int(counts.max()))
        return [
            worker_pb2.BeamCandidates(
                request_id=batch.request_id_of(row),
                candidates=[worker_pb2.TokenCandidate(token_id=t, logprob=v) for t, v in zip(ids[:k], vals[:k])],
            )
            for row, k, ids, vals in zip(rows.tolist(), counts.tolist(), indices, values)
        ]
