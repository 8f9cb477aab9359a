"""Neox-style rotary embedding in Triton for query and key (GQA: different head counts), one program per token.

Torch reference: kernels/rotary_ref.py (`rotary_embedding`), which is llama.py's RotaryEmbedding.

Positions come from a device tensor (no host copy); cos/sin come from the model's fp32 table
`[max_positions, head_dim]` (cos half | sin half). The rotation pairs element i with i + head_dim / 2.
Rounding follows HF step by step: cos and sin are cast to the activation dtype, and each product and
the sum round to it, as torch's elementwise ops do; arithmetic itself is explicit fp32, so no interpreter
upcast flag is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    in_ptr,
    out_ptr,
    stride_in_head,
    stride_out_head,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """out = x * cos + rotate_half(x) * sin for every head of one token, rounding like torch."""
    heads = tl.arange(0, BLOCK_HEADS)
    half = tl.arange(0, BLOCK_HALF)
    mask = (heads < NUM_HEADS)[:, None] & (half < HALF_DIM)[None, :]
    first_ptrs = in_ptr + heads[:, None] * stride_in_head + half[None, :]
    first = tl.load(first_ptrs, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(first_ptrs + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out_first = (first * cos).to(dtype).to(tl.float32) + (-second * sin).to(dtype).to(tl.float32)
    out_second = (second * cos).to(dtype).to(tl.float32) + (first * sin).to(dtype).to(tl.float32)
    out_ptrs = out_ptr + heads[:, None] * stride_out_head + half[None, :]
    tl.store(out_ptrs, out_first.to(dtype), mask=mask)
    tl.store(out_ptrs + HALF_DIM, out_second.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    query_out_ptr,
    key_out_ptr,
    cos_sin_cache_ptr,
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    stride_query_out_token,
    stride_query_out_head,
    stride_key_out_token,
    stride_key_out_head,
    stride_cache_position,
    NUM_QUERY_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_QUERY_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    half_mask = half < HALF_DIM
    cache_row = cos_sin_cache_ptr + position * stride_cache_position
    dtype = query_out_ptr.dtype.element_ty
    cos = tl.load(cache_row + half, mask=half_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(cache_row + HALF_DIM + half, mask=half_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    _rotate_heads(
        query_ptr + token * stride_query_token, query_out_ptr + token * stride_query_out_token,
        stride_query_head, stride_query_out_head, cos, sin,
        NUM_QUERY_HEADS, BLOCK_QUERY_HEADS, HALF_DIM, BLOCK_HALF,
    )
    _rotate_heads(
        key_ptr + token * stride_key_token, key_out_ptr + token * stride_key_out_token,
        stride_key_head, stride_key_out_head, cos, sin,
        NUM_KV_HEADS, BLOCK_KV_HEADS, HALF_DIM, BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels/rotary_ref.py: rotated copies of query [T, Hq, D] and key [T, Hkv, D].

    query/key may be strided views (e.g. of a fused QKV output) with a contiguous last axis.
    """
    num_tokens, num_query_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert query.dtype == key.dtype and query.stride(2) == 1 and key.stride(2) == 1
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1
    query_out = torch.empty((num_tokens, num_query_heads, head_dim), dtype=query.dtype, device=query.device)
    key_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    half_dim = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, query_out, key_out, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        query_out.stride(0), query_out.stride(1), key_out.stride(0), key_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_QUERY_HEADS=num_query_heads,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_QUERY_HEADS=triton.next_power_of_2(num_query_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        HALF_DIM=half_dim,
        BLOCK_HALF=triton.next_power_of_2(half_dim),
        num_warps=4,
    )
    return query_out, key_out
