"""Torch reference of the INT8 W8A8 linear layer (compressed-tensors "int-quantized", llm-compressor's W8A8):
quantize the activation, dequantize both operands to float32, then the plain matmul.

The math: the weight W [N, K] is int8 with one scale per output channel (row) s_w [N] (a per-tensor scale is
that scale on every row); the activation x [M, K] is quantized to int8 with one scale per row (token) computed
at run time ("dynamic"), or with the checkpoint's static per-tensor `input_scale`. Then

    y = (q(x) * s_x) @ (W * s_w)^T + b,   cast to x's dtype.

q follows compressed-tensors' own symmetric int8 quantization (`calculate_qparams`, `round_to_quantized_type_args`),
the forward the checkpoint was calibrated and evaluated with: s_x = amax(|x_row|) / 127.5 (its range 255 over 2;
vLLM's CUDA kernel divides by 127 instead), x / s_x clamped to [-128, 127] and rounded half to even
(torch.round); an all-zero row gets a nonzero scale (its quotients are 0 whatever it is). Unlike
compressed-tensors, which divides in the model's dtype, this divides in float32: the same for a float32 model,
within one bf16 rounding of the quotient for a bf16 one.

Why a reference: it runs on any device (CI's CPU). The GPU path (kernels/triton_int8_quant.py: a Triton
quantizer and torch._int_mm) computes the same integers and the same product, and its test compares the two.
"""

from __future__ import annotations

import torch

INT8_MIN, INT8_MAX = -128.0, 127.0
# compressed-tensors' symmetric scale divides the absolute maximum by half the int8 range, (127 - -128) / 2.
HALF_RANGE = (INT8_MAX - INT8_MIN) / 2


def quantize_to_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(clamp(x / scale, -128, 127)) as int8 (ties to even); `scale` broadcasts against x."""
    return torch.round((x.float() / scale.float()).clamp(INT8_MIN, INT8_MAX)).to(torch.int8)


def symmetric_int8_scales(x: torch.Tensor) -> torch.Tensor:
    """One float32 scale per row of x [M, K], amax / 127.5, shape [M, 1]; a zero row's scale is 1."""
    scales = x.float().abs().amax(dim=-1, keepdim=True) / HALF_RANGE
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 x [M, K], float32 scales [M, 1]): the dynamic activation quantization."""
    scales = symmetric_int8_scales(x)
    return quantize_to_int8(x, scales), scales


def int8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """y [*, N] in x's dtype from x [*, K], int8 weight [N, K], weight_scale [N] float32, input_scale (a float32
    scalar: static; None: per token) and bias [N] or None. Dequantized to float32, then one matmul."""
    rows = x.reshape(-1, x.shape[-1])
    if input_scale is None:
        quantized, scales = quantize_per_token_int8(rows)
    else:
        scales = input_scale.float().reshape(1, 1)
        quantized = quantize_to_int8(rows, scales)
    activation = quantized.float() * scales
    output = activation @ (weight.float() * weight_scale.float().reshape(-1, 1)).t()
    if bias is not None:
        output = output + bias.float()
    return output.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
