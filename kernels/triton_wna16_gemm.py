"""Weight-only integer GEMM (W4A16 / W8A16) in Triton: y = x W^T + b with W unpacked and dequantized in registers.

Torch reference: kernels/wna16_ref.py (`wna16_linear_ref`), whose docstring defines the one canonical layout read
here: qweight int32 [K // pack, N] packed along K (first value in the lowest bits), scales [K // G, N], zeros
[K // G, N] as floats or None (symmetric, zero point 2**(bits - 1)).

Each program owns a BLOCK_M x BLOCK_N tile of y. Per BLOCK_K step it loads the step's packed words once
(int32 [BLOCK_K // pack, BLOCK_N]: each word from DRAM once, one load instruction per word), unpacks them by
shifting every word by each of its `pack` bit offsets ([BLOCK_K // pack, pack, BLOCK_N], reshaped in order to
[BLOCK_K, BLOCK_N]: packed along K, first value in the lowest bits, so the reshape's row-major order is K's),
subtracts the zero point and multiplies by the scale in fp32, rounds W to x's dtype (the reference's rounding
point: it casts the fp32 W to x's dtype before its matmul) and feeds `tl.dot` with an fp32 accumulator. A step
covers GROUPS_PER_STEP whole groups of GROUP_K rows (BLOCK_K a multiple of the group size: 4 groups of 32 in a
step of 128) or lies inside one group (the group size a multiple of BLOCK_K, or the whole of K): the scale and
zero rows of its groups are loaded once ([GROUPS_PER_STEP, BLOCK_N]) and broadcast over their GROUP_K rows.
With bf16 activations and 4-bit values (`BF16_DEQUANT`), the values become bf16 without an int-to-float conversion
(quarter rate on the GPU): OR-ing q (0..15) into 0x4300, the bits of bf16 128.0 whose mantissa's last bit is 1,
gives the bf16 number 128 + q; subtracting 128, then the zero point (a small integer), is exact in bf16, and
the one bf16 multiply by the scale rounds the exact product once, as the fp32 path's product rounded to bf16
does: the same bits. (Zero points are integers in every served format: AWQ, GPTQ, compressed-tensors.)
Why not the simpler load of every word once per value it holds (one int32 per W element, the repeats served
from L1): measured on an H200 it reached 14-17% of the copy bandwidth at decode's row counts, slower than the
bf16 layer it replaces; it issued `pack` times the load instructions and kept `pack` times the registers.

`SWAP_AB` computes y^T = W x^T instead: tl.dot's first operand is the dequantized [BLOCK_N, BLOCK_K] W tile (64
or more wide) and the second the [BLOCK_K, BLOCK_M] x^T, as the FP8 few-row GEMM does (kernels/triton_fp8_gemm.py):
Hopper's wgmma takes a first operand at least 64 rows tall, straight from registers, where decode's 16-row x
as the first operand leaves the older mma instructions.

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
# Split-K: aim for this many programs (the sweep's fastest split counts gave 512-1792 on an H200's 132 SMs).
SPLIT_TARGET_PROGRAMS = 1024


class Tiles(NamedTuple):
    """One launch configuration of the GEMM: block sizes, warps, pipeline stages, and whether K may be split."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    split_k: bool
    swap_ab: bool = False  # y^T = W x^T: the dequantized W as tl.dot's wide first operand (module docstring)


# (up to this many rows, tiles); the last holds any number of rows. Chosen by benchmarks/wna16_gemm_gpu.py
# `--sweep` on an H200 (docs/quantization.md has the figures).
ROW_TILES = (
    (16, Tiles(16, 128, 64, 4, 3, split_k=True, swap_ab=True)),
    (64, Tiles(64, 64, 128, 4, 3, split_k=False)),
    (1 << 62, Tiles(128, 64, 128, 8, 3, split_k=False)),
)


class LaunchPlan(NamedTuple):
    """What one call launches: the tiles, BLOCK_K after fitting it to the group size, the rows that share one
    scale row within a step (`group_k`: the group size, or BLOCK_K when a step lies inside one group), and the K
    slices (1: the plain variant, no partial buffer and no reduce)."""

    tiles: Tiles
    block_k: int
    group_k: int
    splits: int


def _fits(block_k: int, group_size: int, k_size: int) -> int | None:
    """GROUP_K for steps of `block_k` rows, or None when a step would cut a group unevenly."""
    if group_size == k_size or group_size % block_k == 0:
        return block_k
    if block_k % group_size == 0 and (block_k // group_size) & (block_k // group_size - 1) == 0:
        return group_size  # a power-of-two number of whole groups per step (Triton's shapes are powers of two)
    return None


def launch_plan(num_rows: int, n_size: int, k_size: int, group_size: int, splits: int | None = None,
                tiles: Tiles | None = None) -> LaunchPlan:
    """The launch for x [num_rows, k_size] times a [k_size, n_size] weight quantized in groups of `group_size`;
    `splits` and `tiles` force the number of K slices and the tiles (tests, the benchmark's sweep), None
    chooses them. Raises ValueError for a group size (one that divides K: `wna16_gemm` checks) the kernel
    cannot tile."""
    tiles = tiles or next(t for most_rows, t in ROW_TILES if num_rows <= most_rows)
    block_k = tiles.block_k
    while block_k > max(k_size, SMALLEST_BLOCK_K):  # no step longer than K: a small K still splits
        block_k //= 2
    while _fits(block_k, group_size, k_size) is None and block_k > SMALLEST_BLOCK_K:
        block_k //= 2
    group_k = _fits(block_k, group_size, k_size)
    if group_k is None:
        raise ValueError(f"group_size {group_size} is neither a multiple of {SMALLEST_BLOCK_K} nor a power-of-two "
                         "fraction of a K step (nor all of K)")
    k_tiles = triton.cdiv(k_size, block_k)
    programs = triton.cdiv(num_rows, tiles.block_m) * triton.cdiv(n_size, tiles.block_n)
    return LaunchPlan(tiles, block_k, group_k, split_count(programs, k_tiles, splits, SPLIT_TARGET_PROGRAMS)
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


@triton.jit
def unpack_step(packed, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """W^T's [BLOCK_K, BLOCK_N] integer values (int32, 0 .. 2**BITS - 1) from one step's packed words
    [BLOCK_K // pack, BLOCK_N]: every word shifted by each value's bit offset, then K's rows in order."""
    PACK: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, PACK) * BITS
    values = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # the mask drops the sign's fill
    return tl.reshape(values, (BLOCK_K, BLOCK_N))


@triton.jit
def dequantize_step(packed, scales_ptr, zeros_ptr, k_start, cols, col_mask, k_size, group_size, stride_s, stride_z,
                    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    GROUP_K: tl.constexpr, BF16_DEQUANT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """W^T's rows k_start .. k_start + BLOCK_K at `cols` in OUT_DTYPE from their packed words (module docstring:
    whole groups of GROUP_K rows or one group's part; fp32 arithmetic, or bf16 under BF16_DEQUANT). Shared with
    the whole-weight dequantization (kernels/triton_wna16_linear.py)."""
    GROUPS_PER_STEP: tl.constexpr = BLOCK_K // GROUP_K
    values = unpack_step(packed, BITS, BLOCK_K, BLOCK_N)
    if BF16_DEQUANT:  # 0x4300 | q is bf16 128 + q: no int-to-float conversion; exact (see module docstring)
        q = (values | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0
    else:
        q = values.to(tl.float32)
    q = tl.reshape(q, (GROUPS_PER_STEP, GROUP_K, BLOCK_N))
    group_starts = k_start + tl.arange(0, GROUPS_PER_STEP) * GROUP_K
    groups = (group_starts // group_size).to(tl.int64)
    group_mask = (group_starts < k_size)[:, None] & col_mask[None, :]
    scale = tl.load(scales_ptr + groups[:, None] * stride_s + cols[None, :], mask=group_mask, other=0.0)
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + groups[:, None] * stride_z + cols[None, :], mask=group_mask, other=0.0)
        q = q - zero.to(q.dtype)[:, None, :]
    else:
        q = q - (1 << (BITS - 1))
    return tl.reshape(q * scale.to(q.dtype)[:, None, :], (BLOCK_K, BLOCK_N)).to(OUT_DTYPE)


@triton.jit(do_not_specialize=["num_rows"])
def _wna16_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    num_rows, n_size, k_size, group_size, k_tiles_per_split,
    stride_x, stride_q, stride_s, stride_z, stride_out, stride_split,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BF16_DEQUANT: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y over K slice `program_id(2)`: with SPLIT, its fp32 partial sums to slice
    `program_id(2)` of `out_ptr`; without, y itself (plus the bias) in out_ptr's dtype. GROUP_K: the rows that
    share one scale row within a step (the group size, or BLOCK_K when a step lies inside one group)."""
    PACK: tl.constexpr = 32 // BITS
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < num_rows, cols < n_size
    split = tl.program_id(2)
    k_first = split * k_tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_size, k_first + k_tiles_per_split * BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    offs_packed = tl.arange(0, BLOCK_K // PACK)
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(k_first, k_end, BLOCK_K):
        ks = k_start + offs_k
        k_mask = ks < k_size  # only a per-channel K that is not a multiple of BLOCK_K has a partial step
        a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        packed_rows = (k_start // PACK + offs_packed).to(tl.int64)
        packed = tl.load(qweight_ptr + packed_rows[:, None] * stride_q + cols[None, :],
                         mask=(packed_rows * PACK < k_size)[:, None] & col_mask[None, :], other=0)
        w = dequantize_step(packed, scales_ptr, zeros_ptr, k_start, cols, col_mask, k_size, group_size, stride_s,
                            stride_z, BITS, HAS_ZEROS, BLOCK_K, BLOCK_N, GROUP_K, BF16_DEQUANT,
                            x_ptr.dtype.element_ty)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        if SWAP_AB:
            acc = tl.dot(tl.trans(w), tl.trans(a), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)
    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT:
        partial = out_ptr + split.to(tl.int64) * stride_split + rows[:, None] * stride_out + cols[None, :]
        tl.store(partial, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def bf16_dequant_applies(dtype: torch.dtype, bits: int, scales: torch.Tensor) -> bool:
    """Whether the GEMM dequantizes in bf16 (module docstring): 4-bit values into bf16 activations with bf16
    scales (another scale dtype would be rounded twice) on a GPU (the interpreter's 16-bit arithmetic is wrong,
    kernels/triton_numerics.py)."""
    return dtype == torch.bfloat16 and bits == 4 and scales.dtype == torch.bfloat16 and not needs_upcast(dtype)


def check_operands(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
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
               group_size: int, bias: torch.Tensor | None = None, splits: int | None = None,
               tiles: Tiles | None = None, bf16_dequant: bool | None = None) -> torch.Tensor:
    """y = x W^T + b for x [*, K] in fp16 / bf16 / fp32 and W in the canonical layout (module docstring): [*, N]
    in x's dtype. `splits`, `tiles` and `bf16_dequant` force the K slices, the tiles and the dequantization
    arithmetic (tests and benchmarks); None lets `launch_plan` and `bf16_dequant_applies` choose. Every size is
    a function of the shapes: the call can be captured in a CUDA graph."""
    k_size, n_size = check_operands(x, qweight, scales, zeros, bits, group_size, bias)
    leading = x.shape[:-1]
    x = _columns_contiguous(x.reshape(-1, k_size))
    qweight, scales, zeros, bias = (_columns_contiguous(t) for t in (qweight, scales, zeros, bias))
    num_rows = x.shape[0]
    plan = launch_plan(num_rows, n_size, k_size, group_size, splits, tiles)
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
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=plan.block_k, GROUP_K=plan.group_k,
        UPCAST=needs_upcast(x.dtype), DOT_PRECISION=dot_precision(x.dtype),
        BF16_DEQUANT=bf16_dequant if bf16_dequant is not None else bf16_dequant_applies(x.dtype, bits, scales),
        SWAP_AB=tiles.swap_ab, num_warps=tiles.warps, num_stages=tiles.stages,
    )
    if split:
        sum_splits(target, bias, out)
    return out.reshape(*leading, n_size)
