"""Where a decode step's time goes inside the worker: drives a real `Worker` (no scheduler, no sockets) with
synthetic plans (B requests, PROMPT tokens each, prefilled, then decode steps) under torch.profiler, and
prints the top GPU kernels and host ops plus wall time per decode step.

    python benchmarks/profile_decode_step.py --shape qwen2.5-1.5b --batch 256
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.model_shapes import SHAPES, write_config_dir  # noqa: E402
from protos.pagedserve.v1 import worker_pb2  # noqa: E402
from worker_svc.config import WorkerConfig  # noqa: E402
from worker_svc.worker import Worker  # noqa: E402


def prefilled_worker(shape: str, batch: int, prompt: int, cuda_graphs: bool = True, num_kv_blocks: int | None = None,
                     spread: bool = False, overlap: bool = False):
    """A real `Worker` (random weights of `shape`, bf16, CUDA) holding `batch` greedy requests of `prompt`
    tokens, prefilled; returns a function that runs one decode step over all of them. With `overlap`, each
    call launches a step and then finishes the previous one, as the serving loop does with the scheduler
    planning ahead (call `torch.cuda.synchronize()` after the last)."""
    worker = decode_worker(shape, batch, cuda_graphs, num_kv_blocks)
    return prefill(worker, batch, prompt, spread=spread, overlap=overlap)[0]


def decode_worker(shape: str, batch: int, cuda_graphs: bool = True, num_kv_blocks: int | None = None) -> Worker:
    """A real `Worker` (random weights of `shape`, bf16, CUDA) set up for `batch` requests of up to 768 tokens."""
    model_dir = write_config_dir(shape, Path(tempfile.mkdtemp()) / shape)
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model_dir), device="cuda", dtype="bfloat16",
                                 load_format="dummy", swap_space=0.1, num_kv_blocks=num_kv_blocks or batch * 48,
                                 cuda_graphs=cuda_graphs))
    worker.setup(worker_pb2.WorkerSetup(block_size=16, max_num_seqs=batch, max_num_batched_tokens=16384,
                                        max_model_len=1024))
    gc.freeze()  # as the serving loop does after setup: full collections then skip the model's objects
    return worker


def prefill(worker: Worker, batch: int, prompt: int, sampling: dict | None = None, spread: bool = False,
            overlap: bool = False, replaces: Sequence[str] = (),
            tag: str = "r") -> tuple[Callable[[], None], list[str]]:
    """Adds `batch` requests of `prompt` tokens (sampling: WorkerSamplingParams fields; default greedy; request
    i gets seed i), finishing the requests in `replaces` in the same plan, and prefills them in one step;
    returns a function that runs one decode step over them (see `prefilled_worker`), and their ids."""
    blocks_per_request = 48
    fields = {**dict(temperature=0.0, top_p=1.0, top_k=-1, num_logprobs=-1, num_prompt_logprobs=-1), **(sampling or {})}
    step_ids = itertools.count(1)  # the worker only echoes them
    plan = worker_pb2.StepPlan(step_id=next(step_ids), finished_request_ids=list(replaces))
    request_ids = [f"{tag}{i}" for i in range(batch)]
    for i, request_id in enumerate(request_ids):
        plan.new_requests.append(worker_pb2.NewRequest(
            request_id=request_id, token_ids=[(i * 7 + j) % 1000 + 3 for j in range(prompt)], num_prompt_tokens=prompt,
            sampling=worker_pb2.WorkerSamplingParams(seed=i, **fields),
            block_ids=[(b * batch + i) if spread else i * blocks_per_request + b for b in range(blocks_per_request)],
            num_computed_tokens=0, num_scheduled_tokens=prompt))
    worker.execute(plan)  # prefill all at once
    in_flight = None

    def decode_step():
        nonlocal in_flight
        decode = worker_pb2.StepPlan(step_id=next(step_ids))
        for request_id in request_ids:
            decode.scheduled_requests.append(worker_pb2.ScheduledRequest(request_id=request_id, num_scheduled_tokens=1))
        if not overlap:
            worker.execute(decode)
            return
        launched = worker.launch(decode, previous=in_flight)
        if in_flight is not None:
            worker.finish(in_flight)
        in_flight = launched

    return decode_step, request_ids


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: 48 per request")
    parser.add_argument("--spread", action="store_true", help="spread each request's blocks over the pool")
    parser.add_argument("--overlap", action="store_true", help="launch each step before finishing the previous")
    args = parser.parse_args()
    decode_step = prefilled_worker(args.shape, args.batch, args.prompt, cuda_graphs=not args.no_cuda_graphs,
                                   num_kv_blocks=args.num_kv_blocks, spread=args.spread, overlap=args.overlap)
    for _ in range(5):
        decode_step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        decode_step()
    torch.cuda.synchronize()
    print(f"decode step wall: {(time.perf_counter() - start) / 20 * 1e3:.2f} ms at batch {args.batch}"
          f"{' (overlapped)' if args.overlap else ''}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(5):
            decode_step()
        torch.cuda.synchronize()
    table = profiler.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    print(table)
    print(profiler.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
