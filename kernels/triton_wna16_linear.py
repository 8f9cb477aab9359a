"""A weight-only integer linear (W4A16 / W8A16) on the GPU: a CUDA-core GEMV for one to four rows
(kernels/triton_wna16_gemv.py says why), the in-register GEMM for a decode's few rows, the whole weight
dequantized then a dense matmul for more.

Why two ways: at 1-16 rows the step is bound by reading the weights, and the split-K GEMM of
kernels/triton_wna16_gemm.py reads a quarter (4-bit) of a bf16 layer's bytes. With more rows the product is
compute-bound, and the Triton GEMM, which dequantizes every weight tile once per BLOCK_M rows and feeds
mma from registers, ran at 0.2-0.4x of cuBLAS's bf16 matmul on an H200 at 64 and 256 rows (sweep in
docs/quantization.md). Dequantizing the whole weight into a scratch buffer in x's dtype (read 0.5 bytes per
weight, write 2) and handing it to torch's linear costs one extra pass over the bf16 bytes, which the matmul's
own time hides more and more as rows grow. The dequantized weight is the reference's own (kernels/wna16_ref.py:
the fp32 W rounded to x's dtype, same bits), so this path is the reference computed by cuBLAS. The scratch
buffer comes from torch's caching allocator per call: the largest layer's (Llama-3.1-8B gate_up: 235 MB in
bf16) is reused, and the memory profile, which runs the largest step, counts it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_wna16_gemm import bf16_dequant_applies, check_operands, dequantize_step, launch_plan, wna16_gemm
from kernels.triton_wna16_gemv import GEMV_MOST_ROWS, wna16_gemv
from kernels.wna16_ref import pack_factor

GEMM_MOST_ROWS = 16  # more rows than this: dequantize, then torch's linear
DEQUANT_BLOCK_K, DEQUANT_BLOCK_N = 64, 128


@triton.jit
def _dequantize_kernel(qweight_ptr, scales_ptr, zeros_ptr, out_ptr, n_size, k_size, group_size, stride_q,
                       stride_s, stride_z, stride_out, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr,
                       BF16_DEQUANT: tl.constexpr):
    """W^T's [BLOCK_K, BLOCK_N] tile (program_id 0: K, 1: N) into out [K, N] in out's dtype."""
    PACK: tl.constexpr = 32 // BITS
    k_start = tl.program_id(0) * BLOCK_K
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_size
    packed_rows = (k_start // PACK + tl.arange(0, BLOCK_K // PACK)).to(tl.int64)
    packed = tl.load(qweight_ptr + packed_rows[:, None] * stride_q + cols[None, :],
                     mask=(packed_rows * PACK < k_size)[:, None] & col_mask[None, :], other=0)
    w = dequantize_step(packed, scales_ptr, zeros_ptr, k_start, cols, col_mask, k_size, group_size, stride_s,
                        stride_z, BITS, HAS_ZEROS, BLOCK_K, BLOCK_N, GROUP_K, BF16_DEQUANT,
                        out_ptr.dtype.element_ty)
    ks = (k_start + tl.arange(0, BLOCK_K)).to(tl.int64)
    tl.store(out_ptr + ks[:, None] * stride_out + cols[None, :], w, mask=(ks < k_size)[:, None] & col_mask[None, :])


def wna16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                     group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N] in `dtype` from the canonical layout: kernels/wna16_ref.py's `dequantize_wna16` rounded to
    `dtype`, the same bits."""
    k_size, n_size = qweight.shape[0] * pack_factor(bits), qweight.shape[1]
    out = torch.empty((k_size, n_size), dtype=dtype, device=qweight.device)
    plan = launch_plan(GEMM_MOST_ROWS + 1, n_size, k_size, group_size)  # only for BLOCK_K fitted to the groups
    block_k = min(DEQUANT_BLOCK_K, plan.block_k)
    group_k = block_k if plan.group_k == plan.block_k else plan.group_k
    _dequantize_kernel[(triton.cdiv(k_size, block_k), triton.cdiv(n_size, DEQUANT_BLOCK_N))](
        qweight, scales, zeros if zeros is not None else scales, out, n_size, k_size, group_size,
        qweight.stride(0), scales.stride(0), zeros.stride(0) if zeros is not None else 0, out.stride(0),
        BITS=bits, HAS_ZEROS=zeros is not None, BLOCK_K=block_k, BLOCK_N=DEQUANT_BLOCK_N, GROUP_K=group_k,
        BF16_DEQUANT=bf16_dequant_applies(dtype, bits, scales), num_warps=4,
    )
    return out


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bits: int, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b (the arguments of `wna16_gemm`): the CUDA-core GEMV for at most GEMV_MOST_ROWS rows
    (kernels/triton_wna16_gemv.py), the GEMM for at most GEMM_MOST_ROWS, else the dequantized weight and torch's
    linear (as the reference) (module docstring). The choice is a function of the shapes."""
    k_size, n_size = check_operands(x, qweight, scales, zeros, bits, group_size, bias)
    if 0 < x.numel() // k_size <= GEMV_MOST_ROWS:
        return wna16_gemv(x, qweight, scales, zeros, bits, group_size, bias=bias)
    if x.numel() // k_size <= GEMM_MOST_ROWS:
        return wna16_gemm(x, qweight, scales, zeros, bits, group_size, bias=bias)
    weight = wna16_dequantize(qweight.contiguous(), scales.contiguous(),
                              zeros.contiguous() if zeros is not None else None, bits, group_size, x.dtype)
    return torch.nn.functional.linear(x, weight.t(), None if bias is None else bias.to(x.dtype))
