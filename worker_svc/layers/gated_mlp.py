"""The SiLU-gated MLP of the Llama family (gate and up fused into one projection)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.layer_ops import LayerOps
from worker_svc.model_config import ModelConfig


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one projection whose output halves feed silu_and_mul."""

    def __init__(self, config: ModelConfig, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(hidden)))
