"""One parallel linear layer's LoRA adapters: every adapter's A and B for each fused part, stacked by slot.

Why stacked by slot: a step mixes requests of several adapters and of the base model, and each token adds its
own adapter's delta (`kernels/lora_ref.lora_add`), so a layer holds --max-loras adapters at once, indexed by the
slot the token's row runs with; base tokens carry slot -1 and are skipped. Every adapter is padded with zeros to
the server's --max-lora-rank (zeros add nothing).

Who owns it: the layer (`ColumnParallelLinear.lora`, `RowParallelLinear.lora`, None without LoRA), made at setup
and written slot by slot as the plans load adapters (worker_svc/lora_adapters.py); the per-token slots come with
each step's attention metadata, with their order by slot (`LoraTokens`, sorted once per step by the model).

Why one stack for all parts: the parts of a fused layer (q|k|v, gate|up) share the input, so one shrink over their
stacked A ([slots, parts * R, K]) and one expand over B ([slots, N, R], each output column's part's B) serve them
all: two kernel launches per layer instead of two per part. `LoraPart` views each part's place in the stacks, for
the loads to write.

Tensor parallel, split the way the base layer is: a column-parallel layer holds, per fused part, A whole and
this rank's rows of B (the part's output rows it computes); a row-parallel layer holds this rank's input columns
of A and B whole, and its partial deltas are summed by the layer's all-reduce with the partial products (the sum
over ranks of (x_r A_r^T) B^T is (x A^T) B^T, up to the summation order, as for the base weight itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.lora_ref import LoraTokens

LoraAddFused = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...], LoraTokens,
                         torch.Tensor], None]


@dataclass(frozen=True)
class LoraPart:
    """The adapters of one fused part, views of the layer's stacks: its output columns [offset, offset + rows) of
    the layer's output, A [slots, R, K] (rows [part * R, (part + 1) * R) of the stacked A) and B [slots, rows, R]."""

    offset: int
    rows: int
    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass(frozen=True)
class LayerLora:
    """`lora_a` [slots, parts * R, K] and `lora_b` [slots, N, R]: every part's adapters stacked, N the layer's
    output width (the parts' rows in order); `parts` their views. `scalings` [slots]: each adapter's alpha / r (or
    alpha / sqrt(r), rsLoRA), one tensor shared by every layer. `lora_add`: the kernel (the torch reference on the
    CPU)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    parts: tuple[LoraPart, ...]
    scalings: torch.Tensor
    lora_add: LoraAddFused

    @classmethod
    def zeros(cls, part_rows: tuple[int, ...], slots: int, rank: int, input_columns: int, dtype: torch.dtype,
              scalings: torch.Tensor, lora_add: LoraAddFused) -> LayerLora:
        """Empty slots (zeros: no delta) in `dtype` for a layer whose output is the parts of `part_rows` rows, in
        order, on the device of `scalings`."""
        lora_a = torch.zeros(slots, len(part_rows) * rank, input_columns, device=scalings.device, dtype=dtype)
        lora_b = torch.zeros(slots, sum(part_rows), rank, device=scalings.device, dtype=lora_a.dtype)
        parts, offset = [], 0
        for part, rows in enumerate(part_rows):
            parts.append(LoraPart(offset, rows, lora_a[:, part * rank : (part + 1) * rank],
                                  lora_b[:, offset : offset + rows]))
            offset += rows
        return cls(lora_a, lora_b, tuple(parts), scalings, lora_add)

    def add_delta(self, output: torch.Tensor, hidden: torch.Tensor, tokens: LoraTokens) -> None:
        """In place: each token's adapter delta added to its row of `output` (the layer's output, or this rank's
        partial sum before a row-parallel all-reduce), every part in one call."""
        self.lora_add(output, hidden, self.lora_a, self.lora_b, tuple(part.rows for part in self.parts), tokens,
                      self.scalings)
