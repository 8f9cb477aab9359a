"""Torch reference of the FP8 W8A8 linear layer: quantize, dequantize, then the plain matmul.

The math (vLLM's "fp8" and compressed-tensors' FP8 W8A8 schemes): the weight W [N, K] is float8_e4m3fn with
one float32 scale per output channel (row) s_w [N] (a per-tensor scale is that scale on every row); the
activation x [M, K] is quantized to float8_e4m3fn with one scale per row (token), s_x = amax(|x_row|) / 448,
computed at run time ("dynamic"), or with one static scale from the checkpoint (`input_scale`). Then

    y = (q(x) * s_x) @ (W * s_w)^T + b,   cast to x's dtype.

Why a reference: CI has no FP8 tensor cores. This computes exactly the quantized math in float32 on any
device; the GPU path (kernels/fp8_linear.py: torch._scaled_mm) computes the same product on the tensor
cores, and its test compares the two. 448 is the largest finite float8_e4m3fn.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# The smallest scale a row gets (an all-zero row would divide by 0): vLLM's 1 / (448 * 512).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to +-448, as float8_e4m3fn (round to nearest even). `scale` broadcasts against x."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def per_token_scales(x: torch.Tensor) -> torch.Tensor:
    """One float32 scale per row of x [M, K]: amax / 448 (at least MIN_SCALE), shape [M, 1]."""
    return (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 x, its scales [M, 1]): the dynamic activation quantization."""
    scales = per_token_scales(x)
    return quantize_to_fp8(x, scales), scales


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 W [N, K], float32 scales [N]): one scale per output channel, amax / 448 of its row (online fp8)."""
    scales = per_token_scales(weight)
    return quantize_to_fp8(weight, scales), scales.squeeze(-1)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """y [*, N] in x's dtype from x [*, K], float8 weight [N, K], weight_scale [N] float32, input_scale (a
    float32 scalar: static; None: per token) and bias [N] or None. Dequantized to float32, then one matmul."""
    rows = x.reshape(-1, x.shape[-1])
    if input_scale is None:
        quantized, scales = quantize_per_token(rows)
    else:
        scales = input_scale.float().reshape(1, 1)
        quantized = quantize_to_fp8(rows, scales)
    activation = quantized.float() * scales
    output = activation @ (weight.float() * weight_scale.float().reshape(-1, 1)).t()
    if bias is not None:
        output = output + bias.float()
    return output.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
