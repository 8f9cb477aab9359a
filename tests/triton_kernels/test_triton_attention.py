"""Triton paged attention and cache write equal the torch reference (CPU interpreter, see conftest.py).

Cases come from attention_cases.py: shuffled block tables over a NaN-filled pool, so a read of a slot
a sequence does not own shows as NaN.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.paged_attention_ref import paged_attention, write_kv_cache
from kernels.triton_backend import TritonAttentionBackend, count_leading_decodes
from kernels.triton_decode_attention import choose_num_kv_splits
from kernels.triton_numerics import is_interpreting
from pagedserve.testing.attention_cases import (
    BLOCK_SIZE,
    DECODES,
    MIXED,
    MIXED_DECODES,
    MIXED_PREFILLS,
    NUM_KV_HEADS,
    WINDOW_DECODES,
    WINDOW_PREFILLS,
    WINDOWS,
    make_case,
    poison_keys_before_windows,
)


def assert_matches_reference(backend, query, kv_cache, metadata, tolerance):
    scale = query.shape[2] ** -0.5
    output = backend.paged_attention(query, kv_cache, metadata, scale)
    expected = paged_attention(query, kv_cache, metadata, scale)
    assert output.dtype == query.dtype
    assert not torch.isnan(output).any()
    torch.testing.assert_close(output.float(), expected.float(), atol=tolerance, rtol=tolerance)
    return output


def test_kernels_run_in_the_interpreter():
    assert is_interpreting()


@pytest.mark.parametrize("num_kv_splits", [1, 16], ids=["single_pass", "split_kv"])
@pytest.mark.parametrize("group_size", [1, 4, 6])
def test_mixed_batch_of_decodes_prefills_chunks_and_padding(group_size, num_kv_splits):
    query, kv_cache, metadata = make_case(MIXED, group_size, 64, torch.float32, num_padding_tokens=3)
    assert metadata.num_decode_seqs == len(MIXED_DECODES)
    output = assert_matches_reference(
        TritonAttentionBackend(decode_kv_splits=num_kv_splits), query, kv_cache, metadata, 1e-4
    )
    assert torch.equal(output[-3:], torch.zeros_like(output[-3:]))


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_context_lengths_around_block_boundaries_head_dim_128(num_kv_splits):
    query, kv_cache, metadata = make_case(DECODES, 4, 128, torch.float32)
    assert_matches_reference(TritonAttentionBackend(decode_kv_splits=num_kv_splits), query, kv_cache, metadata, 1e-4)


def test_prefill_head_dim_128():
    query, kv_cache, metadata = make_case(MIXED_PREFILLS[:5], 4, 128, torch.float32)
    assert metadata.num_decode_seqs == 0
    assert_matches_reference(TritonAttentionBackend(), query, kv_cache, metadata, 1e-4)


@pytest.mark.parametrize("num_kv_splits", [1, 16], ids=["single_pass", "split_kv"])
def test_bfloat16_through_the_interpreter_upcast(num_kv_splits):
    query, kv_cache, metadata = make_case(MIXED, 4, 64, torch.bfloat16, num_padding_tokens=2)
    assert_matches_reference(TritonAttentionBackend(decode_kv_splits=num_kv_splits), query, kv_cache, metadata, 2e-2)


# Decodes, then prefills, every context within 64 keys: one key tile of either kernel.
ONE_TILE = [(1, 1), (16, 1), (45, 1), (64, 1), (15, 15), (40, 9), (33, 17), (64, 64)]


@pytest.mark.parametrize("group_size", [1, 4])
def test_bfloat16_rounds_probabilities_as_the_reference_does(group_size):
    """Within one key tile the kernels' running max is the row max the reference rounds the
    probabilities against, so their bf16 outputs equal the reference's bit for bit (measured; the
    interpreter rounds casts as a GPU does, see conftest.py). Probabilities left in fp32 under the
    interpreter's upcast differed in a third of the outputs."""
    query, kv_cache, metadata = make_case(ONE_TILE, group_size, 64, torch.bfloat16, num_padding_tokens=2)
    scale = query.shape[2] ** -0.5
    output = TritonAttentionBackend(decode_kv_splits=1).paged_attention(query, kv_cache, metadata, scale)
    assert torch.equal(output, paged_attention(query, kv_cache, metadata, scale))


def test_head_dim_that_is_not_a_power_of_two():
    query, kv_cache, metadata = make_case([(17, 1), (40, 1), (33, 20)], 4, 48, torch.float32)
    assert_matches_reference(TritonAttentionBackend(decode_kv_splits=4), query, kv_cache, metadata, 1e-4)


def test_unknown_decode_count_is_derived_and_late_decodes_go_to_prefill():
    # A decode after a prefill is outside the leading decode range: the prefill kernel serves it.
    cases = [(17, 1), (40, 9), (30, 1)]
    query, kv_cache, metadata = make_case(cases, 4, 64, torch.float32)
    metadata = AttentionMetadata(
        metadata.slot_mapping, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, BLOCK_SIZE
    )
    assert metadata.num_decode_seqs is None and count_leading_decodes(metadata) == 1
    assert_matches_reference(TritonAttentionBackend(), query, kv_cache, metadata, 1e-4)


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_cuda_graph_padding_rows_write_zeros(num_kv_splits):
    """A decode bucket padded with sequences of length 0 (slot -1) gives zeros there and no NaN."""
    query, kv_cache, metadata = make_case(DECODES[:3], 4, 64, torch.float32)
    bucket, real = 5, 3
    padded = AttentionMetadata(
        slot_mapping=torch.cat([metadata.slot_mapping, torch.full((bucket - real,), -1)]),
        query_start_loc=torch.arange(bucket + 1, dtype=torch.int32),
        seq_lens=torch.cat([metadata.seq_lens, torch.zeros(bucket - real, dtype=torch.int32)]),
        block_tables=torch.cat([metadata.block_tables, metadata.block_tables[:1].repeat(bucket - real, 1)]),
        block_size=BLOCK_SIZE,
        num_decode_seqs=bucket,
    )
    padded_query = torch.cat([query, torch.randn(bucket - real, *query.shape[1:])])
    output = TritonAttentionBackend(decode_kv_splits=num_kv_splits).paged_attention(
        padded_query, kv_cache, padded, 64**-0.5
    )
    expected = paged_attention(query, kv_cache, metadata, 64**-0.5)
    torch.testing.assert_close(output[:real], expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(output[real:], torch.zeros_like(output[real:]))


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_sequence_without_query_token_writes_nothing(num_kv_splits):
    """A decode row with context but no token this step must not write the token after it."""
    query, kv_cache, metadata = make_case([(17, 1), (40, 1)], 4, 64, torch.float32, num_padding_tokens=1)
    no_query = AttentionMetadata(
        slot_mapping=metadata.slot_mapping,
        query_start_loc=torch.tensor([0, 1, 1], dtype=torch.int32),  # row 1 points at the padding token
        seq_lens=metadata.seq_lens,
        block_tables=metadata.block_tables,
        block_size=BLOCK_SIZE,
        num_decode_seqs=2,
    )
    output = TritonAttentionBackend(decode_kv_splits=num_kv_splits).paged_attention(
        query, kv_cache, no_query, 64**-0.5
    )
    expected = paged_attention(query, kv_cache, no_query, 64**-0.5)
    assert torch.equal(expected[1:], torch.zeros_like(expected[1:]))
    torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)


def test_split_kv_only_for_grids_too_small_to_fill_the_gpu():
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8) == 64
    assert choose_num_kv_splits(num_seqs=8, num_kv_heads=8) == 8
    assert choose_num_kv_splits(num_seqs=12, num_kv_heads=8) == 8
    assert choose_num_kv_splits(num_seqs=16, num_kv_heads=8) == 4
    assert choose_num_kv_splits(num_seqs=32, num_kv_heads=8) == 1
    assert choose_num_kv_splits(num_seqs=256, num_kv_heads=2) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_places_tokens_and_skips_padding_slots(dtype):
    torch.manual_seed(0)
    num_blocks, head_dim = 6, 64
    expected = torch.full((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim), float("nan"), dtype=dtype)
    actual = expected.clone()
    slots = torch.tensor([5 * BLOCK_SIZE + 15, -1, 0, 2 * BLOCK_SIZE + 7, -1, 17])
    # Key and value as strided views of one fused projection output, as a fused QKV would give them.
    fused = torch.randn(len(slots), 3, NUM_KV_HEADS, head_dim, dtype=dtype)
    key, value = fused[:, 1], fused[:, 2]
    write_kv_cache(key, value, expected, slots)
    TritonAttentionBackend().write_kv_cache(key, value, actual, slots)
    assert torch.equal(actual.nan_to_num(7.0), expected.nan_to_num(7.0))
    assert int((~torch.isnan(actual)).any(dim=(-1, -2)).sum()) == 8  # four slots, K and V each


# Sliding window and soft-capping: cases from attention_cases.py (WINDOWS, WINDOW_DECODES, WINDOW_PREFILLS).


def assert_window_matches_reference(backend, cases, window, softcap=None, dtype=torch.float32, tolerance=1e-4,
                                    num_padding_tokens=0):
    query, kv_cache, metadata = make_case(cases, 4, 64, dtype, num_padding_tokens=num_padding_tokens)
    scale = 64**-0.5
    expected = paged_attention(query, kv_cache, metadata, scale, window, softcap)
    poisoned = kv_cache if window is None else poison_keys_before_windows(kv_cache, metadata, window)
    output = backend.paged_attention(query, poisoned, metadata, scale, window, softcap)
    assert not torch.isnan(output).any()
    torch.testing.assert_close(output.float(), expected.float(), atol=tolerance, rtol=tolerance)
    return query, kv_cache, metadata, expected


@pytest.mark.parametrize("num_kv_splits", [1, 4], ids=["single_pass", "split_kv"])
@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_decode_reads_only_the_window(window, num_kv_splits):
    query, kv_cache, metadata, expected = assert_window_matches_reference(
        TritonAttentionBackend(decode_kv_splits=num_kv_splits), WINDOW_DECODES, window
    )
    assert not torch.allclose(expected, paged_attention(query, kv_cache, metadata, 64**-0.5))  # the window cut


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_prefill_and_chunks_over_a_cached_prefix(window):
    assert_window_matches_reference(TritonAttentionBackend(), WINDOW_PREFILLS, window)


@pytest.mark.parametrize("num_kv_splits", [1, 16], ids=["single_pass", "split_kv"])
def test_sliding_window_in_a_mixed_batch_with_padding(num_kv_splits):
    assert_window_matches_reference(
        TritonAttentionBackend(decode_kv_splits=num_kv_splits), MIXED, 24, num_padding_tokens=3
    )


@pytest.mark.parametrize("window", [None, 16], ids=["softcap", "softcap_and_window"])
@pytest.mark.parametrize("num_kv_splits", [1, 4], ids=["single_pass", "split_kv"])
def test_logit_softcap_alone_and_with_a_window(window, num_kv_splits):
    cases = [(17, 1), (300, 1), (70, 70), (100, 31)]
    query, kv_cache, metadata, expected = assert_window_matches_reference(
        TritonAttentionBackend(decode_kv_splits=num_kv_splits), cases, window, softcap=0.5
    )
    uncapped = paged_attention(query, kv_cache, metadata, 64**-0.5, window)
    assert (expected - uncapped).abs().max() > 0.1  # a cap of 0.5 changes the scores


@pytest.mark.parametrize("num_kv_splits", [1, 16], ids=["single_pass", "split_kv"])
def test_window_and_softcap_in_bfloat16_through_the_interpreter_upcast(num_kv_splits):
    assert_window_matches_reference(
        TritonAttentionBackend(decode_kv_splits=num_kv_splits), MIXED, 24, softcap=2.0, dtype=torch.bfloat16,
        tolerance=2e-2, num_padding_tokens=2,
    )


def test_softcap_of_huge_and_infinite_scores_is_finite():
    """tanh from exp2 (the interpreter has no libdevice) must saturate, never overflow to NaN."""
    query, kv_cache, metadata = make_case([(40, 1), (33, 17)], 1, 64, torch.float32)
    query = query * 1e30
    output = TritonAttentionBackend().paged_attention(query, kv_cache, metadata, 64**-0.5, None, 5.0)
    expected = paged_attention(query, kv_cache, metadata, 64**-0.5, None, 5.0)
    assert not torch.isnan(output).any()
    torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)
