"""The tensor-parallel all-reduce of small and mid-sized activations through symmetric memory (torch's
`torch.distributed._symmetric_memory`), with NCCL for the rest.

Why: a decode step all-reduces each layer's row-parallel output twice, and at 256 rows of an 8B model that is
2 MiB a time, 65 times a step. At these sizes NCCL's ring runs its latency-bound protocol (NVLink multicast off),
and its all-reduces take a large share of the step's GPU time; the two-shot kernel here takes well under half
of NCCL's time for each (benchmarks/all_reduce_bench.py, benchmarks/profile_decode_step.py -tp 2; figures in
docs/benchmarks.md, "Kernels" and "Tensor parallel"). A symmetric-memory all-reduce is one kernel that reads the peers'
copies straight over NVLink (one-shot: every rank sums all of them; two-shot: each rank sums its slice and the
slices are exchanged), with no protocol of NCCL's in between. It is what vLLM uses on Hopper for this
(its "custom all-reduce", `--disable-custom-all-reduce` turns it off), and it runs inside CUDA graphs.

Who owns what: `init_tensor_parallel` creates one per CUDA process group when it can (a rendezvous of every
rank, so at start-up only), sized for `max_bytes` of the model's dtype; `TensorParallel.all_reduce` gives it
every tensor it takes (`takes`: from `min_bytes` to `max_bytes`, of its dtype) and NCCL the others (one-row
decodes, prefill chunks, other dtypes).

With two ranks a sum is a + b on either path (all_reduce_bench.py finds them equal bit for bit); with more,
the order may differ from NCCL's, so bf16 sums may differ in the last bit between the paths, never between two
runs of the same path and size.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Per all-reduce: up to this many bytes in one buffer (vLLM's bound for two ranks); larger goes to NCCL.
DEFAULT_MAX_BYTES = 8 << 20
# Below this NCCL stays: a whole decode step of one row is slower through the symmetric path (its TPOT on the 8B
# shape at -tp 2, docs/benchmarks.md), though alone, in a graph of 50, it is faster at every size.
DEFAULT_MIN_BYTES = 1 << 20


class SymmetricAllReduce:
    """One symmetric buffer of the group's dtype and the ops that reduce through it (see the module)."""

    def __init__(self, buffer: torch.Tensor, group_name: str, min_bytes: int = DEFAULT_MIN_BYTES):
        self.buffer = buffer
        self.group_name = group_name
        self.min_bytes = min_bytes

    def takes(self, tensor: torch.Tensor) -> bool:
        size = tensor.numel() * tensor.element_size()
        return (tensor.dtype == self.buffer.dtype and tensor.is_contiguous() and tensor.numel() <= self.buffer.numel()
                and size >= self.min_bytes and size % 16 == 0)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks into `tensor` (which `takes` accepted). Two-shot: with two ranks it beats one-shot
        at every size from 8 KiB to 8 MiB (benchmarks/all_reduce_bench.py)."""
        staged = self.buffer[: tensor.numel()]
        staged.copy_(tensor.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        tensor.view(-1).copy_(staged)
        return tensor


def symmetric_all_reduce(group: Any, dtype: torch.dtype, device: torch.device,
                         max_bytes: int = DEFAULT_MAX_BYTES) -> SymmetricAllReduce | None:
    """A `SymmetricAllReduce` for `group` (every rank must call this together), or None, with a warning, where
    the torch build, the driver or the GPUs' links cannot give one (NCCL then carries every all-reduce)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(max_bytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group.group_name)
    except Exception as error:  # noqa: BLE001 -- any failure here only means "use NCCL"
        logger.warning("symmetric-memory all-reduce unavailable (%s); every all-reduce goes through NCCL", error)
        return None
    return SymmetricAllReduce(buffer, group.group_name)
