"""A stand-in for the scheduler's `WorkerLink` that answers every plan at once, for driving the real engine loop
without workers: the scheduler host-time benchmark and the engine's publishing tests.

It reads the encoded plans as a worker does (new rows, scheduled rows, computed counts, finished and preempted
ids, cancels) and samples one token for each row whose computed tokens reached its prompt's end, with
`sample(request_id, position)`, so the answer is a pure function of the plans: two runs that schedule the same
requests get the same tokens whatever the engine publishes when.

`step_s` > 0 makes it a device of fixed speed instead: each step's result is ready `step_s` after the later of
its plan's arrival and the previous step's result (one step at a time, as a GPU runs them), so a stand-in engine
serves at a GPU's pace and its host work (schedule, publish, gRPC) is measured at that pace, not flat out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from protos.pagedserve.v1 import worker_pb2


class InstantWorkerLink:
    """The stand-in link (module docstring): per request the prompt and computed token counts it read from the
    plans, and each step's result until the engine takes it. `on_plan` sees every plan first (tests: count steps,
    act at a request's n-th output)."""

    last_result_wait_s = 0.0  # as WorkerLink's: nothing is ever waited for

    def __init__(self, sample: Callable[[str, int], int], on_plan: Callable[[worker_pb2.StepPlan], None] | None = None,
                 step_s: float = 0.0):
        self._sample = sample
        self._on_plan = on_plan
        self._step_s = step_s
        self._rows: dict[str, list[int]] = {}  # request id -> [num_prompt_tokens, num_computed_tokens]
        self._results: dict[int, worker_pb2.StepResult] = {}
        self._ready_at: dict[int, float] = {}  # step id -> when its result is ready (with step_s only)
        self._device_free_at = 0.0  # when the stand-in device finishes the last step sent (monotonic)

    async def send_plan(self, message: worker_pb2.SchedulerToWorker) -> None:
        plan = message.plan
        if self._on_plan is not None:
            self._on_plan(plan)
        rows = self._rows
        for request_id in (*plan.finished_request_ids, *plan.preempted_request_ids):
            rows.pop(request_id, None)
        sampled_ids, token_ids = [], []
        for new in plan.new_requests:
            rows[new.request_id] = [new.num_prompt_tokens, new.num_computed_tokens]
        for request_id, num_scheduled in (*((new.request_id, new.num_scheduled_tokens) for new in plan.new_requests),
                                          *((entry.request_id, entry.num_scheduled_tokens)
                                            for entry in plan.scheduled_requests)):
            row = rows[request_id]
            row[1] += num_scheduled
            if row[1] >= row[0]:
                sampled_ids.append(request_id)
                token_ids.append(self._sample(request_id, row[1]))
        result = worker_pb2.StepResult(step_id=plan.step_id)
        result.sampled.request_ids.extend(sampled_ids)
        result.sampled.token_ids.extend(token_ids)
        result.sampled.logprobs.extend([-1.0] * len(sampled_ids))
        self._results[plan.step_id] = result
        if self._step_s > 0:
            self._device_free_at = max(self._device_free_at, time.monotonic()) + self._step_s
            self._ready_at[plan.step_id] = self._device_free_at

    async def send_cancels(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._rows.pop(request_id, None)

    async def receive_result(self, step_id: int) -> worker_pb2.StepResult:
        wait = self._ready_at.pop(step_id, 0.0) - time.monotonic()
        await asyncio.sleep(max(wait, 0.0))  # as a real wait does, lets the streams' readers (gRPC handlers) run meanwhile
        return self._results.pop(step_id)
