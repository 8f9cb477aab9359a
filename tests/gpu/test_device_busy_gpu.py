"""The worker's steady-decode busy clock (worker_svc/device_busy.py, `Worker.runner.device_busy`, whose summary
the serving loop logs at shutdown) on CUDA events, through `Worker.execute`:
it counts every decode step that follows a decode step, its busy fraction lies strictly between 0 and 1, and
the idle time it reports between steps holds the time the host kept the GPU waiting: a known sleep between
steps shows up as at least that much idle per step, and no more than the wall time between the steps.
tests/test_device_busy.py checks its arithmetic with fake events; only here do CUDA's events time a step."""

from __future__ import annotations

import re
import time

import pytest

from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from worker_svc.config import WorkerConfig
from worker_svc.worker import Worker

NUM_ROWS = 8
BACK_TO_BACK_STEPS = 16
SLEPT_STEPS = 6
SLEEP_S = 0.05
SUMMARY = re.compile(r"over (\d+) steps \(idle ([\d.]+) ms between steps, span ([\d.]+) ms\)")


def clock_totals(worker: Worker) -> tuple[int, float, float]:
    """(decode steps counted, idle ms, span ms) so far, from the clock's summary line (what the worker logs)."""
    summary = worker.runner.device_busy.summary()
    found = SUMMARY.search(summary)
    assert found, f"the clock measured nothing: {summary!r}"
    steps, idle, span = int(found[1]), float(found[2]), float(found[3])
    return steps, idle * steps, span * steps


def decode_step(step_id: int) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(step_id=step_id, scheduled_requests=[
        worker_pb2.ScheduledRequest(request_id=f"r{i}", num_scheduled_tokens=1) for i in range(NUM_ROWS)])


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=4)
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model), device="cuda", dtype="float32",
                                 num_kv_blocks=64, swap_space=0.01))
    worker.setup(worker_pb2.WorkerSetup(block_size=16, max_num_seqs=NUM_ROWS, max_num_batched_tokens=256,
                                        max_model_len=64))
    return worker


def test_the_busy_clock_counts_decode_steps_and_the_idle_time_between_them(worker):
    prefill = worker_pb2.StepPlan(step_id=0, new_requests=[worker_pb2.NewRequest(
        request_id=f"r{i}", token_ids=[5 + i, 9, 2, 7], block_ids=[2 * i, 2 * i + 1], num_computed_tokens=0,
        num_scheduled_tokens=4, num_prompt_tokens=4,
        sampling=worker_pb2.WorkerSamplingParams(temperature=0.0, top_p=1.0, top_k=-1, seed=i, num_logprobs=-1,
                                                 num_prompt_logprobs=-1)) for i in range(NUM_ROWS)])
    worker.execute(prefill)
    for step_id in range(1, BACK_TO_BACK_STEPS + 1):
        worker.execute(decode_step(step_id))
    steps, idle_ms, span_ms = clock_totals(worker)
    assert steps == BACK_TO_BACK_STEPS - 1, "the first decode step follows a prefill: not counted"
    busy = worker.runner.device_busy.busy_fraction()
    assert 0.0 < busy < 1.0 and span_ms > 0.0 and idle_ms > 0.0, worker.runner.device_busy.summary()

    walls = []
    for step_id in range(BACK_TO_BACK_STEPS + 1, BACK_TO_BACK_STEPS + SLEPT_STEPS + 1):
        started = time.perf_counter()
        time.sleep(SLEEP_S)  # the host keeps the GPU waiting
        worker.execute(decode_step(step_id))
        walls.append(time.perf_counter() - started)
    slept_steps, slept_idle_ms, slept_span_ms = clock_totals(worker)
    assert slept_steps == steps + SLEPT_STEPS
    idle_per_step = (slept_idle_ms - idle_ms) / SLEPT_STEPS
    assert 1e3 * SLEEP_S <= idle_per_step <= 1e3 * max(walls), (
        f"{idle_per_step:.3f} ms idle a step, the host slept {1e3 * SLEEP_S:.0f} ms and each step took at most "
        f"{1e3 * max(walls):.3f} ms of wall time")
    assert worker.runner.device_busy.busy_fraction() < busy, "idle steps must lower the busy fraction"
