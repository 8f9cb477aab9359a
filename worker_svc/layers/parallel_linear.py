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
FP8 W8A8, weight-only integer): the layer keeps the split (which rows or columns are this rank's, the fused
parts, the all-reduce, the bias), and slices each checkpoint tensor where the method's `TensorLayout` says its
output or input dimension lies. The model loader sets the method (`set_linear_method`, which refuses a shard
that would split a packed int32 or a quantization group) while the model is still on the meta device, and
calls `process_after_loading` once the checkpoint is in.

LoRA (--enable-lora): a layer some adapter targets holds them all (`lora`, layers/layer_lora.py) and adds each
token's adapter delta to its output when the step has adapter tokens (`lora_tokens`, from the attention
metadata; None: no token has one and the forward pass is the base layer's alone).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kernels.lora_ref import LoraTokens
from worker_svc.layers.checkpoint_tensor import PER_OUTPUT_ROW, CheckpointTensor, TensorLayout, copy_into, copy_part
from worker_svc.layers.layer_lora import LayerLora
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
        self.splits_input = False  # every rank multiplies the whole input (a method's act order needs it whole)
        self.linear_method: LinearMethod = UNQUANTIZED
        UNQUANTIZED.create_weights(self, self.output_size, input_size, len(shards), None)
        self.bias = nn.Parameter(torch.empty(self.output_size)) if bias else None
        self.lora: LayerLora | None = None  # set at setup when an adapter targets the layer (lora_adapters.py)

    @classmethod
    def split(cls, input_size: int, output_sizes: list[int], bias: bool, tp: TensorParallel) -> ColumnParallelLinear:
        """Each of the fused parts `output_sizes` split evenly over the ranks."""
        return cls(input_size, [tp.shard(size) for size in output_sizes], bias)

    def set_linear_method(self, method: LinearMethod, dtype: torch.dtype) -> None:
        """Holds `method`'s parameters instead (allocated on the current device: the loader's meta device);
        raises if this rank's rows of a part would split an entry of one of its checkpoint tensors."""
        for kind in _hold_method(self, method, self.output_size, self.input_size, len(self.shards), dtype):
            layout = method.layout(kind)
            per_entry = layout.output_per_entry
            for part, (start, rows) in enumerate(self.shards):
                if layout.output_axis is not None and (start % per_entry or rows % per_entry):
                    raise ValueError(f"{kind}: this rank's output rows {start}..{start + rows - 1} of part {part} "
                                     f"({rows} rows) do not fall on a boundary of the {per_entry} rows each entry "
                                     f"holds ({layout.entry})")

    def process_after_loading(self) -> None:
        self.linear_method.process_after_loading(self, [rows for _, rows in self.shards])

    def forward(self, hidden: torch.Tensor, lora_tokens: LoraTokens | None = None) -> torch.Tensor:
        output = self.linear_method.apply(self, hidden, self.bias)
        if self.lora is not None and lora_tokens is not None:
            self.lora.add_delta(output, hidden, lora_tokens)
        return output

    def load(self, kind: str, checkpoint: CheckpointTensor, part: int = 0) -> None:
        """Copies this rank's rows of `part` from a checkpoint tensor (wherever its layout puts the output
        dimension); a tensor that is one per part goes whole to the part's place."""
        layout = checkpoint_layout(self, kind)
        target = getattr(self, kind)
        if layout.output_axis is None:
            copy_part(target[part], checkpoint.full())
            return
        start, rows = self.shards[part]
        axis, per_entry = layout.output_axis, layout.output_per_entry
        place = target.narrow(axis, self.offsets[part] // per_entry, rows // per_entry)
        copy_into(place, layout.along(checkpoint, axis, start, rows))


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, then + b: this rank holds the input columns `tp.shard(input_size)`."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.linear = F.linear  # the loader sets LayerOps.linear (a batch-invariant one with --batch-invariant)
        self.tp = tp
        self.input_start, self.local_input = tp.shard(input_size)
        self.output_size = output_size
        self.splits_input = tp.is_parallel  # each rank multiplies its columns of the input
        self.linear_method: LinearMethod = UNQUANTIZED
        UNQUANTIZED.create_weights(self, output_size, self.local_input, 1, None)
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None
        self.lora: LayerLora | None = None  # set at setup when an adapter targets the layer (lora_adapters.py)

    def set_linear_method(self, method: LinearMethod, dtype: torch.dtype) -> None:
        """Holds `method`'s parameters instead (allocated on the current device: the loader's meta device);
        raises if this rank's input columns would split an entry (a packed int32, a group) of one of its
        checkpoint tensors."""
        start, count = self.input_start, self.local_input
        for kind in _hold_method(self, method, self.output_size, self.local_input, 1, dtype):
            layout = method.layout(kind)
            per_entry = layout.input_per_entry
            if layout.input_axis is not None and (start % per_entry or count % per_entry):
                raise ValueError(f"{kind}: the {count * self.tp.world_size} input columns split over "
                                 f"{self.tp.world_size} tensor-parallel ranks give this rank columns {start}.."
                                 f"{start + count - 1}, which do not fall on a boundary of the {per_entry} columns "
                                 f"each entry holds ({layout.entry})")

    def process_after_loading(self) -> None:
        self.linear_method.process_after_loading(self, [self.output_size])

    def forward(self, hidden: torch.Tensor, lora_tokens: LoraTokens | None = None) -> torch.Tensor:
        with_lora = self.lora is not None and lora_tokens is not None
        if not self.tp.is_parallel:
            output = self.linear_method.apply(self, hidden, self.bias)
            if with_lora:
                self.lora.add_delta(output, hidden, lora_tokens)
            return output
        output = self.linear_method.apply(self, hidden, None)
        if with_lora:  # this rank's partial delta, summed with the partial products (layers/layer_lora.py)
            self.lora.add_delta(output, hidden, lora_tokens)
        output = self.tp.all_reduce(output)
        return output if self.bias is None else output + self.bias

    def load(self, kind: str, checkpoint: CheckpointTensor, part: int = 0) -> None:
        """This rank's input columns of a checkpoint tensor (wherever its layout puts the input dimension);
        the rest (the bias, per-row and per-tensor scales) whole."""
        layout = checkpoint_layout(self, kind)
        if layout.input_axis is None:
            source = checkpoint.full()
        else:
            source = layout.along(checkpoint, layout.input_axis, self.input_start, self.local_input)
        target = getattr(self, kind)
        if layout.output_axis is None:  # one per part, of which a row-parallel layer has one
            copy_part(target[0], source)
        else:
            copy_into(target, source)


def checkpoint_layout(layer: nn.Module, kind: str) -> TensorLayout:
    """Where the checkpoint tensor `kind` of a parallel linear layer holds its output and input dimensions: the
    bias one entry per output row, everything else as the layer's method says."""
    return PER_OUTPUT_ROW if kind == "bias" else layer.linear_method.layout(kind)


def _hold_method(layer: nn.Module, method: LinearMethod, output_size: int, input_size: int, num_parts: int,
                 dtype: torch.dtype) -> list[str]:
    """Replaces the parameters of `layer`'s method (the unquantized weight, say) by `method`'s own; returns the
    checkpoint tensor kinds `method` registered (the layer checks their boundaries)."""
    layer.linear_method = method
    for kind in _method_kinds(layer):
        delattr(layer, kind)
    method.create_weights(layer, output_size, input_size, num_parts, dtype)
    return _method_kinds(layer)


def _method_kinds(layer: nn.Module) -> list[str]:
    """The checkpoint tensor kinds `layer`'s method registered (all its parameters but the bias)."""
    return [name for name, _ in layer.named_parameters(recurse=False) if name != "bias"]
