"""The gated MLP of the Llama family (SiLU) and of Gemma (GELU), gate and up fused into one projection."""

from __future__ import annotations

import torch
from torch import nn

from kernels.layer_ops import LayerOps
from kernels.lora_ref import LoraTokens
from worker_svc.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.model_config import ModelConfig
from worker_svc.tensor_parallel import TensorParallel


# HF activation names (ACT2FN) -> torch's GELU `approximate`; "silu" is the Llama family's.
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GatedMLP(nn.Module):
    """Gated MLP with gate and up fused into one projection whose output halves feed the activation-and-mul
    (`activation` an HF name: "silu", or Gemma's "gelu_pytorch_tanh" / "gelu").
    Tensor parallel: each rank holds its share of the intermediate features (of gate and of up alike), and
    down_proj's all-reduce sums the shares."""

    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel, activation: str = "silu"):
        super().__init__()
        if activation != "silu" and activation not in GELU_APPROXIMATIONS:
            supported = ["silu", *GELU_APPROXIMATIONS]
            raise ValueError(f"hidden activation {activation!r} is not supported; supported: {supported}")
        self.ops = ops
        self.approximate = GELU_APPROXIMATIONS.get(activation)
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.split(config.hidden_size, [inter, inter], bias=False, tp=tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False, tp=tp)

    def forward(self, hidden: torch.Tensor, lora_tokens: LoraTokens | None = None) -> torch.Tensor:
        """`lora_tokens`: each token's LoRA slot (-1 none) and their order by slot, or None when no token has an
        adapter."""
        gate_up = self.gate_up_proj(hidden, lora_tokens)
        if self.approximate is None:
            return self.down_proj(self.ops.silu_and_mul(gate_up), lora_tokens)
        return self.down_proj(self.ops.gelu_and_mul(gate_up, self.approximate), lora_tokens)
