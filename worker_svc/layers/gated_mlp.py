"""The SiLU-gated MLP of the Llama family (gate and up fused into one projection)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.layer_ops import LayerOps
from worker_svc.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.model_config import ModelConfig
from worker_svc.tensor_parallel import TensorParallel


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one projection whose output halves feed silu_and_mul.
    Tensor parallel: each rank holds its share of the intermediate features (of gate and of up alike), and
    down_proj's all-reduce sums the shares."""

    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel):
        super().__init__()
        self.ops = ops
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.split(config.hidden_size, [inter, inter], bias=False, tp=tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False, tp=tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(hidden)))
