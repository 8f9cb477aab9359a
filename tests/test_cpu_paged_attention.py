"""The CPU serving path's attention (kernels/cpu_paged_attention.py) gives the reference's answer
(kernels/paged_attention_ref.py) on decodes, prefills, chunks and their mixes, with GQA, sliding windows,
soft-capping, padding tokens, bf16 and fp8 caches, context lengths off the block size, and a pool whose
unowned slots hold NaN (the batched decode reads past each context up to the longest)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import paged_attention_ref
from kernels.cpu_paged_attention import CpuAttentionBackend
from kernels.kv_quant import FP8_KV_DTYPE, KVScales
from pagedserve.testing.paged_runner import build_metadata, shuffled_block_tables

BLOCK_SIZE = 16
HEAD_DIM = 32
NUM_KV_HEADS = 2

# (context length after the step, new tokens this step)
DECODES = [(1, 1), (15, 1), (16, 1), (17, 1), (40, 1), (97, 1)]
MIXED = [(17, 1), (40, 9), (5, 5), (16, 1), (33, 33), (48, 31), (3, 1)]


def attend_both(cases, group_size, *, cache_dtype=torch.float32, query_dtype=torch.float32, window=None,
                softcap=None, num_padding_tokens=0, kv_scales=KVScales(), seed=0):
    """The CPU backend's and the reference's outputs for one step of `cases` over a NaN-initialised pool."""
    torch.manual_seed(seed)
    blocks_per_seq = [-(-seq_len // BLOCK_SIZE) for seq_len, _ in cases]
    num_blocks = sum(blocks_per_seq) + 3
    tables = shuffled_block_tables(blocks_per_seq, num_blocks, random.Random(seed))
    kv_cache = torch.full((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan")).to(cache_dtype)
    seq_lens = [seq_len for seq_len, _ in cases]
    everything = build_metadata(tables, seq_lens, seq_lens, BLOCK_SIZE)
    total = sum(seq_lens)
    paged_attention_ref.write_kv_cache(torch.randn(total, NUM_KV_HEADS, HEAD_DIM).to(query_dtype),
                                       torch.randn(total, NUM_KV_HEADS, HEAD_DIM).to(query_dtype), kv_cache,
                                       everything.slot_mapping, kv_scales)
    metadata = build_metadata(tables, seq_lens, [query_len for _, query_len in cases], BLOCK_SIZE,
                              num_padding_tokens)
    query = torch.randn(metadata.slot_mapping.shape[0], NUM_KV_HEADS * group_size, HEAD_DIM).to(query_dtype)
    scale = HEAD_DIM**-0.5
    ours = CpuAttentionBackend().paged_attention(query, kv_cache, metadata, scale, window, softcap, kv_scales)
    reference = paged_attention_ref.paged_attention(query, kv_cache, metadata, scale, window, softcap, kv_scales)
    return ours, reference


@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize("cases", [DECODES, MIXED], ids=["decodes", "mixed"])
def test_float32_matches_the_reference(cases, group_size):
    ours, reference = attend_both(cases, group_size, num_padding_tokens=3)
    assert not torch.isnan(ours).any()
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)
    assert torch.equal(ours[-3:], torch.zeros_like(ours[-3:]))  # padding tokens


@pytest.mark.parametrize("window,softcap", [(1, None), (7, None), (16, None), (17, 5.0), (None, 0.5)])
def test_sliding_window_and_soft_capping_match_the_reference(window, softcap):
    ours, reference = attend_both(DECODES + MIXED, 2, window=window, softcap=softcap)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)


def test_bf16_rounds_as_the_reference():
    ours, reference = attend_both(MIXED + DECODES, 3, cache_dtype=torch.bfloat16, query_dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), reference.float(), atol=1e-2, rtol=1e-2)


def test_fp8_cache_is_read_with_its_scales():
    ours, reference = attend_both(DECODES, 2, cache_dtype=FP8_KV_DTYPE, kv_scales=KVScales(0.5, 2.0))
    assert not torch.isnan(ours).any()
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_decodes_not_first_in_the_batch_are_batched_too():
    """Decodes after a prefill (rows not 0..n-1) take the indexed path, not the slices."""
    ours, reference = attend_both([(33, 33), (17, 1), (40, 1), (5, 5), (2, 1)], 2)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8_KV_DTYPE])
def test_cache_write_lands_where_the_references_does(cache_dtype):
    """With padding (slot -1: the reference's path) and without (the index copies)."""
    for slots in ([2 * BLOCK_SIZE + 5, 0, 17, 3 * BLOCK_SIZE + 15], [2 * BLOCK_SIZE + 5, -1, 0, 17]):
        key, value = torch.randn(4, NUM_KV_HEADS, HEAD_DIM), torch.randn(4, NUM_KV_HEADS, HEAD_DIM)
        ours = torch.zeros(2, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(cache_dtype)
        reference = ours.clone()
        scales = KVScales(0.5, 2.0)
        CpuAttentionBackend().write_kv_cache(key, value, ours, torch.tensor(slots), scales)
        paged_attention_ref.write_kv_cache(key, value, reference, torch.tensor(slots), scales)
        assert torch.equal(ours.float(), reference.float()) and ours.float().abs().sum() > 0
