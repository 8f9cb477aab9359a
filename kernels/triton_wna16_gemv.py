"""Weight-only integer GEMV (W4A16 / W8A16) on the CUDA cores for a lone row: y = x W^T + b.

Torch reference: kernels/wna16_ref.py (`wna16_linear_ref`), whose docstring defines the canonical layout read
here (qweight int32 [K // pack, N] packed along K, first value in the lowest bits; scales and zeros [K // G, N]).

Why a second kernel beside the tensor-core GEMM (kernels/triton_wna16_gemm.py): a lone request's decode step
multiplies one row by every weight, and must read the weights at the card's bandwidth to be worth quantizing.
At 4 bits that is about ten billion weights a second on an H100/H200, and the card issues about thirty billion
thread instructions a second: three instructions per weight, everything included. The GEMM spends more than that
(unpack with a shift and a mask per value, an int-to-float conversion or bf16 arithmetic, the scale, then the
layout change into the MMA's operand registers) and reached 20-28% of the copy bandwidth. Here a weight costs one
LOP3 (mask and OR), one FFMA and half a shift (about four SASS instructions per weight with x's handling: on an
H200 29-53% of the copy bandwidth, still bound by instructions; two values per instruction would need bf16x2
arithmetic, which Triton does not emit from plain code):

- a value q ORed into a float32's mantissa under the exponent of 1.0 reads as f = 1 + q * 2**(p - 23), p its
  lowest bit's position (no conversion instruction). One shift of a 4-bit word puts an odd value at bit 19 (f = 1
  + q / 16) and the even value below it at bit 15 (f = 1 + q / 256), whose x is taken 16 times (exact: a power of
  two); 8-bit values go to bit 15, one shift each;
- the products sum x * f over a step: S = X' + P / 2**BITS, where X' is the sum of those (scaled) x and P = sum x *
  q, so P = 2**BITS * (S - X') (the subtraction loses about 8 bits of S's 24, far below the bf16 output's 8);
- per step and column, once: y += scale * (P - zero * X), X the plain sum of x (symmetric: zero = 2**(BITS - 1)).

Rows: one program per row (the grid's first dimension), each unpacking the words again. Measured on an H200
(Llama-3.1-8B projections, 4-bit, groups of 128; docs/quantization.md): one row 1.3-1.6x bf16's matmul and 1.2-1.8x
the tensor-core GEMM (kernels/triton_wna16_gemm.py), two rows even with the GEMM, four rows half its speed (the
unpacking is the cost, and the GEMM's does not grow with rows). So kernels/triton_wna16_linear.py sends only
GEMV_MOST_ROWS = 1 row here; more rows are served, for tests and the sweep.

Each program owns BLOCK_N columns and a slice of K (split-K as the GEMM, same ordered reduce:
kernels/triton_split_k.py). It walks its slice in steps of STEP_WORDS packed rows, each inside one group (the
group size a multiple of the step's K: `launch_plan`), loads the step's words once ([STEP_WORDS, BLOCK_N], along N:
coalesced, one load per word) and x's [STEP_WORDS, values per word] block in one load, split in registers into
one vector per value offset (x[8 w + i] for value i of word w).
Sizes are a function of the shapes (a CUDA graph captures one launch); the tiles come from a sweep on an H200
(benchmarks/wna16_gemm_gpu.py `--gemv-sweep`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton_split_k import split_count, sum_splits
from kernels.triton_wna16_gemm import check_operands
from kernels.wna16_ref import pack_factor

GEMV_MOST_ROWS = 1  # the linear's choice (module docstring); the kernel takes up to SERVED_ROWS
SERVED_ROWS = 4
MAX_SPLITS = 32  # more K slices than the GEMM's: one row's tiles are few (48 for the 8B qkv at 128 columns)


class GemvTiles(NamedTuple):
    """One launch configuration: columns per program, warps, the K slices' target program count."""

    block_n: int
    warps: int
    target_programs: int
    step_words: int = 16  # packed rows per step at most (fewer when the group is smaller)


# Chosen by benchmarks/wna16_gemm_gpu.py --gemv-sweep on an H200 (fastest for all four 8B projections at one
# row: 128 columns, one warp, 8 packed rows a step, 16-32 K slices).
TILES = GemvTiles(block_n=128, warps=1, target_programs=4096, step_words=8)


class GemvPlan(NamedTuple):
    """What one call launches: the tiles, packed rows per step, steps per K slice, and the slice count."""

    tiles: GemvTiles
    step_words: int
    steps_per_split: int
    splits: int


def launch_plan(num_rows: int, n_size: int, k_size: int, bits: int, group_size: int, splits: int | None = None,
                tiles: GemvTiles | None = None) -> GemvPlan:
    """The launch for x [num_rows <= SERVED_ROWS, k_size] times a quantized [k_size, n_size] weight; `splits`
    and `tiles` force them (tests, the sweep). A step never crosses a group: its K (step_words * pack) divides
    the group size, or the group is all of K."""
    if not 1 <= num_rows <= SERVED_ROWS:
        raise ValueError(f"the GEMV takes 1 to {SERVED_ROWS} rows, got {num_rows}")
    tiles = tiles or TILES
    pack = pack_factor(bits)
    step_words = tiles.step_words
    if group_size != k_size:
        while step_words > 1 and group_size % (step_words * pack):
            step_words //= 2
        if group_size % (step_words * pack):
            raise ValueError(f"group_size {group_size} is not a multiple of {pack} (the values per packed word)")
    steps = triton.cdiv(triton.cdiv(k_size, pack), step_words)
    tiles_per_row = triton.cdiv(n_size, tiles.block_n)
    wanted = splits or min(MAX_SPLITS, triton.cdiv(tiles.target_programs, num_rows * tiles_per_row))
    count = split_count(1, steps, wanted)
    return GemvPlan(tiles, step_words, triton.cdiv(steps, count), count)


@triton.jit
def _split_pairs(xb, STEP_WORDS: tl.constexpr):
    """A row's x over a 4-bit step, [STEP_WORDS, 8] (x[8 w + i] at [w, i]), as its four pairs of columns
    (i = 2j + 1, i = 2j) for j = 0..3, split in registers."""
    x_even, x_odd = tl.split(tl.reshape(xb, (STEP_WORDS, 4, 2)))  # i = 0, 2, 4, 6 and 1, 3, 5, 7
    x04, x26 = tl.split(tl.reshape(x_even, (STEP_WORDS, 2, 2)))
    x15, x37 = tl.split(tl.reshape(x_odd, (STEP_WORDS, 2, 2)))
    x0, x4 = tl.split(x04)
    x2, x6 = tl.split(x26)
    x1, x5 = tl.split(x15)
    x3, x7 = tl.split(x37)
    return x1, x0, x3, x2, x5, x4, x7, x6


@triton.jit
def _mantissa_float(moved, POSITION: tl.constexpr, BITS: tl.constexpr):
    """The BITS-bit value at bit POSITION of `moved` (int32) as the float32 1 + q * 2**(POSITION - 23): the
    value ORed into the mantissa under the exponent of 1.0 (one LOP3, no conversion)."""
    return ((moved & (((1 << BITS) - 1) << POSITION)) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _shifted(packed, SHIFT: tl.constexpr):
    """`packed` moved left by SHIFT bits, or right by -SHIFT (arithmetic: callers mask the sign's fill off)."""
    if SHIFT >= 0:
        return packed << SHIFT
    else:
        return packed >> (-SHIFT)


@triton.jit
def _four_bit_sums(packed, xb, STEP_WORDS: tl.constexpr):
    """sum over a step's values i of x_i * f_i per word and column ([STEP_WORDS, BLOCK_N]), and the matching x
    sum X' (module docstring: one shift serves two values, the odd one at mantissa bit 19 (f = 1 + q / 16), the
    even one at bit 15 (f = 1 + q / 256, its x scaled by 16), so P = 16 * (S - X'))."""
    x1, x0, x3, x2, x5, x4, x7, x6 = _split_pairs(xb, STEP_WORDS)
    x0, x2, x4, x6 = x0 * 16.0, x2 * 16.0, x4 * 16.0, x6 * 16.0
    moved = _shifted(packed, 15)  # values 1 and 0 at bits 19 and 15
    sums = x1[:, None] * _mantissa_float(moved, 19, 4)
    sums += x0[:, None] * _mantissa_float(moved, 15, 4)  # one FFMA per value: no sum of products
    moved = _shifted(packed, 7)  # values 3 and 2
    sums += x3[:, None] * _mantissa_float(moved, 19, 4)
    sums += x2[:, None] * _mantissa_float(moved, 15, 4)
    moved = _shifted(packed, -1)  # values 5 and 4
    sums += x5[:, None] * _mantissa_float(moved, 19, 4)
    sums += x4[:, None] * _mantissa_float(moved, 15, 4)
    moved = _shifted(packed, -9)  # values 7 and 6
    sums += x7[:, None] * _mantissa_float(moved, 19, 4)
    sums += x6[:, None] * _mantissa_float(moved, 15, 4)
    x_sum = tl.sum(x1 + x3 + x5 + x7 + x0 + x2 + x4 + x6, axis=0)
    return sums, x_sum


@triton.jit
def _eight_bit_sums(packed, xb, STEP_WORDS: tl.constexpr):
    """As `_four_bit_sums` for 8-bit values (four per word), each moved to mantissa bit 15 (f = 1 + q / 256):
    P = 256 * (S - X)."""
    x_even, x_odd = tl.split(tl.reshape(xb, (STEP_WORDS, 2, 2)))  # i = 0, 2 and 1, 3
    x0, x2 = tl.split(x_even)
    x1, x3 = tl.split(x_odd)
    sums = x0[:, None] * _mantissa_float(_shifted(packed, 15), 15, 8)
    sums += x1[:, None] * _mantissa_float(_shifted(packed, 7), 15, 8)
    sums += x2[:, None] * _mantissa_float(_shifted(packed, -1), 15, 8)
    sums += x3[:, None] * _mantissa_float(_shifted(packed, -9), 15, 8)
    return sums, tl.sum(x0 + x1 + x2 + x3, axis=0)


@triton.jit(do_not_specialize=["num_rows"])
def _wna16_gemv_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    num_rows, n_size, k_size, group_size, steps_per_split,
    stride_x, stride_q, stride_s, stride_z, stride_out, stride_split,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, STEP_WORDS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):
    """y's row `program_id(0)`, columns of block `program_id(1)`, over K slice `program_id(2)` (module docstring):
    with SPLIT, fp32 partial sums into slice `program_id(2)` of out_ptr; without, y (plus the bias) in out_ptr's
    dtype. Rows come first in the grid so that a tile's rows run together and share its words through L2."""
    PACK: tl.constexpr = 32 // BITS
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_size
    split = tl.program_id(2)
    words_total = k_size // PACK
    step_first = split * steps_per_split
    step_end = tl.minimum(step_first + steps_per_split, tl.cdiv(words_total, STEP_WORDS))
    offs_words = tl.arange(0, STEP_WORDS)
    offs_values = tl.arange(0, PACK)
    first_word = step_first * STEP_WORDS
    q_ptrs = qweight_ptr + (first_word + offs_words).to(tl.int64)[:, None] * stride_q + cols[None, :]
    x_offsets = (first_word + offs_words)[:, None] * PACK + offs_values[None, :]
    x_ptrs = x_ptr + row * stride_x + x_offsets
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in range(step_first, step_end):
        words = step * STEP_WORDS + offs_words
        if EVEN_K and EVEN_N:
            packed = tl.load(q_ptrs)
        else:
            packed = tl.load(q_ptrs, mask=(words < words_total)[:, None] & col_mask[None, :], other=0)
        if EVEN_K:
            xb = tl.load(x_ptrs).to(tl.float32)
        else:
            xb = tl.load(x_ptrs, mask=(words * PACK)[:, None] + offs_values[None, :] < k_size, other=0.0)
            xb = xb.to(tl.float32)
        if BITS == 4:
            sums, x_sum = _four_bit_sums(packed, xb, STEP_WORDS)
        else:
            sums, x_sum = _eight_bit_sums(packed, xb, STEP_WORDS)
        group = (step * STEP_WORDS * PACK) // group_size
        scale = tl.load(scales_ptr + group * stride_s + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + group * stride_z + cols, mask=col_mask, other=0.0).to(tl.float32)
        else:
            zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
        products = (tl.sum(sums, axis=0) - x_sum) * (1 << BITS)  # P = sum x * q over the step
        x_plain = x_sum if BITS == 8 else tl.sum(tl.sum(xb, axis=1), axis=0)  # X: x_sum counts even values 16x
        acc += scale * (products - zero * x_plain)
        q_ptrs += STEP_WORDS * stride_q
        x_ptrs += STEP_WORDS * PACK
    if SPLIT:
        tl.store(out_ptr + split.to(tl.int64) * stride_split + row * stride_out + cols, acc, mask=col_mask)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def wna16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
               group_size: int, bias: torch.Tensor | None = None, splits: int | None = None,
               tiles: GemvTiles | None = None) -> torch.Tensor:
    """y = x W^T + b for x [*, K] of 1 to SERVED_ROWS rows (the arguments of kernels/triton_wna16_gemm's
    `wna16_gemm`); `splits` and `tiles` force the launch (tests, the sweep)."""
    k_size, n_size = check_operands(x, qweight, scales, zeros, bits, group_size, bias)
    leading = x.shape[:-1]
    x = x.reshape(-1, k_size).contiguous()
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else None
    bias = bias.contiguous() if bias is not None else None
    num_rows = x.shape[0]
    out = torch.empty((num_rows, n_size), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n_size == 0:
        return out.reshape(*leading, n_size)
    plan = launch_plan(num_rows, n_size, k_size, bits, group_size, splits, tiles)
    split = plan.splits > 1
    target = torch.empty((plan.splits, num_rows, n_size), dtype=torch.float32, device=x.device) if split else out
    block_n, step_k = plan.tiles.block_n, plan.step_words * pack_factor(bits)
    _wna16_gemv_kernel[(num_rows, triton.cdiv(n_size, block_n), plan.splits)](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, target,
        num_rows, n_size, k_size, group_size, plan.steps_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0) if zeros is not None else 0,
        target.stride(-2), target.stride(0) if split else 0,
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, STEP_WORDS=plan.step_words, EVEN_N=n_size % block_n == 0, EVEN_K=k_size % step_k == 0,
        num_warps=plan.tiles.warps,
    )
    if split:
        sum_splits(target, bias, out)
    return out.reshape(*leading, n_size)
