"""BatchInvariantTritonBackend: paged attention whose output for a query token never depends on the batch.

Torch reference: kernels/paged_attention_ref.py (`paged_attention`), same contract and rounding points.

Why not kernels/triton_backend.py: there a decode token goes through the decode kernel (query heads packed
into rows, split-KV with a number of segments chosen by the batch size, partial results merged by
log-sum-exp) and the same token in a prefill or an extend chunk goes through the prefill kernel (another
tile size, and with a sliding window its key tiles start at the window start of the tile's first query row,
which depends on how the prompt was chunked). Each path is correct, but they fold the keys into the online
softmax in different groupings, so a token's bits depend on whether it was decoded, prefilled, chunked or
served from the prefix cache, and on the batch (--batch-invariant).

A token's result is DEFINED by fixed groupings of its keys, the same however it is served:
- Keys are cut in segments of `segment` keys (SEGMENT, a multiple of the tile) from key 0, and segments in
  tiles `[j * BLOCK_N, (j + 1) * BLOCK_N)`. Per segment: the online softmax over its tiles in order from a
  fresh state (max -inf, sum 0, acc 0) (kernels/triton_paged_kv.py's `online_softmax_step`).
- The segments' states are merged in segment order into a running (M, L, ACC) by one formula
  (`_merge_weights`): M' = max(M, m), L' = L * exp2(M - M') + l * exp2(m - M'), ACC' likewise, with
  exp2(-inf - -inf) guarded; a segment in which the row sees no key is skipped. Then out = ACC / L.

Two ways to compute it, which give the same bits:
(a) one program folds its segments one after the other and merges them in registers: prefill / extend
    query tiles, and decodes in large batches (`DECODE` without `SPLIT`: one program per sequence, no search);
(b) decodes in small batches (`SPLIT`): one program per (decode sequence, KV head, split) computes segments
    split, split + num_splits, ... and writes each one's (m, l, acc) in fp32 to a scratch buffer;
    `_merge_segments_kernel` merges them in segment order by the same formula and divides.
The segment's arithmetic is the same source in both (one kernel, constexpr variants), fp32 stores and loads
are exact, and the merge and the division are the same elementwise operations in both kernels. What could
still differ is the compiler's contraction of `a * b + c` into an FMA, which it may decide differently in
different kernels (or variants): every launch here passes `enable_fp_fusion=False` (a Triton launch option:
PTX is built with --fmad=false), so each multiply and add rounds on its own everywhere. The interpreter
ignores the option (numpy never fuses). `segments_agree` checks (a) == (b) on the device at start-up;
where they differ (not expected), decodes stay on (a) and are still invariant, only slower.
Which way a decode takes depends on the shape only (decode rows x KV heads < SPLIT_BELOW_PROGRAMS), and
since (a) and (b) agree bit for bit the choice changes no token's bits.

Rows in one program: a program owns the query heads of one KV head for a few consecutive tokens of one
sequence (rows = tokens x heads, as the decode kernel packs heads), and every row's math is its own:
- Tiles or segments a row sees nothing of leave its state exactly as it was (max unchanged, rescale
  exp2(0) = 1, probabilities exactly 0; skipped by the merge), so extra tiles never change a row's bits.
- Every tile is masked the same way (no unmasked fast path whose extent depends on the tile's first row).
  Keys no row of the program sees read as 0 (never NaN), so they contribute exact zeros.
- A row's scores and P @ V are per-row dots of a fixed tile shape (BLOCK_M, BLOCK_N, head dim, warps: the
  same in every variant); the MMA computes each output element the same way whatever its row in the tile.

Why SEGMENT = 256 keys (4 tiles of 64 for a 16-bit cache): a lone decode at 4k context gets 16 segments x
KV heads programs (vs 2 programs before), each still streaming 128 KB of K/V (head dim 128, bf16) to pay for
its fixed cost; its partial (12 heads x (128 + 2) fp32 for Qwen2.5-1.5B, 6 KB) is ~5% of the K/V it read
(10% at 128 keys, 2.5% at 512); the merge walks one partial per 256 keys; a prefill program merges in
registers every 4 tiles (a few elementwise ops on 16 x 128, cheap next to 8 dots). A different segment
gives every token other (equally invariant) bits: it is fixed per backend; benchmarks/ times 128/256/512.

Why not only route decodes to kernels/triton_prefill_attention.py with its block sizes fixed: with a window
its tiles start at the window start of the query tile's first row (the grouping moves with the chunking),
and it folds keys in an unmasked loop and a masked one, which body a key tile goes through depending on
where the row's query tile begins (two bodies the compiler may contract differently).

CUDA graphs: every grid and buffer is a function of shapes: the prefill grid is `T // (BLOCK_M // (Hq /
Hkv)) + B` programs per KV head; the decode grid (decodes, Hkv, splits) and the scratch [decodes, Hq,
max_segments, D] with max_segments = block-table width x block size / SEGMENT (the decode graphs' tables
are max-model-len wide; a window bounds it too). No host sync when `metadata.num_decode_seqs` is set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import triton_cache_write
from kernels.attention_metadata import AttentionMetadata
from kernels.kv_quant import UNIT_KV_SCALES, KVScales, is_fp8
from kernels.triton_backend import count_leading_decodes
from kernels.triton_numerics import dot_precision, needs_upcast
from kernels.triton_paged_kv import LOG2_E, attend_paged_tile
from kernels.triton_prefill_attention import _find_sequence

SEGMENT = 256  # keys a segment, from key 0: see the module docstring for why 256
# Decode rows x KV heads below which decodes run split. The same boundary as the split-KV decode's
# (triton_decode_attention.choose_num_kv_splits' min_programs), so worker_svc/kernel_warmup.py's decode
# size classes compile both variants before serving.
SPLIT_BELOW_PROGRAMS = 256
TARGET_SPLIT_PROGRAMS = 512  # split-decode programs aimed at (most exit at once when contexts are short)
MERGE_CHUNK = 16  # segment partials the merge kernel loads at once


@triton.jit
def _visible_keys(context_before, token_first, query_len, sliding_window, TOKENS_PER_TILE: tl.constexpr,
                  HAS_WINDOW: tl.constexpr):
    """[first_key, causal_end): the keys some row of a program whose first token is `token_first` may see."""
    causal_end = context_before + tl.minimum(token_first + TOKENS_PER_TILE, query_len)
    if HAS_WINDOW:
        # The first token's window starts first; earlier keys are read as 0 (no row sees them).
        first_key = tl.maximum(context_before + token_first - sliding_window + 1, 0)
    else:
        first_key = context_before * 0
    return first_key, causal_end


@triton.jit
def _merge_weights(total_max, segment_max):
    """The one merge formula's max and rescale factors; the caller forms `total * alpha + segment * beta`.
    A -inf total (nothing merged yet) rescales by exp2(-inf) = 0, never by exp2(-inf - -inf) = NaN."""
    new_max = tl.maximum(total_max, segment_max)
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    return new_max, tl.exp2(total_max - safe_max), tl.exp2(segment_max - safe_max)


@triton.jit(do_not_specialize=["num_seqs", "stride_table_seq", "num_splits", "max_segments"],
            do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"])
def _batch_invariant_attention_kernel(
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
    num_seqs,
    num_splits,
    max_segments,
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
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEGMENT: tl.constexpr,
    DECODE: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One program: TOKENS_PER_TILE query tokens of one sequence x the QUERIES_PER_KV query heads of one KV
    head, row r = (token r // QUERIES_PER_KV, head r % QUERIES_PER_KV), BLOCK_M rows (the unused tail masked).

    DECODE: program axis 0 is the sequence (each has at most one query token; no search). SPLIT (with DECODE):
    program axis 2 takes segments split, split + num_splits, ... of the row's and writes each segment's
    state to the partials (merged by `_merge_segments_kernel`); otherwise the program merges its segments
    in registers and writes the output."""
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE:
        seq = tile_index
        token_start = tl.load(query_start_loc_ptr + seq)
        token_first = token_start * 0
    else:
        seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_index, TOKENS_PER_TILE)
        first_token = tl.load(query_start_loc_ptr)
        token_start = tl.load(query_start_loc_ptr + seq)
        token_first = (tile_index - ((token_start - first_token) // TOKENS_PER_TILE + seq)) * TOKENS_PER_TILE
    query_len = tl.load(query_start_loc_ptr + seq + 1) - token_start
    if token_first >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - query_len
    first_key, causal_end = _visible_keys(context_before, token_first, query_len, sliding_window,
                                          TOKENS_PER_TILE, HAS_WINDOW)
    first_segment = first_key // SEGMENT
    end_segment = tl.cdiv(causal_end, SEGMENT)
    if SPLIT:
        segment_begin = first_segment + tl.program_id(2)
        segment_step = num_splits
        if segment_begin >= end_segment:
            return
    else:
        segment_begin = first_segment
        segment_step = 1

    rows = tl.arange(0, BLOCK_M)
    token_rows = token_first + rows // QUERIES_PER_KV  # the token of each row, within the sequence's chunk
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    dims = tl.arange(0, BLOCK_D)
    row_valid = (rows < TOKENS_PER_TILE * QUERIES_PER_KV) & (token_rows < query_len)
    row_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    tokens = (token_start + token_rows).to(tl.int64)
    query_offsets = tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
    query = tl.load(query_ptr + query_offsets, mask=row_mask, other=0.0)
    if UPCAST:
        query = query.to(tl.float32)
    query_positions = context_before + token_rows
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    first_tile = first_key // BLOCK_N * BLOCK_N
    total_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total_sum = tl.zeros([BLOCK_M], tl.float32)
    total_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    partial = (seq.to(tl.int64) * (QUERIES_PER_KV * tl.num_programs(1)) + heads) * max_segments - first_segment
    tile = tl.arange(0, BLOCK_N)
    for segment in range(segment_begin, end_segment, segment_step):
        # The segment's own online softmax from a fresh state, over tiles at multiples of BLOCK_N from key 0.
        segment_start = segment * SEGMENT
        segment_end = tl.minimum(segment_start + SEGMENT, causal_end)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for tile_start in range(tl.maximum(segment_start, first_tile), segment_end, BLOCK_N):
            positions = tile_start + tile
            in_context = (positions < causal_end) & (positions >= first_key)
            visible = in_context[None, :] & (positions[None, :] <= query_positions[:, None])
            if HAS_WINDOW:
                visible = visible & (positions[None, :] > query_positions[:, None] - sliding_window)
            running_max, running_sum, acc = attend_paged_tile(
                query, key_cache_ptr, value_cache_ptr, table_row, positions, in_context, visible, kv_head,
                stride_cache_block, stride_cache_token, stride_cache_head, dims, running_max, running_sum, acc,
                scale_log2, softcap_log2, k_scale, v_scale, HEAD_DIM, BLOCK_D, BLOCK_SIZE, UPCAST, DOT_PRECISION, True,
                HAS_SOFTCAP, KV_FP8, query_ptr.dtype.element_ty,
            )
        if SPLIT:
            tl.store(partial_max_ptr + partial + segment, running_max, mask=row_valid)
            tl.store(partial_sum_ptr + partial + segment, running_sum, mask=row_valid)
            tl.store(partial_acc_ptr + (partial + segment)[:, None] * BLOCK_D + dims[None, :], acc,
                     mask=row_valid[:, None])
        else:
            # A segment in which a row sees no key leaves the row's state as it is (not even a zero's sign).
            seen = running_max != float("-inf")
            new_max, alpha, beta = _merge_weights(total_max, running_max)
            total_sum = tl.where(seen, total_sum * alpha + running_sum * beta, total_sum)
            total_acc = tl.where(seen[:, None], total_acc * alpha[:, None] + acc * beta[:, None], total_acc)
            total_max = tl.where(seen, new_max, total_max)

    if not SPLIT:
        output = total_acc / tl.where(total_sum == 0.0, 1.0, total_sum)[:, None]
        tl.store(
            output_ptr + tokens[:, None] * stride_o_token + heads[:, None] * stride_o_head + dims[None, :],
            output.to(output_ptr.dtype.element_ty),
            mask=row_mask,
        )


@triton.jit(do_not_specialize=["max_segments"])
def _merge_segments_kernel(
    output_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    sliding_window,
    max_segments,
    stride_o_token,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    SEGMENT: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One (decode sequence, query head): its segments' states merged in segment order, then ACC / L; the
    attention kernel's in-register merge, operation for operation. CHUNK partials are loaded at once (one
    memory latency, not one per segment) and taken out one by one by a max against -inf (exact)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - token_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key, causal_end = _visible_keys(seq_len - query_len, token_start * 0, query_len, sliding_window,
                                          TOKENS_PER_TILE, HAS_WINDOW)
    first_segment = first_key // SEGMENT
    end_segment = tl.cdiv(causal_end, SEGMENT)
    partial = (seq.to(tl.int64) * tl.num_programs(1) + head) * max_segments - first_segment
    chunk = tl.arange(0, CHUNK)
    dims = tl.arange(0, BLOCK_D)
    total_max = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), 0)
    total_sum = tl.sum(tl.zeros([CHUNK], tl.float32), 0)
    total_acc = tl.zeros([BLOCK_D], tl.float32)
    for chunk_start in range(first_segment, end_segment, CHUNK):
        segments = chunk_start + chunk
        in_range = segments < end_segment
        chunk_max = tl.load(partial_max_ptr + partial + segments, mask=in_range, other=float("-inf"))
        chunk_sum = tl.load(partial_sum_ptr + partial + segments, mask=in_range, other=0.0)
        chunk_acc = tl.load(partial_acc_ptr + (partial + segments)[:, None] * BLOCK_D + dims[None, :],
                            mask=in_range[:, None], other=0.0)
        for index in tl.static_range(CHUNK):
            pick = chunk == index
            running_max = tl.max(tl.where(pick, chunk_max, float("-inf")), 0)
            running_sum = tl.max(tl.where(pick, chunk_sum, float("-inf")), 0)
            acc = tl.max(tl.where(pick[:, None], chunk_acc, float("-inf")), 0)
            seen = running_max != float("-inf")
            new_max, alpha, beta = _merge_weights(total_max, running_max)
            total_sum = tl.where(seen, total_sum * alpha + running_sum * beta, total_sum)
            total_acc = tl.where(seen, total_acc * alpha + acc * beta, total_acc)
            total_max = tl.where(seen, new_max, total_max)
    output = total_acc / tl.where(total_sum == 0.0, 1.0, total_sum)
    tl.store(
        output_ptr + token_start.to(tl.int64) * stride_o_token + head * stride_o_head + dims,
        output.to(output_ptr.dtype.element_ty),
        mask=dims < tl.where(query_len > 0, HEAD_DIM, 0),
    )


class BatchInvariantTritonBackend:
    """The AttentionBackend protocol (kernels/attention_backend.py) with batch-invariant paged attention.

    `block_m` query rows (token x query head pairs; raised to the next power of two of Hq / Hkv if that is
    larger), `block_n` keys a tile and `segment` keys a segment are fixed for the backend's lifetime
    (changing them changes every token's bits, consistently). `block_n` None: 64 keys for 16-bit caches, 32
    for fp32 (an fp32 64 x 64 x D pipeline does not fit shared memory), chosen by the cache dtype, which is
    fixed for a model; `segment` must be a multiple of it. `split_decodes`: None picks way (b) for decodes by
    the shape (decode rows x KV heads < SPLIT_BELOW_PROGRAMS), True / False forces (b) / (a) (tests, benches,
    and False where `segments_agree` does not hold). Requirements as kernels/triton_backend.py's.
    """

    def __init__(self, block_m: int = 16, block_n: int | None = None, segment: int = SEGMENT,
                 split_decodes: bool | None = None, num_warps: int = 4, num_stages: int = 2):
        self.block_m = block_m
        self.block_n = block_n
        self.segment = segment
        self.split_decodes = split_decodes
        self.num_warps = num_warps
        self.num_stages = num_stages

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        """A copy of each token's K/V into its slot (quantized elementwise into an fp8 cache): no reduction,
        invariant as it is."""
        triton_cache_write.write_kv_cache(key, value, kv_cache, slot_mapping, kv_scales)

    def paged_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        output: torch.Tensor | None = None,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        """Same contract as kernels/paged_attention_ref.py; tokens outside every sequence get zeros.
        The first `metadata.num_decode_seqs` sequences (found with one host sync when None) run the decode
        variants, the rest the prefill variant: the same math for every token. With `output` (like `query`), the
        result goes there and rows of tokens outside every sequence keep what they held, as in
        kernels/triton_backend.py (a piecewise CUDA graph's buffer: worker_svc/mixed_graphs.py). An fp8 cache is
        read exactly in fp16 with `kv_scales` applied to the dots (kernels/triton_paged_kv.py), the same for every
        token whatever kernel variant runs it, which keeps every token's result invariant."""
        assert query.dtype == kv_cache.dtype or is_fp8(kv_cache.dtype), "query and KV cache must share a dtype"
        if output is None:
            output = torch.zeros_like(query)
        num_seqs = metadata.num_seqs
        if num_seqs == 0:
            return output
        num_decodes = metadata.num_decode_seqs
        if num_decodes is None:
            num_decodes = count_leading_decodes(metadata)
        num_query_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        assert query.stride(2) == 1 and key_cache.stride(3) == 1
        block_n = self.block_n
        if block_n is None:
            block_n = 64 if kv_cache.element_size() <= 2 else 32
        assert self.segment % block_n == 0, "a segment is a whole number of key tiles"
        block_tables = metadata.block_tables
        queries_per_kv = num_query_heads // num_kv_heads
        block_m = max(self.block_m, triton.next_power_of_2(queries_per_kv))
        tokens_per_tile = block_m // queries_per_kv
        block_d = triton.next_power_of_2(head_dim)

        def launch(grid, seqs, decode=False, partials=None, num_splits=1, max_segments=1):
            _batch_invariant_attention_kernel[grid](
                query, key_cache, value_cache, output,
                metadata.query_start_loc[seqs.start: seqs.stop + 1], metadata.seq_lens[seqs], block_tables[seqs],
                *(partials or (output, output, output)),
                scale * LOG2_E,
                0.0 if logit_softcap is None else logit_softcap * LOG2_E,
                kv_scales.k, kv_scales.v,
                0 if sliding_window is None else sliding_window,
                seqs.stop - seqs.start, num_splits, max_segments,
                query.stride(0), query.stride(1), output.stride(0), output.stride(1),
                key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
                QUERIES_PER_KV=queries_per_kv,
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                BLOCK_SIZE=block_size,
                BLOCK_M=block_m,
                TOKENS_PER_TILE=tokens_per_tile,
                BLOCK_N=block_n,
                SEGMENT=self.segment,
                DECODE=decode,
                SPLIT=partials is not None,
                UPCAST=needs_upcast(query.dtype) or needs_upcast(kv_cache.dtype),
                DOT_PRECISION=dot_precision(query.dtype),
                HAS_WINDOW=sliding_window is not None,
                HAS_SOFTCAP=logit_softcap is not None,
                KV_FP8=is_fp8(kv_cache.dtype),
                num_warps=self.num_warps,
                num_stages=self.num_stages,
                enable_fp_fusion=False,
            )

        if num_decodes > 0:
            decodes = slice(0, num_decodes)
            split = self.split_decodes
            if split is None:
                split = num_decodes * num_kv_heads < SPLIT_BELOW_PROGRAMS
            if not split:
                launch((num_decodes, num_kv_heads, 1), decodes, decode=True)
            else:
                max_segments = triton.cdiv(block_tables.shape[1] * block_size, self.segment)
                if sliding_window is not None:
                    max_segments = min(max_segments, triton.cdiv(sliding_window, self.segment) + 1)
                num_splits = min(max_segments, triton.cdiv(TARGET_SPLIT_PROGRAMS, num_decodes * num_kv_heads))
                shape = (num_decodes, num_query_heads, max_segments)
                partials = (torch.empty(shape + (block_d,), dtype=torch.float32, device=query.device),
                            torch.empty(shape, dtype=torch.float32, device=query.device),
                            torch.empty(shape, dtype=torch.float32, device=query.device))
                launch((num_decodes, num_kv_heads, num_splits), decodes, True, partials, num_splits, max_segments)
                _merge_segments_kernel[(num_decodes, num_query_heads)](
                    output, metadata.query_start_loc[: num_decodes + 1], metadata.seq_lens[:num_decodes],
                    *partials,
                    0 if sliding_window is None else sliding_window,
                    max_segments, output.stride(0), output.stride(1),
                    HEAD_DIM=head_dim, BLOCK_D=block_d, TOKENS_PER_TILE=tokens_per_tile, SEGMENT=self.segment,
                    CHUNK=MERGE_CHUNK, HAS_WINDOW=sliding_window is not None,
                    num_warps=1, enable_fp_fusion=False,
                )
        if num_decodes < num_seqs:
            num_tiles = query.shape[0] // tokens_per_tile + num_seqs - num_decodes
            launch((num_tiles, num_kv_heads, 1), slice(num_decodes, num_seqs))
        return output


def segments_agree(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether decodes through (b) (segments in programs of their own, merged by a second kernel) give the
    bits of (a) (one program merging in registers) on this device: random contexts spanning 1 to 5 segments,
    plain, with a window and with a soft-cap."""
    generator = torch.Generator().manual_seed(0)
    num_kv_heads, group, head_dim, block_size = 2, 6, 128, 16
    seq_lens = [1, 255, 256, 257, 700, 1200]
    widths = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(widths)
    kv_cache = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=generator).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros((len(seq_lens), max(widths)), dtype=torch.int32)
    start = 0
    for row, width in enumerate(widths):
        block_tables[row, :width] = tables[start: start + width]
        start += width
    metadata = AttentionMetadata(
        slot_mapping=torch.full((len(seq_lens),), -1, device=device),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device), block_size=block_size, num_decode_seqs=len(seq_lens))
    query = torch.randn((len(seq_lens), num_kv_heads * group, head_dim), generator=generator).to(device, dtype)
    for options in ({}, {"sliding_window": 300}, {"logit_softcap": 30.0}):
        outputs = [BatchInvariantTritonBackend(split_decodes=split).paged_attention(
            query, kv_cache, metadata, head_dim ** -0.5, **options) for split in (False, True)]
        if not torch.equal(outputs[0], outputs[1]):
            return False
    return True
