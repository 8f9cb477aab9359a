"""Batched multi-LoRA in Triton: `lora_add_fused`, the same call as kernels/lora_ref.py's (its docstring defines
the math and the rounding points), for every fused part of a layer at once (q|k|v, gate|up, or one part), as two
kernels, shrink then expand, with no host sync (CUDA-graph capturable).

Why one launch pair per layer: the parts of a fused layer share x, so their A stack to [S, P*R, K] and one shrink
gives every part's h ([T, P*R]); one expand writes each part's output columns from that part's R entries of h.
Per part, that was 7 shrink/expand pairs per decoder layer (448 launches per step of a 32-layer model).

Why tokens sorted by slot: with a (token tiles x slots) grid, 256 tokens on 8 adapters put about two tokens of
each slot in every 16-row tile, so every program ran (and read its slot's A and B) for two useful rows, and at a
decode batch most programs exited. Here the step's tokens are ordered by slot once (kernels/lora_ref.LoraTokens, on
the device, stable, base tokens last; every layer of the step reuses it) and the grid is (sorted token tiles, K slices)
for the shrink, (sorted token tiles, column tiles) for the expand: a tile holds the tokens of one slot, or of the
few slots whose runs meet in it, and a program runs one `tl.dot` per slot present (Punica's SGMV / vLLM's tokens
sorted by LoRA, written our own way: no segment table, the slots present are read from the tile's sorted slots).
Each token is in one tile, so each output row is written by one program per column tile: no races.

Steps without adapter rows (all slots -1, as the CUDA graphs captured with LoRA run for base-only steps): base
tokens sort last, so a program loads its tile's sorted slots and rows (together: one round trip, where loading
the first slot alone before the rest made every program wait for two) and returns when none is >= 0: no x, A, B,
partials or y traffic.

- shrink: partials[split, i, :] = x[order[i]] A[s_i]^T over the program's K slice, fp32, for sorted positions i.
- expand: sums i's K-slice partials (fp32; in slice order on the `tl.dot` path, by a fixed `tl.sum` tree over one
  [slices, tokens, P*R] load on the few-token path), rounds h to x's dtype, multiplies it by B^T loaded as [P*R
  (padded to a power of two), BLOCK_N] with column c's R entries at its part's rows and zeros elsewhere (the other
  parts' h then add exact zeros: the same sums as one part's), rounds d to x's dtype, multiplies by the slot's
  scaling in fp32, rounds again, adds to y in fp32 and rounds to y's dtype: the reference's four roundings, in its
  order. Sums are in a fixed order for given shapes and tiles (bit-reproducible run to run: no atomics).

Two paths (`LoraTiles.block_m`, chosen by the token count alone: kernels/lora_tiles.py): tiles of 16 sorted tokens
and one `tl.dot` per slot present (prefill and large decode batches), and the few-token path of decode's 1-16 tokens:
1-8 tokens per program, each row multiplied with its own slot's A and B in fp32 and summed by `tl.sum` (bf16
products are exact in fp32, so only the order of the fp32 sums differs from a dot's), with no loop over the
slots present: at one token a call is launch and dependent-load latency, not bytes (an 8B layer's adapters are
0.3-0.9 MB), and at 16 tokens of 8 adapters the dot path's tile ran its slots one after another.

Why K slices: a decode step's few tokens give the shrink one program per token tile, which alone would read a
4096-14336-wide A through one SM (and 256 tokens sorted give only 16 tiles); cutting K into slices of at least
`split_columns`, up to about SHRINK_PROGRAMS programs, spreads it. Partials are summed by the expand programs in
a fixed order (bit-reproducible, no atomics, no third launch). Why an expand program covers several column
blocks (`expand_columns`): each program sums its rows' partials once per slot, so at 256 tokens a gate|up
output (28672 columns) in 64-column programs would re-read them 448 times per token tile; programs of wider
column groups (about EXPAND_PROGRAMS of them) re-read them a few dozen times.

Requirements: R (the padded rank, max_lora_rank) a power of two, 16 <= R <= 128 (`tl.dot` needs dimensions of at
least 16; the few-token path holds [tokens, K block, P*R] products in registers, `fit_registers`); at most
MAX_PARTS parts, contiguous in y's columns. Offsets are int64. Under TRITON_INTERPRET=1, 16-bit arithmetic is wrong
(kernels/triton_numerics.py): `UPCAST` takes operands to fp32 after each rounding to x's dtype, so the
interpreter's results keep the GPU's rounding points.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_ref import LoraTokens, check_fused_lora_shapes, check_lora_shapes
from kernels.lora_tiles import DOT_BLOCK_M, LoraTiles, expand_columns, fit_registers, shrink_splits, tiles_for
from kernels.triton_numerics import dot_precision, is_interpreting, needs_upcast

MIN_RANK, MAX_RANK = 16, 128
MAX_PARTS = 3  # q|k|v, the most parts a fused layer has
# The kernels' arguments that change with the token count, not specialized (Triton would otherwise compile again
# when one is 1 or a multiple of 16): one compile per tiles and layer shape. The K slice and the expand's column
# group come in blocks (times BLOCK_K or BLOCK_N inside), so the kernels still know them to be multiples of the
# block: unspecialized widths made every load of A scalar (sm_90 SASS: 130 LDG.E.U16 in place of vector loads).
SIZES = ("num_tokens", "k_blocks_per_split", "column_blocks_per_program", "num_splits")


@triton.jit
def _sorted_tile(order_ptr, sorted_slots_ptr, num_tokens, BLOCK_M: tl.constexpr):
    """This tile's (grid axis 0) positions in the sorted order, their token rows (int64) and slots (-1 beyond the
    last token)."""
    positions = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = positions < num_tokens
    slots = tl.load(sorted_slots_ptr + positions, mask=valid, other=-1)
    rows = tl.load(order_ptr + positions, mask=valid, other=0).to(tl.int64)
    return positions, rows, slots


@triton.jit
def _next_slot(slots, slot):
    """The least slot of the tile above `slot` (a large number when none)."""
    return tl.min(tl.where(slots > slot, slots, 1 << 30), axis=0)


@triton.jit(do_not_specialize=SIZES)
def _lora_shrink_kernel(x_ptr, a_ptr, order_ptr, sorted_slots_ptr, partials_ptr, num_tokens, k_size,
                        k_blocks_per_split,
                        stride_x, stride_a_slot, stride_a_rank, stride_split, stride_partial, stacked_rank,
                        STACKED_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """partials[split, i, :] = sum over this slice's k of x[order[i], k] A[s_i, :, k] (fp32) for the tile's sorted
    positions i, s_i = sorted_slots[i] >= 0: one `tl.dot` per slot present in a 16-token tile, or (BLOCK_M < 16)
    each row against its own slot's A, multiplied in fp32 (bf16 products are exact there) and summed by `tl.sum`.
    PDL: lets the expand launch at once (`LoraTiles.pdl`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    positions, rows, slots = _sorted_tile(order_ptr, sorted_slots_ptr, num_tokens, BLOCK_M)
    last = tl.max(slots, axis=0)
    if last < 0:  # base tokens sort last: a tile that starts with one holds nothing else
        return
    split = tl.program_id(1)
    ranks = tl.arange(0, STACKED_BLOCK)
    rank_mask = ranks < stacked_rank
    x_rows = x_ptr + rows * stride_x
    k_per_split = k_blocks_per_split * BLOCK_K
    k_start = split.to(tl.int64) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k_size)
    out = partials_ptr + split.to(tl.int64) * stride_split + positions[:, None] * stride_partial + ranks[None, :]
    if BLOCK_M < 16:
        mine = slots >= 0
        a_rows = (a_ptr + tl.maximum(slots, 0).to(tl.int64)[:, None, None] * stride_a_slot
                  + ranks.to(tl.int64)[None, None, :] * stride_a_rank)
        a_mask = mine[:, None, None] & rank_mask[None, None, :]
        acc = tl.zeros((BLOCK_M, STACKED_BLOCK), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < k_end
            x = tl.load(x_rows[:, None] + cols[None, :], mask=mine[:, None] & col_mask[None, :], other=0.0)
            a_t = tl.load(a_rows + cols[None, :, None], mask=a_mask & col_mask[None, :, None], other=0.0)
            acc += tl.sum(x.to(tl.float32)[:, :, None] * a_t.to(tl.float32), axis=1)
        tl.store(out, acc, mask=mine[:, None])
    else:
        slot = _next_slot(slots, -1)  # the tile's first
        while slot <= last:
            mine = slots == slot
            a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + ranks.to(tl.int64) * stride_a_rank
            acc = tl.zeros((BLOCK_M, STACKED_BLOCK), dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                col_mask = cols < k_end
                x = tl.load(x_rows[:, None] + cols[None, :], mask=mine[:, None] & col_mask[None, :], other=0.0)
                a_t = tl.load(a_rows[None, :] + cols[:, None], mask=col_mask[:, None] & rank_mask[None, :],
                              other=0.0)
                if UPCAST:
                    x = x.to(tl.float32)
                    a_t = a_t.to(tl.float32)
                acc = tl.dot(x, a_t, acc, input_precision=PRECISION)
            tl.store(out, acc, mask=mine[:, None])
            slot = _next_slot(slots, slot)


@triton.jit(do_not_specialize=SIZES)
def _lora_expand_kernel(partials_ptr, b_ptr, order_ptr, sorted_slots_ptr, scalings_ptr, y_ptr, num_tokens, n_size,
                        column_blocks_per_program, num_splits, second_part, third_part, stride_split, stride_partial,
                        stride_b_slot, stride_b_col, stride_y, RANK: tl.constexpr, STACKED_BLOCK: tl.constexpr,
                        SPLITS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """y[order[i], c] += round(round(round(h_i[p(c)]) B[s_i, c, :]^T) * scalings[s_i]) for the tile's sorted
    positions i with s_i = sorted_slots[i] >= 0 and the program's BLOCK_N x `column_blocks_per_program` columns c
    (grid axis 1), h_i the sum of the shrink's K-slice partials and h_i[p] its R entries of column c's part p(c) (0
    below `second_part`, 1 below `third_part`, else 2); rounding to x's (= B's) dtype. B^T is loaded as [stacked rank,
    BLOCK_N] with column c's R entries at its part's rows and zeros elsewhere, so the other parts' h add exact
    zeros. BLOCK_M 16: per slot present, h summed slice by slice and one `tl.dot` per BLOCK_N columns; BLOCK_M < 16:
    all slices' partials in one [SPLITS_BLOCK, BLOCK_M, stacked] load summed in registers (`tl.sum`, a fixed
    tree), then each row against its own slot's B (a product and `tl.sum`), no loop over slots. PDL: waits for the
    shrink (`LoraTiles.pdl`) before the first read of the partials."""
    positions, rows, slots = _sorted_tile(order_ptr, sorted_slots_ptr, num_tokens, BLOCK_M)
    last = tl.max(slots, axis=0)
    if last < 0:
        return
    dtype = b_ptr.dtype.element_ty
    stacked = tl.arange(0, STACKED_BLOCK)
    columns_per_program = column_blocks_per_program * BLOCK_N
    col_start = tl.program_id(1).to(tl.int64) * columns_per_program
    col_end = tl.minimum(col_start + columns_per_program, n_size)
    y_rows = y_ptr + rows * stride_y
    if PDL:
        tl.extra.cuda.gdc_wait()
    if BLOCK_M < 16:
        mine = slots >= 0
        splits = tl.arange(0, SPLITS_BLOCK)
        partials = tl.load(partials_ptr + splits[:, None, None].to(tl.int64) * stride_split
                           + positions[None, :, None] * stride_partial + stacked[None, None, :],
                           mask=(splits < num_splits)[:, None, None] & mine[None, :, None], other=0.0)
        h = tl.sum(partials, axis=0).to(dtype).to(tl.float32)
        slot_of_row = tl.maximum(slots, 0).to(tl.int64)
        scaling = tl.load(scalings_ptr + slot_of_row, mask=mine, other=0.0)
        b_rows = b_ptr + slot_of_row[:, None, None] * stride_b_slot + (stacked % RANK)[None, :, None]
        for n0 in range(col_start, col_end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_mask = cols < col_end
            col_part = (cols >= second_part).to(tl.int32) + (cols >= third_part).to(tl.int32)
            b_mask = (stacked[:, None] // RANK == col_part[None, :]) & col_mask[None, :]
            b_t = tl.load(b_rows + cols[None, None, :] * stride_b_col, mask=mine[:, None, None] & b_mask[None, :, :],
                          other=0.0)
            expanded = tl.sum(h[:, :, None] * b_t.to(tl.float32), axis=1).to(dtype).to(tl.float32)
            scaled = (expanded * scaling[:, None]).to(dtype).to(tl.float32)
            y_tile = y_rows[:, None] + cols[None, :]
            mask = mine[:, None] & col_mask[None, :]
            y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_tile, (y + scaled).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        slot = _next_slot(slots, -1)  # the tile's first
        while slot <= last:
            mine = slots == slot
            partials = partials_ptr + positions[:, None] * stride_partial + stacked[None, :]
            shrunk = tl.zeros((BLOCK_M, STACKED_BLOCK), dtype=tl.float32)
            for _ in range(0, num_splits):
                shrunk += tl.load(partials, mask=mine[:, None], other=0.0)
                partials += stride_split
            h = shrunk.to(dtype)
            if UPCAST:
                h = h.to(tl.float32)
            scaling = tl.load(scalings_ptr + slot)
            b_slot = b_ptr + slot.to(tl.int64) * stride_b_slot
            for n0 in range(col_start, col_end, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                col_mask = cols < col_end
                col_part = (cols >= second_part).to(tl.int32) + (cols >= third_part).to(tl.int32)
                b_mask = (stacked[:, None] // RANK == col_part[None, :]) & col_mask[None, :]
                b_t = tl.load(b_slot + cols[None, :] * stride_b_col + (stacked % RANK)[:, None], mask=b_mask,
                              other=0.0)
                if UPCAST:
                    b_t = b_t.to(tl.float32)
                expanded = tl.dot(h, b_t, input_precision=PRECISION).to(dtype).to(tl.float32)
                scaled = (expanded * scaling).to(dtype).to(tl.float32)
                y_tile = y_rows[:, None] + cols[None, :]
                mask = mine[:, None] & col_mask[None, :]
                y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
                tl.store(y_tile, (y + scaled).to(y_ptr.dtype.element_ty), mask=mask)
            slot = _next_slot(slots, slot)


def lora_add_fused(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   part_rows: tuple[int, ...], tokens: LoraTokens, scalings: torch.Tensor,
                   tiles: LoraTiles | None = None) -> None:
    """kernels/lora_ref.lora_add_fused's call (its docstring states the operands; `tokens` the step's slots and
    their order by slot). Here R must be a power of two in [16, 128]. `tiles`: `tiles_for(T)` unless given (the
    benchmark's sweep passes others), fitted to the registers (`fit_registers`)."""
    token_slots, order, sorted_slots = tokens.slots, tokens.order, tokens.sorted_slots
    check_fused_lora_shapes(y, x, lora_a, lora_b, part_rows, token_slots, scalings)
    num_tokens, k_size = x.shape
    num_slots, stacked_rank, _ = lora_a.shape
    rank = lora_b.shape[2]
    n_size = y.shape[1]
    if rank < MIN_RANK or rank > MAX_RANK or rank & (rank - 1):
        raise ValueError(f"padded LoRA rank {rank} must be a power of two in [{MIN_RANK}, {MAX_RANK}]")
    if len(part_rows) > MAX_PARTS:
        raise ValueError(f"{len(part_rows)} fused parts: the kernels take at most {MAX_PARTS}")
    if x.stride(1) != 1 or lora_a.stride(2) != 1 or lora_b.stride(2) != 1 or not token_slots.is_contiguous() \
            or not scalings.is_contiguous():
        raise ValueError("x, lora_a and lora_b need a unit last stride; token_slots and scalings contiguous")
    if num_tokens == 0 or num_slots == 0 or n_size == 0:
        return
    stacked_block = triton.next_power_of_2(stacked_rank)
    tiles = fit_registers(tiles or tiles_for(num_tokens), stacked_block)
    starts = [sum(part_rows[:part]) for part in range(1, MAX_PARTS)]
    second_part, third_part = (start if part < len(part_rows) else n_size for part, start in enumerate(starts, 1))
    splits = shrink_splits(num_tokens, k_size, tiles)
    k_blocks_per_split = triton.cdiv(triton.cdiv(k_size, splits), tiles.block_k)
    partials = torch.empty((splits, num_tokens, stacked_block), dtype=torch.float32, device=x.device)
    token_tiles = triton.cdiv(num_tokens, tiles.block_m)
    upcast, precision = needs_upcast(x.dtype), dot_precision(x.dtype)
    pdl = tiles.pdl and not is_interpreting()
    _lora_shrink_kernel[(token_tiles, splits)](
        x, lora_a, order, sorted_slots, partials, num_tokens, k_size, k_blocks_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), partials.stride(0), partials.stride(1), stacked_rank,
        STACKED_BLOCK=stacked_block, BLOCK_M=tiles.block_m, BLOCK_K=tiles.block_k, UPCAST=upcast,
        PRECISION=precision, PDL=pdl, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    columns_per_program = expand_columns(num_tokens, n_size, tiles)
    splits_block = triton.next_power_of_2(splits) if tiles.block_m < DOT_BLOCK_M else 1
    _lora_expand_kernel[(token_tiles, triton.cdiv(n_size, columns_per_program))](
        partials, lora_b, order, sorted_slots, scalings, y, num_tokens, n_size, columns_per_program // tiles.block_n,
        splits, second_part, third_part,
        partials.stride(0), partials.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        RANK=rank, STACKED_BLOCK=stacked_block, SPLITS_BLOCK=splits_block, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, UPCAST=upcast, PRECISION=precision, PDL=pdl, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **({"launch_pdl": True} if pdl else {}))


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor, scalings: torch.Tensor, tiles: LoraTiles | None = None) -> None:
    """kernels/lora_ref.lora_add's call: one part (`lora_add_fused` with P = 1), the tokens sorted here."""
    check_lora_shapes(y, x, lora_a, lora_b, token_slots, scalings)
    lora_add_fused(y, x, lora_a, lora_b, (y.shape[1],), LoraTokens.of(token_slots), scalings, tiles)
