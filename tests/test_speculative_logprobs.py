"""Speculative decoding's logprobs on the scheduler side: a step that keeps drafts reports a logprob for each
kept draft (SampledTokens.accepted_draft_logprobs), and the request groups put one logprob per token in each
message and add every one of them to the cumulative logprob, so both equal those of the run without
speculation (streamed, best_of ranking, a stop token inside an accepted run). Pure Python: the scheduler and a
fake worker that verifies drafts; its results go through the wire codec."""

from __future__ import annotations

import pytest

from protos.pagedserve.v1 import worker_pb2
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerLimits
from scheduler_svc.groups.request_group import GroupContext, ParallelSampling, SingleSequence, StreamEnd
from scheduler_svc.core.speculative_config import SpeculativeConfig
from scheduler_svc.worker_io.plan_codec import decode_step_result
from tests.fake_worker import FakeWorker
from tests.test_scheduler_speculative import cyclic_model

PROMPT = [11, 12, 13, 14, 15, 11, 12]


def logprob_at(position: int) -> float:
    """The fake model's logprob of the token at a position (any value that differs by position)."""
    return -1.0 / (position + 3)


def wire_result(worker: FakeWorker, sampled: dict[str, int]) -> worker_pb2.StepResult:
    """The worker's answer as it crosses the wire: each row's token, its logprob, and its kept drafts'."""
    result = worker_pb2.StepResult()
    out = result.sampled
    for request_id, token_id in sampled.items():
        end = len(worker.rows[request_id].token_ids) - 1  # the sampled token's position, after its kept drafts
        kept = worker.accepted_drafts.get(request_id, 0)
        out.request_ids.append(request_id)
        out.token_ids.append(token_id)
        out.logprobs.append(logprob_at(end))
        out.accepted_draft_logprobs.extend(logprob_at(p) for p in range(end - kept, end))
    if worker.accepted_drafts:
        out.num_accepted_drafts.extend(worker.accepted_drafts.get(r, 0) for r in sampled)
    return result


def serve(group_type, params: SamplingParams, speculative: bool):
    """Runs one group to its end; returns its messages and the number of drafts its requests kept."""
    spec = SpeculativeConfig(3, 3, 1, 8) if speculative else None
    scheduler = Scheduler(SchedulerLimits(8, 64, 256), BlockManager(4, 64, 0), speculative=spec)
    worker = FakeWorker(4, 64, 0, model=cyclic_model)
    context = GroupContext(scheduler, None, {})
    group = group_type("g", Request("g", list(PROMPT), params, eos_token_ids=(0,)), context)
    group.start()
    num_kept = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        sampled = worker.execute(output)
        outcome = decode_step_result(wire_result(worker, sampled))
        num_kept += sum(outcome.accepted_drafts.values())
        for request in scheduler.update_from_output(output, outcome.sampled, outcome.accepted_drafts):
            owner = context.owners.get(request.request_id)
            if owner is not None:
                owner.on_step(request, outcome)
    group.queue.flush()
    messages = []
    while not group.queue.empty():
        messages.append(group.queue.get_nowait())
    assert isinstance(messages.pop(), StreamEnd)
    return messages, num_kept


@pytest.mark.parametrize("group_type, params", [
    (SingleSequence, SamplingParams(max_tokens=20, seed=1)),
    (SingleSequence, SamplingParams(max_tokens=40, seed=1, stop_token_ids=(15,), min_tokens=7)),
    (ParallelSampling, SamplingParams(max_tokens=20, seed=1, n=2)),
    (ParallelSampling, SamplingParams(max_tokens=20, seed=1, n=1, best_of=2)),
], ids=["single", "stop-token-inside-a-run", "n2-streamed", "best-of-2"])
def test_messages_carry_one_logprob_per_token_and_the_cumulative_logprob_of_no_speculation(group_type, params):
    plain, _ = serve(group_type, params, speculative=False)
    speculative, num_kept = serve(group_type, params, speculative=True)
    assert num_kept > 0  # (with the stop token: 3 drafts kept, of which the request takes the first, the stop)
    for messages in (plain, speculative):
        assert all(len(m.logprobs) == len(m.token_ids) for m in messages)

    def whole(messages):
        """Per sequence: its tokens, their logprobs and its final cumulative logprob."""
        out = {}
        for m in messages:
            tokens, logprobs, _ = out.get(m.index, ((), (), None))
            out[m.index] = (tokens + m.token_ids, logprobs + m.logprobs,
                            m.cumulative_logprob if m.finish_reason is not None else None)
        return out

    assert whole(speculative) == whole(plain)
    for tokens, logprobs, cumulative in whole(plain).values():
        assert cumulative == pytest.approx(sum(logprobs)) and len(logprobs) == len(tokens)
