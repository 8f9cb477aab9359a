"""BatchInvariantTritonBackend: paged attention whose output for a query token never depends on the batch.

Torch reference: kernels/paged_attention_ref.py (`paged_attention`), same contract and rounding points.

Why not kernels/triton_backend.py: there a decode token goes through the decode kernel (query heads packed
into rows, split-KV with a number of segments chosen by the batch size, partial results merged by
log-sum-exp) and the same token in a prefill or an extend chunk goes through the prefill kernel (another
tile size, and with a sliding window its key tiles start at the window start of the tile's first query row,
which depends on how the prompt was chunked). Each path is correct, but they fold the keys into the online
softmax in different groupings, so a token's bits depend on whether it was decoded, prefilled, chunked or
served from the prefix cache, and on the batch (--batch-invariant, issue 21).

Here every query token, decode or not, goes through ONE kernel with ONE configuration (BLOCK_M, BLOCK_N
fixed per backend instance and model). A program owns the query heads of one KV head for a few consecutive
tokens of one sequence (rows = tokens x heads, as the decode kernel packs heads), and every row's math is
fixed by the row alone:
- The keys are folded in tiles `[j * BLOCK_N, (j + 1) * BLOCK_N)` from key 0 (with a window: from the tile
  holding the window start, still on those boundaries), in increasing order, whatever the row's tile of
  queries is. A program may fold tiles some of its rows see nothing of; the online softmax leaves such a
  row's (max, sum, acc) exactly as they were (max unchanged, rescale exp2(0) = 1, probabilities exactly 0;
  before its first visible key the state stays -inf / 0 / 0), so extra tiles never change a row's bits.
- Every tile is masked the same way (no unmasked fast path whose extent depends on the tile's first row).
  Keys no row of the program sees read as 0 (never NaN), so they contribute exact zeros.
- A row's scores and P @ V are per-row dots of a fixed tile shape (the MMA computes each output element
  the same way whatever its row in the tile; numpy's matmul under the interpreter does too).

Why not only route decodes to kernels/triton_prefill_attention.py with its block sizes fixed: without a
window its key tiles are already on multiples of BLOCK_N from key 0 (tests/triton_kernels/ found a prompt
prefilled whole and in two chunks bitwise equal through it), but (1) with a window its tiles start at the
window start of the query tile's first row, so the grouping moves with the chunking (found unequal), and (2)
it folds the keys before a query tile's first row in an unmasked loop and the rest in a masked one: which
body a given key tile goes through for a given row depends on where the row's query tile begins, and the
two bodies are different code, whose floating-point contraction (FMA fusion of the score scaling into the
exponent's argument) the GPU compiler may decide differently. Here one loop body folds every tile.

The kernel reuses the building blocks of the other attention kernels (kernels/triton_paged_kv.py: paged
addressing, `online_softmax_step`, the NaN guard for a -inf max) and the prefill kernel's flat grid over
query tiles found by binary search (`_find_sequence`).

Cost: a decode is a BLOCK_M-row program with Hq / Hkv valid rows reading its KV head's context once, with
no split-KV, so small batches use few SMs; a prefill folds every tile masked, and at BLOCK_M 16 (vs 64)
reads K/V more often. That is the price of invariance (vLLM's and SGLang's batch-invariant modes pay it
too); BLOCK_M 16 keeps the wasted rows of a decode few. Not measured on a GPU yet.

CUDA graphs: the grid is `T // (BLOCK_M // (Hq / Hkv)) + B` programs per KV head (shapes only), no host sync
(num_decode_seqs is not needed and is ignored), so `paged_attention` can be captured as the Triton
backend's can.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import triton_cache_write
from kernels.attention_metadata import AttentionMetadata
from kernels.triton_numerics import dot_precision, needs_upcast
from kernels.triton_paged_kv import LOG2_E, attend_paged_tile
from kernels.triton_prefill_attention import _find_sequence


@triton.jit(do_not_specialize=["num_seqs", "stride_table_seq"],
            do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"])
def _batch_invariant_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    output_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    softcap_log2,
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
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """One program: TOKENS_PER_TILE query tokens of one sequence x the QUERIES_PER_KV query heads of one KV
    head, row r = (token r // QUERIES_PER_KV, head r % QUERIES_PER_KV), BLOCK_M rows (the unused tail masked)."""
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_index, TOKENS_PER_TILE)
    first_token = tl.load(query_start_loc_ptr)
    token_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - token_start
    token_first = (tile_index - ((token_start - first_token) // TOKENS_PER_TILE + seq)) * TOKENS_PER_TILE
    if token_first >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - query_len

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
    # Keys past the program's last token are visible to none of its rows.
    causal_end = context_before + tl.minimum(token_first + TOKENS_PER_TILE, query_len)
    if HAS_WINDOW:
        # The first token's window starts first; earlier keys are read as 0 (no row sees them).
        first_key = tl.maximum(context_before + token_first - sliding_window + 1, 0)
    else:
        first_key = context_before * 0
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tile = tl.arange(0, BLOCK_N)
    # Tile boundaries at multiples of BLOCK_N from key 0, the same for every query row of every batch.
    for tile_start in range(first_key // BLOCK_N * BLOCK_N, causal_end, BLOCK_N):
        positions = tile_start + tile
        in_context = (positions < causal_end) & (positions >= first_key)
        visible = in_context[None, :] & (positions[None, :] <= query_positions[:, None])
        if HAS_WINDOW:
            visible = visible & (positions[None, :] > query_positions[:, None] - sliding_window)
        running_max, running_sum, acc = attend_paged_tile(
            query, key_cache_ptr, value_cache_ptr, table_row, positions, in_context, visible, kv_head,
            stride_cache_block, stride_cache_token, stride_cache_head, dims, running_max, running_sum, acc,
            scale_log2, softcap_log2, HEAD_DIM, BLOCK_D, BLOCK_SIZE, UPCAST, DOT_PRECISION, True, HAS_SOFTCAP,
        )

    output = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(
        output_ptr + tokens[:, None] * stride_o_token + heads[:, None] * stride_o_head + dims[None, :],
        output.to(output_ptr.dtype.element_ty),
        mask=row_mask,
    )


class BatchInvariantTritonBackend:
    """The AttentionBackend protocol (kernels/attention_backend.py) with batch-invariant paged attention.

    `block_m` query rows (token x query head pairs; raised to the next power of two of Hq / Hkv if that is
    larger) and `block_n` keys a tile are fixed for the backend's lifetime (changing them changes every
    token's bits, consistently). `block_n` None: 64 keys for 16-bit caches, 32 for fp32 (an
    fp32 64 x 64 x D pipeline does not fit shared memory), chosen by the cache dtype, which is fixed for a
    model. Requirements as kernels/triton_backend.py's.
    """

    def __init__(self, block_m: int = 16, block_n: int | None = None, num_warps: int = 4, num_stages: int = 2):
        self.block_m = block_m
        self.block_n = block_n
        self.num_warps = num_warps
        self.num_stages = num_stages

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """A copy of each token's K/V into its slot: no reduction, invariant as it is."""
        triton_cache_write.write_kv_cache(key, value, kv_cache, slot_mapping)

    def paged_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        """Same contract as kernels/paged_attention_ref.py; tokens outside every sequence get zeros.
        Decodes, prefills, chunks and extends all run the one kernel (`metadata.num_decode_seqs` is not read)."""
        assert query.dtype == kv_cache.dtype, "query and KV cache must share a dtype"
        output = torch.zeros_like(query)
        num_seqs = metadata.num_seqs
        if num_seqs == 0:
            return output
        num_query_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        assert query.stride(2) == 1 and key_cache.stride(3) == 1
        block_n = self.block_n
        if block_n is None:
            block_n = 64 if kv_cache.element_size() <= 2 else 32
        block_tables = metadata.block_tables
        queries_per_kv = num_query_heads // num_kv_heads
        block_m = max(self.block_m, triton.next_power_of_2(queries_per_kv))
        tokens_per_tile = block_m // queries_per_kv
        num_tiles = query.shape[0] // tokens_per_tile + num_seqs
        _batch_invariant_attention_kernel[(num_tiles, num_kv_heads)](
            query, key_cache, value_cache, output,
            metadata.query_start_loc, metadata.seq_lens, block_tables,
            scale * LOG2_E,
            0.0 if logit_softcap is None else logit_softcap * LOG2_E,
            0 if sliding_window is None else sliding_window,
            num_seqs,
            query.stride(0), query.stride(1), output.stride(0), output.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
            QUERIES_PER_KV=queries_per_kv,
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            TOKENS_PER_TILE=tokens_per_tile,
            BLOCK_N=block_n,
            UPCAST=needs_upcast(query.dtype) or needs_upcast(kv_cache.dtype),
            DOT_PRECISION=dot_precision(kv_cache.dtype),
            HAS_WINDOW=sliding_window is not None,
            HAS_SOFTCAP=logit_softcap is not None,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )
        return output
