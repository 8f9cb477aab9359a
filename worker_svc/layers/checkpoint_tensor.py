"""One checkpoint tensor as a layer loads it: whole, or only the rows or columns this rank holds.

Why not a tensor: under tensor parallel each rank needs only its slice of most weights (rows of a
column-parallel projection, columns of a row-parallel one, rows of the vocabulary). From safetensors the
slice is read from the file alone (`safe_open(...).get_slice`), so no rank ever holds a whole sharded tensor:
a 70B checkpoint needs about 70B / N of host memory per rank, not 70B. The loader (models/weight_loader.py)
makes them; each parallel layer's `load` takes its slice.
"""

from __future__ import annotations

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


class RowBlock(CheckpointTensor):
    """Rows start .. start + count - 1 of another checkpoint tensor, itself read by rows or columns: one part of a
    tensor the checkpoint stores fused (Phi-3's qkv_proj, gate_up_proj), so a rank reads only its slice of it."""

    def __init__(self, parent: CheckpointTensor, start: int, count: int):
        super().__init__(parent, (count, *parent.shape[1:]))
        self._start = start

    def full(self) -> torch.Tensor:
        return self._source.rows(self._start, self.shape[0])

    def rows(self, start: int, count: int) -> torch.Tensor:
        return self._source.rows(self._start + start, count)

    def columns(self, start: int, count: int) -> torch.Tensor:
        return self.full()[:, start : start + count]

    def narrow(self, dim: int, start: int, count: int) -> torch.Tensor:
        return self.rows(start, count) if dim == 0 else self.full().narrow(dim, start, count)


def load_whole(target: torch.Tensor, checkpoint: CheckpointTensor) -> None:
    """Copies a replicated parameter (a norm's weight) whole."""
    copy_into(target, checkpoint.full())


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copies a checkpoint tensor (or this rank's slice of one) into a parameter; raises on a shape mismatch."""
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"checkpoint shape {tuple(source.shape)} != {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(source)
