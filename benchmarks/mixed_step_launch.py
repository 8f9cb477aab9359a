"""Does launching a step with prefill make the host wait for the GPU? One command on a lent GPU:

    python benchmarks/mixed_step_launch.py [--shape qwen2.5-1.5b]

A real `Worker` (random weights of the shape, bf16, CUDA graphs for decodes) holds 192 decoding requests;
then, with a long step queued on the device first (so that any wait shows), it launches steps that add prompts
(1, 4 and 24 prompts of 512 tokens, each twice) beside the decodes, and reports each launch's host time against the same
step's device time. Every launch runs under torch.cuda.set_sync_debug_mode("warn"): each operation that
synchronizes with the device is listed with the line of ours that called it. JSON to $OUT/mixed_step_launch.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.model_shapes import SHAPES  # noqa: E402
from benchmarks.profile_decode_step import decode_worker, prefill  # noqa: E402
from protos.pagedserve.v1 import worker_pb2  # noqa: E402

DECODES, PROMPT = 192, 512


def mixed_plan(step_id: int, decoding: list[str], num_prompts: int, tag: str) -> worker_pb2.StepPlan:
    plan = worker_pb2.StepPlan(step_id=step_id)
    for request_id in decoding:
        plan.scheduled_requests.append(worker_pb2.ScheduledRequest(request_id=request_id, num_scheduled_tokens=1))
    for i in range(num_prompts):
        plan.new_requests.append(worker_pb2.NewRequest(
            request_id=f"{tag}{i}", token_ids=[(i * 11 + j) % 1000 + 3 for j in range(PROMPT)], num_prompt_tokens=PROMPT,
            sampling=worker_pb2.WorkerSamplingParams(temperature=0.0, top_p=1.0, top_k=-1, num_logprobs=-1,
                                                     num_prompt_logprobs=-1, seed=i),
            block_ids=[DECODES * 48 + i * 32 + b for b in range(32)], num_computed_tokens=0,
            num_scheduled_tokens=PROMPT))
    return plan


def our_frame(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of this repository's code that led to a synchronizing call."""
    root = str(Path(__file__).resolve().parent.parent)
    ours = [f for f in stack if f.filename.startswith(root) and "benchmarks/" not in f.filename]
    frame = ours[-1] if ours else stack[-1]
    return f"{Path(frame.filename).relative_to(root) if frame.filename.startswith(root) else frame.filename}:{frame.lineno} {frame.line}"


def profile_launch(worker, decode_step, decoding: list[str], step_ids) -> None:
    """cProfile of one warm launch of a step with 4 prompts beside the decodes (host time by function)."""
    import cProfile
    import pstats

    decode_step()
    plan = mixed_plan(next(step_ids), decoding, 4, "profiled_")
    profiler = cProfile.Profile()
    profiler.enable()
    launched = worker.launch(plan)
    profiler.disable()
    worker.finish(launched)
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--cprofile", action="store_true", help="also print where a warm launch's host time goes")
    args = parser.parse_args()
    worker = decode_worker(args.shape, DECODES + 64)  # 48 blocks per request: prompts use those past the decodes'
    decode_step, decoding = prefill(worker, DECODES, PROMPT)
    step_ids = itertools.count(1000)
    results = []
    for round_index, num_prompts in enumerate((1, 4, 24, 1, 4, 24)):
        # Something long on the device first: a decode step, then a big matmul, so a synchronizing launch waits.
        decode_step()
        big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(20):
            big = big @ big / 90.0
        plan = mixed_plan(next(step_ids), decoding, num_prompts, f"p{round_index}_")
        syncs: list[str] = []
        original = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            syncs.append(f"{message} <- {our_frame(traceback.extract_stack()[:-1])}")

        torch.cuda.set_sync_debug_mode("warn")
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                launched = worker.launch(plan)
            launch_s = time.perf_counter() - started
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = original
        worker.finish(launched)
        total_s = time.perf_counter() - started
        finish_plan = worker_pb2.StepPlan(step_id=next(step_ids),
                                          finished_request_ids=[r.request_id for r in plan.new_requests])
        worker.execute(finish_plan)
        row = {"prompts": num_prompts, "tokens": DECODES + num_prompts * PROMPT, "launch_ms": 1e3 * launch_s,
               "launch_to_result_ms": 1e3 * total_s, "syncs": sorted(set(syncs)), "num_syncs": len(syncs),
               "warm": round_index >= 3}
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.cprofile:
        profile_launch(worker, decode_step, decoding, step_ids)
    out = Path(os.environ.get("OUT", ".")) / "mixed_step_launch.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "shape": args.shape, "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
