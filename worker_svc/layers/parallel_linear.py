"""Linear layers split over the tensor-parallel ranks, Megatron-style, as every model file uses them.

- `ColumnParallelLinear`: the output features are split; each rank computes its slice and no collective
  runs. Several projections of one input may be fused into it as parts (q|k|v, gate|up): each part is split
  on its own, so a rank holds its share of every part and one matmul computes them all.
- `RowParallelLinear`: the input features are split (the slices a column-parallel layer produced); each rank
  multiplies its slice and one all-reduce sums the partial outputs; the bias is added once, after the sum.

A column-parallel layer followed by a row-parallel one (attention: qkv_proj -> o_proj; MLP: gate_up -> down)
costs one all-reduce. Each layer loads its own slice of a checkpoint tensor (`load`), reading only that slice
from a safetensors file. With one rank the forward pass is exactly `F.linear(x, weight, bias)`, what
`nn.Linear` ran before: the parallel layers cost nothing when N is 1.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from worker_svc.layers.checkpoint_tensor import CheckpointTensor, copy_into
from worker_svc.tensor_parallel import TensorParallel


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b over this rank's output rows: for each fused part, the rows `shards[part]` = (first row
    in the checkpoint tensor of that part, number of rows), stacked in part order."""

    def __init__(self, input_size: int, shards: list[tuple[int, int]], bias: bool):
        super().__init__()
        self.linear = F.linear  # the loader sets LayerOps.linear (a batch-invariant one with --batch-invariant)
        self.shards = shards
        self.offsets = [sum(rows for _, rows in shards[:part]) for part in range(len(shards))]
        output_size = sum(rows for _, rows in shards)
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    @classmethod
    def split(cls, input_size: int, output_sizes: list[int], bias: bool, tp: TensorParallel) -> ColumnParallelLinear:
        """Each of the fused parts `output_sizes` split evenly over the ranks."""
        return cls(input_size, [tp.shard(size) for size in output_sizes], bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden, self.weight, self.bias)

    def load(self, kind: str, checkpoint: CheckpointTensor, part: int = 0) -> None:
        """Copies this rank's rows of `part` from the checkpoint's weight or bias."""
        start, rows = self.shards[part]
        offset = self.offsets[part]
        copy_into(getattr(self, kind)[offset : offset + rows], checkpoint.rows(start, rows))


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, then + b: this rank holds the input columns `tp.shard(input_size)`."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.linear = F.linear  # the loader sets LayerOps.linear (a batch-invariant one with --batch-invariant)
        self.tp = tp
        self.input_start, local_input = tp.shard(input_size)
        self.weight = nn.Parameter(torch.empty(output_size, local_input))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return self.linear(hidden, self.weight, self.bias)
        output = self.tp.all_reduce(self.linear(hidden, self.weight, None))
        return output if self.bias is None else output + self.bias

    def load(self, kind: str, checkpoint: CheckpointTensor, part: int = 0) -> None:
        if kind == "bias":
            copy_into(self.bias, checkpoint.full())
        else:
            copy_into(self.weight, checkpoint.columns(self.input_start, self.weight.shape[1]))

