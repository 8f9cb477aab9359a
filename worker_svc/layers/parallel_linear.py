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

What the layer holds and how it multiplies is its linear method's (layers/linear_method.py: unquantized, or
FP8 W8A8): the layer keeps the split (which rows or columns are this rank's, the fused parts, the
all-reduce, the bias). The model loader sets the method (`set_linear_method`) while the model is still on
the meta device, and calls `process_after_loading` once the checkpoint is in.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from worker_svc.layers.checkpoint_tensor import CheckpointTensor, copy_into
from worker_svc.layers.linear_method import UNQUANTIZED, LinearMethod
from worker_svc.tensor_parallel import TensorParallel


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b over this rank's output rows: for each fused part, the rows `shards[part]` = (first row
    in the checkpoint tensor of that part, number of rows), stacked in part order."""

    def __init__(self, input_size: int, shards: list[tuple[int, int]], bias: bool):
        super().__init__()
        self.linear = F.linear  # the loader sets LayerOps.linear (a batch-invariant one with --batch-invariant)
        self.shards = shards
        self.offsets = [sum(rows for _, rows in shards[:part]) for part in range(len(shards))]
        self.input_size = input_size
        self.output_size = sum(rows for _, rows in shards)
        self.linear_method: LinearMethod = UNQUANTIZED
        UNQUANTIZED.create_weights(self, self.output_size, input_size, len(shards), None)
        self.bias = nn.Parameter(torch.empty(self.output_size)) if bias else None

    @classmethod
    def split(cls, input_size: int, output_sizes: list[int], bias: bool, tp: TensorParallel) -> ColumnParallelLinear:
        """Each of the fused parts `output_sizes` split evenly over the ranks."""
        return cls(input_size, [tp.shard(size) for size in output_sizes], bias)

    def set_linear_method(self, method: LinearMethod, dtype: torch.dtype) -> None:
        """Holds `method`'s parameters instead (allocated on the current device: the loader's meta device)."""
        self.linear_method = method
        method.create_weights(self, self.output_size, self.input_size, len(self.shards), dtype)

    def process_after_loading(self) -> None:
        self.linear_method.process_after_loading(self, [rows for _, rows in self.shards])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, hidden, self.bias)

    def load(self, kind: str, checkpoint: CheckpointTensor, part: int = 0) -> None:
        """Copies this rank's rows of `part` from the checkpoint's weight or bias (or per-row scale); a value per
        part (a per-tensor scale) goes whole to the part's place."""
        if not self.linear_method.sharded_by_rows(kind):
            copy_into(getattr(self, kind)[part : part + 1], checkpoint.full().reshape(1))
            return
        start, rows = self.shards[part]
        offset = self.offsets[part]
        copy_into(getattr(self, kind)[offset : offset + rows], checkpoint.rows(start, rows))


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, then + b: this rank holds the input columns `tp.shard(input_size)`."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.linear = F.linear  # the loader sets LayerOps.linear (a batch-invariant one with --batch-invariant)
        self.tp = tp
        self.input_start, self.local_input = tp.shard(input_size)
        self.output_size = output_size
        self.linear_method: LinearMethod = UNQUANTIZED
        UNQUANTIZED.create_weights(self, output_size, self.local_input, 1, None)
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def set_linear_method(self, method: LinearMethod, dtype: torch.dtype) -> None:
        """Holds `method`'s parameters instead (allocated on the current device: the loader's meta device)."""
        self.linear_method = method
        method.create_weights(self, self.output_size, self.local_input, 1, dtype)

    def process_after_loading(self) -> None:
        self.linear_method.process_after_loading(self, [self.output_size])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return self.linear_method.apply(self, hidden, self.bias)
        output = self.tp.all_reduce(self.linear_method.apply(self, hidden, None))
        return output if self.bias is None else output + self.bias

    def load(self, kind: str, checkpoint: CheckpointTensor, part: int = 0) -> None:
        """This rank's columns of the weight; everything else (bias, per-row and per-tensor scales) whole."""
        if kind == "weight":
            copy_into(self.weight, checkpoint.columns(self.input_start, self.weight.shape[1]))
        elif kind == "bias":
            copy_into(self.bias, checkpoint.full())
        else:  # a scale: compressed-tensors writes a per-tensor one as [1], ours is [1] too; a per-row one [N, 1]
            copy_into(getattr(self, kind), checkpoint.full())
