"""Batch-invariant linear layer in Triton: `hidden @ weight.T (+ bias)` whose row i never depends on the other rows.

Torch reference: `torch.nn.functional.linear` (to within one rounding of the output).

Why a kernel of its own: cuBLAS (and torch's CPU GEMMs) pick a kernel by the problem's shape, M (the
number of tokens) included: a decode step of 8 rows may run split-K (partial sums over K slices reduced in
another order) where a prefill of 2,000 rows runs a plain tiled GEMM. Both are correct, but a row's fp32
sum is taken in a different order, so the same token gets different bits depending on what else is in the
batch (--batch-invariant). Here everything that decides a row's reduction order is a constant:

- ONE tile configuration, `TILE` below, unless the device shows that the tiles make no difference: no
  autotuning, no split-K chosen by the rows. The tile shape fixes the MMA instructions and so a product's
  accumulation order, and the number of rows only changes how many tiles there are. On Hopper GPUs every tile
  tried (benchmarks/batch_invariant_kernel_bench.py) gave the same bits: Hopper's MMA chains the K dimension 16
  products at a time, in K order, whatever the tile, and the 16- and 32-row tiles (the pre-Hopper MMA) and the
  tiles loaded by the tensor memory accelerator (`Tile.tma`) give those bits too. So
  `tile_by_rows` (ROW_TILES: small tiles for a decode's few rows, larger ones for more) is used where
  `tiles_agree` finds the same on the device at start-up (kernels/batch_invariant_layer_ops.py), and TILE
  alone everywhere else (the interpreter, whose numpy matmul sums a tile's K in its own order).
- K is summed in one chain: each program loops over all of K in `BLOCK_K` steps into one fp32 accumulator
  (the last partial K tile reads zeros: exact zero products, which change no sum). No split-K, not even
  one fixed for every row count: a small tile over the full K keeps a decode step's linears close to cuBLAS
  (its own split-K included), while fixed K slices (each summed from zero, added in order) cost more at one
  row and more again at many rows, where the slices' nested loops restart the software pipeline (benchmarks/
  batch_invariant_kernel_bench.py --decode; figures in docs/benchmarks.md, "Batch-invariant mode").
- Each output element depends only on its row of `hidden` and its row of `weight`: a row's position inside
  its M tile does not change its math (the MMA computes every element of a tile the same way: checked on a
  GPU by tests/gpu/test_batch_invariance_gpu.py; the interpreter's numpy matmul need not, since the host's BLAS
  may give a row other bits by its position, so the CPU tests sum the interpreter's dots in K order).

Rounding: the fp32 accumulator plus the bias (added in fp32, before the one rounding, as cuBLAS's bias
epilogue does) is rounded once to the input dtype. torch's CPU `F.linear` for bf16 may round the product
first and then add the bias: the two agree to within one rounding of the output (the test's tolerance).

Numerics under TRITON_INTERPRET=1: 16-bit operands are upcast to fp32 after loading (kernels/triton_numerics.py);
fp32 operands use IEEE products (no TF32) on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton_numerics import dot_precision, needs_upcast



class Tile(NamedTuple):
    """One launch configuration: the block sizes, warps and pipeline stages, and whether tiles are loaded by the
    tensor memory accelerator (`tma`; where a tensor's alignment does not allow it, the same tile is loaded
    by pointers, which gives the same bits)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    tma: bool = False


# TILE: the one tile where tiles are not known to agree. ROW_TILES: (up to this many rows, this tile), the
# fastest for a step's linears at that many rows on a Hopper GPU, in CUDA graphs (benchmarks/
# batch_invariant_kernel_bench.py --decode); the last holds any number of rows.
TILE = Tile(128, 128, 64, 8, 3)
ROW_TILES = ((8, Tile(16, 32, 256, 4, 4)), (32, Tile(16, 32, 256, 4, 4, tma=True)),
             (128, Tile(64, 32, 128, 4, 4, tma=True)), (256, Tile(64, 64, 64, 4, 6, tma=True)),
             (512, Tile(128, 64, 64, 4, 4, tma=True)), (1024, Tile(128, 128, 64, 8, 4, tma=True)),
             (2048, Tile(128, 128, 64, 8, 3, tma=True)), (1 << 62, Tile(256, 128, 64, 8, 3, tma=True)))
GROUP_M = 8


def tile_by_rows(num_rows: int) -> Tile:
    """The faster tile for this many rows; batch-invariant only where `tiles_agree` holds."""
    return next(tile for most_rows, tile in ROW_TILES if num_rows <= most_rows)


def tiles_agree(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether every tile of ROW_TILES gives TILE's bits on this device: random products (K a multiple of
    every BLOCK_K, and not), compared whole."""
    generator = torch.Generator().manual_seed(0)
    for rows, n, k in ((70, 192, 1536), (33, 130, 1000)):
        hidden = torch.randn(rows, k, generator=generator).to(device, dtype)
        weight = (torch.randn(n, k, generator=generator) / k**0.5).to(device, dtype)
        expected = linear(hidden, weight, tile=TILE)
        if not all(torch.equal(linear(hidden, weight, tile=tile), expected) for _, tile in ROW_TILES):
            return False
    return True


@triton.jit
def _grouped_tile(num_rows, n_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (row tile, column tile) in grouped launch order (GROUP_M row tiles sweep the column tiles
    together): a weight tile and a group's rows stay in L2 while they are reused. The order programs run in
    changes no element's math."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(num_rows, BLOCK_M), tl.cdiv(n_size, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * tiles_n)) % group_rows, (pid % (GROUP_M * tiles_n)) // group_rows


@triton.jit
def _add_bias_and_store(acc, bias_ptr, out_ptr, stride_out, tile_m, tile_n, num_rows, n_size,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_size
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows < num_rows)[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _batch_invariant_linear_kernel(
    hidden,
    weight,
    bias_ptr,
    out_ptr,
    num_rows,
    n_size,
    k_size,
    stride_hidden,
    stride_weight,
    stride_out,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """`hidden` and `weight`: pointers with their row strides, or with TMA tensor descriptors, whose tiles the
    tensor memory accelerator loads (Hopper's bulk copies; out of bounds rows, columns and K read zeros, as the
    pointer loads' masks do). Either way the same tiles reach the same dot products."""
    tile_m, tile_n = _grouped_tile(num_rows, n_size, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, k_size, BLOCK_K):
        if TMA:
            a = hidden.load([tile_m * BLOCK_M, k_start])
            b = weight.load([tile_n * BLOCK_N, k_start]).T
        else:
            ks = k_start + tl.arange(0, BLOCK_K)
            k_mask = ks < k_size
            a = tl.load(hidden + rows[:, None] * stride_hidden + ks[None, :],
                        mask=(rows < num_rows)[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(weight + cols[None, :] * stride_weight + ks[:, None],
                        mask=k_mask[:, None] & (cols < n_size)[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    _add_bias_and_store(acc, bias_ptr, out_ptr, stride_out, tile_m, tile_n, num_rows, n_size, HAS_BIAS, BLOCK_M,
                        BLOCK_N)


def tma_fits(*tensors: torch.Tensor) -> bool:
    """Whether the tensor memory accelerator can load these 2-D row-major tensors: 16-byte aligned start and
    row stride."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in tensors)


def linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tile: Tile | Callable[[int], Tile] = TILE) -> torch.Tensor:
    """hidden [T, K] @ weight [N, K].T (+ bias [N]) -> [T, N] in hidden's dtype (fp32, bf16 or fp16), fp32
    accumulation; row i's bits depend only on hidden[i], weight and bias (the LayerOps `linear` contract).
    Leading axes beyond one are flattened into rows, as F.linear accepts them. `tile`: one tile for every
    call, or a function of the row count (`tile_by_rows`, where `tiles_agree`)."""
    assert weight.dim() == 2 and hidden.shape[-1] == weight.shape[1]
    assert hidden.dtype == weight.dtype, "hidden and weight must share a dtype"
    leading = hidden.shape[:-1]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    num_rows, k_size = hidden.shape
    n_size = weight.shape[0]
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    block_m, block_n, block_k, num_warps, num_stages, tma = tile(num_rows) if callable(tile) else tile
    out = torch.empty((num_rows, n_size), dtype=hidden.dtype, device=hidden.device)
    if num_rows == 0 or n_size == 0:
        return out.reshape(*leading, n_size)
    if bias is not None:
        assert bias.shape == (n_size,)
        bias = bias.contiguous()
    grid = (triton.cdiv(num_rows, block_m) * triton.cdiv(n_size, block_n),)
    tma = tma and tma_fits(hidden, weight)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        operands = (TensorDescriptor.from_tensor(hidden, [block_m, block_k]),
                    TensorDescriptor.from_tensor(weight, [block_n, block_k]))
    else:
        operands = (hidden, weight)
    _batch_invariant_linear_kernel[grid](
        *operands, bias if bias is not None else out, out,
        num_rows, n_size, k_size,
        hidden.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M,
        UPCAST=needs_upcast(hidden.dtype),
        DOT_PRECISION=dot_precision(hidden.dtype),
        TMA=tma,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out.reshape(*leading, n_size)
