"""Prefill / extend attention in Triton: variable-length query chunks over their paged context.

Torch reference: kernels/paged_attention_ref.py (`paged_attention`).

One kernel serves fresh prefill, chunked prefill and prefix-cache hits: sequence i's `q_len` new tokens
are the last `q_len` positions of its `seq_len`-token context, and the new tokens' K/V were already
written into the cache (kernels/triton_cache_write.py) before this runs, so every key is read through the
block table; there is no separate "new K/V" input.

Design (KERNELS.md):
- A program owns BLOCK_M (64) query tokens of one sequence and one query head (decode's 16-row tiles
  halve prefill speed). It loops over key tiles only up to its causal bound: tiles strictly before its
  first query position need no mask at all; the rest (the diagonal) are masked.
- The grid is flat over query tiles, `T // BLOCK_M + B` of them, an upper bound on
  `sum_i ceil(q_len_i / BLOCK_M)` known from shapes alone. Each program finds its sequence by a binary
  search over `first_tile(i) = (query_start_loc[i] - query_start_loc[0]) // BLOCK_M + i` and exits if it
  is past its sequence's last tile. So the launch needs no max query length and no host sync.

Sliding window (HAS_WINDOW) and soft-capping (HAS_SOFTCAP) are constexpr variants; with a window a program
starts at its first row's window start and masks where its rows' windows differ (`_attend_window`).

Tuning: BLOCK_N 64, 4 warps, 2 stages, the best of benchmarks/kernel_bench.py's sweep; how it stands against
torch SDPA's FlashAttention is in docs/benchmarks.md ("Kernels").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import UNIT_KV_SCALES, KVScales, is_fp8
from kernels.triton_numerics import dot_precision, needs_upcast
from kernels.triton_paged_kv import LOG2_E, attend_paged_tile


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_M: tl.constexpr):
    """The last sequence whose first query tile is <= `tile` (binary search over query_start_loc)."""
    first_token = tl.load(query_start_loc_ptr)
    # int32 tensors from the start (not Python ints): loop-carried values must keep one type.
    low = first_token * 0
    high = low + num_seqs
    while low < high:
        middle = (low + high) // 2
        first_tile = (tl.load(query_start_loc_ptr + middle) - first_token) // BLOCK_M + middle
        if first_tile <= tile:
            low = middle + 1
        else:
            high = middle
    return low - 1


@triton.jit
def _attend_window_stretch(
    start, end, query, key_cache_ptr, value_cache_ptr, table_row, query_positions, causal_end, sliding_window,
    kv_head, stride_cache_block, stride_cache_token, stride_cache_head, dims,
    running_max, running_sum, acc, scale_log2, softcap_log2, k_scale, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
    KV_FP8: tl.constexpr, KV_DTYPE: tl.constexpr,
):
    """Fold key tiles `start`, `start + BLOCK_N`, ... below `end`; MASKED: each row sees its causal window."""
    tile = tl.arange(0, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tile
        in_context = positions < causal_end
        visible = in_context[None, :]
        if MASKED:
            visible = (visible & (positions[None, :] <= query_positions[:, None])
                       & (positions[None, :] > query_positions[:, None] - sliding_window))
        running_max, running_sum, acc = attend_paged_tile(
            query, key_cache_ptr, value_cache_ptr, table_row, positions, in_context, visible, kv_head,
            stride_cache_block, stride_cache_token, stride_cache_head, dims, running_max, running_sum, acc,
            scale_log2, softcap_log2, k_scale, v_scale, HEAD_DIM, BLOCK_D, BLOCK_SIZE, UPCAST, DOT_PRECISION, MASKED,
            HAS_SOFTCAP, KV_FP8, KV_DTYPE,
        )
    return running_max, running_sum, acc


@triton.jit
def _attend_window(
    query, key_cache_ptr, value_cache_ptr, table_row, query_positions, first_position, last_position,
    causal_end, sliding_window, kv_head, stride_cache_block, stride_cache_token, stride_cache_head, dims,
    running_max, running_sum, acc, scale_log2, softcap_log2, k_scale, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr, KV_DTYPE: tl.constexpr,
):
    """Fold the keys a tile of query rows sees through a sliding window W: the rows' windows start at
    different keys (row at position p sees p - W + 1 .. p), so the loop starts at the first row's window
    start and runs three stretches of key tiles from there: masked tiles until every row's window has
    begun (keys from `last_position - W + 1` on), unmasked tiles while every row sees every key (up to the
    first row's position), masked tiles to the causal end. A row may see nothing of a masked tile; the
    online softmax keeps such a row's state at -inf / 0 without NaN."""
    window_first = tl.maximum(first_position - sliding_window + 1, 0)
    every_row_first = tl.maximum(last_position - sliding_window + 1, 0)
    masked_end = window_first + tl.cdiv(every_row_first - window_first, BLOCK_N) * BLOCK_N
    masked_end = tl.minimum(masked_end, causal_end)
    unmasked_end = masked_end + tl.maximum(first_position + 1 - masked_end, 0) // BLOCK_N * BLOCK_N
    running_max, running_sum, acc = _attend_window_stretch(
        window_first, masked_end, query, key_cache_ptr, value_cache_ptr, table_row, query_positions, causal_end,
        sliding_window, kv_head, stride_cache_block, stride_cache_token, stride_cache_head, dims, running_max,
        running_sum, acc, scale_log2, softcap_log2, k_scale, v_scale,
        HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, UPCAST, DOT_PRECISION, HAS_SOFTCAP, True, KV_FP8, KV_DTYPE,
    )
    running_max, running_sum, acc = _attend_window_stretch(
        masked_end, unmasked_end, query, key_cache_ptr, value_cache_ptr, table_row, query_positions, causal_end,
        sliding_window, kv_head, stride_cache_block, stride_cache_token, stride_cache_head, dims, running_max,
        running_sum, acc, scale_log2, softcap_log2, k_scale, v_scale,
        HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, UPCAST, DOT_PRECISION, HAS_SOFTCAP, False, KV_FP8, KV_DTYPE,
    )
    running_max, running_sum, acc = _attend_window_stretch(
        unmasked_end, causal_end, query, key_cache_ptr, value_cache_ptr, table_row, query_positions, causal_end,
        sliding_window, kv_head, stride_cache_block, stride_cache_token, stride_cache_head, dims, running_max,
        running_sum, acc, scale_log2, softcap_log2, k_scale, v_scale,
        HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, UPCAST, DOT_PRECISION, HAS_SOFTCAP, True, KV_FP8, KV_DTYPE,
    )
    return running_max, running_sum, acc


# Metadata views are sliced past the step's decodes, and the block table is as wide as the step's longest
# sequence needs, so the views' alignment, the sequence count and the table's row stride vary from step to step:
# specialized on them (== 1, divisible by 16), the kernel would compile again while serving, stalling the step
# that meets the new variant (worker_svc/compile_watch.py names any such compile).
@triton.jit(do_not_specialize=["num_seqs", "stride_table_seq"],
            do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"])
def _prefill_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    output_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    softcap_log2,
    k_scale,
    v_scale,
    sliding_window,
    num_seqs,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table_seq,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    tile_index = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_index, BLOCK_M)
    first_token = tl.load(query_start_loc_ptr)
    token_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - token_start
    row_start = (tile_index - ((token_start - first_token) // BLOCK_M + seq)) * BLOCK_M
    if row_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - query_len

    rows = row_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_valid = rows < query_len
    row_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    tokens = (token_start + rows).to(tl.int64)
    query = tl.load(
        query_ptr + tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
        mask=row_mask,
        other=0.0,
    )
    if UPCAST:
        query = query.to(tl.float32)
    query_positions = context_before + rows

    # Keys before the tile's first query position are visible to every row: no mask there.
    unmasked_end = (context_before + row_start) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(seq_len, context_before + row_start + BLOCK_M)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tile = tl.arange(0, BLOCK_N)
    if HAS_WINDOW:
        running_max, running_sum, acc = _attend_window(
            query, key_cache_ptr, value_cache_ptr, table_row, query_positions, context_before + row_start,
            context_before + tl.minimum(row_start + BLOCK_M, query_len) - 1, causal_end, sliding_window, kv_head,
            stride_cache_block, stride_cache_token, stride_cache_head, dims, running_max, running_sum, acc,
            scale_log2, softcap_log2, k_scale, v_scale, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, UPCAST, DOT_PRECISION,
            HAS_SOFTCAP, KV_FP8, query_ptr.dtype.element_ty,
        )
    else:
        for tile_start in range(0, unmasked_end, BLOCK_N):
            positions = tile_start + tile
            running_max, running_sum, acc = attend_paged_tile(
                query, key_cache_ptr, value_cache_ptr, table_row, positions, positions < seq_len,
                positions[None, :] < seq_len, kv_head, stride_cache_block, stride_cache_token,
                stride_cache_head, dims, running_max, running_sum, acc, scale_log2, softcap_log2, k_scale,
                v_scale, HEAD_DIM, BLOCK_D, BLOCK_SIZE, UPCAST, DOT_PRECISION, False, HAS_SOFTCAP,
                KV_FP8, query_ptr.dtype.element_ty,
            )
        for tile_start in range(unmasked_end, causal_end, BLOCK_N):
            positions = tile_start + tile
            in_context = positions < causal_end
            visible = in_context[None, :] & (positions[None, :] <= query_positions[:, None])
            running_max, running_sum, acc = attend_paged_tile(
                query, key_cache_ptr, value_cache_ptr, table_row, positions, in_context,
                visible, kv_head, stride_cache_block, stride_cache_token,
                stride_cache_head, dims, running_max, running_sum, acc, scale_log2, softcap_log2, k_scale,
                v_scale, HEAD_DIM, BLOCK_D, BLOCK_SIZE, UPCAST, DOT_PRECISION, True, HAS_SOFTCAP,
                KV_FP8, query_ptr.dtype.element_ty,
            )

    output = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(
        output_ptr + tokens[:, None] * stride_o_token + head * stride_o_head + dims[None, :],
        output.to(output_ptr.dtype.element_ty),
        mask=row_mask,
    )


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    output: torch.Tensor,
    num_query_tokens: int,
    block_m: int = 64,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    kv_scales: KVScales = UNIT_KV_SCALES,
) -> None:
    """Write causal attention of `seq_lens.shape[0]` sequences' query chunks into `output` in place.

    query / output [T, Hq, D] (the whole step's token axis; rows are addressed through
    `query_start_loc`, which may start past 0); kv_cache [2, num_blocks, block_size, Hkv, D];
    query_start_loc [B + 1]; seq_lens [B]; block_tables [B, W]. `num_query_tokens` is a host-side upper
    bound on the tokens these sequences own (e.g. T minus the decode tokens before them); it only sizes
    the grid. `block_n` defaults to 64 key tokens a tile for 16-bit caches and 32 for fp32 ones (an
    fp32 64 x 64 x 128 pipeline would not fit in shared memory); it, `num_warps` and `num_stages` are
    tuning knobs (benchmarks/kernel_bench.py --sweep). `sliding_window` W and `logit_softcap` c are
    constexpr variants (HAS_WINDOW, HAS_SOFTCAP) as in decode_attention; with a window a tile reads the
    keys from its first row's window start on (O(W + BLOCK_M) keys, not the whole prefix). An fp8 `kv_cache`
    (KV_FP8) is read exactly in fp16 with `kv_scales` applied to the dots (kernels/triton_paged_kv.py).
    """
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    num_query_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    assert query.stride(2) == 1 and output.stride(2) == 1 and key_cache.stride(3) == 1
    if block_n is None:
        block_n = 64 if kv_cache.element_size() <= 2 else 32
    num_tiles = num_query_tokens // block_m + num_seqs
    _prefill_attention_kernel[(num_tiles, num_query_heads)](
        query, key_cache, value_cache, output,
        query_start_loc, seq_lens, block_tables,
        scale * LOG2_E,
        0.0 if logit_softcap is None else logit_softcap * LOG2_E,
        kv_scales.k, kv_scales.v,
        0 if sliding_window is None else sliding_window,
        num_seqs,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=num_query_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UPCAST=needs_upcast(query.dtype) or needs_upcast(kv_cache.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=logit_softcap is not None,
        KV_FP8=is_fp8(kv_cache.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
