"""The engine's plan encoder (`plan_codec.StepPlanEncoder`): plans whose rows are plain decodes (taken from the wire
bytes it keeps per request) mixed with every other kind of row come out exactly as the rows built one by one,
in order, plan after plan, including a request id that finishes and comes back with another kind of row."""

from __future__ import annotations

import random

from protos.pagedserve.v1 import worker_pb2
from scheduler_svc.core.scheduler_output import ScheduledRequestData, SchedulerOutput
from scheduler_svc.worker_io.plan_codec import StepPlanEncoder


def row_by_row(output: SchedulerOutput) -> worker_pb2.StepPlan:
    """The StepPlan's scheduled rows as the worker must read them, each built from its fields."""
    plan = worker_pb2.StepPlan(step_id=output.step_id, finished_request_ids=output.finished_request_ids,
                               preempted_request_ids=output.preempted_request_ids)
    for data in output.scheduled_requests:
        plan.scheduled_requests.append(worker_pb2.ScheduledRequest(
            request_id=data.request_id, new_block_ids=data.new_block_ids,
            num_scheduled_tokens=data.num_scheduled_tokens, new_token_ids=data.new_token_ids,
            replaced_blocks=[worker_pb2.BlockReplacement(index=i, block_id=b) for i, b in data.replaced_blocks],
            draft_token_ids=data.draft_token_ids))
        plan.has_draft_tokens |= bool(data.draft_token_ids)
    return plan


def random_row(rng: random.Random, request_id: str) -> ScheduledRequestData:
    kind = rng.choices(["plain", "new_block", "copy", "drafts", "beam_token", "chunk"], [12, 2, 1, 1, 1, 1])[0]
    if kind == "plain":
        return ScheduledRequestData(request_id, (), 1)
    if kind == "new_block":
        return ScheduledRequestData(request_id, (rng.randrange(1000),), 1)
    if kind == "copy":
        return ScheduledRequestData(request_id, (), 1, replaced_blocks=((rng.randrange(8), rng.randrange(1000)),))
    if kind == "drafts":
        drafts = tuple(rng.randrange(50) for _ in range(rng.randint(1, 3)))
        return ScheduledRequestData(request_id, (), 1 + len(drafts), draft_token_ids=drafts)
    if kind == "beam_token":
        return ScheduledRequestData(request_id, (), 1, new_token_ids=(rng.randrange(50),))
    return ScheduledRequestData(request_id, (), rng.randint(2, 9))  # a prefill chunk of a row the worker holds


def test_plans_with_plain_decode_rows_encode_as_built_row_by_row():
    rng = random.Random(7)
    encoder = StepPlanEncoder()
    live = [f"r{i}" for i in range(20)]
    num_plain = 0
    for step_id in range(300):
        finished = tuple(rng.sample(live, rng.choice([0, 0, 0, 1, 2])))  # ids come back: the pool is fixed
        rows = tuple(random_row(rng, request_id) for request_id in rng.sample(live, rng.randint(0, len(live))))
        num_plain += sum(row == ScheduledRequestData(row.request_id, (), 1) for row in rows)
        output = SchedulerOutput(step_id=step_id, new_requests=(), scheduled_requests=rows,
                                 finished_request_ids=finished, preempted_request_ids=(), swap_out=(), swap_in=(),
                                 copy=(), total_num_scheduled_tokens=sum(r.num_scheduled_tokens for r in rows))
        assert encoder.encode(output).plan == row_by_row(output), step_id
    assert num_plain > 1000
