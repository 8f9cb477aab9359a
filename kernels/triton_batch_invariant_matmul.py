"""Batch-invariant linear layer in Triton: `hidden @ weight.T (+ bias)` whose row i never depends on the other rows.

Torch reference: `torch.nn.functional.linear` (to within one rounding of the output).

Why a kernel of its own: cuBLAS (and torch's CPU GEMMs) pick a kernel by the problem's shape, M (the
number of tokens) included: a decode step of 8 rows may run split-K (partial sums over K slices reduced in
another order) where a prefill of 2,000 rows runs a plain tiled GEMM. Both are correct, but a row's fp32
sum is taken in a different order, so the same token gets different bits depending on what else is in the
batch (--batch-invariant, issue 21). Here everything that decides a row's reduction order is a constant:

- ONE tile configuration, `TILE` below, unless the device shows that the tiles make no difference: no
  autotuning, no split-K chosen by the rows. The tile shape fixes the MMA instructions and so a product's accumulation order,
  and the number of rows only changes how many tiles there are. On an H200 every tile we tried (BLOCK_M 64
  to 256, BLOCK_N 32 to 256, BLOCK_K 32 to 256, 4 or 8 warps; benchmarks/batch_invariant_kernel_bench.py)
  gave the same bits: Hopper's MMA chains the K dimension 16 products at a time, in K order, whatever the
  tile. So `tile_by_rows` (a decode-sized tile up to SMALL_ROWS rows, a prefill-sized one past) is used
  where `tiles_agree` finds the same on the device at start-up (kernels/batch_invariant_layer_ops.py), and
  TILE alone everywhere else (the interpreter, whose numpy matmul sums a tile's K in its own order).
- K is cut into K_SLICES fixed slices; each is looped in `BLOCK_K` steps into a fresh fp32 accumulator, and
  the slices' sums are added in slice order, for every row; the last partial K tile reads zeros (exact zero
  products, which change no sum). Whether one program adds its slices or each slice has programs of its own
  and a second kernel adds them (few rows), the operations are the same (`slices_agree` checks it).
- Each output element depends only on its row of `hidden` and its row of `weight`: a row's position inside
  its M tile does not change its math (the MMA computes every element of a tile the same way; under the
  interpreter numpy's matmul does too, checked by the tests).

Rounding: the fp32 accumulator plus the bias (added in fp32, before the one rounding, as cuBLAS's bias
epilogue does) is rounded once to the input dtype. torch's CPU `F.linear` for bf16 may round the product
first and then add the bias: the two agree to within one rounding of the output (the test's tolerance).

Numerics under TRITON_INTERPRET=1: 16-bit operands are upcast to fp32 after loading (kernels/triton_numerics.py);
fp32 operands use IEEE products (no TF32) on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.triton_numerics import dot_precision, needs_upcast

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). TILE: the one tile where tiles are not known to agree; a prefill's
# best on an H200 (1.28x cuBLAS at 16k rows). SMALL_TILE: a decode's best there (64 to 256 rows).
TILE = (128, 128, 64, 8, 3)
SMALL_TILE, SMALL_ROWS = (64, 64, 128, 4, 3), 256
GROUP_M = 8
# K is summed in K_SLICES slices (of a length aligned to every BLOCK_K) whose fp32 sums are added in slice
# order, for every row count: a row's bits do not depend on how the slices are computed. Past SPLIT_ROWS rows
# one program sums its tile's slices one after the other; up to SPLIT_ROWS rows (a decode of a few requests,
# whose tiles alone would leave most SMs idle) each slice has programs of its own writing fp32 partials, and
# a second kernel adds them in the same order: split-K's parallelism with one reduction order for all T.
K_SLICES, K_SLICE_ALIGN, SPLIT_ROWS, SUM_BLOCK = 4, 256, 32, 1024
# Tiles a split launch may have when its last programs add the slices (`tile_counters`): an LM head of 152k
# columns in 64-column tiles needs 2,374; larger launches use the second kernel.
COUNTERS = 8192

Tile = tuple[int, int, int, int, int]


def tile_by_rows(num_rows: int) -> Tile:
    """The faster tile for this many rows; batch-invariant only where `tiles_agree` holds."""
    return SMALL_TILE if num_rows <= SMALL_ROWS else TILE


def tiles_agree(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether SMALL_TILE and TILE give the same bits on this device: random products (K a multiple of every
    BLOCK_K, and not), compared whole."""
    generator = torch.Generator().manual_seed(0)
    for rows, n, k in ((70, 192, 1536), (33, 130, 1000)):
        hidden = torch.randn(rows, k, generator=generator).to(device, dtype)
        weight = (torch.randn(n, k, generator=generator) / k**0.5).to(device, dtype)
        if not torch.equal(linear(hidden, weight, tile=SMALL_TILE), linear(hidden, weight, tile=TILE)):
            return False
    return True


def slices_agree(device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                 counters: torch.Tensor | None = None) -> bool:
    """Whether the K slices summed by programs of their own (by the tiles' last programs, with `counters`)
    give the bits of the in-program sum here."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 1000, generator=generator).to(device, dtype)
    weight = (torch.randn(130, 1000, generator=generator) / 1000**0.5).to(device, dtype)
    bias = torch.randn(130, generator=generator).to(device, dtype)
    whole = linear(hidden, weight, bias, split_rows=0)
    return all(torch.equal(whole, linear(hidden, weight, bias, split_rows=5, counters=counters)) for _ in range(3))


@triton.jit(do_not_specialize=["num_rows"])
def _batch_invariant_linear_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,
    counters_ptr,
    num_rows,
    n_size,
    k_size,
    k_slice,
    num_slices,
    stride_hidden,
    stride_weight,
    stride_out,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SLICE_PER_PROGRAM: tl.constexpr,
    LAST_SUMS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Grouped launch order (GROUP_M row tiles sweep the column tiles together): a weight tile and a group's
    # rows stay in L2 while they are reused. The order programs run in changes no element's math.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(num_rows, BLOCK_M), tl.cdiv(n_size, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    tile_n = (pid % (GROUP_M * tiles_n)) // group_rows
    rows = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < n_size
    mask = row_mask[:, None] & col_mask[None, :]
    if SLICE_PER_PROGRAM:
        # One K slice (program axis 1); its fp32 sum goes to the partials [slices, T, N], summed in slice
        # order by the tile's last program (LAST_SUMS) or by `_sum_slices_kernel`.
        first_slice, last_slice = tl.program_id(1), tl.program_id(1) + 1
    else:
        first_slice, last_slice = 0, num_slices
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_slice_index in range(first_slice, last_slice):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        slice_end = tl.minimum((k_slice_index + 1) * k_slice, k_size)
        for k_start in range(k_slice_index * k_slice, slice_end, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_mask = ks < slice_end
            a = tl.load(hidden_ptr + rows[:, None] * stride_hidden + ks[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(weight_ptr + cols[None, :] * stride_weight + ks[:, None],
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        total = total + acc
    if SLICE_PER_PROGRAM:
        offsets = rows[:, None] * n_size + cols[None, :]
        slice_size = num_rows.to(tl.int64) * n_size
        tl.store(partials_ptr + tl.program_id(1) * slice_size + offsets, total, mask=mask)
        if LAST_SUMS:
            # The tile's last program to finish adds the slices in slice order (the operations of the one-
            # program sum, whichever program it is), then re-arms the tile's counter for the next launch:
            # split-K without a second kernel. The barrier and the counter's acquire-release order every
            # thread's partial before the count; the sums are read from L2 (".cg"), where the stores went.
            tl.debug_barrier()
            arrived = tl.atomic_add(counters_ptr + pid, 1, sem="acq_rel")
            if arrived == num_slices - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k_slice_index in range(0, num_slices):
                    total = total + tl.load(partials_ptr + k_slice_index * slice_size + offsets, mask=mask,
                                            other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total = total + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], total.to(out_ptr.dtype.element_ty),
                         mask=mask)
                tl.atomic_xchg(counters_ptr + pid, 0, sem="relaxed")
    else:
        if HAS_BIAS:
            total = total + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_elements", "n_size"])
def _sum_slices_kernel(partials_ptr, bias_ptr, out_ptr, num_elements, n_size, num_slices, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out = (((0 + slice 0) + slice 1) + ...) (+ bias), rounded once: the in-program sum's operations, in order."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = index < num_elements
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for k_slice_index in range(0, num_slices):
        total = total + tl.load(partials_ptr + k_slice_index * num_elements + index, mask=mask, other=0.0)
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + index % n_size, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + index, total.to(out_ptr.dtype.element_ty), mask=mask)


def tile_counters(device: torch.device | str) -> torch.Tensor:
    """The zeroed per-tile counters `linear(..., counters=)` needs, for one device and one stream at a time
    (each launch leaves them zero again); a model's layers share one."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tile: Tile | Callable[[int], Tile] = TILE, split_rows: int = SPLIT_ROWS,
           counters: torch.Tensor | None = None, k_slices: int = K_SLICES) -> torch.Tensor:
    """hidden [T, K] @ weight [N, K].T (+ bias [N]) -> [T, N] in hidden's dtype (fp32, bf16 or fp16), fp32
    accumulation; row i's bits depend only on hidden[i], weight and bias (the LayerOps `linear` contract).
    Leading axes beyond one are flattened into rows, as F.linear accepts them. `tile`: one tile for every
    call, or a function of the row count (`tile_by_rows`, where `tiles_agree`). Up to `split_rows` rows, each
    K slice gets programs of its own (see K_SLICES; 0: never, where `slices_agree` does not hold); with
    `counters` (`tile_counters`) each tile's last program adds its slices, else a second kernel does.
    `k_slices`: K_SLICES but in benchmarks (another count gives other bits, for every row alike)."""
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
    block_m, block_n, block_k, num_warps, num_stages = tile(num_rows) if callable(tile) else tile
    out = torch.empty((num_rows, n_size), dtype=hidden.dtype, device=hidden.device)
    if num_rows == 0 or n_size == 0:
        return out.reshape(*leading, n_size)
    if bias is not None:
        assert bias.shape == (n_size,)
        bias = bias.contiguous()
    k_slice = triton.cdiv(triton.cdiv(k_size, k_slices), K_SLICE_ALIGN) * K_SLICE_ALIGN
    num_slices = triton.cdiv(k_size, k_slice)
    slice_per_program = num_rows <= split_rows
    num_tiles = triton.cdiv(num_rows, block_m) * triton.cdiv(n_size, block_n)
    grid = (num_tiles, num_slices if slice_per_program else 1)
    partials = (torch.empty((num_slices, num_rows, n_size), dtype=torch.float32, device=hidden.device)
                if slice_per_program else out)
    last_sums = slice_per_program and counters is not None and num_tiles <= counters.numel()
    _batch_invariant_linear_kernel[grid](
        hidden, weight, bias if bias is not None else out, out, partials,
        counters if last_sums else out,
        num_rows, n_size, k_size, k_slice, num_slices,
        hidden.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M, SLICE_PER_PROGRAM=slice_per_program,
        LAST_SUMS=last_sums,
        UPCAST=needs_upcast(hidden.dtype),
        DOT_PRECISION=dot_precision(hidden.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    if slice_per_program and not last_sums:
        _sum_slices_kernel[(triton.cdiv(num_rows * n_size, SUM_BLOCK),)](
            partials, bias if bias is not None else out, out, num_rows * n_size, n_size, num_slices,
            HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK)
    return out.reshape(*leading, n_size)
