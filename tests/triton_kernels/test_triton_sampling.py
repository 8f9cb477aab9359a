"""The sampling kernels (first pass, k-th largest, nucleus, logprob details) against kernels/sample_ref.py in
Triton's interpreter: the same tokens, thresholds, ranks and top tokens, on rows of mixed parameters."""

from __future__ import annotations

import pytest
import torch

from kernels import sample_ref
from kernels.triton_gather import gather_at_least
from kernels.triton_kth_largest import group_max_bound, kth_largest, radix_select
from kernels.triton_logprob_details import logprob_details
from kernels.triton_nucleus import nucleus
from kernels.triton_sample import first_pass

GREEDY_BELOW = 1e-5
VOCAB = 3000  # not a multiple of the blocks


def rows(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=generator) * 3
    logits[0, 5:50] = float("-inf")  # masked tokens (bad words, min_tokens)
    logits[1, 100:110] = logits[1, 99]  # ties
    return dict(
        logits=logits,
        temperature=torch.tensor([0.0, 0.7, 1.0, 1.3, 0.5, 2.0, 1e-6, 0.9])[:num_rows],
        seed=torch.arange(num_rows, dtype=torch.int64) * 7919 - 3,
        position=torch.arange(num_rows, dtype=torch.int64) + 100,
    )


@pytest.mark.parametrize("noise", [True, False])
@pytest.mark.parametrize("separate_raw", [False, True])
def test_first_pass_matches_reference(noise, separate_raw):
    case = rows(8)
    processed = case["logits"]
    raw = processed + torch.randn(processed.shape) if separate_raw else None
    args = (case["temperature"], case["seed"], case["position"], GREEDY_BELOW, noise)
    expected = sample_ref.first_pass(processed, raw, *args)
    got = first_pass(processed, raw, *args, block=1024)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[2], expected[2], rtol=0, atol=1e-5)


def test_draws_that_skip_blocks_no_entry_of_which_can_win_are_the_reference_draws():
    """Many small blocks, so most are skipped by the noise's upper bound (kernels/triton_sample.py's
    running_gumbel_argmax); temperatures from 0.05 (large x: float32 rounding of x) to 5 (flat)."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 20_000, generator=generator) * 4
    logits[3] *= 1000  # |x| in the tens of thousands
    temperature = torch.tensor([0.05, 0.3, 0.7, 1.0, 1.5, 5.0, 0.9, 0.6] * 2)
    seed, position = torch.arange(16, dtype=torch.int64) * 104729, torch.arange(16, dtype=torch.int64)
    args = (temperature, seed, position, GREEDY_BELOW, True)
    expected = sample_ref.first_pass(logits, None, *args)[0]
    assert torch.equal(first_pass(logits, None, *args, block=256)[0], expected)
    assert len(set(expected.tolist())) > 8


def test_kth_largest_is_exact():
    case = rows(8)
    values = case["logits"]
    values[2, :] = 0.5  # one value everywhere
    values[3, ::2] = -values[3, ::2]  # negative and positive, -0.0 included below
    values[3, 7] = -0.0
    k = torch.tensor([1, 13, 2999, 64, 0, -1, 3000, 1500], dtype=torch.int64)
    expected = sample_ref.kth_largest(values, k).threshold
    assert torch.equal(radix_select(values, k, block=1024), expected)
    assert torch.equal(kth_largest(values, k, k_max=3000).threshold, expected)
    # The group-max filter: small k, rows of ties overflowing the buffer (row 2), rows keeping everything.
    small = torch.tensor([1, 13, 40, 64, 0, -1, 3000, 50], dtype=torch.int64)
    top_k = kth_largest(values, small, k_max=64)
    assert torch.equal(top_k.threshold, sample_ref.kth_largest(values, small).threshold)
    assert top_k.candidates.fits.tolist() == [True, True, False, True, False, False, False, True]


def test_rows_split_over_several_programs_gather_count_and_bound_as_one_program():
    """The streaming passes that split a row over programs (kernels/row_split.py; one per row on the CPU)."""
    values = rows(8, vocab=20_480)["logits"]
    values[2, ::3] = 9.0  # ties past the buffer
    threshold = torch.tensor([5.0, 6.0, 9.0, float("inf"), 7.5, -30.0, 8.0, 10.0])
    tokens = torch.tensor([0, 17, 3, 19_999, 512, 8191, 8192, 4])
    for parts in (1, 3):
        got_values, got_ids, count, rank = gather_at_least(values, threshold, 64, tokens, block=1024, parts=parts)
        assert torch.equal(count, (values >= threshold.unsqueeze(-1)).sum(-1).int())
        assert torch.equal(rank, 1 + (values > values.gather(-1, tokens.unsqueeze(-1))).sum(-1))
        for row in range(8):
            kept = min(int(count[row]), 64)
            assert torch.equal(got_values[row, :kept], values[row, got_ids[row, :kept]])
            assert bool((got_values[row, :kept] >= threshold[row]).all())
            assert len(set(got_ids[row, :kept].tolist())) == kept
        k = torch.tensor([1, 3, 7, 20, 0, -1, 5, 2])
        bound = group_max_bound(values, k, k_max=20, parts=parts)
        groups = values.view(8, -1, 128).amax(-1)  # at least 4 * 20 groups: 160 of 128
        expected = sample_ref.kth_largest(groups, k).threshold
        assert torch.equal(bound, expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nucleus_draws_what_the_reference_draws(seed):
    case = rows(8, seed=seed)
    processed = case["logits"]
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.2, 1.0, 0.8, 0.99])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.05, 0.0, 0.0, 0.3, 0.01])
    top_k = torch.tensor([-1, 40, 5, -1, 0, 2, 50, 3000], dtype=torch.int32)
    common = (case["temperature"], case["seed"], case["position"])
    tokens, max_scaled, _ = sample_ref.first_pass(processed, None, *common, GREEDY_BELOW, True)
    threshold = sample_ref.kth_largest(processed, top_k).threshold
    expected = sample_ref.nucleus(processed, tokens.clone(), max_scaled, *common, top_p, min_p, threshold,
                                  GREEDY_BELOW)
    got = nucleus(processed, tokens.clone(), max_scaled, *common, top_p, min_p, threshold, GREEDY_BELOW,
                  block=1024)
    assert torch.equal(got, expected)
    # Top-k rows drawn from their gathered candidates draw the same tokens.
    candidates = kth_largest(processed, top_k, k_max=64).candidates
    assert candidates.fits.any()
    got = nucleus(processed, tokens.clone(), max_scaled, *common, top_p, min_p, threshold, GREEDY_BELOW,
                  candidates, block=1024)
    assert torch.equal(got, expected)
    # The test means something: the restrictions moved some rows' draws.
    assert not torch.equal(expected, tokens)


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprob_details_match_reference(k):
    case = rows(8)
    logits = case["logits"]
    tokens = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(k))
    log_normalizer = torch.logsumexp(logits, dim=-1)
    expected = sample_ref.logprob_details(logits, tokens, log_normalizer, k)
    got = logprob_details(logits, tokens, log_normalizer, k)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1][2:], expected[1][2:])  # rows 0 and 1 hold ties, broken by index here
    torch.testing.assert_close(got[2], expected[2])


def test_sample_with_the_kernels_equals_sample_with_the_references():
    """The whole sampler (worker_svc/sampler.py) with the Triton set and with the torch set: every kind of row
    in one batch, top-k rows drawn from their gathered candidates, processed logits and logprobs."""
    from kernels.sampling_ops import torch_sampling_ops, triton_sampling_ops
    from worker_svc.sampling.logits_processors import LogitsAdjustments, SparseLogits
    from worker_svc.sampling.sampler import SamplingTensors, sample

    logits = rows(8)["logits"]
    bias = SparseLogits(rows=torch.tensor([1, 2]), token_ids=torch.tensor([7, 9]), values=torch.tensor([9.0, -5.0]))
    tensors = SamplingTensors.from_host(
        temperature=[0.0, 0.7, 1.0, 1.3, 0.5, 2.0, 0.8, 0.9], top_k=[-1, 40, 5, -1, 3, 2, 50, -1],
        top_p=[1.0, 0.9, 1.0, 0.95, 0.2, 1.0, 0.8, 1.0], min_p=[0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.3, 0.0],
        seed=list(range(8)), position=[5] * 8, adjustments=LogitsAdjustments(sparse=bias), num_top_logprobs=3,
        device="cpu",
    )
    fast, reference = sample(logits, tensors, triton_sampling_ops()), sample(logits, tensors, torch_sampling_ops())
    assert torch.equal(fast.token_ids, reference.token_ids)
    assert torch.equal(fast.ranks, reference.ranks)
    assert torch.equal(fast.top_ids[2:], reference.top_ids[2:])  # rows 0 and 1 hold ties
    torch.testing.assert_close(fast.logprobs, reference.logprobs)
