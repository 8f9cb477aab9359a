"""Building blocks shared by the Triton attention kernels: paged K/V addressing and one online-softmax step.

Why a shared module: the decode kernel and the prefill/extend kernel read K/V through the same block
table and fold tiles into the same running (max, sum, acc) state; writing that once keeps the two kernels
numerically identical and the traps handled in one place:

- Addresses are int64: `block_id * stride_block` overflows int32 on a real pool (tens of GB).
- A row that has seen no visible key yet has max = -inf; `exp2(-inf - -inf)` is NaN, so the running max
  used for rescaling is replaced by 0 while it is -inf (the row's probabilities are then exactly 0).
- Scores are kept in the log2 domain (`scale * log2(e)` folded in) so the kernels use `exp2`.
- Logit soft-capping (Gemma 2: `c * tanh(s / c)` on the scaled scores, before the mask) is the same
  function in that domain with the cap `c * log2(e)`, so the kernels take `softcap_log2` and stay in it.
  tanh is built from exp2 in fp32 (`soft_cap`): libdevice's tanh does not exist in the interpreter.

- An fp8 cache (KV_FP8, kernels/kv_quant.py) is read as its exact values in fp16 (a 16-bit query; fp32 for an
  fp32 one) and the per-tensor scales are applied to what the tile's dots give, not to each element: the scores
  are `q . k_stored` times `k_scale` (folded into the score scale) and the tile's P @ V is `P . v_stored` times
  `v_scale`. Why: every e4m3 value is exact in fp16 (4 significant bits, exponents 2^-9 .. 2^8), so the
  conversion is one packed cvt per two values, where dequantizing each element to the query's dtype
  (`float(x) * scale`, rounded) cost about three instructions per value and left the fp8 kernel slower than the
  bf16 one it halves the bytes of (H200, 8B shape, 256 rows: 5.6 vs 5.0 ms of attention per step). The query
  (and P) go to fp16 for those dots: exact for a bf16 query in fp16's range (|q| <= 65504, beyond it clamped
  there rather than turned into inf; below 2^-14 fp16 keeps fewer bits, which no score can notice), and P
  rounded to fp16 is finer than to bf16. The numbers are the reference's (kernels/kv_quant.py: dequantized
  elements rounded to the query's dtype) within that dtype's rounding (tests/triton_kernels/test_triton_fp8_kv.py).

Cache layout read here: `[num_blocks, block_size, num_kv_heads, head_dim]` with a contiguous last axis
(the K or V half of the per-layer `[2, ...]` tensor).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634  # host side: the kernels take `scale * LOG2_E` and use exp2


@triton.jit
def soft_cap(scores, cap):
    """`cap * tanh(scores / cap)` in fp32 from exp2: tanh(|x|) = (1 - e^(-2|x|)) / (1 + e^(-2|x|)), which
    neither overflows nor turns NaN for any finite or infinite score."""
    x = scores / cap
    decay = tl.exp2(tl.abs(x) * -2.8853900817779268)  # e^(-2|x|); a jit function reads no plain global
    magnitude = (1.0 - decay) / (1.0 + decay)
    return cap * tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def paged_token_offsets(
    table_row_ptr,
    positions,
    in_context,
    kv_head,
    stride_block,
    stride_token,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """int64 element offsets of context `positions` of one sequence (its block-table row) for `kv_head`."""
    if MASKED:
        block_ids = tl.load(table_row_ptr + positions // BLOCK_SIZE, mask=in_context, other=0)
    else:
        block_ids = tl.load(table_row_ptr + positions // BLOCK_SIZE)
    return (
        block_ids.to(tl.int64) * stride_block
        + (positions % BLOCK_SIZE) * stride_token
        + kv_head * stride_head
    )


@triton.jit
def load_kv_tile(
    cache_ptr,
    token_offsets,
    in_context,
    dims,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
):
    """[BLOCK_N, BLOCK_D] tile of K or V; masked-out tokens and padded dims read as 0 (never NaN)."""
    ptrs = cache_ptr + token_offsets[:, None] + dims[None, :]
    if MASKED:
        return tl.load(ptrs, mask=in_context[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    elif BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def online_softmax_step(
    query,
    key,
    value,
    visible,
    running_max,
    running_sum,
    acc,
    scale_log2,
    softcap_log2,
    value_scale,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SCALES_VALUES: tl.constexpr,
):
    """Fold one K/V tile into the running state of rows `query` [R, D]; `visible` [R, N] when MASKED.
    With HAS_SOFTCAP the scaled scores are soft-capped at `softcap_log2` (log2 domain) before the mask.
    With SCALES_VALUES the tile's P @ V is multiplied by `value_scale` (an fp8 cache's v_scale).

    Returns (running_max, running_sum, acc) with acc unnormalized, all fp32, max in the log2 domain.
    Rounding as flash attention (see kernels/paged_attention_ref.py): the sum takes the fp32
    probabilities, the P @ V product takes them rounded to the cache dtype, also when UPCAST computes
    that product in fp32.
    """
    cache_dtype = value.dtype
    if UPCAST:
        key = key.to(tl.float32)
        value = value.to(tl.float32)
    scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale_log2
    if HAS_SOFTCAP:
        scores = soft_cap(scores, softcap_log2)
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2(running_max - safe_max)
    probs = tl.exp2(scores - safe_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, 1)
    rounded_probs = probs.to(cache_dtype).to(value.dtype)
    weighted = tl.dot(rounded_probs, value, input_precision=DOT_PRECISION)
    if SCALES_VALUES:
        weighted = weighted * value_scale
    acc = acc * rescale[:, None] + weighted
    return new_max, running_sum, acc


@triton.jit
def attend_paged_tile(
    query,
    key_cache_ptr,
    value_cache_ptr,
    table_row_ptr,
    positions,
    in_context,
    visible,
    kv_head,
    stride_block,
    stride_token,
    stride_head,
    dims,
    running_max,
    running_sum,
    acc,
    scale_log2,
    softcap_log2,
    k_scale,
    v_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_DTYPE: tl.constexpr,
):
    """Gather the K/V of context `positions` through the block table and fold them into the state.

    Without MASKED every position is in the context and visible to every row (no masks at all). With KV_FP8
    the cache holds fp8, read exactly in fp16 (fp32 when KV_DTYPE, the query's dtype, is fp32) with `k_scale`
    folded into the score scale and `v_scale` applied to the tile's P @ V (module docstring).
    """
    offsets = paged_token_offsets(
        table_row_ptr, positions, in_context, kv_head, stride_block, stride_token, stride_head, BLOCK_SIZE, MASKED
    )
    key = load_kv_tile(key_cache_ptr, offsets, in_context, dims, HEAD_DIM, BLOCK_D, MASKED)
    value = load_kv_tile(value_cache_ptr, offsets, in_context, dims, HEAD_DIM, BLOCK_D, MASKED)
    if KV_FP8:
        exact = tl.float32 if KV_DTYPE.primitive_bitwidth == 32 else tl.float16
        key = key.to(exact)
        value = value.to(exact)
        if not UPCAST:  # upcast (the interpreter), the query is already fp32 and the dots run in fp32
            query = tl.clamp(query.to(tl.float32), -65504.0, 65504.0).to(exact)  # fp16's range: never inf
        scale_log2 = scale_log2 * k_scale
    return online_softmax_step(
        query, key, value, visible, running_max, running_sum, acc, scale_log2, softcap_log2, v_scale,
        UPCAST, DOT_PRECISION, MASKED, HAS_SOFTCAP, KV_FP8,
    )
