"""RMSNorm with the residual add fused in, through the layer ops (torch reference or Triton)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.layer_ops import LayerOps


class RMSNorm(nn.Module):
    """RMSNorm with an optional residual add fused in: `norm(hidden, residual)` returns (normed, the sum).

    `unit_offset` (Gemma): the weight is an offset from 1, multiplied in fp32 (ops.gemma_rms_norm)."""

    def __init__(self, hidden_size: int, eps: float, ops: LayerOps, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.norm = ops.gemma_rms_norm if unit_offset else ops.rms_norm

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(hidden, self.weight, self.eps, residual)
