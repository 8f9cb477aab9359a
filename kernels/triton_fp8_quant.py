"""Per-token FP8 activation quantization in one Triton kernel, and the FP8 matmul on the tensor cores.

Torch reference: kernels/fp8_linear_ref.py (`quantize_per_token`, `quantize_to_fp8`, `fp8_linear_ref`).

Why a kernel: the torch ops (abs, amax, divide, clamp, cast) read the activation four times and launch five
kernels before each FP8 matmul; one program per row reads its row twice (once for the amax, once to write
float8, the second read from L2) and writes the float8 row and its scale. A static `input_scale` skips the
amax pass. Divisions are IEEE-rounded (`div_rn`; Triton's `/` is approximate on a GPU), so the scales and
the float8 activations equal the reference's bit for bit.

The matmul is torch._scaled_mm (cuBLASLt FP8 on Hopper): `scale_a` [M, 1] per-token rowwise and `scale_b`
[1, N] per-channel, float32, with a bfloat16 output (rowwise scaling requires it); a model in another dtype
gets its output cast, and the bias is added after (in the model's dtype). The weight is passed as `weight.t()`: the [N, K] row-major float8
weight is the column-major [K, N] operand _scaled_mm wants, with no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_linear_ref import FP8_DTYPE, FP8_MAX, MIN_SCALE
from kernels.triton_numerics import is_interpreting

BLOCK = 1024


@triton.jit
def _quantize_rows(x_ptr, out_ptr, scale_ptr, static_scale_ptr, K, x_stride, out_stride,
                   STATIC: tl.constexpr, FP8_BOUND: tl.constexpr, SCALE_FLOOR: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_BOUND), SCALE_FLOOR)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        quantized = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_BOUND), FP8_BOUND)
        tl.store(out_ptr + row * out_stride + cols, quantized.to(out_ptr.dtype.element_ty), mask=cols < K)


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 x [M, K], float32 scales [M, 1]) of x [M, K]: per row (amax / 448), or with `static_scale` (a
    float32 scalar tensor) for every row."""
    rows, width = x.shape
    # The interpreter's float32 -> float8 cast is wrong where rounding carries into the exponent (125.3 -> 64,
    # not 128): interpreted, the kernel writes the saturated float32 quotients and torch casts them.
    interpreting = is_interpreting()
    quantized = torch.empty((rows, width), dtype=torch.float32 if interpreting else FP8_DTYPE, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    # With a static scale each row's scale is that scale: _scaled_mm's rowwise mode takes one per row.
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows[(rows,)](x, quantized, scales, scales if static_scale is None else static_scale, width,
                                x.stride(0), quantized.stride(0), STATIC=static_scale is not None,
                                FP8_BOUND=FP8_MAX, SCALE_FLOOR=MIN_SCALE,
                                BLOCK_K=min(BLOCK, triton.next_power_of_2(width)))
    return (quantized.to(FP8_DTYPE) if interpreting else quantized), scales


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor,
                  input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """y [*, N] in x's dtype: x [*, K] quantized here, float8 weight [N, K], weight_scale_row [1, N] float32,
    input_scale a float32 scalar (static) or None (per token), bias [N] or None."""
    rows = x.reshape(-1, x.shape[-1])
    quantized, scales = quantize_per_token(rows, input_scale)
    output = torch._scaled_mm(quantized, weight.t(), scale_a=scales, scale_b=weight_scale_row,
                              out_dtype=torch.bfloat16)
    if output.dtype != x.dtype:
        output = output.to(x.dtype)
    if bias is not None:
        output = output + bias
    return output.reshape(*x.shape[:-1], weight.shape[0])
