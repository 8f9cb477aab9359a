"""The torch paged-attention reference equals dense causal attention over the same context."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels.paged_attention_ref import paged_attention, write_kv_cache
from pagedserve.testing.paged_runner import build_metadata, shuffled_block_tables

BLOCK_SIZE = 16
HEAD_DIM = 32
NUM_KV_HEADS = 2

# (context length after the step, new tokens this step): decode, fresh prefill, chunked prefill.
DECODES = [(1, 1), (15, 1), (16, 1), (17, 1), (40, 1)]
PREFILLS = [(1, 1), (15, 15), (16, 16), (17, 17), (33, 33)]
CHUNKED = [(40, 9), (33, 17), (32, 16), (20, 3)]
MIXED = [(17, 1), (40, 9), (5, 5), (16, 1), (33, 33), (48, 31)]


def dense_causal_attention(query, key, value, scale, window=None, softcap=None):
    """query [q_len, Hq, D] at the last q_len positions of key/value [L, Hkv, D]: a band mask (causal, and
    within `window` when given) and tanh soft-capped scores, written out densely."""
    query_len, context_len = query.shape[0], key.shape[0]
    group_size = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group_size, dim=1).transpose(0, 1)
    value = value.repeat_interleave(group_size, dim=1).transpose(0, 1)
    visible = torch.ones(query_len, context_len, dtype=torch.bool).tril(context_len - query_len)
    if window is not None:
        visible &= ~torch.ones(query_len, context_len, dtype=torch.bool).tril(context_len - query_len - window)
    if softcap is None:
        out = F.scaled_dot_product_attention(query.transpose(0, 1), key, value, attn_mask=visible, scale=scale)
        return out.transpose(0, 1)
    scores = torch.tanh(query.transpose(0, 1) @ key.transpose(1, 2) * scale / softcap) * softcap
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ value).transpose(0, 1)


def run_case(cases, group_size, num_padding_tokens=0, dtype=torch.float32, seed=0, window=None, softcap=None):
    """Cache the old part of each context, write the new part through write_kv_cache, attend."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    num_q_heads = NUM_KV_HEADS * group_size
    blocks_per_seq = [-(-seq_len // BLOCK_SIZE) for seq_len, _ in cases]
    num_blocks = sum(blocks_per_seq) + 4  # spare blocks nobody owns stay NaN
    tables = shuffled_block_tables(blocks_per_seq, num_blocks, rng)
    kv_cache = torch.full(
        (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype
    )
    contexts = [
        (torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, dtype=dtype),
         torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, dtype=dtype))
        for seq_len, _ in cases
    ]
    cached_lens = [seq_len - query_len for seq_len, query_len in cases]
    cached = build_metadata(tables, cached_lens, cached_lens, BLOCK_SIZE)
    write_kv_cache(
        torch.cat([k[:n] for (k, _), n in zip(contexts, cached_lens)]),
        torch.cat([v[:n] for (_, v), n in zip(contexts, cached_lens)]),
        kv_cache, cached.slot_mapping,
    )
    seq_lens = [seq_len for seq_len, _ in cases]
    query_lens = [query_len for _, query_len in cases]
    metadata = build_metadata(tables, seq_lens, query_lens, BLOCK_SIZE, num_padding_tokens)
    pad = torch.randn(num_padding_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    new_keys = torch.cat([k[-q:] for (k, _), q in zip(contexts, query_lens)] + [pad])
    new_values = torch.cat([v[-q:] for (_, v), q in zip(contexts, query_lens)] + [pad])
    write_kv_cache(new_keys, new_values, kv_cache, metadata.slot_mapping)
    query = torch.randn(sum(query_lens) + num_padding_tokens, num_q_heads, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM**-0.5
    output = paged_attention(query, kv_cache, metadata, scale, window, softcap)
    starts = metadata.query_start_loc.tolist()
    expected = [
        dense_causal_attention(query[starts[i] : starts[i + 1]].float(), k.float(), v.float(), scale, window, softcap)
        for i, (k, v) in enumerate(contexts)
    ]
    return output, torch.cat(expected), kv_cache, tables, seq_lens


@pytest.mark.parametrize("group_size", [1, 4])
@pytest.mark.parametrize(
    "cases", [DECODES, PREFILLS, CHUNKED, MIXED], ids=["decode", "prefill", "chunked", "mixed"]
)
def test_paged_attention_matches_dense_causal_attention(cases, group_size):
    output, expected, _, _, _ = run_case(cases, group_size)
    num_real = expected.shape[0]
    assert not torch.isnan(output).any()
    torch.testing.assert_close(output[:num_real], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(1, None), (7, None), (16, None), (17, 5.0), (None, 0.5)])
def test_sliding_window_and_soft_capping_match_dense_attention(window, softcap):
    """Windows shorter than, equal to and past a block, across decodes, prefills and chunks."""
    output, expected, _, _, _ = run_case(MIXED + DECODES, 4, window=window, softcap=softcap)
    torch.testing.assert_close(output[: expected.shape[0]], expected, atol=1e-5, rtol=1e-5)
    if window is not None:  # the window changes the answer on these contexts
        unwindowed, _, _, _, _ = run_case(MIXED + DECODES, 4)
        assert not torch.allclose(output, unwindowed, atol=1e-3)


@pytest.mark.parametrize("group_size", [1, 4])
def test_padding_tokens_are_not_written_and_get_zero_output(group_size):
    output, expected, kv_cache, tables, seq_lens = run_case(MIXED, group_size, num_padding_tokens=5)
    num_real = expected.shape[0]
    torch.testing.assert_close(output[:num_real], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(output[num_real:], torch.zeros_like(output[num_real:]))
    owned = torch.zeros(kv_cache.shape[1] * BLOCK_SIZE, dtype=torch.bool)
    for table, seq_len in zip(tables, seq_lens):
        for position in range(seq_len):
            owned[table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE] = True
    flat = kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    assert not torch.isnan(flat[:, owned]).any()
    assert torch.isnan(flat[:, ~owned]).all()  # slot -1 did not land in the pool's last slot


def test_write_kv_cache_places_each_token_at_its_slot():
    kv_cache = torch.zeros(2, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    value = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    write_kv_cache(key, value, kv_cache, torch.tensor([2 * BLOCK_SIZE + 5, -1, 0]))
    assert torch.equal(kv_cache[0, 2, 5], key[0]) and torch.equal(kv_cache[1, 2, 5], value[0])
    assert torch.equal(kv_cache[0, 0, 0], key[2]) and torch.equal(kv_cache[1, 0, 0], value[2])
    assert int((kv_cache != 0).any(dim=(-1, -2)).sum()) == 4  # two slots, K and V each


def test_bf16_output_keeps_dtype_and_is_close():
    output, expected, _, _, _ = run_case(MIXED, 4, dtype=torch.bfloat16)
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)
