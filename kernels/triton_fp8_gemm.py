"""FP8 W8A8 GEMM for few rows (decode) in Triton: y = (q(x) @ W^T) * s_x[row] * s_w[col] (+ b), split along K.

Torch reference: kernels/fp8_linear_ref.py (`fp8_linear_ref`). `fp8_fewrow_mm` is a drop-in for
kernels/triton_fp8_quant.py's `fp8_scaled_mm` (same arguments, same scale conventions): x [*, K] in the model's
dtype is quantized per token (or with the static `input_scale`) by the same Triton quantizer, W is the layer's
float8_e4m3fn [N, K] as Fp8Linear stores it (row-major, K contiguous: read in place, no second copy), s_w the
float32 [1, N] row of per-output-channel scales, s_x the float32 [M, 1] per-row scales.

Why not torch._scaled_mm at few rows: measured on an H200, cuBLASLt's FP8 GEMM at 1-16 rows was slower than
the bf16 one (Llama-3.1-8B qkv: 21 us against 15 us) although it reads half the bytes. At M <= 16 the GEMM is
bound by reading W; this kernel streams W once through N x K-slice programs (kernels/triton_split_k.py: why split
K, and why the slices are summed by an ordered reduce, not atomics, so outputs are the same bits every run).

Each program holds a BLOCK_N x BLOCK_M tile of y^T: the product is computed as W_tile [BLOCK_N, BLOCK_K] times
x_tile^T [BLOCK_K, BLOCK_M] ("swap AB"), so the wide weight tile is the MMA's M side (Hopper's FP8 wgmma wants
M >= 64 and both operands K-major, which a row-major W and a row-major x give as they are) and the few token rows
the narrow N side (BLOCK_M = 16, tl.dot's smallest). The fp32 accumulator is multiplied by s_w and s_x in the
epilogue (the reference multiplies before summing: the same value up to fp32 rounding). Unsplit, the program adds
the bias and rounds once to the output dtype; split, it writes scaled fp32 partials for the reduce, which adds
the bias and rounds once. The output is rounded once from fp32 (fp8_scaled_mm rounds _scaled_mm's bf16 output,
then adds the bias in the model's dtype: the two paths can differ by an ulp).

Tiles: one default (`DEFAULT_TILES`) and a small table of candidates (`CANDIDATE_TILES`) that
benchmarks/fp8_linear_gpu.py times on a GPU; `tiles=` and `splits=` force a configuration. No autotuning: a
CUDA graph captures one launch and every constexpr combination is a compile to warm up before capture. Every
size is a function of the shapes, with no host sync: the call can be captured.

On the GPU the tensor cores take the float8 operands and accumulate in fp32. Under TRITON_INTERPRET=1 the kernel
runs unchanged, with no upcast constexpr (16-bit kernels need one: kernels/triton_numerics.py): the interpreter's
`tl.dot` converts float8 operands to fp16, which holds every e4m3 value exactly, and multiplies in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fp8_linear_ref import FP8_DTYPE
from kernels.triton_fp8_quant import quantize_per_token
from kernels.triton_split_k import split_count, sum_splits

# Up to this many rows Fp8Linear takes this kernel, beyond it torch._scaled_mm (which wins from ~256 rows).
FEW_ROWS = 16
BLOCK_M = 16  # rows per program: tl.dot's smallest side; one row tile covers all of FEW_ROWS
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Fp8Tiles(NamedTuple):
    """One launch configuration: weight rows (output columns) and K per step, warps, pipeline stages."""

    block_n: int
    block_k: int
    warps: int
    stages: int


# What a GPU sweep chooses between (benchmarks/fp8_linear_gpu.py). Shared memory per stage is
# (BLOCK_N + BLOCK_M) x BLOCK_K bytes: at most 36 KiB, 180 KiB at 5 stages (an H100/H200 SM has 227 KiB).
CANDIDATE_TILES = tuple(Fp8Tiles(block_n, block_k, 4, stages) for block_n in (32, 64, 128)
                        for block_k in (128, 256) for stages in (3, 4, 5))
# Not yet timed on a GPU: a guess (64-wide tiles give a 4096-wide projection 64 tiles, each split K in 4).
DEFAULT_TILES = Fp8Tiles(64, 256, 4, 4)


@triton.jit(do_not_specialize=["num_rows"])
def _fp8_gemm_kernel(
    x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr,
    num_rows, n_size, k_size, k_tiles_per_split,
    stride_x, stride_w, stride_out, stride_split,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y^T's [BLOCK_N, BLOCK_M] tile over K slice `program_id(2)`, scaled by s_w and s_x: with SPLIT, fp32 partial
    sums to slice `program_id(2)` of `out_ptr` [splits, M, N]; without, y itself (plus the bias) in out's dtype."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < num_rows, cols < n_size
    split = tl.program_id(2)
    k_first = split * k_tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_size, k_first + k_tiles_per_split * BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k_start in range(k_first, k_end, BLOCK_K):
        ks = k_start + offs_k
        k_mask = ks < k_size  # only a K that is not a multiple of BLOCK_K has a partial step
        w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=col_mask[:, None] & k_mask[None, :],
                    other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
    acc = acc * w_scale[:, None] * x_scale[None, :]
    mask = col_mask[:, None] & row_mask[None, :]
    if SPLIT:
        partial = out_ptr + split.to(tl.int64) * stride_split + rows[None, :] * stride_out + cols[:, None]
        tl.store(partial, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows[None, :] * stride_out + cols[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_operands(x_fp8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
                    weight_scale_row: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    """ValueError naming the offending operand of an invalid call."""
    if x_fp8.dtype != FP8_DTYPE or x_fp8.dim() != 2:
        raise ValueError(f"x must be 2-D {FP8_DTYPE}, got {x_fp8.dtype} of shape {tuple(x_fp8.shape)}")
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"weight must be 2-D {FP8_DTYPE}, got {weight.dtype} of shape {tuple(weight.shape)}")
    num_rows, k_size = x_fp8.shape
    n_size = weight.shape[0]
    if weight.shape[1] != k_size:
        raise ValueError(f"x has {k_size} input features, the weight {weight.shape[1]}")
    if weight.stride(1) != 1:
        raise ValueError("the weight [N, K] must be contiguous along K (Fp8Linear's layout)")
    if x_scales.dtype != torch.float32 or x_scales.numel() != num_rows:
        raise ValueError(f"x_scales must hold {num_rows} float32 values, got {x_scales.dtype} "
                         f"of shape {tuple(x_scales.shape)}")
    if weight_scale_row.dtype != torch.float32 or tuple(weight_scale_row.shape) != (1, n_size):
        raise ValueError(f"weight_scale_row must be float32 (1, {n_size}), got {weight_scale_row.dtype} "
                         f"of shape {tuple(weight_scale_row.shape)}")
    if bias is not None and tuple(bias.shape) != (n_size,):
        raise ValueError(f"bias of shape {tuple(bias.shape)}, expected ({n_size},)")
    if out_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output dtype {out_dtype} is not served (supported: {OUTPUT_DTYPES})")


def launch_splits(num_rows: int, n_size: int, k_size: int, tiles: Fp8Tiles, splits: int | None = None) -> int:
    """The K slices `fp8_gemm` launches for x [num_rows, k_size] times W [n_size, k_size]^T with `tiles`
    (`splits` forces them: ValueError below 1)."""
    tile_programs = triton.cdiv(num_rows, BLOCK_M) * triton.cdiv(n_size, tiles.block_n)
    return split_count(tile_programs, triton.cdiv(k_size, tiles.block_k), splits)


def fp8_gemm(x_fp8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, tiles: Fp8Tiles = DEFAULT_TILES,
             splits: int | None = None) -> torch.Tensor:
    """y [M, N] in `out_dtype` from float8 x [M, K] with float32 x_scales [M, 1], float8 weight [N, K] with
    float32 weight_scale_row [1, N], and bias [N] or None. `tiles` and `splits` (the number of K slices; None:
    split_count's choice) force a configuration (tests, benchmarks). Any M works; it is fast for M <= FEW_ROWS."""
    _check_operands(x_fp8, x_scales, weight, weight_scale_row, bias, out_dtype)
    num_rows, k_size = x_fp8.shape
    n_size = weight.shape[0]
    if x_fp8.stride(1) != 1:
        x_fp8 = x_fp8.contiguous()
    x_scales, w_scales = x_scales.reshape(-1).contiguous(), weight_scale_row.reshape(-1).contiguous()
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty((num_rows, n_size), dtype=out_dtype, device=x_fp8.device)
    if num_rows == 0 or n_size == 0:
        return out
    num_splits = launch_splits(num_rows, n_size, k_size, tiles, splits)
    split = num_splits > 1
    target = torch.empty((num_splits, num_rows, n_size), dtype=torch.float32, device=x_fp8.device) if split else out
    grid = (triton.cdiv(num_rows, BLOCK_M), triton.cdiv(n_size, tiles.block_n), num_splits)
    _fp8_gemm_kernel[grid](
        x_fp8, weight, x_scales, w_scales, bias if bias is not None else w_scales, target,
        num_rows, n_size, k_size, triton.cdiv(triton.cdiv(k_size, tiles.block_k), num_splits),
        x_fp8.stride(0), weight.stride(0), target.stride(-2), target.stride(0) if split else 0,
        HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_M=BLOCK_M, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )
    if split:
        sum_splits(target, bias, out)
    return out


def fp8_fewrow_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor,
                  input_scale: torch.Tensor | None, bias: torch.Tensor | None, tiles: Fp8Tiles = DEFAULT_TILES,
                  splits: int | None = None) -> torch.Tensor:
    """fp8_scaled_mm's contract (y [*, N] in x's dtype: x [*, K] quantized here, float8 weight [N, K],
    weight_scale_row [1, N] float32, input_scale a float32 scalar (static) or None (per token), bias [N] or None)
    computed by `fp8_gemm`."""
    quantized, scales = quantize_per_token(x.reshape(-1, x.shape[-1]), input_scale)
    output = fp8_gemm(quantized, scales, weight, weight_scale_row, bias, x.dtype, tiles, splits)
    return output.reshape(*x.shape[:-1], weight.shape[0])
