"""The worker's record of aborted requests (worker_svc/cancelled_requests.py): their new and running rows are
dropped from every plan until one lists them as finished; then the id may come back as a new request."""

from __future__ import annotations

from protos.pagedserve.v1 import worker_pb2
from worker_svc.cancelled_requests import CancelledRequests


def _plan(new=(), scheduled=(), finished=()) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(
        new_requests=[worker_pb2.NewRequest(request_id=r, num_scheduled_tokens=8) for r in new],
        scheduled_requests=[worker_pb2.ScheduledRequest(request_id=r, num_scheduled_tokens=1) for r in scheduled],
        finished_request_ids=list(finished))


def test_cancelled_rows_are_dropped_until_a_plan_reports_the_request_finished():
    cancelled = CancelledRequests()
    cancelled.add(["a"])
    plan = _plan(new=["a", "b"], scheduled=["c", "a"])
    assert cancelled.drop_rows(plan) == 2
    assert [r.request_id for r in plan.new_requests] == ["b"]
    assert [r.request_id for r in plan.scheduled_requests] == ["c"]
    assert cancelled.drop_rows(_plan(scheduled=["a"])) == 1  # a later chunk of the same request
    reused = _plan(new=["a"], finished=["a"])  # reported finished: "a" is a new request again
    assert cancelled.drop_rows(reused) == 0 and [r.request_id for r in reused.new_requests] == ["a"]
