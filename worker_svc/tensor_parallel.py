"""This worker's place in its tensor-parallel group, and the group's collectives.

Who owns what: the worker process creates one `TensorParallel` at start-up (`init_tensor_parallel`, one
torch.distributed process group per engine: NCCL on CUDA, gloo on the CPU) and hands the same frozen object to
the model it builds, the KV cache it sizes and the sampler's logits gather. Nothing reads it from a global:
a layer gets it through its constructor, as it gets the attention backend.

With `world_size == 1` there is no process group at all and every collective returns its input untouched,
so the single-GPU path pays nothing for the parallel layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from worker_svc.symmetric_all_reduce import SymmetricAllReduce, symmetric_all_reduce

_JOIN_TIMEOUT_S = 600


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    # The torch.distributed process group of the engine's ranks; None when world_size == 1.
    group: Any = None
    # All-reduces that fit it go through symmetric memory (worker_svc/symmetric_all_reduce.py); None: NCCL only.
    symmetric: SymmetricAllReduce | None = None
    # --batch-invariant: sums in rank order whatever the tensor's size (see `all_reduce`).
    fixed_order: bool = False

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def kv_heads(self, num_kv_heads: int) -> int:
        """KV heads this rank holds: an equal share, or one replicated head when there are fewer KV heads than
        ranks (as vLLM does: each head then lives on world_size // num_kv_heads ranks)."""
        if num_kv_heads >= self.world_size:
            return self.shard(num_kv_heads)[1]
        if self.world_size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads do not divide tensor-parallel size {self.world_size}")
        return 1

    def kv_head_start(self, num_kv_heads: int) -> int:
        """The first KV head this rank holds (see `kv_heads`)."""
        if num_kv_heads >= self.world_size:
            return self.shard(num_kv_heads)[0]
        return self.rank // (self.world_size // num_kv_heads)

    def shard(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `size` along a split dimension; `size` must divide."""
        if size % self.world_size:
            raise ValueError(f"{size} does not divide over tensor-parallel size {self.world_size}")
        length = size // self.world_size
        return self.rank * length, length

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel outputs, masked vocab-parallel lookups)."""
        if not self.is_parallel:
            return tensor
        if self.fixed_order and self.world_size > 2:
            # A ring's order of summation follows where the tensor's chunks fall, which follows its size (the
            # batch). Two ranks need nothing (a + b either way); more gather every rank's part and sum them
            # in rank order.
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor.contiguous(), group=self.group)
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            tensor.copy_(total)
            return tensor
        if self.symmetric is not None and self.symmetric.takes(tensor):
            return self.symmetric.all_reduce_(tensor)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's shard of the last dimension, concatenated in rank order (vocab-parallel logits)."""
        if not self.is_parallel:
            return tensor
        shards = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(shards, tensor.contiguous(), group=self.group)
        return torch.cat(shards, dim=-1)

    def all_reduce_min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (the KV pool size all ranks can hold)."""
        if not self.is_parallel:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())


SINGLE_RANK = TensorParallel()


def init_tensor_parallel(rank: int, world_size: int, init_method: str | None, device: torch.device,
                         dtype: torch.dtype = torch.bfloat16, custom_all_reduce: bool = True,
                         fixed_order: bool = False) -> TensorParallel:
    """Joins the engine's process group (NCCL on CUDA, gloo on the CPU) at `init_method` (a tcp://host:port
    every rank reaches); world_size 1 joins nothing. On CUDA, with `custom_all_reduce`, all-reduces of `dtype`
    up to a few MiB go through symmetric memory (worker_svc/symmetric_all_reduce.py says why)."""
    # Alone too: a -dp engine's rank on cuda:1 captures graphs on its own device's stream. A bare "cuda" names the
    # current device (torch refuses set_device without an index).
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if world_size == 1:
        return SINGLE_RANK
    if init_method is None:
        raise ValueError("tensor parallel needs --distributed-init-method (tcp://HOST:PORT reachable by every rank)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A rank that never comes (a worker not started) fails the others after this long, not torch's 30 minutes.
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=_JOIN_TIMEOUT_S))
    group = dist.group.WORLD
    symmetric = symmetric_all_reduce(group, dtype, device) if device.type == "cuda" and custom_all_reduce else None
    return TensorParallel(rank=rank, world_size=world_size, group=group, symmetric=symmetric, fixed_order=fixed_order)
