"""Paged decode attention in Triton: one query token per sequence against its whole paged context.

Torch reference: kernels/paged_attention_ref.py (`paged_attention` with every query length 1).

Design (KERNELS.md; tuned with benchmarks/kernel_bench.py, figures in docs/benchmarks.md, "Kernel tuning"):
- One program per (kv head, sequence): it packs all query heads that share the KV head into the rows of
  its tile (rows padded to >= 16 so `tl.dot` is legal), so each K/V byte is read once per sequence.
- Online softmax in fp32 over tiles of BLOCK_N context tokens gathered through the block table; full
  tiles load without masks, only the last tile is masked, so large batches read K/V at about the card's copy
  rate.
- Split-KV variant for small batches / long contexts, where (sequences x kv heads) programs cannot fill
  the GPU: a third grid axis cuts the context into `num_kv_splits` segments; each writes an unnormalized
  fp32 partial (acc, max, sum) and `_merge_kv_splits_kernel` combines them by log-sum-exp. The segment
  length is computed inside the kernel from `seq_lens`, so the grid depends only on the batch size:
  launches are CUDA-graph capturable with static (bucketed) batch sizes.

- Sliding window (HAS_WINDOW, runtime W) and soft-capping (HAS_SOFTCAP) are constexpr variants: with a
  window the loop (and the split-KV segments) covers only the window's keys, so a decode costs O(W), not
  O(context) (benchmarks/window_attention_bench.py).

Rows of the batch with no query token (query_start_loc[i + 1] == query_start_loc[i]) write nothing; rows
with `seq_len == 0` (CUDA-graph padding) write zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import UNIT_KV_SCALES, KVScales, is_fp8
from kernels.triton_numerics import dot_precision, needs_upcast
from kernels.triton_paged_kv import LOG2_E, attend_paged_tile


# The block table is as wide as the step's longest sequence needs: its row stride varies from step to step, and
# specialized on it the kernel would compile again while serving (see triton_prefill_attention.py).
@triton.jit(do_not_specialize=["stride_table_seq"])
def _decode_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    output_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    scale_log2,
    softcap_log2,
    k_scale,
    v_scale,
    sliding_window,
    num_query_heads,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table_seq,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    if HEADS_FASTEST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token_start = tl.load(query_start_loc_ptr + seq)
    has_query = tl.load(query_start_loc_ptr + seq + 1) > token_start
    token = token_start.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * QUERIES_PER_KV + rows
    # A row without a query token (padding) reads and writes no head.
    num_rows = tl.where(has_query, QUERIES_PER_KV, 0)
    head_mask = (rows < num_rows)[:, None] & (dims < HEAD_DIM)[None, :]
    query = tl.load(
        query_ptr + token * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
        mask=head_mask,
        other=0.0,
    )
    if UPCAST:
        query = query.to(tl.float32)

    # The keys the query (at position seq_len - 1) sees: all of them, or the window's last W. Tiles start
    # at the window's first key (not at 0 nor at a tile boundary), so a decode costs O(W), and every key
    # of a tile before the last is visible: the window needs no mask.
    if HAS_WINDOW:
        window_start = tl.maximum(seq_len - sliding_window, 0)
    else:
        window_start = 0
    if NUM_KV_SPLITS == 1:
        context_start = window_start
        context_end = seq_len
    else:  # the splits share the window's keys, not the whole context's
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len - window_start, BLOCK_N), NUM_KV_SPLITS)
        context_start = window_start + split * tiles_per_split * BLOCK_N
        context_end = tl.minimum(context_start + tiles_per_split * BLOCK_N, seq_len)
        context_end = tl.maximum(context_end, context_start)  # a split past the context is empty
    full_end = context_start + (context_end - context_start) // BLOCK_N * BLOCK_N

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    tile = tl.arange(0, BLOCK_N)
    for tile_start in range(context_start, full_end, BLOCK_N):
        positions = tile_start + tile
        running_max, running_sum, acc = attend_paged_tile(
            query, key_cache_ptr, value_cache_ptr, table_row, positions, positions < context_end,
            positions[None, :] < context_end, kv_head, stride_cache_block, stride_cache_token,
            stride_cache_head, dims, running_max, running_sum, acc, scale_log2, softcap_log2, k_scale, v_scale,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, UPCAST, DOT_PRECISION, False, HAS_SOFTCAP,
            KV_FP8, query_ptr.dtype.element_ty,
        )
    if full_end < context_end:
        positions = full_end + tile
        in_context = positions < context_end
        running_max, running_sum, acc = attend_paged_tile(
            query, key_cache_ptr, value_cache_ptr, table_row, positions, in_context,
            in_context[None, :], kv_head, stride_cache_block, stride_cache_token,
            stride_cache_head, dims, running_max, running_sum, acc, scale_log2, softcap_log2, k_scale, v_scale,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, UPCAST, DOT_PRECISION, True, HAS_SOFTCAP,
            KV_FP8, query_ptr.dtype.element_ty,
        )

    if NUM_KV_SPLITS == 1:
        output = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(
            output_ptr + token * stride_o_token + heads[:, None] * stride_o_head + dims[None, :],
            output.to(output_ptr.dtype.element_ty),
            mask=head_mask,
        )
    else:
        # Partials are [seqs, query heads, splits] (+ [BLOCK_D] for acc), fp32, contiguous.
        partial = (seq.to(tl.int64) * num_query_heads + heads) * NUM_KV_SPLITS + split
        row_mask = rows < QUERIES_PER_KV
        tl.store(partial_max_ptr + partial, running_max, mask=row_mask)
        tl.store(partial_sum_ptr + partial, running_sum, mask=row_mask)
        tl.store(partial_acc_ptr + partial[:, None] * BLOCK_D + dims[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _merge_kv_splits_kernel(
    output_ptr,
    query_start_loc_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    num_query_heads,
    stride_o_token,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
):
    """Log-sum-exp merge of one (sequence, query head)'s split partials; empty splits weigh 0."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token_start = tl.load(query_start_loc_ptr + seq)
    query_end = tl.load(query_start_loc_ptr + seq + 1)
    splits = tl.arange(0, NUM_KV_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    partial = (seq.to(tl.int64) * num_query_heads + head) * NUM_KV_SPLITS + splits
    split_max = tl.load(partial_max_ptr + partial)
    split_sum = tl.load(partial_sum_ptr + partial)
    split_acc = tl.load(partial_acc_ptr + partial[:, None] * BLOCK_D + dims[None, :])
    overall_max = tl.max(split_max, 0)
    weight = tl.exp2(split_max - tl.where(overall_max == float("-inf"), 0.0, overall_max))
    total = tl.sum(weight * split_sum, 0)
    output = tl.sum(split_acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        output_ptr + token_start.to(tl.int64) * stride_o_token + head * stride_o_head + dims,
        output.to(output_ptr.dtype.element_ty),
        mask=dims < tl.where(query_end > token_start, HEAD_DIM, 0),
    )


def choose_num_kv_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_splits: int = 64,
    min_programs: int = 256,
    target_programs: int = 512,
) -> int:
    """Split-KV segments for a decode batch: 1 (single pass) unless the grid cannot fill the GPU.

    Depends on host ints only (the batch bucket and the model), never on context lengths, so a CUDA
    graph captured for a bucket stays valid. Below `min_programs` (sequence, kv head) programs the
    single pass leaves SMs idle; then the context is cut so that about `target_programs` programs run
    (a power of two, at most `max_splits`). Why these thresholds: splits multiply the bandwidth of a lone
    long sequence several times and help up to about 16 sequences, while from about 32 sequences the single
    pass already fills the card and splitting only adds the merge (benchmarks/kernel_bench.py; figures in
    docs/benchmarks.md, "Kernel tuning").
    """
    programs = num_seqs * num_kv_heads
    if programs >= min_programs:
        return 1
    wanted = -(-target_programs // max(programs, 1))
    return min(max_splits, triton.next_power_of_2(wanted))


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    output: torch.Tensor,
    num_kv_splits: int = 1,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    heads_fastest: bool = True,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    kv_scales: KVScales = UNIT_KV_SCALES,
) -> None:
    """Write decode attention of `seq_lens.shape[0]` sequences into `output` [T, Hq, D] in place.

    query [T, Hq, D]; kv_cache [2, num_blocks, block_size, Hkv, D]; query_start_loc [B + 1] (each
    sequence has at most one query token, at `query_start_loc[i]`); seq_lens [B]; block_tables [B, W].
    `num_kv_splits` 1 runs the single-pass kernel; a power of two > 1 the split-KV kernel plus merge.
    No host sync: the grid is (Hkv, B[, splits]). `block_n` (context tokens a tile), `num_warps` and
    `num_stages` are tuning knobs (benchmarks/kernel_bench.py --sweep), as is `heads_fastest`: the grid
    order, kv heads varying fastest so the programs running together read the interleaved head rows of
    the same blocks rather than one head's rows of many sequences (slightly faster).
    `num_stages` defaults to 3 over an fp8 cache (1-4% faster than 2 there, up to 30% at split-KV: H200,
    benchmarks/fp8_kv_attention_gpu.py) and 2 otherwise.
    `block_n` defaults to 128 for a single pass over a 16-bit cache (fewer, longer tiles read a large batch's
    K/V closer to the copy rate) and 64 otherwise (split segments are short; an fp32 tile is twice as big).
    `sliding_window` W: the query sees its last W keys only, and only they are read (the split-KV segments
    cut the window, not the context). `logit_softcap` c: scores become `c * tanh(s / c)`. Each is a
    constexpr variant (HAS_WINDOW, HAS_SOFTCAP); without them the kernel is the plain one. An fp8 `kv_cache`
    (KV_FP8) is read exactly in fp16 with `kv_scales` applied to the dots (kernels/triton_paged_kv.py).
    """
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    num_query_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    queries_per_kv = num_query_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    assert query.stride(2) == 1 and output.stride(2) == 1 and key_cache.stride(3) == 1
    assert num_kv_splits == 1 or num_kv_splits == triton.next_power_of_2(num_kv_splits)
    if block_n is None:
        block_n = 128 if num_kv_splits == 1 and kv_cache.element_size() <= 2 else 64
    if num_stages is None:
        num_stages = 3 if is_fp8(kv_cache.dtype) else 2
    if num_kv_splits == 1:
        partial_acc = partial_max = partial_sum = output  # unused by the single-pass variant
    else:
        partial_acc = torch.empty(
            (num_seqs, num_query_heads, num_kv_splits, block_d), dtype=torch.float32, device=query.device
        )
        partial_max = torch.empty(
            (num_seqs, num_query_heads, num_kv_splits), dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
    grid = (num_kv_heads, num_seqs, num_kv_splits) if heads_fastest else (num_seqs, num_kv_heads, num_kv_splits)
    _decode_attention_kernel[grid](
        query, key_cache, value_cache, output,
        query_start_loc, seq_lens, block_tables,
        partial_acc, partial_max, partial_sum,
        scale * LOG2_E,
        0.0 if logit_softcap is None else logit_softcap * LOG2_E,
        kv_scales.k, kv_scales.v,
        0 if sliding_window is None else sliding_window,
        num_query_heads,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_H=max(16, triton.next_power_of_2(queries_per_kv)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_KV_SPLITS=num_kv_splits,
        UPCAST=needs_upcast(query.dtype) or needs_upcast(kv_cache.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
        HEADS_FASTEST=heads_fastest,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=logit_softcap is not None,
        KV_FP8=is_fp8(kv_cache.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_kv_splits > 1:
        _merge_kv_splits_kernel[(num_seqs, num_query_heads)](
            output, query_start_loc, partial_acc, partial_max, partial_sum,
            num_query_heads, output.stride(0), output.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_KV_SPLITS=num_kv_splits,
            num_warps=4,
        )
