"""One checkpoint tensor as a layer loads it: whole, or only the rows or columns this rank holds.

Why not a tensor: under tensor parallel each rank needs only its slice of most weights (rows of a
column-parallel projection, columns of a row-parallel one, rows of the vocabulary). From safetensors the
slice is read from the file alone (`safe_open(...).get_slice`), so no rank ever holds a whole sharded tensor:
a 70B checkpoint needs about 70B / N of host memory per rank, not 70B. The loader (models/weight_loader.py)
makes them; each parallel layer's `load` takes its slice, which a `TensorLayout` (which axis is the layer's
output dimension, which its input, and by what each is packed or grouped) locates in any format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class CheckpointTensor:
    """One checkpoint tensor, read whole or by the rows or columns a rank needs."""

    def __init__(self, source: Any, shape: tuple[int, ...]):
        self._source = source  # a torch.Tensor, or a safetensors slice that reads from the file on indexing
        self.shape = shape

    def full(self) -> torch.Tensor:
        return self._source[...]

    def rows(self, start: int, count: int) -> torch.Tensor:
        return self._source[start : start + count]

    def columns(self, start: int, count: int) -> torch.Tensor:
        return self._source[:, start : start + count]

    def narrow(self, dim: int, start: int, count: int) -> torch.Tensor:
        """Indices start .. start + count - 1 along `dim`, whole along the others (a stacked experts tensor's
        slice of the intermediate dimension)."""
        return self._source[(slice(None),) * dim + (slice(start, start + count),)]


class Block(CheckpointTensor):
    """Entries start .. start + count - 1 along `axis` (0: rows, 1: columns) of another checkpoint tensor, itself
    read by rows or columns: one part of a tensor the checkpoint stores fused (Phi-3's qkv_proj, gate_up_proj:
    their rows; an AWQ qweight's packed columns), so a rank reads only its slice of it."""

    def __init__(self, parent: CheckpointTensor, axis: int, start: int, count: int):
        shape = list(parent.shape)
        shape[axis] = count
        super().__init__(parent, tuple(shape))
        self._axis, self._start = axis, start

    def full(self) -> torch.Tensor:
        return self._along(self._start, self.shape[self._axis])

    def rows(self, start: int, count: int) -> torch.Tensor:
        return self._along(self._start + start, count) if self._axis == 0 else self.full()[start : start + count]

    def columns(self, start: int, count: int) -> torch.Tensor:
        return self._along(self._start + start, count) if self._axis == 1 else self.full()[:, start : start + count]

    def narrow(self, dim: int, start: int, count: int) -> torch.Tensor:
        return self._along(self._start + start, count) if dim == self._axis else self.full().narrow(dim, start, count)

    def _along(self, start: int, count: int) -> torch.Tensor:
        return self._source.rows(start, count) if self._axis == 0 else self._source.columns(start, count)


@dataclass(frozen=True)
class TensorLayout:
    """Where one kind of checkpoint tensor of a linear layer keeps the layer's output and input dimensions.

    Why: a parallel layer takes its rank's slice of every tensor it loads (the output rows of a column-parallel
    layer, the input columns of a row-parallel one), and the formats put those dimensions in different places:
    a float weight is [out, in]; GPTQ's qweight [in / 8, out] (eight 4-bit values packed per int32 along the
    input), AWQ's [in, out / 8], compressed-tensors' weight_packed [out, in / 8]; group scales [in / G, out] or
    [out, in / G]; a per-tensor scale is one value per fused part. Each linear method describes its kinds with
    this, and the layers slice by it (parallel_linear.py), so no layer knows a format.

    `output_axis`: the axis indexed by output row, `output_per_entry` rows per entry along it (8 where eight are
    packed in an int32); None: the tensor is not per output row but one per fused part, kept on the parameter's
    leading axis (a per-tensor scale, a g_idx). `input_axis`, `input_per_entry`: the same for the input
    dimension (a pack factor, or a group size); None: whole on every rank (a per-channel scale, a bias).
    `entry`: what one entry along the split axes holds, for the refusal of a shard that splits one.
    """

    output_axis: int | None = None
    output_per_entry: int = 1
    input_axis: int | None = None
    input_per_entry: int = 1
    entry: str = ""

    def along(self, checkpoint: CheckpointTensor, axis: int, start: int, count: int) -> torch.Tensor:
        """Entries of `checkpoint` for the output rows or input columns start .. start + count - 1 along `axis`
        (this layout's output or input axis: 0 or 1)."""
        per_entry = self.output_per_entry if axis == self.output_axis else self.input_per_entry
        start, count = start // per_entry, count // per_entry
        return checkpoint.rows(start, count) if axis == 0 else checkpoint.columns(start, count)


WEIGHT = TensorLayout(output_axis=0, input_axis=1)  # [out, in]: a float or fp8 weight
PER_OUTPUT_ROW = TensorLayout(output_axis=0)  # [out] or [out, 1]: a bias, a per-channel scale
PER_PART = TensorLayout()  # one value per fused part: a per-tensor scale


def load_whole(target: torch.Tensor, checkpoint: CheckpointTensor) -> None:
    """Copies a replicated parameter (a norm's weight) whole."""
    copy_into(target, checkpoint.full())


def copy_part(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copies a per-part checkpoint tensor into its part's place; a single value may come as [1] or []."""
    copy_into(target, source.reshape(target.shape) if source.numel() == 1 == target.numel() else source)


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copies a checkpoint tensor (or this rank's slice of one) into a parameter; raises on a shape mismatch."""
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"checkpoint shape {tuple(source.shape)} != {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(source)
