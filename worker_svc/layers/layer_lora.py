"""One parallel linear layer's LoRA adapters: every adapter's A and B for each fused part, stacked by slot.

Why stacked by slot: a step mixes requests of several adapters and of the base model, and each token adds its
own adapter's delta (`kernels/lora_ref.lora_add`), so a layer holds --max-loras adapters at once, indexed by the
slot the token's row runs with; base tokens carry slot -1 and are skipped. Every adapter is padded with zeros to
the server's --max-lora-rank (zeros add nothing).

Who owns it: the layer (`ColumnParallelLinear.lora`, `RowParallelLinear.lora`, None without LoRA), made at setup
and written slot by slot as the plans load adapters (worker_svc/lora_adapters.py); the per-token slots come with
each step's attention metadata.

Tensor parallel, split the way the base layer is: a column-parallel layer holds, per fused part, A whole and
this rank's rows of B (the part's output rows it computes); a row-parallel layer holds this rank's input columns
of A and B whole, and its partial deltas are summed by the layer's all-reduce with the partial products (the sum
over ranks of (x_r A_r^T) B^T is (x A^T) B^T, up to the summation order, as for the base weight itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LoraAdd = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class LoraPart:
    """The adapters of one fused part: its output columns [offset, offset + rows) of the layer's output, A
    [slots, R, K] and B [slots, rows, R]."""

    offset: int
    rows: int
    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass(frozen=True)
class LayerLora:
    """`scalings` [slots]: each adapter's alpha / r (or alpha / sqrt(r), rsLoRA), one tensor shared by every
    layer. `lora_add`: the kernel (the torch reference on the CPU)."""

    parts: tuple[LoraPart, ...]
    scalings: torch.Tensor
    lora_add: LoraAdd

    def add_delta(self, output: torch.Tensor, hidden: torch.Tensor, token_slots: torch.Tensor) -> None:
        """In place: each token's adapter delta added to its row of `output` (the layer's output, or this rank's
        partial sum before a row-parallel all-reduce)."""
        for part in self.parts:
            self.lora_add(output[:, part.offset : part.offset + part.rows], hidden, part.lora_a, part.lora_b,
                          token_slots, self.scalings)
