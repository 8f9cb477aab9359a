"""Cache write in Triton: the step's new K/V rows into their slots of the paged KV cache.

Torch reference: kernels/paged_attention_ref.py (`write_kv_cache`).

One program per token moves that token's K and V (all kv heads x head_dim) into slot
`slot_mapping[t]` = `block_id * block_size + offset`; a slot < 0 marks a padding token (CUDA-graph padding
or a row with nothing to store) and its program returns without writing. Slots are int64 and every cache
address is int64 (a real pool passes 2**31 elements). Casts to the cache dtype on store, as the reference; into
an fp8 cache (QUANTIZE) it stores `fp8(clamp(x / scale, -448, 448))` with the layer's K and V scales
(kernels/kv_quant.py). Why `round_to_e4m3`: the interpreter's fp32 -> fp8 cast mis-rounds values whose mantissa
rounds up into the next binade (125.3 becomes 64, not 128), so under TRITON_INTERPRET=1 the kernel rounds to
the e4m3 grid itself (ties to even) and the cast only meets exact values; on a GPU the cast's own rounding (also
to nearest even, as torch's) is used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import FP8_E4M3_MAX, UNIT_KV_SCALES, KVScales, is_fp8
from kernels.triton_numerics import is_interpreting


@triton.jit
def round_to_e4m3(x):
    """fp32 `x` (|x| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32: adding and subtracting
    1.5 * 2**23 ulps rounds to a multiple of the ulp in IEEE fp32 (3 mantissa bits; subnormals below 2**-6 share
    its ulp 2**-9). The sign is put back last so that -0.0 stays -0.0."""
    magnitude = tl.abs(x)
    exponent = tl.maximum(((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = (((exponent - 3 + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -rounded, rounded)


@triton.jit
def quantize_fp8(x, scale, fp8_max, ROUND_ON_GRID: tl.constexpr):
    """`clamp(x / scale, -448, 448)` in fp32, ready for the cast to fp8 (rounded first when ROUND_ON_GRID); the
    division rounds to nearest (`div_rn`: a plain `/` is approximate on a GPU), as torch's."""
    scaled = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -fp8_max), fp8_max)
    if ROUND_ON_GRID:
        scaled = round_to_e4m3(scaled)
    return scaled


@triton.jit
def _cache_write_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    fp8_max,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,
    ROUND_ON_GRID: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    cache_offsets = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_token
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    key = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :], mask=mask
    )
    if QUANTIZE:
        key = quantize_fp8(key, k_scale, fp8_max, ROUND_ON_GRID)
        value = quantize_fp8(value, v_scale, fp8_max, ROUND_ON_GRID)
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales = UNIT_KV_SCALES,
) -> None:
    """Store key/value `[T, Hkv, D]` into their slots of `kv_cache` `[2, blocks, block_size, Hkv, D]` (an fp8
    cache quantized with `kv_scales`).

    Same contract as the reference; key/value may be strided views (e.g. slices of a fused QKV output)
    as long as their last axis is contiguous. No host sync; the grid is T programs.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    assert key.stride(2) == 1 and value.stride(2) == 1 and key_cache.stride(3) == 1
    quantize = is_fp8(kv_cache.dtype)
    _cache_write_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, kv_scales.k, kv_scales.v, FP8_E4M3_MAX,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZE=quantize,
        ROUND_ON_GRID=quantize and is_interpreting(),
        num_warps=4,
    )
