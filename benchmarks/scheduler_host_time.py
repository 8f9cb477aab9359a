"""The scheduler's host time per step at 256 running requests in steady decode, on the CPU, no worker.

Drives the serving code path itself: `Engine.run` (schedule, encode the plan to its protobuf, update from the
decoded `StepResult`, publish: detokenizing, stop-string checks, the streams' paced queues, drained by one
reader task per stream as the gRPC handlers drain them) with an instant stand-in for the `WorkerLink`. The
stand-in reads the encoded plans as a worker does (rows, computed counts, finished and preempted ids) and
answers each step at once with a StepResult sampling one plausible token (a word-ish id of the embedded
model's vocabulary) for every row that reached the end of its prompt (pagedserve/testing/instant_worker_link.py).
Everything but the GPU is real, so the engine's step timers measure what they measure while serving; by
default on the loop thread's CPU time (`--clock cpu`), since wall time on a shared machine measures the other
processes too.

Reported: the step timers' per-phase mean (ms) over the steady window (every plan from the first one that
decodes all `--requests` rows to the last), the median of `--runs` runs, as JSON.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/scheduler_host_time.py --runs 5 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import random
import statistics
import sys
import time

from pagedserve.testing.instant_worker_link import InstantWorkerLink
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_limits import SchedulerLimits
from scheduler_svc.core.validated_request import ValidatedRequest
from scheduler_svc.engine import Engine
from scheduler_svc.groups.request_group import StreamEnd
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model
from service_runtime.step_timer import StepTimer

PHASES = ("schedule", "encode", "update", "publish")
# The service's defaults for what shapes the loop (--max-steps-in-flight, --stream-messages-per-step).
SERVING_DEFAULTS = {field.name: field.default for field in dataclasses.fields(SchedulerConfig)}
# Never produced by the sampled ids below, so every request runs to max_tokens, yet checked every step.
STOP_STRINGS = ("<<end of answer>>",)


class SteadyWindow:
    """Snapshots of the engine's step timer at the first and the last plan that decode every request."""

    def __init__(self, num_requests: int) -> None:
        self.num_requests = num_requests
        self.engine: Engine | None = None
        self.first: tuple[int, dict[str, float], float] | None = None
        self.last: tuple[int, dict[str, float], float] | None = None

    def on_plan(self, plan) -> None:
        steady = (not plan.new_requests and len(plan.scheduled_requests) == self.num_requests
                  and all(entry.num_scheduled_tokens == 1 for entry in plan.scheduled_requests))
        if steady:
            snapshot = (*self.engine.step_timer.totals(), time.perf_counter())
            if self.first is None:
                self.first = snapshot
            self.last = snapshot

    def per_step_ms(self) -> dict[str, float]:
        (steps0, totals0, wall0), (steps1, totals1, wall1) = self.first, self.last
        steps = steps1 - steps0
        if steps < 10:
            raise RuntimeError(f"only {steps} steady steps: too few to measure")
        out = {phase: 1e3 * (totals1.get(phase, 0.0) - totals0.get(phase, 0.0)) / steps for phase in totals1}
        out["wall"] = 1e3 * (wall1 - wall0) / steps
        out["steps"] = steps
        return out


def word_token_pool(tokenizer, size: int = 4000) -> list[int]:
    """Ids of the vocabulary's ordinary words (letters, most with a leading space), as text sampling gives."""
    pool = []
    for token_id in range(200, tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if text.strip().isalpha() and text.isascii():
            pool.append(token_id)
            if len(pool) == size:
                break
    return pool


async def one_run(tokenizer, token_pool, args) -> dict[str, float]:
    block_size = 16
    max_model_len = args.prompt_len + args.max_tokens
    blocks_per_request = -(-max_model_len // block_size)
    scheduler = Scheduler(
        SchedulerLimits(args.requests, args.max_num_batched_tokens, max_model_len),
        BlockManager(block_size=block_size, num_gpu_blocks=args.requests * blocks_per_request + 64, num_cpu_blocks=0),
        max_steps_in_flight=SERVING_DEFAULTS["max_steps_in_flight"],
    )
    window = SteadyWindow(args.requests)
    sampler = random.Random(0)
    link = InstantWorkerLink(lambda request_id, position: sampler.choice(token_pool), window.on_plan)
    engine = Engine(scheduler, link, tokenizer, eos_token_ids=(2,), seed=0,
                    max_messages_per_step=args.stream_messages_per_step)
    if args.clock == "cpu":  # the loop thread's CPU time: what the phases cost, not how long others held the core
        engine.step_timer = StepTimer("scheduler", clock=time.thread_time)
    window.engine = engine
    rng = random.Random(1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=STOP_STRINGS)
    received = []

    async def read_stream(queue):
        num_tokens = 0
        while not isinstance(item := await queue.get(), StreamEnd):
            if isinstance(item, BaseException):
                raise item
            num_tokens += len(item.token_ids)
        received.append(num_tokens)

    readers = []
    for i in range(args.requests):
        prompt = rng.choices(token_pool, k=args.prompt_len)
        queue, _ = engine.submit(f"r{i}", ValidatedRequest(prompt_token_ids=prompt, sampling_params=params))
        readers.append(asyncio.create_task(read_stream(queue)))
    gc.freeze()
    loop = asyncio.create_task(engine.run())
    await asyncio.gather(*readers)
    loop.cancel()
    try:
        await loop
    except asyncio.CancelledError:
        pass
    if received != [args.max_tokens] * args.requests:
        raise RuntimeError("a stream did not receive every token")
    return window.per_step_ms()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--stream-messages-per-step", type=int, default=SERVING_DEFAULTS["stream_messages_per_step"],
                        help="as the service's flag (stream pacing: each stream is flushed every k-th step)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="time the phases by the loop thread's CPU time (default: robust on a busy machine) "
                             "or by wall time, as the serving engine's timers do")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model(None).path)
    token_pool = word_token_pool(tokenizer)
    runs = []
    for index in range(args.runs):
        runs.append(asyncio.run(one_run(tokenizer, token_pool, args)))
        print(f"run {index}: " + " ".join(f"{k}={v:.3f}" for k, v in runs[-1].items()), file=sys.stderr)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    report = {
        "clock": args.clock,
        "what": f"scheduler host time per steady decode step, {args.requests} running requests, "
                f"{args.prompt_len}-token prompts, {args.max_tokens} outputs, embedded model's tokenizer, "
                f"stop strings checked, instant stand-in worker, {args.stream_messages_per_step} stream messages "
                "per step",
        "phases_ms_median": {phase: round(median[phase], 4) for phase in PHASES if phase in median},
        "sum_of_phases_ms_median": round(statistics.median(sum(run.get(p, 0.0) for p in PHASES) for run in runs), 4),
        "all_timers_ms_median": {key: round(value, 4) for key, value in median.items()},
        "runs": runs,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
