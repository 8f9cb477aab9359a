"""On two GPUs, one process each: `TensorParallel.all_reduce` sends a tensor of 1 to 8 MiB through the
symmetric-memory all-reduce (worker_svc/symmetric_all_reduce.py) and not through NCCL, smaller and larger ones
through NCCL and not through it, and each sum equals NCCL's sum of the same tensors bit for bit (with two ranks
both paths compute a + b). tests/test_symmetric_all_reduce.py checks the routing on the CPU with fakes; only
here does the kernel itself run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pagedserve.free_port import free_port
from worker_svc import tensor_parallel as tensor_parallel_module
from worker_svc.tensor_parallel import init_tensor_parallel

WORLD_SIZE = 2
HIDDEN = 4096  # a row of bf16 activations is 8 KiB
# Rows of a [rows, HIDDEN] bf16 tensor, and the path its all-reduce must take.
ROWS = [
    (127, "nccl"),  # 1016 KiB: below the symmetric path's 1 MiB
    (128, "symmetric"),  # 1 MiB
    (384, "symmetric"),  # 3 MiB
    (1000, "symmetric"),  # 7.8 MiB
    (1024, "symmetric"),  # 8 MiB: the whole buffer
    (1025, "nccl"),  # past the buffer
]


def _reduce_on_rank(rank: int, init_method: str) -> None:
    """One rank: joins the group (its symmetric buffer included, as a worker does), then all-reduces each size,
    counting which path took it."""
    device = torch.device(f"cuda:{rank}")
    parallel = init_tensor_parallel(rank, WORLD_SIZE, init_method, device, torch.bfloat16)
    symmetric = parallel.symmetric
    assert symmetric is not None, "no symmetric-memory all-reduce: every all-reduce goes through NCCL"
    calls = {"symmetric": 0, "nccl": 0}
    nccl_all_reduce, symmetric_all_reduce = dist.all_reduce, symmetric.all_reduce_

    def counted_nccl(tensor, *args, **kwargs):
        calls["nccl"] += 1
        return nccl_all_reduce(tensor, *args, **kwargs)

    def counted_symmetric(tensor):
        calls["symmetric"] += 1
        return symmetric_all_reduce(tensor)

    # Only this process's functions: the rank is a process of its own.
    tensor_parallel_module.dist.all_reduce = counted_nccl
    symmetric.all_reduce_ = counted_symmetric
    for rows, path in ROWS:
        torch.manual_seed(rows * WORLD_SIZE + rank)
        data = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device=device)
        expected = data.clone()
        nccl_all_reduce(expected, group=parallel.group)
        before = dict(calls)
        reduced = parallel.all_reduce(data.clone())
        torch.cuda.synchronize(device)
        taken = {name: calls[name] - before[name] for name in calls}
        assert taken == {"symmetric": int(path == "symmetric"), "nccl": int(path == "nccl")}, (
            f"{rows * HIDDEN * 2 / 2**20:.2f} MiB should go through {path}; calls made: {taken}")
        assert torch.equal(reduced, expected), (
            f"{rows * HIDDEN * 2 / 2**20:.2f} MiB through {path}: the sum differs from NCCL's by up to "
            f"{(reduced.float() - expected.float()).abs().max().item():.3g}")
    # Not on a failure: the other rank may be inside a collective then (spawn ends it when this one raises).
    nccl_all_reduce(torch.zeros(1, device=device), group=parallel.group)
    dist.destroy_process_group()


def test_mid_sized_all_reduces_go_through_symmetric_memory_and_sum_as_nccl():
    if torch.cuda.device_count() < WORLD_SIZE:
        pytest.skip(f"needs {WORLD_SIZE} GPUs")
    torch.multiprocessing.spawn(_reduce_on_rank, args=(f"tcp://127.0.0.1:{free_port()}",), nprocs=WORLD_SIZE)
