"""Translation between the scheduler's typed step output and the worker wire schema (protos/.../worker.proto).

The only place that knows both shapes: the scheduler core stays free of protobuf, the worker free of the
scheduler's classes.
"""

from __future__ import annotations

from protos.pagedserve.v1 import worker_pb2
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import SchedulerOutput
from scheduler_svc.core.scheduler_output import NewRequestData
from scheduler_svc.core.step_outcome import StepOutcome
from scheduler_svc.core.token_logprobs import PromptLogprobChunk, TokenLogprob


class StepPlanEncoder:
    """Encodes the engine's plans, one after another.

    Why a class: steady decode sends the same row for a request every step (its id, one token, nothing else:
    `ScheduledRequestData` of a plain decode), and building hundreds of protobuf messages per step cost more
    than the rest of the encoding. The encoder keeps each such row's wire bytes (a `scheduled_requests` field
    of StepPlan), made once per request, and a run of them enters the plan as one parse of their concatenation
    (protobuf appends a repeated field's entries in the order they are parsed). Owned by the engine loop; a
    request's bytes are dropped when a plan lists it finished or preempted."""

    def __init__(self) -> None:
        self._plain_decode_rows: dict[str, bytes] = {}

    def encode(self, output: SchedulerOutput) -> worker_pb2.SchedulerToWorker:
        message = worker_pb2.SchedulerToWorker()
        plan = message.plan  # filled in place: wrapping a finished StepPlan would copy it whole
        plan.SetInParent()  # the oneof is `plan` even for a plan whose fields are all defaults
        plan.step_id = output.step_id
        plan.propose_draft_tokens = output.propose_draft_tokens
        plan.finished_request_ids.extend(output.finished_request_ids)
        plan.preempted_request_ids.extend(output.preempted_request_ids)
        plain_rows = self._plain_decode_rows
        for request_id in (*output.finished_request_ids, *output.preempted_request_ids):
            plain_rows.pop(request_id, None)
        for moves, pairs in ((plan.swap_out, output.swap_out), (plan.swap_in, output.swap_in),
                             (plan.copy, output.copy)):
            for src, dst in pairs:
                moves.add(src=src, dst=dst)
        for load in output.lora_loads:
            plan.lora_loads.add(slot=load.slot, name=load.name, path=load.path, generation=load.generation)
        for new in output.new_requests:
            plan.new_requests.append(
                worker_pb2.NewRequest(
                    request_id=new.request_id,
                    token_ids=new.token_ids,
                    sampling=_worker_sampling(new),
                    block_ids=new.block_ids,
                    num_computed_tokens=new.num_computed_tokens,
                    num_scheduled_tokens=new.num_scheduled_tokens,
                    num_prompt_tokens=new.num_prompt_tokens,
                    lora_slot=new.lora_slot,
                )
            )
        scheduled = plan.scheduled_requests
        run: list[bytes] = []  # wire bytes of the plain decodes since the last other row
        for cached in output.scheduled_requests:
            if cached.num_scheduled_tokens == 1 and not (
                cached.new_block_ids or cached.new_token_ids or cached.replaced_blocks or cached.draft_token_ids
            ):
                row = plain_rows.get(cached.request_id)
                if row is None:
                    row = plain_rows[cached.request_id] = worker_pb2.StepPlan(scheduled_requests=[
                        worker_pb2.ScheduledRequest(request_id=cached.request_id, num_scheduled_tokens=1)
                    ]).SerializeToString()
                run.append(row)
                continue
            if run:
                plan.MergeFromString(b"".join(run))
                run = []
            # Built in place (add, not append: no copy), repeated fields only when there is something in them.
            entry = scheduled.add(request_id=cached.request_id, num_scheduled_tokens=cached.num_scheduled_tokens)
            if cached.new_block_ids:
                entry.new_block_ids.extend(cached.new_block_ids)
            if cached.new_token_ids:
                entry.new_token_ids.extend(cached.new_token_ids)
            for index, block_id in cached.replaced_blocks:
                entry.replaced_blocks.add(index=index, block_id=block_id)
            if cached.draft_token_ids:
                entry.draft_token_ids.extend(cached.draft_token_ids)
                plan.has_draft_tokens = True
        if run:
            plan.MergeFromString(b"".join(run))
        return message


def encode_step_plan(output: SchedulerOutput) -> worker_pb2.SchedulerToWorker:
    """One plan, on its own (the engine keeps a `StepPlanEncoder` across its plans)."""
    return StepPlanEncoder().encode(output)


def _worker_sampling(new: NewRequestData) -> worker_pb2.WorkerSamplingParams:
    params: SamplingParams = new.sampling_params
    assert params.seed is not None, "the engine seeds every request at admission"
    min_tokens_masked = params.stop_token_ids + (() if params.ignore_eos else new.eos_token_ids)
    return worker_pb2.WorkerSamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed,
        num_beam_candidates=new.num_beam_candidates,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=[worker_pb2.LogitBias(token_id=t, bias=b) for t, b in params.logit_bias],
        min_tokens=params.min_tokens,
        min_tokens_masked_ids=sorted(set(min_tokens_masked)) if params.min_tokens else [],
        bad_words=[worker_pb2.BadWord(token_ids=ids) for ids in params.bad_words_token_ids],
        num_logprobs=-1 if params.logprobs is None else params.logprobs,
        num_prompt_logprobs=-1 if params.prompt_logprobs is None else params.prompt_logprobs,
        structured_grammar=params.structured_grammar,
        structured_grammar_after_token_id=params.structured_grammar_after_token_id,
    )


def decode_step_result(result: worker_pb2.StepResult) -> StepOutcome:
    sampled = result.sampled
    request_ids, token_ids, logprobs = list(sampled.request_ids), list(sampled.token_ids), list(sampled.logprobs)
    return StepOutcome(
        sampled=dict(zip(request_ids, token_ids)),
        logprobs=dict(zip(request_ids, logprobs)),
        beam_candidates={
            b.request_id: [(c.token_id, c.logprob) for c in b.candidates] for b in result.beam_candidates
        },
        token_logprobs=_token_logprobs(sampled, request_ids, token_ids, logprobs),
        prompt_logprobs={
            p.request_id: PromptLogprobChunk(
                p.first_position, tuple(TokenLogprob(t.token_id, t.logprob, t.rank, _top(t.top)) for t in p.tokens)
            )
            for p in result.prompt_logprobs
        },
        failed={f.request_id: f.reason for f in result.failed_requests},
        # Parallel to request_ids when some row had drafts; rows that accepted none are left out.
        accepted_drafts={rid: count for rid, count in zip(request_ids, sampled.num_accepted_drafts) if count},
        accepted_draft_logprobs=_accepted_draft_logprobs(sampled, request_ids),
        proposed_drafts=_proposed_drafts(sampled, request_ids),
    )


def _accepted_draft_logprobs(sampled: worker_pb2.SampledTokens, request_ids: list[str]) -> dict[str, tuple]:
    """Each row's slice of the flat kept drafts' logprobs (num_accepted_drafts of them, row after row)."""
    return _row_slices(sampled.accepted_draft_logprobs, request_ids, sampled.num_accepted_drafts)


def _proposed_drafts(sampled: worker_pb2.SampledTokens, request_ids: list[str]) -> dict[str, tuple[int, ...]]:
    """Each row's slice of the flat proposed draft tokens (num_proposed_draft_tokens of them, row after row)."""
    return _row_slices(sampled.proposed_draft_token_ids, request_ids, sampled.num_proposed_draft_tokens)


def _row_slices(flat_values, request_ids: list[str], counts) -> dict[str, tuple]:
    """A flat list cut into its rows' runs (`counts[i]` values for row i, row after row); rows with none left
    out."""
    if not flat_values:
        return {}
    flat, out, start = list(flat_values), {}, 0
    for request_id, count in zip(request_ids, counts):
        if count:
            out[request_id] = tuple(flat[start : start + count])
            start += count
    return out


def _token_logprobs(sampled: worker_pb2.SampledTokens, request_ids: list[str], token_ids: list[int],
                    logprobs: list[float]) -> dict[str, TokenLogprob]:
    """The rows that asked for logprobs (rank >= 1), each with its slice of the flat top lists."""
    top_ids, top_logprobs = list(sampled.top_token_ids), list(sampled.top_logprobs)
    out, start = {}, 0
    for i, (rank, num_top) in enumerate(zip(sampled.ranks, sampled.num_top)):
        if rank:
            end = start + num_top
            out[request_ids[i]] = TokenLogprob(token_ids[i], logprobs[i], rank,
                                               tuple(zip(top_ids[start:end], top_logprobs[start:end])))
        start += num_top
    return out


def _top(candidates) -> tuple[tuple[int, float], ...]:
    return tuple((c.token_id, c.logprob) for c in candidates)
