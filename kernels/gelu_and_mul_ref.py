"""Torch reference of the GeGLU activation: GELU(gate) * up, the math of Gemma's MLP.

Same layout as silu_and_mul_ref.py (`[T, 2 * I]`, gate half first, from a fused gate_up projection) and the
same rounding: HF's `act_fn(gate_proj(x)) * up_proj(x)` in the activation dtype, GELU rounded, then the
product. `approximate` is torch's: "tanh" (HF's gelu_pytorch_tanh, Gemma 2/3 and most Gemma 1 configs) or
"none" (HF's exact "gelu").
"""

from __future__ import annotations

import torch
from torch import nn


def gelu_and_mul(gate_up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU of the first half of the last axis times the second half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.gelu(gate.contiguous(), approximate=approximate) * up
