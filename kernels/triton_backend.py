"""TritonAttentionBackend: the AttentionBackend protocol (kernels/attention_backend.py) on Triton kernels.

Why it splits the batch: decode rows (one query token each) and prefill/extend rows (chunks of many)
want different kernels. A decode program packs a KV head's query heads into 16 rows and streams the
context once (bandwidth bound, split-KV for small batches); a prefill program takes 64 query tokens of
one head (compute bound). One kernel that branches between the two breaks Triton's pipelining, so the
backend launches the decode kernel over sequences `[0, num_decode_seqs)` and the prefill kernel over
`[num_decode_seqs, B)`: disjoint ranges of the same metadata, written into one output.

Host values a step needs, and why none costs a device sync when the input builder fills
`metadata.num_decode_seqs`:
- T, B, Hq, Hkv, D, block size: tensor shapes (host metadata of the tensors).
- num_decode_seqs: where the decode range ends; slices the metadata tensors (views) and sizes the
  decode grid. Left None, it is derived from `query_start_loc` with one host sync (kept only as a
  convenience for tests and tools; the worker should fill it).
- The split-KV choice: a function of num_decode_seqs and Hkv only (`choose_num_kv_splits`).
- The prefill grid: `T // 64 + (B - num_decode_seqs)` tiles, an upper bound from shapes; programs past
  their sequence exit. No max query length is needed.
Context lengths never reach the host: every loop bound is read from `seq_lens` inside the kernels.

CUDA graphs: with a decode-only batch padded to a bucket size (padding sequences with seq_len 0 and
one padding token, slot -1, each), every grid, slice and scalar argument is a function of the bucket,
so `write_kv_cache` and `paged_attention` (its output and split-KV partials are allocated inside, from
the graph's pool) can be captured. Warm up every bucket eagerly before capturing: each split count is a
separate compile, and Triton also specializes on pointer alignment (a sliced metadata view starting at
an odd sequence is a second variant).

Requirements: query, key/value and the cache share one dtype (fp32, fp16 or bf16), or the cache is fp8
(kernels/kv_quant.py: written quantized, read dequantized to the query's dtype with the layer's scales,
host floats that a captured graph keeps); head_dim and
block_size are any sizes (powers of two are fastest); the cache's last axis is contiguous.
"""

from __future__ import annotations

import torch

from kernels import triton_cache_write, triton_decode_attention, triton_prefill_attention
from kernels.attention_metadata import AttentionMetadata
from kernels.kv_quant import UNIT_KV_SCALES, KVScales, is_fp8


def count_leading_decodes(metadata: AttentionMetadata) -> int:
    """Sequences at the front of the batch with exactly one query token (one device-to-host sync)."""
    query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).tolist()
    count = 0
    for query_len in query_lens:
        if query_len != 1:
            break
        count += 1
    return count


class TritonAttentionBackend:
    """Paged attention and cache writes on Triton kernels (GPU; CPU under TRITON_INTERPRET=1).

    `decode_kv_splits` forces the decode variant: 1 = single pass, a power of two > 1 = split-KV with
    that many segments; None picks by batch size (`choose_num_kv_splits`, up to `max_kv_splits`).
    """

    def __init__(self, decode_kv_splits: int | None = None, max_kv_splits: int = 64):
        self.decode_kv_splits = decode_kv_splits
        self.max_kv_splits = max_kv_splits

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
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
        A `sliding_window` or `logit_softcap` selects the kernels' HAS_WINDOW / HAS_SOFTCAP variants (each
        combination a compile of its own: worker_svc/kernel_warmup.py warms the model's). With `output` (like
        `query`), the result goes there and rows of tokens outside every sequence keep what they held (a CUDA
        graph's buffer whose padding rows nobody reads: worker_svc/mixed_graphs.py)."""
        assert query.dtype == kv_cache.dtype or is_fp8(kv_cache.dtype), "query and KV cache must share a dtype"
        if output is None:
            output = torch.zeros_like(query)
        num_seqs = metadata.num_seqs
        num_decodes = metadata.num_decode_seqs
        if num_decodes is None:
            num_decodes = count_leading_decodes(metadata)
        if num_decodes > 0:
            num_kv_splits = self.decode_kv_splits
            if num_kv_splits is None:
                num_kv_splits = triton_decode_attention.choose_num_kv_splits(
                    num_decodes, kv_cache.shape[3], self.max_kv_splits
                )
            triton_decode_attention.decode_attention(
                query, kv_cache,
                metadata.query_start_loc[: num_decodes + 1],
                metadata.seq_lens[:num_decodes],
                metadata.block_tables[:num_decodes],
                scale, output, num_kv_splits,
                sliding_window=sliding_window, logit_softcap=logit_softcap, kv_scales=kv_scales,
            )
        if num_decodes < num_seqs:
            triton_prefill_attention.prefill_attention(
                query, kv_cache,
                metadata.query_start_loc[num_decodes:],
                metadata.seq_lens[num_decodes:],
                metadata.block_tables[num_decodes:],
                scale, output, num_query_tokens=query.shape[0],
                sliding_window=sliding_window, logit_softcap=logit_softcap, kv_scales=kv_scales,
            )
        return output
