"""Pure-torch paged attention: the reference every faster kernel is tested against, and the CPU path.

KV cache layout (one tensor per layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`, index 0 = K,
1 = V. A sequence's context position p lives in block `block_table[p // block_size]` at offset
`p % block_size`. This file favours obviousness over speed: a Python loop over sequences, math in fp32.

Rounding follows flash attention, which is what transformers' sdpa runs on a GPU (and what vLLM's and
our Triton kernels do): scores and softmax in fp32, the unnormalized probabilities `exp(s - max)` rounded
to the cache dtype for the P @ V product (fp32 accumulation), the fp32 row sum of the unrounded
probabilities dividing the result, one rounding of the output. In fp32 the rounding is the identity.
An fp8 cache (kernels/kv_quant.py) is written quantized with the layer's K/V scales and read dequantized to the
query's dtype; attention then runs as over a cache of that dtype.
Why it matters: a bf16 model amplifies any one-ulp difference to bf16's whole error, so a reference that
kept P in fp32 is as far from transformers' bf16 as bf16 is from fp32. A kernel rounds P against its
running max, tile by tile; this reference uses the row max (one tile spanning the whole context).
"""

from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.kv_quant import UNIT_KV_SCALES, KVScales, dequantize, quantize


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales = UNIT_KV_SCALES,
) -> None:
    """Store key/value `[T, Hkv, D]` into their slots of `kv_cache` in place; slots < 0 are padding. An fp8
    cache stores them quantized with `kv_scales`."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    flat_cache = kv_cache.view(2, -1, num_kv_heads, head_dim)  # view, not reshape: writes must land
    is_real = slot_mapping >= 0
    slots = slot_mapping[is_real]
    flat_cache[0, slots] = quantize(key[is_real], kv_scales.k, kv_cache.dtype)
    flat_cache[1, slots] = quantize(value[is_real], kv_scales.v, kv_cache.dtype)


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, kv_scales: KVScales = UNIT_KV_SCALES,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[seq_len, Hkv, D]` of one sequence's context, read through its block table (an fp8 cache's
    dequantized to `dtype` with `kv_scales`)."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    key = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    value = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return dequantize(key, kv_scales.k, dtype), dequantize(value, kv_scales.v, dtype)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    kv_scales: KVScales = UNIT_KV_SCALES,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries `[T, Hq, D]` over its paged context.

    Query j of a sequence with `q_len` new tokens and context `L` sits at position `L - q_len + j` and
    sees keys `0 ..` that position, or with a `sliding_window` W only the last W of them (keys
    `p - W + 1 .. p`, transformers' sliding-window mask). Query head h reads KV head `h // (Hq // Hkv)`
    (GQA, as HF's repeat_kv). `logit_softcap` c (Gemma 2) bounds the scaled scores: `c * tanh(s / c)`,
    before the mask. Tokens outside every sequence (padding) get zeros. An fp8 cache is read with `kv_scales`.
    """
    output = torch.zeros_like(query)
    for start, end, key, value in sequences(kv_cache, metadata, kv_scales, query.dtype):
        output[start:end] = attend(query[start:end], key, value, scale, sliding_window, logit_softcap)
    return output


def sequences(kv_cache: torch.Tensor, metadata: AttentionMetadata, kv_scales: KVScales = UNIT_KV_SCALES,
              dtype: torch.dtype | None = None):
    """(start, end, key, value) of each sequence with new tokens: its rows [start, end) of the step's tokens,
    and its whole context's K and V `[L, Hkv, D]` read through its block table (an fp8 cache's dequantized to
    `dtype`, the query's). A sequence of context 0 is a CUDA-graph bucket's padding row (decode_graphs.py): skipped,
    as the Triton kernels skip it, so its rows stay zeros."""
    starts = metadata.query_start_loc.tolist()
    for seq_index, seq_len in enumerate(metadata.seq_lens.tolist()):
        start, end = starts[seq_index], starts[seq_index + 1]
        if end > start and seq_len > 0:
            yield start, end, *gather_context(kv_cache, metadata.block_tables[seq_index], seq_len, kv_scales,
                                              dtype)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """One sequence's last `q_len` queries `[q_len, Hq, D]` over its whole context `key`/`value`
    `[L, Hkv, D]` (so query j sits at position `L - q_len + j`), as `paged_attention` states; returns
    `[q_len, Hq, D]` in the query's dtype. The values' dtype is the cache's (P is rounded to it)."""
    seq_len, query_len = key.shape[0], query.shape[0]
    group_size = query.shape[1] // key.shape[1]
    cache_dtype = value.dtype
    key = key.float().repeat_interleave(group_size, dim=1).transpose(0, 1)  # [Hq, L, D]
    value = value.float().repeat_interleave(group_size, dim=1).transpose(0, 1)
    seq_query = query.float().transpose(0, 1)  # [Hq, q_len, D]
    scores = torch.matmul(seq_query, key.transpose(1, 2)) * scale  # [Hq, q_len, L]
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    query_positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
    key_positions = torch.arange(seq_len, device=query.device)
    visible = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        visible &= key_positions[None, :] > query_positions[:, None] - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    weighted = torch.matmul(probs.to(cache_dtype).float(), value) / probs.sum(-1, keepdim=True)
    return weighted.transpose(0, 1).to(query.dtype)
