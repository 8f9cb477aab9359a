"""Triton cache write and attention over an fp8 KV pool (`--kv-cache-dtype fp8`) equal the torch reference, with
K/V scales other than 1 (CPU interpreter, see conftest.py).

The pools come from attention_cases.py (shuffled block tables, NaN in every slot no sequence owns: fp8 keeps the
NaN), quantized with the reference's `quantize`; the write kernel must store the reference's bytes exactly.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_quant import FP8_KV_DTYPE, KVScales, quantize
from kernels.paged_attention_ref import paged_attention, write_kv_cache
from kernels.triton_backend import TritonAttentionBackend
from kernels.triton_batch_invariant_attention import BatchInvariantTritonBackend
from kernels.triton_cache_write import write_kv_cache as triton_write_kv_cache
from pagedserve.testing.attention_cases import MIXED, MIXED_DECODES, NUM_KV_HEADS, make_case

SCALES = KVScales(k=0.05, v=2.5)


def fp8_case(cases, group_size, dtype, seed=0, num_padding_tokens=0):
    """(query in `dtype`, fp8 pool quantized with SCALES, metadata)."""
    query, kv_cache, metadata = make_case(cases, group_size, 64, torch.float32, num_padding_tokens, seed=seed)
    pool = torch.stack([quantize(kv_cache[0], SCALES.k, FP8_KV_DTYPE), quantize(kv_cache[1], SCALES.v, FP8_KV_DTYPE)])
    return query.to(dtype), pool, metadata


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_stores_the_reference_fp8_bytes_with_scales_and_clamps(dtype):
    generator = torch.Generator().manual_seed(1)
    num_tokens, head_dim = 37, 64
    key = (torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=generator) * 0.3).to(dtype)
    value = (torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=generator) * 40).to(dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0]).to(dtype)  # past +-448 * scale: clamped, not NaN
    slots = torch.randperm(5 * 16, generator=generator)[:num_tokens]
    slots[3] = -1  # padding: not written
    expected = torch.zeros((2, 5, 16, NUM_KV_HEADS, head_dim), dtype=FP8_KV_DTYPE)
    written = expected.clone()
    write_kv_cache(key, value, expected, slots, SCALES)
    triton_write_kv_cache(key, value, written, slots, SCALES)
    assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8))
    stored = expected.view(2, -1, NUM_KV_HEADS, head_dim)[0, slots[0], 0, :4].float()
    assert stored.tolist() == [448.0, -448.0, 0.0, 0.0]
    # The stored values are x / scale: dequantized they come back within e4m3's relative step (2**-4).
    real = slots >= 0
    back = expected.view(2, -1, NUM_KV_HEADS, head_dim)[1, slots[real]].float() * SCALES.v
    torch.testing.assert_close(back, value[real].float(), rtol=2**-4, atol=SCALES.v * 2**-9)


@pytest.mark.parametrize("num_kv_splits", [1, 4], ids=["single_pass", "split_kv"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group_size", [4])
def test_mixed_batch_over_an_fp8_pool_matches_the_reference(group_size, dtype, tolerance, num_kv_splits):
    query, pool, metadata = fp8_case(MIXED, group_size, dtype, num_padding_tokens=2)
    assert metadata.num_decode_seqs == len(MIXED_DECODES)
    scale = query.shape[2] ** -0.5
    output = TritonAttentionBackend(decode_kv_splits=num_kv_splits).paged_attention(
        query, pool, metadata, scale, kv_scales=SCALES)
    expected = paged_attention(query, pool, metadata, scale, kv_scales=SCALES)
    assert output.dtype == dtype and not torch.isnan(output[:-2]).any()
    torch.testing.assert_close(output.float(), expected.float(), atol=tolerance, rtol=tolerance)
    # Without the scales the kernels would read other numbers: the scales are applied, not ignored.
    unscaled = TritonAttentionBackend(decode_kv_splits=num_kv_splits).paged_attention(query, pool, metadata, scale)
    assert (unscaled.float() - expected.float()).abs().max() > 0.1


def test_batch_invariant_kernel_reads_an_fp8_pool_as_the_reference():
    query, pool, metadata = fp8_case(MIXED, 4, torch.float32, seed=5)
    scale = query.shape[2] ** -0.5
    output = BatchInvariantTritonBackend().paged_attention(query, pool, metadata, scale, kv_scales=SCALES)
    expected = paged_attention(query, pool, metadata, scale, kv_scales=SCALES)
    torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)
