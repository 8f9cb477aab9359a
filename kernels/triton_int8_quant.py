"""Per-token INT8 activation quantization in one Triton kernel, and the INT8 matmul (torch._int_mm) with its
scale epilogue.

Torch reference: kernels/int8_linear_ref.py (`quantize_per_token_int8`, `quantize_to_int8`, `int8_linear_ref`).

Why a kernel: the torch ops (abs, amax, divide, clamp, round, cast) read the activation several times and launch
six kernels before each matmul; one program per row reads its row twice (the amax pass, then the quantizing
pass, from L2) and writes the int8 row and its float32 scale. A static `input_scale` skips the amax pass.
Divisions are IEEE-rounded (`div_rn`: Triton's `/` is approximate on a GPU) and the rounding is half to even
(libdevice's rint; in the interpreter, which has no libdevice, adding and subtracting 1.5 * 2**23, which
rounds a float32 below 2**22 to an integer half to even), so the scales and integers equal the reference's.

The matmul is torch._int_mm (int8 x int8 -> int32 on the tensor cores, cuBLASLt). Its CUDA constraints:
more than 16 rows on some torch versions (the quantized activation is allocated with at least 17 rows, the
extra ones zero, and the product sliced back), K and N multiples of 8 (other shapes take the float32 product of
the same integers: slower). The weight is passed as `weight.t()`: the [N, K] row-major int8 weight is
the column-major [K, N] operand, with no copy. The epilogue (int32 -> float32, times the per-token and the
per-channel scales, plus the bias) runs in float32 and casts to the activation's dtype once, as the reference
does. No host syncs or data-dependent shapes: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.int8_linear_ref import HALF_RANGE, INT8_MAX, INT8_MIN
from kernels.triton_numerics import has_libdevice

BLOCK = 1024
INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA has required more than 16 rows
INT_MM_MULTIPLE = 8  # ... and K, N multiples of 8
ROUNDING_MAGIC: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + it lands where a float32 ulp is 1


@triton.jit
def _round_half_even(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.rint(x)
    return (x + ROUNDING_MAGIC) - ROUNDING_MAGIC


@triton.jit
def _quantize_rows(x_ptr, out_ptr, scale_ptr, static_scale_ptr, K, x_stride, out_stride,
                   STATIC: tl.constexpr, LIBDEVICE: tl.constexpr, Q_MIN: tl.constexpr, Q_MAX: tl.constexpr,
                   SCALE_DIVISOR: tl.constexpr, BLOCK_K: tl.constexpr):
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
        scale = tl.math.div_rn(tl.max(amax, axis=0), SCALE_DIVISOR)
        scale = tl.where(scale > 0, scale, 1.0)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        clamped = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), Q_MIN), Q_MAX)
        tl.store(out_ptr + row * out_stride + cols, _round_half_even(clamped, LIBDEVICE).to(tl.int8),
                 mask=cols < K)


def quantize_per_token_int8(x: torch.Tensor, static_scale: torch.Tensor | None = None, min_rows: int = 0
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 x [max(M, min_rows), K], float32 scales [M, 1]) of x [M, K]: per row (amax / 127.5), or with
    `static_scale` (a float32 scalar tensor) for every row. Rows past M (padding for torch._int_mm) are zero."""
    rows, width = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    padded = max(rows, min_rows)
    quantized = (torch.zeros if padded > rows else torch.empty)((padded, width), dtype=torch.int8, device=x.device)
    # With a static scale each row's scale is that scale: the epilogue takes one per row either way.
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows[(rows,)](x, quantized, scales, scales if static_scale is None else static_scale, width,
                                x.stride(0), quantized.stride(0), STATIC=static_scale is not None,
                                LIBDEVICE=has_libdevice(), Q_MIN=INT8_MIN, Q_MAX=INT8_MAX,
                                SCALE_DIVISOR=HALF_RANGE, BLOCK_K=min(BLOCK, triton.next_power_of_2(width)))
    return quantized, scales


def int8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor,
                   input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """y [*, N] in x's dtype: x [*, K] quantized here, int8 weight [N, K], weight_scale_row [1, N] float32,
    input_scale a float32 scalar (static) or None (per token), bias [N] or None."""
    rows = x.reshape(-1, x.shape[-1])
    count, width = rows.shape
    out_features = weight.shape[0]
    fits = width % INT_MM_MULTIPLE == 0 and out_features % INT_MM_MULTIPLE == 0
    quantized, scales = quantize_per_token_int8(rows, input_scale, INT_MM_MIN_ROWS if fits else 0)
    if fits:
        accumulated = torch._int_mm(quantized, weight.t())[:count].float()
    else:
        accumulated = quantized.float() @ weight.t().float()  # exact while K * 128 * 128 < 2**24
    output = accumulated * scales * weight_scale_row
    if bias is not None:
        output = output + bias.float()
    return output.to(x.dtype).reshape(*x.shape[:-1], out_features)
