"""The requests the scheduler aborted while plans that schedule them were already on their way here.

Why: the scheduler plans up to `max_steps_in_flight` steps ahead, so when a client cancels a long prompt its
next chunks already sit in this worker's inbox. The scheduler's `CancelRequests` message comes behind them;
the IO thread (scheduler_link.py) records its ids here as soon as it arrives, even while the main thread is
in a forward pass, and the main thread drops those requests' rows from each plan before it launches it. An
abort then costs the step running now, not every planned chunk (on the CPU, seconds each).

Who owns what: the IO thread only adds ids, the main thread only drops rows and forgets ids; a set's add,
membership test and discard are each atomic under the GIL, and a race only decides whether one more step
runs the row. An id is forgotten when a plan lists it in `finished_request_ids`: the scheduler reports every
finished request once, after every plan that scheduled it, so the id may then come back as a new request.
Only a single-rank worker drops rows: ranks of a tensor-parallel group would each see the message at their
own step, and their batches must stay equal (`SchedulerLink` is then given no `CancelledRequests`).
"""

from __future__ import annotations

from protos.pagedserve.v1 import worker_pb2


class CancelledRequests:
    def __init__(self) -> None:
        self._request_ids: set[str] = set()

    def add(self, request_ids) -> None:
        """IO thread: the scheduler aborted these requests."""
        self._request_ids.update(request_ids)

    def drop_rows(self, plan: worker_pb2.StepPlan) -> int:
        """Main thread, before launching `plan`: forgets the ids it reports finished, and removes the rows of
        cancelled requests (new and running) from it. Returns how many rows it removed."""
        cancelled = self._request_ids
        for request_id in plan.finished_request_ids:
            cancelled.discard(request_id)
        if not cancelled:
            return 0
        num_dropped = 0
        for rows in (plan.new_requests, plan.scheduled_requests):
            for index in reversed([i for i, row in enumerate(rows) if row.request_id in cancelled]):
                del rows[index]
                num_dropped += 1
        return num_dropped
