"""Weight-only integer GEMM (W4A16 / W8A16) in Triton: y = x W^T + b with W unpacked and dequantized in registers.

Torch reference: kernels/wna16_ref.py (`wna16_linear_ref`), whose docstring defines the one canonical layout read
here: qweight int32 [K // pack, N] packed along K (first value in the lowest bits), scales [K // G, N], zeros
[K // G, N] as floats or None (symmetric, zero point 2**(bits - 1)).

Each program owns a BLOCK_M x BLOCK_N tile of y. Per BLOCK_K step it loads the packed words of its K rows (every
word `pack` times, once per value it holds: the repeats are served from L1, each word comes from DRAM once),
shifts and masks out the values, subtracts the group's zero point and multiplies by the group's scale in fp32,
rounds W to x's dtype (the reference's rounding point: it casts the fp32 W to x's dtype before its matmul) and
feeds `tl.dot` with an fp32 accumulator. A BLOCK_K step never straddles two groups (group_size is a multiple of
BLOCK_K, or the whole of K), so one scale row and one zero row serve the step.

Two variants, one kernel source:

- plain tiled (any M beyond 16): grid (M tiles, N tiles), each program sums all of K.
- split-K (decode, M <= 16): a third grid dimension cuts K into slices whose fp32 partial sums a second small
  kernel adds in slice order, with the bias, rounding once to x's dtype (kernels/triton_split_k.py says why
  split, and why an ordered reduce rather than atomics).

Sizes are a fixed table chosen by M (`ROW_TILES`) and a split count computed from the shape alone
(`launch_plan`): no autotuning, since a CUDA graph captures one launch configuration and every constexpr
combination is a compile to warm up before capture (shared/KERNELS.md). Row, packed-row and split offsets are
int64: an lm_head-sized N times 16k rows overflows int32. Under TRITON_INTERPRET=1, 16-bit arithmetic is wrong
(kernels/triton_numerics.py), so `UPCAST` takes the 16-bit operands to fp32 after W's rounding to x's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton_numerics import dot_precision, needs_upcast
from kernels.triton_split_k import split_count, sum_splits
from kernels.wna16_ref import pack_factor

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SMALLEST_BLOCK_K = 16  # tl.dot's smallest K


class Tiles(NamedTuple):
    """One launch configuration of the GEMM: block sizes, warps, pipeline stages, and whether K may be split."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    split_k: bool


# (up to this many rows, tiles); the last holds any number of rows. Not yet timed on a GPU
# (benchmarks/wna16_gemm_gpu.py is the measurement to tune them by). Decode's BLOCK_K stays at 64: each
# step holds its packed words once per value (int32 [BLOCK_K, BLOCK_N]) and the dequantized fp32 tile in registers.
ROW_TILES = (
    (16, Tiles(16, 64, 64, 4, 3, split_k=True)),
    (64, Tiles(64, 64, 64, 4, 3, split_k=False)),
    (1 << 62, Tiles(128, 128, 64, 8, 3, split_k=False)),
)


class LaunchPlan(NamedTuple):
    """What one call launches: the tiles, BLOCK_K after fitting it to the group size, and the K slices (1: the
    plain variant, no partial buffer and no reduce)."""

    tiles: Tiles
    block_k: int
    splits: int


def launch_plan(num_rows: int, n_size: int, k_size: int, group_size: int, splits: int | None = None) -> LaunchPlan:
    """The launch for x [num_rows, k_size] times a [k_size, n_size] weight quantized in groups of `group_size`;
    `splits` forces the number of K slices (tests), None chooses it. Raises ValueError for a group size (one
    that divides K: `wna16_gemm` checks) the kernel cannot tile."""
    tiles = next(t for most_rows, t in ROW_TILES if num_rows <= most_rows)
    block_k = tiles.block_k
    if group_size != k_size:  # a BLOCK_K step must sit inside one group
        while group_size % block_k and block_k > SMALLEST_BLOCK_K:
            block_k //= 2
        if group_size % block_k:
            raise ValueError(f"group_size {group_size} is not a multiple of {SMALLEST_BLOCK_K} (nor all of K)")
    k_tiles = triton.cdiv(k_size, block_k)
    programs = triton.cdiv(num_rows, tiles.block_m) * triton.cdiv(n_size, tiles.block_n)
    return LaunchPlan(tiles, block_k, split_count(programs, k_tiles, splits)
                      if tiles.split_k or splits is not None else 1)


@triton.jit
def dequantize_tile(packed, shifts, scale_row_ptr, zero_row_ptr, cols, col_mask, BITS: tl.constexpr,
                    HAS_ZEROS: tl.constexpr):
    """W^T's [BLOCK_K, BLOCK_N] tile in fp32 from its packed words (int32, each word repeated for every value it
    holds; `shifts` [BLOCK_K] the bit offset of each row's value) and its one group's scale and zero rows
    (pointers to row `group` of scales and zeros, read at `cols`). Shared with the integer fused MoE
    (kernels/triton_fused_moe.py)."""
    q = ((packed >> shifts[:, None]) & ((1 << BITS) - 1)).to(tl.float32)  # the mask drops the sign's fill
    scale = tl.load(scale_row_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(zero_row_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        return (q - zero[None, :]) * scale[None, :]
    return (q - (1 << (BITS - 1))) * scale[None, :]


@triton.jit(do_not_specialize=["num_rows"])
def _wna16_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    num_rows, n_size, k_size, group_size, k_tiles_per_split,
    stride_x, stride_q, stride_s, stride_z, stride_out, stride_split,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y over K slice `program_id(2)`: with SPLIT, its fp32 partial sums to slice
    `program_id(2)` of `out_ptr`; without, y itself (plus the bias) in out_ptr's dtype."""
    PACK: tl.constexpr = 32 // BITS
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < num_rows, cols < n_size
    split = tl.program_id(2)
    k_first = split * k_tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_size, k_first + k_tiles_per_split * BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    shifts = (offs_k % PACK) * BITS  # BLOCK_K is a multiple of PACK: offs_k % PACK == k % PACK
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(k_first, k_end, BLOCK_K):
        ks = k_start + offs_k
        k_mask = ks < k_size  # only a per-channel K that is not a multiple of BLOCK_K has a partial step
        a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        packed = tl.load(qweight_ptr + (ks // PACK).to(tl.int64)[:, None] * stride_q + cols[None, :],
                         mask=k_mask[:, None] & col_mask[None, :], other=0)
        group = (k_start // group_size).to(tl.int64)
        w = dequantize_tile(packed, shifts, scales_ptr + group * stride_s, zeros_ptr + group * stride_z, cols,
                            col_mask, BITS, HAS_ZEROS)
        w = w.to(x_ptr.dtype.element_ty)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT:
        partial = out_ptr + split.to(tl.int64) * stride_split + rows[:, None] * stride_out + cols[None, :]
        tl.store(partial, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_operands(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    bits: int, group_size: int, bias: torch.Tensor | None) -> tuple[int, int]:
    """(K, N) of a valid call; ValueError naming the offending value otherwise."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D int32, got {qweight.dtype} of shape {tuple(qweight.shape)}")
    k_size = qweight.shape[0] * pack_factor(bits)  # pack_factor refuses other bit widths
    n_size = qweight.shape[1]
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"activation dtype {x.dtype} is not served (supported: {ACTIVATION_DTYPES})")
    if x.shape[-1] != k_size:
        raise ValueError(f"x has {x.shape[-1]} input features, the packed weight {k_size}")
    if group_size <= 0 or k_size % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {k_size} input features")
    expected = (k_size // group_size, n_size)
    for name, tensor in (("scales", scales), ("zeros", zeros)):
        if tensor is not None and tuple(tensor.shape) != expected:
            raise ValueError(f"{name} of shape {tuple(tensor.shape)}, expected {expected}")
    if bias is not None and tuple(bias.shape) != (n_size,):
        raise ValueError(f"bias of shape {tuple(bias.shape)}, expected ({n_size},)")
    return k_size, n_size


def _columns_contiguous(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor if tensor is None or tensor.stride(-1) == 1 else tensor.contiguous()


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
               group_size: int, bias: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """y = x W^T + b for x [*, K] in fp16 / bf16 / fp32 and W in the canonical layout (module docstring): [*, N]
    in x's dtype. `splits` forces the number of K slices (tests and benchmarks); None lets `launch_plan` choose
    by the number of rows. Every size is a function of the shapes: the call can be captured in a CUDA graph."""
    k_size, n_size = _check_operands(x, qweight, scales, zeros, bits, group_size, bias)
    leading = x.shape[:-1]
    x = _columns_contiguous(x.reshape(-1, k_size))
    qweight, scales, zeros, bias = (_columns_contiguous(t) for t in (qweight, scales, zeros, bias))
    num_rows = x.shape[0]
    plan = launch_plan(num_rows, n_size, k_size, group_size, splits)
    out = torch.empty((num_rows, n_size), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n_size == 0:
        return out.reshape(*leading, n_size)
    tiles = plan.tiles
    k_tiles_per_split = triton.cdiv(triton.cdiv(k_size, plan.block_k), plan.splits)
    split = plan.splits > 1
    target = torch.empty((plan.splits, num_rows, n_size), dtype=torch.float32, device=x.device) if split else out
    grid = (triton.cdiv(num_rows, tiles.block_m), triton.cdiv(n_size, tiles.block_n), plan.splits)
    _wna16_gemm_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, target,
        num_rows, n_size, k_size, group_size, k_tiles_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0) if zeros is not None else 0,
        target.stride(-2), target.stride(0) if split else 0,
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=plan.block_k,
        UPCAST=needs_upcast(x.dtype), DOT_PRECISION=dot_precision(x.dtype),
        num_warps=tiles.warps, num_stages=tiles.stages,
    )
    if split:
        sum_splits(target, bias, out)
    return out.reshape(*leading, n_size)
