"""Where a decode step's time goes inside the worker: drives a real `Worker` (no scheduler, no sockets) with
synthetic plans (B requests, PROMPT tokens each, prefilled, then decode steps) under torch.profiler, and
prints the top GPU kernels and host ops plus wall time per decode step. With `--tensor-parallel-size N` it
runs one such worker per GPU (ranks of one NCCL group, each fed the same plans, as the scheduler does), profiles
rank 0, and reports the collectives' (NCCL kernels') share of a decode step's GPU time and of its wall time;
`--json PATH` writes those figures.

    python benchmarks/profile_decode_step.py --shape qwen2.5-1.5b --batch 256 [--tensor-parallel-size 2]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import socket
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
                     spread: bool = False, overlap: bool = False, rank: int = 0, world_size: int = 1,
                     init_method: str | None = None, custom_all_reduce: bool = True, batch_invariant: bool = False,
                     draft_tokens: int = 0, **worker_options):
    """A real `Worker` (random weights of `shape`, bf16, CUDA; `worker_options`: more WorkerConfig fields, such as
    quantization="fp8" or kv_cache_dtype="fp8") holding `batch` greedy requests of `prompt`
    tokens, prefilled; returns a function that runs one decode step over all of them. With `overlap`, each
    call launches a step and then finishes the previous one, as the serving loop does with the scheduler
    planning ahead (call `torch.cuda.synchronize()` after the last). `rank` of `world_size` (meeting at
    `init_method`) makes it one tensor-parallel rank on cuda:rank; every rank must be fed the same steps."""
    # Room for a verification step's rows x (1 + drafts) one-token decodes, as a serving engine's max_num_seqs
    # leaves them: the step then runs through the decode graphs, as it does when serving.
    worker = decode_worker(shape, batch * (1 + draft_tokens), cuda_graphs, num_kv_blocks or batch * 48, rank,
                           world_size, init_method, custom_all_reduce, batch_invariant, **worker_options)
    return prefill(worker, batch, prompt, spread=spread, overlap=overlap, draft_tokens=draft_tokens)[0]


def decode_worker(shape: str, batch: int, cuda_graphs: bool = True, num_kv_blocks: int | None = None,
                  rank: int = 0, world_size: int = 1, init_method: str | None = None,
                  custom_all_reduce: bool = True, batch_invariant: bool = False, **worker_options) -> Worker:
    """A real `Worker` (random weights of `shape`, bf16, CUDA) set up for `batch` requests of up to 768 tokens."""
    model_dir = write_config_dir(shape, Path(tempfile.mkdtemp()) / shape)
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model_dir), device=f"cuda:{rank}", dtype="bfloat16",
                                 load_format="dummy", swap_space=0.1, num_kv_blocks=num_kv_blocks or batch * 48,
                                 cuda_graphs=cuda_graphs, rank=rank, world_size=world_size,
                                 distributed_init_method=init_method, custom_all_reduce=custom_all_reduce,
                                 batch_invariant=batch_invariant, **worker_options))
    worker.setup(worker_pb2.WorkerSetup(block_size=16, max_num_seqs=batch, max_num_batched_tokens=16384,
                                        max_model_len=1024))
    gc.freeze()  # as the serving loop does after setup: full collections then skip the model's objects
    return worker


def prefill(worker: Worker, batch: int, prompt: int, sampling: dict | None = None, spread: bool = False,
            overlap: bool = False, replaces: Sequence[str] = (), tag: str = "r",
            draft_tokens: int = 0) -> tuple[Callable[[], None], list[str]]:
    """Adds `batch` requests of `prompt` tokens (sampling: WorkerSamplingParams fields; default greedy; request
    i gets seed i), finishing the requests in `replaces` in the same plan, and prefills them in one step;
    returns a function that runs one decode step over them (see `prefilled_worker`), and their ids. With
    `draft_tokens` d, each decode step verifies d speculative draft tokens per request (a step with drafts, as
    the speculative scheduler plans it: random weights reject them, so each step still adds one token)."""
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
        decode = worker_pb2.StepPlan(step_id=next(step_ids), has_draft_tokens=draft_tokens > 0)
        for request_id in request_ids:
            decode.scheduled_requests.append(worker_pb2.ScheduledRequest(
                request_id=request_id, num_scheduled_tokens=1 + draft_tokens, draft_token_ids=[5] * draft_tokens))
        if not overlap:
            worker.execute(decode)
            return
        launched = worker.launch(decode, previous=in_flight)
        if in_flight is not None:
            worker.finish(in_flight)
        in_flight = launched

    return decode_step, request_ids


def _is_collective(name: str) -> bool:
    return "nccl" in name.lower() or "allreduce" in name.lower().replace("_", "")


def collective_share(profiler, steps: int, wall_s: float) -> dict:
    """The NCCL kernels' share of the profiled steps' GPU kernel time and of their wall time (rank 0's view:
    its collectives' time includes any wait for the slower rank)."""
    kernel_s = collective_s = 0.0
    for event in profiler.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        seconds = getattr(event, "device_time", None)
        seconds = (event.cuda_time if seconds is None else seconds) * 1e-6
        kernel_s += seconds
        collective_s += seconds if _is_collective(event.name) else 0.0
    return {"gpu_kernel_ms_per_step": 1e3 * kernel_s / steps, "collective_ms_per_step": 1e3 * collective_s / steps,
            "gpu_busy_fraction": kernel_s / wall_s if wall_s else None,  # kernels on one stream: no overlap
            "collective_share_of_gpu_time": collective_s / kernel_s if kernel_s else None,
            "collective_share_of_wall_time": collective_s / wall_s if wall_s else None}


def profile_rank(rank: int, args: argparse.Namespace, init_method: str | None) -> None:
    """Warms up, times 20 decode steps and profiles 5 more on one rank (every rank runs the same steps, so the
    ranks' collectives pair up); rank 0 prints the tables and writes the JSON."""
    world_size = args.tensor_parallel_size
    decode_step = prefilled_worker(args.shape, args.batch, args.prompt, cuda_graphs=not args.no_cuda_graphs,
                                   num_kv_blocks=args.num_kv_blocks, spread=args.spread, overlap=args.overlap,
                                   rank=rank, world_size=world_size, init_method=init_method,
                                   custom_all_reduce=not args.disable_custom_all_reduce,
                                   batch_invariant=args.batch_invariant, draft_tokens=args.draft_tokens,
                                   quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    for _ in range(5):
        decode_step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        decode_step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / 20 * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) if rank == 0 else contextlib.nullcontext() as profiler:
        start = time.perf_counter()
        for _ in range(5):
            decode_step()
        torch.cuda.synchronize()
        profiled_s = time.perf_counter() - start
    if rank != 0:
        return
    print(f"decode step wall: {step_ms:.2f} ms at batch {args.batch}, tp {world_size}, {args.draft_tokens} drafts"
          f"{' (overlapped)' if args.overlap else ''}")
    print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(profiler.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
    summary = {"device": torch.cuda.get_device_name(0), "shape": args.shape, "batch": args.batch,
               "draft_tokens": args.draft_tokens, "quantization": args.quantization,
               "kv_cache_dtype": args.kv_cache_dtype,
               "prompt": args.prompt, "tensor_parallel_size": world_size,
               "custom_all_reduce": world_size > 1 and not args.disable_custom_all_reduce, "cuda_graphs": not args.no_cuda_graphs,
               "decode_step_wall_ms": step_ms, "profiled_step_wall_ms": 1e3 * profiled_s / 5,
               **collective_share(profiler, 5, profiled_s)}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: 48 per request")
    parser.add_argument("--spread", action="store_true", help="spread each request's blocks over the pool")
    parser.add_argument("--overlap", action="store_true", help="launch each step before finishing the previous")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks, one per GPU")
    parser.add_argument("--disable-custom-all-reduce", action="store_true", help="every all-reduce through NCCL")
    parser.add_argument("--batch-invariant", action="store_true", help="the worker's --batch-invariant kernels")
    parser.add_argument("--draft-tokens", type=int, default=0, help="speculative drafts verified per request")
    parser.add_argument("--quantization", "-q", default=None, help="the worker's --quantization (e.g. fp8)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the worker's --kv-cache-dtype (auto, fp8)")
    parser.add_argument("--json", default=None, help="write the step's figures here")
    args = parser.parse_args()
    if args.tensor_parallel_size == 1:
        profile_rank(0, args, None)
    else:
        torch.multiprocessing.spawn(profile_rank, args=(args, f"tcp://127.0.0.1:{_free_port()}"),
                                    nprocs=args.tensor_parallel_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
