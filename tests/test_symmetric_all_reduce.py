"""Which all-reduces go through symmetric memory and which through NCCL (the kernels themselves need two GPUs:
benchmarks/all_reduce_bench.py checks their sums against NCCL's)."""

from __future__ import annotations

import torch

from worker_svc import tensor_parallel as tensor_parallel_module
from worker_svc.symmetric_all_reduce import SymmetricAllReduce
from worker_svc.tensor_parallel import TensorParallel


def _symmetric(elements: int = 4096, min_bytes: int = 1024) -> SymmetricAllReduce:
    return SymmetricAllReduce(torch.empty(elements, dtype=torch.bfloat16), "g", min_bytes=min_bytes)


def test_it_takes_contiguous_tensors_of_its_dtype_between_its_bounds():
    symmetric = _symmetric()
    assert symmetric.takes(torch.zeros(4, 128, dtype=torch.bfloat16))  # 1 KiB: the lower bound
    assert symmetric.takes(torch.zeros(4096, dtype=torch.bfloat16))  # the whole buffer
    assert not symmetric.takes(torch.zeros(4, 64, dtype=torch.bfloat16))  # below min_bytes: NCCL is faster
    assert not symmetric.takes(torch.zeros(4097, dtype=torch.bfloat16))  # past the buffer
    assert not symmetric.takes(torch.zeros(1024, dtype=torch.float32))  # another dtype
    assert not symmetric.takes(torch.zeros(128, 16, dtype=torch.bfloat16).t())  # not contiguous


class _Recording(SymmetricAllReduce):
    def __init__(self):
        super().__init__(torch.empty(4096, dtype=torch.bfloat16), "g", min_bytes=1024)
        self.reduced = []

    def all_reduce_(self, tensor):
        self.reduced.append(tensor.shape)
        return tensor


def test_tensor_parallel_sends_what_it_takes_to_it_and_the_rest_to_nccl(monkeypatch):
    nccl = []
    monkeypatch.setattr(tensor_parallel_module.dist, "all_reduce", lambda tensor, group: nccl.append(tensor.shape))
    symmetric = _Recording()
    parallel = TensorParallel(rank=0, world_size=2, group=object(), symmetric=symmetric)
    parallel.all_reduce(torch.zeros(8, 128, dtype=torch.bfloat16))
    parallel.all_reduce(torch.zeros(1, 128, dtype=torch.bfloat16))
    parallel.all_reduce(torch.zeros(64, 128, dtype=torch.bfloat16))
    assert symmetric.reduced == [torch.Size([8, 128])]
    assert nccl == [torch.Size([1, 128]), torch.Size([64, 128])]


def test_without_it_every_all_reduce_is_nccls(monkeypatch):
    nccl = []
    monkeypatch.setattr(tensor_parallel_module.dist, "all_reduce", lambda tensor, group: nccl.append(tensor.shape))
    TensorParallel(rank=0, world_size=2, group=object()).all_reduce(torch.zeros(8, 128, dtype=torch.bfloat16))
    assert nccl == [torch.Size([8, 128])]
