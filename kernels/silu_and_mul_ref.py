"""Torch reference of the gated MLP activation: SiLU(gate) * up, the math of llama.py's MLP.

Why `[T, 2 * I]` input: a fused gate_up projection produces gate and up side by side in one matmul;
the kernel (kernels/triton_silu_and_mul.py) reads both halves of a row and writes `[T, I]`. Rounding is
HF's `act_fn(gate_proj(x)) * up_proj(x)` in the activation dtype: SiLU (computed in fp32 by torch)
rounds, then the product rounds again.
"""

from __future__ import annotations

import torch
from torch import nn


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last axis times the second half."""
    gate, up = gate_up.chunk(2, dim=-1)
    # contiguous(): torch's CPU SiLU takes a different (last-bit different) path on a strided view;
    # the model applies it to a whole projection output.
    return nn.functional.silu(gate.contiguous()) * up
