"""Batched multi-LoRA in Triton: `lora_add`, the same call as kernels/lora_ref.py (its docstring defines the math and
the rounding points), as two kernels, shrink then expand, with no host sync (CUDA-graph capturable).

- shrink: h = x A^T. Grid (token tiles of BLOCK_M, slots, K slices). A program takes the tokens of its tile that
  use its slot (the other rows' x loaded as zeros), runs `tl.dot` of them against that slot's A^T [K, R] over its
  K slice and writes fp32 partial sums [splits, T, R] for those rows only.
- expand: y += scaling * h B^T. Grid (token tiles, BLOCK_N column tiles, slots). A program sums its rows' K-slice
  partials in slice order (fp32) and rounds h to x's dtype, runs `tl.dot` against its slot's B^T [R, BLOCK_N],
  rounds d to x's dtype, multiplies by the slot's scaling in fp32, rounds again, and adds to y in fp32, rounding
  to y's dtype: the reference's four roundings, in its order.

Why a slot grid dimension rather than each row gathering its own slot's A/B rows: `tl.dot` takes one right-hand
matrix per program, and a per-row gather would give up the tensor cores (and read an adapter's A once per token
instead of once per tile). Every program whose tile holds no token of its slot returns after loading the tile's
slots (T and S are shapes, the slot values are data: the grid is a function of the shapes). Each output row is
written by the one program of its slot, so there are no races; rows with slot -1 are written by none.

Why K slices: a decode step's few tokens give the shrink one program per adapter present, which alone would
read a 4096-14336-wide A (R x K) through one SM; cutting K into slices of at least SPLIT_K_COLUMNS spreads it.
Partials are summed by the expand programs in a fixed order (bit-reproducible, no atomics, no third launch);
every column tile re-reads its rows' partials, so slicing is used only up to SPLIT_MAX_TOKENS tokens, beyond
which token tiles x slots already give the shrink many programs.

Requirements: R (the padded rank, max_lora_rank) a power of two, 16 <= R <= 128: `tl.dot` needs dimensions of
at least 16, and R is one block. Offsets are int64 (a stacked B of an lm_head-wide N overflows int32).
Under TRITON_INTERPRET=1, 16-bit arithmetic is wrong (kernels/triton_numerics.py): `UPCAST` takes operands to
fp32 after each rounding to x's dtype, so the interpreter's results keep the GPU's rounding points.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_ref import check_lora_shapes
from kernels.triton_numerics import dot_precision, needs_upcast

MIN_RANK, MAX_RANK = 16, 128
BLOCK_M = 16  # decode-sized batches matter most; a tile holds this many tokens of every slot
SHRINK_BLOCK_K = 64
EXPAND_BLOCK_N = 64
SPLIT_K_COLUMNS = 512  # the least K a shrink slice covers
MAX_SPLITS = 16
SPLIT_MAX_TOKENS = BLOCK_M  # one token tile (decode); beyond it the shrink reads K whole


def shrink_splits(num_tokens: int, k_size: int) -> int:
    """K slices of the shrink for `num_tokens` tokens of width `k_size` (a function of the shapes alone)."""
    if num_tokens > SPLIT_MAX_TOKENS:
        return 1
    return max(1, min(MAX_SPLITS, k_size // SPLIT_K_COLUMNS))


@triton.jit
def _tile_slots(slots_ptr, num_tokens, BLOCK_M: tl.constexpr):
    """The token rows (int64) of this program's tile (grid axis 0) and their slots, -1 beyond the last token."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(slots_ptr + rows, mask=rows < num_tokens, other=-1)
    return rows, slots


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, partials_ptr, num_tokens, k_size, k_per_split,
                        stride_x, stride_a_slot, stride_a_rank, stride_split, stride_partial,
                        RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                        PRECISION: tl.constexpr):
    """partials[split, t, :] = sum over this slice's k of x[t, k] A[s, :, k] (fp32), for the tile's tokens t of
    slot s = program_id(1)."""
    slot = tl.program_id(1)
    rows, slots = _tile_slots(slots_ptr, num_tokens, BLOCK_M)
    mine = slots == slot
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    split = tl.program_id(2)
    ranks = tl.arange(0, RANK)
    a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + ranks.to(tl.int64) * stride_a_rank
    x_rows = x_ptr + rows * stride_x
    k_start = split.to(tl.int64) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k_size)
    acc = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < k_end
        x = tl.load(x_rows[:, None] + cols[None, :], mask=mine[:, None] & col_mask[None, :], other=0.0)
        a_t = tl.load(a_rows[None, :] + cols[:, None], mask=col_mask[:, None], other=0.0)  # [BLOCK_K, RANK]
        if UPCAST:
            x = x.to(tl.float32)
            a_t = a_t.to(tl.float32)
        acc = tl.dot(x, a_t, acc, input_precision=PRECISION)
    out = partials_ptr + split.to(tl.int64) * stride_split + rows[:, None] * stride_partial + ranks[None, :]
    tl.store(out, acc, mask=mine[:, None])


@triton.jit
def _lora_expand_kernel(partials_ptr, b_ptr, slots_ptr, scalings_ptr, y_ptr, num_tokens, n_size, num_splits,
                        stride_split, stride_partial, stride_b_slot, stride_b_col, stride_y,
                        RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                        PRECISION: tl.constexpr):
    """y[t, cols] += round(round(round(h[t]) B[s, cols, :]^T) * scalings[s]) for the tile's tokens t of slot
    s = program_id(2), h the sum of the shrink's K-slice partials; rounding to x's (= B's) dtype."""
    slot = tl.program_id(2)
    rows, slots = _tile_slots(slots_ptr, num_tokens, BLOCK_M)
    mine = slots == slot
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    dtype = b_ptr.dtype.element_ty
    ranks = tl.arange(0, RANK)
    partials = partials_ptr + rows[:, None] * stride_partial + ranks[None, :]
    shrunk = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for _ in range(0, num_splits):
        shrunk += tl.load(partials, mask=mine[:, None], other=0.0)
        partials += stride_split
    h = shrunk.to(dtype)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_size
    b_rows = b_ptr + slot.to(tl.int64) * stride_b_slot + cols * stride_b_col
    b_t = tl.load(b_rows[None, :] + ranks[:, None], mask=col_mask[None, :], other=0.0)  # [RANK, BLOCK_N]
    if UPCAST:
        h = h.to(tl.float32)
        b_t = b_t.to(tl.float32)
    expanded = tl.dot(h, b_t, input_precision=PRECISION).to(dtype).to(tl.float32)
    scaling = tl.load(scalings_ptr + slot)
    scaled = (expanded * scaling).to(dtype).to(tl.float32)
    y_tile = y_ptr + rows[:, None] * stride_y + cols[None, :]
    mask = mine[:, None] & col_mask[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_tile, (y + scaled).to(y_ptr.dtype.element_ty), mask=mask)


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
    """In place: y[t] += scalings[s] * ((x[t] @ lora_a[s].T) @ lora_b[s].T) for every token t whose
    slot s = token_slots[t] >= 0; tokens with slot -1 are untouched.
    y [T, N] (a view whose last stride is 1: a column slice of a fused projection's output is allowed, so
    row stride may exceed N), x [T, K] (rows contiguous), lora_a [S, R, K], lora_b [S, N, R] (both x's dtype;
    a slot whose adapter has a smaller rank holds zeros beyond it), token_slots [T] int32 or int64,
    scalings [S] float32. Here R must be a power of two in [16, 128] (module docstring)."""
    check_lora_shapes(y, x, lora_a, lora_b, token_slots, scalings)
    num_tokens, k_size = x.shape
    num_slots, rank, _ = lora_a.shape
    n_size = y.shape[1]
    if rank < MIN_RANK or rank > MAX_RANK or rank & (rank - 1):
        raise ValueError(f"padded LoRA rank {rank} must be a power of two in [{MIN_RANK}, {MAX_RANK}]")
    if x.stride(1) != 1 or lora_a.stride(2) != 1 or lora_b.stride(2) != 1 or not token_slots.is_contiguous() \
            or not scalings.is_contiguous():
        raise ValueError("x, lora_a and lora_b need a unit last stride; token_slots and scalings contiguous")
    if num_tokens == 0 or num_slots == 0 or n_size == 0:
        return
    splits = shrink_splits(num_tokens, k_size)
    k_per_split = triton.cdiv(triton.cdiv(k_size, splits), SHRINK_BLOCK_K) * SHRINK_BLOCK_K
    partials = torch.empty((splits, num_tokens, rank), dtype=torch.float32, device=x.device)
    token_tiles = triton.cdiv(num_tokens, BLOCK_M)
    upcast, precision = needs_upcast(x.dtype), dot_precision(x.dtype)
    _lora_shrink_kernel[(token_tiles, num_slots, splits)](
        x, lora_a, token_slots, partials, num_tokens, k_size, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), partials.stride(0), partials.stride(1),
        RANK=rank, BLOCK_M=BLOCK_M, BLOCK_K=SHRINK_BLOCK_K, UPCAST=upcast, PRECISION=precision, num_warps=4)
    _lora_expand_kernel[(token_tiles, triton.cdiv(n_size, EXPAND_BLOCK_N), num_slots)](
        partials, lora_b, token_slots, scalings, y, num_tokens, n_size, splits,
        partials.stride(0), partials.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        RANK=rank, BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, UPCAST=upcast, PRECISION=precision, num_warps=4)
