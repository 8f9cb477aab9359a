"""The worker's sampler: greedy, seeded Gumbel-max draws that ignore the batch, top-k, top-p, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

import numpy as np

from kernels.gumbel_ref import W_MAX, gumbel_noise
from kernels.sampling_ops import torch_sampling_ops
from worker_svc.sampling.sampler import SamplingTensors, sample, seed_to_int64


def make_tensors(
    num_rows: int,
    *,
    temperature: float | list[float] = 1.0,
    top_p: float | list[float] = 1.0,
    top_k: int | list[int] = -1,
    seed: int | list[int] = 0,
    position: int | list[int] = 0,
) -> SamplingTensors:
    def column(value):
        return value if isinstance(value, list) else [value] * num_rows

    return SamplingTensors.from_host(
        temperature=column(temperature),
        top_p=column(top_p),
        top_k=column(top_k),
        seed=column(seed),
        position=column(position),
        device="cpu",
    )


def test_greedy_rows_take_the_argmax_alone_and_mixed_with_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    all_greedy = make_tensors(16, temperature=0.0)
    assert all_greedy.all_greedy
    assert torch.equal(sample(logits, all_greedy).token_ids, logits.argmax(-1))

    temperatures = [0.0 if row % 2 == 0 else 1.0 for row in range(16)]
    mixed = make_tensors(16, temperature=temperatures, seed=list(range(16)), top_k=[-1] * 15 + [50])
    assert not mixed.all_greedy
    token_ids = sample(logits, mixed).token_ids
    assert torch.equal(token_ids[0::2], logits[0::2].argmax(-1))
    # The sampled rows really sampled (a flat 1000-way draw rarely hits the argmax).
    assert (token_ids[1::2] != logits[1::2].argmax(-1)).sum() >= 6


@pytest.mark.parametrize("top_k, top_p", [(-1, 1.0), (40, 1.0), (-1, 0.9), (100, 0.8)])
def test_seeded_row_draws_the_same_token_alone_in_a_batch_and_at_any_row(top_k, top_p):
    generator = torch.Generator().manual_seed(1)
    vocab_size, batch_size = 1000, 64
    probe_logits = torch.randn(20, vocab_size, generator=generator)
    probe_seeds = [seed_to_int64(2**64 - 1 - 7919 * i) for i in range(20)]
    probe_positions = [3 * i + 11 for i in range(20)]

    alone = torch.stack([
        sample(
            probe_logits[i : i + 1],
            make_tensors(1, temperature=0.8, top_k=top_k, top_p=top_p, seed=probe_seeds[i], position=probe_positions[i]),
        ).token_ids[0]
        for i in range(20)
    ])
    assert len(set(alone.tolist())) > 10  # the probes really are random draws

    for trial in range(2):
        rows = torch.randperm(batch_size, generator=generator)[:20]  # where the probes land
        logits = torch.randn(batch_size, vocab_size, generator=generator)
        logits[rows] = probe_logits
        # Filler rows with other settings, so the batch takes paths a lone probe may not (sort, greedy).
        temperature = [0.0 if row % 3 == 0 else 1.3 for row in range(batch_size)]
        row_top_k = [5 if row % 2 else -1 for row in range(batch_size)]
        row_top_p = [0.5 if row % 5 == 0 else 1.0 for row in range(batch_size)]
        seed = list(range(1000 * trial, 1000 * trial + batch_size))
        position = [trial] * batch_size
        for probe, row in enumerate(rows.tolist()):
            temperature[row], row_top_k[row], row_top_p[row] = 0.8, top_k, top_p
            seed[row], position[row] = probe_seeds[probe], probe_positions[probe]
        tensors = make_tensors(
            batch_size, temperature=temperature, top_k=row_top_k, top_p=row_top_p, seed=seed, position=position
        )
        assert torch.equal(sample(logits, tensors).token_ids[rows], alone)


def test_different_positions_and_seeds_give_different_draws():
    vocab_size = 1000
    flat = torch.zeros(200, vocab_size)
    by_position = sample(flat, make_tensors(200, seed=5, position=list(range(200)))).token_ids
    by_seed = sample(flat, make_tensors(200, seed=list(range(200)), position=9)).token_ids
    # 200 uniform draws out of 1000 tokens have about 181 distinct values; a shared draw would give 1.
    assert len(set(by_position.tolist())) > 160
    assert len(set(by_seed.tolist())) > 160


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_empirical_frequencies_match_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    num_draws = 40_000
    token_ids = sample(
        logits.expand(num_draws, -1).contiguous(),
        make_tensors(num_draws, temperature=temperature, seed=42, position=list(range(num_draws))),
    ).token_ids
    counts = torch.bincount(token_ids, minlength=logits.numel()).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * num_draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 35.9  # chi-square, 5 degrees of freedom, p = 1e-6
    assert float((counts / num_draws - expected / num_draws).abs().sum()) / 2 < 0.01


def test_top_k_never_samples_outside_the_k_best():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(50, generator=generator)
    best = set(logits.topk(5).indices.tolist())
    num_draws = 4000
    token_ids = sample(
        logits.expand(num_draws, -1).contiguous(),
        make_tensors(num_draws, temperature=5.0, top_k=5, seed=3, position=list(range(num_draws))),
    ).token_ids
    assert set(token_ids.tolist()) == best


@pytest.mark.parametrize("top_p, nucleus_size", [(0.75, 2), (0.85, 3), (0.2, 1)])
def test_top_p_samples_only_inside_the_smallest_set_reaching_p(top_p, nucleus_size):
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    vocab_order = torch.tensor([3, 0, 4, 1, 2])  # token vocab_order[i] has probability probs[i]
    logits = torch.empty(5)
    logits[vocab_order] = probs.log()
    num_draws = 6000
    token_ids = sample(
        logits.expand(num_draws, -1).contiguous(),
        make_tensors(num_draws, top_p=top_p, seed=11, position=list(range(num_draws))),
    ).token_ids
    nucleus = vocab_order[:nucleus_size]
    assert set(token_ids.tolist()) == set(nucleus.tolist())
    # Inside the nucleus, tokens keep their relative probabilities.
    observed = torch.stack([(token_ids == token).double().mean() for token in nucleus])
    renormalized = probs[:nucleus_size].double() / probs[:nucleus_size].sum()
    assert torch.allclose(observed, renormalized, atol=0.03)


def test_temperature_near_zero_concentrates_on_the_argmax():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(256, 100, generator=generator)
    best = logits.argmax(-1)
    logits[torch.arange(256), best] += 0.05  # a gap of at least 0.05 nats: e**-500 odds at T = 1e-4
    tensors = make_tensors(256, temperature=1e-4, seed=list(range(256)), position=7)
    assert not tensors.all_greedy  # this goes through the sampling path, not the greedy shortcut
    assert torch.equal(sample(logits, tensors).token_ids, best)


def test_logprobs_are_log_softmax_of_the_raw_logits_at_the_chosen_ids():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(32, 300, generator=generator) * 3
    tensors = make_tensors(
        32,
        temperature=[0.0, 0.7, 1.5, 0.3] * 8,
        top_k=[-1, 20, 0, 5] * 8,
        top_p=[1.0, 0.9, 0.5, 1.0] * 8,
        seed=list(range(32)),
        position=list(range(100, 132)),
    )
    output = sample(logits, tensors)
    expected = torch.log_softmax(logits, dim=-1).gather(-1, output.token_ids.unsqueeze(-1)).squeeze(-1)
    assert output.token_ids.dtype == torch.int64 and output.logprobs.dtype == torch.float32
    assert torch.allclose(output.logprobs, expected, atol=1e-5)


def reference_gumbel(seed: int, position: int, vocab_index: int) -> float:
    """The documented noise in plain Python integers: what a fused kernel must reproduce bit for bit."""

    def fmix32(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    seed_bits, position_bits = seed & (2**64 - 1), position & (2**64 - 1)
    words = [seed_bits & 0xFFFFFFFF, seed_bits >> 32, position_bits & 0xFFFFFFFF, position_bits >> 32]
    keys = []
    for start in (0x9E3779B9, 0x7F4A7C15):
        key = start
        for word in words:
            key = fmix32(key ^ word)
        keys.append(key)
    bits = fmix32(fmix32(keys[0] ^ vocab_index) ^ keys[1])
    w = min(float((np.float32(bits) + np.float32(0.5)) * np.float32(2.0**-32)), W_MAX)  # float32 ops
    return -math.log(-math.log1p(-w))


def test_noise_is_the_documented_counter_based_hash_for_any_64_bit_seed():
    seeds = [0, 1, seed_to_int64(2**63), seed_to_int64(2**64 - 1), 123456789012345]
    positions = [0, 17, 2**40 + 3, 5, 999]
    noise = gumbel_noise(torch.tensor(seeds), torch.tensor(positions), 70_000)
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        for vocab_index in (0, 1, 65_535, 69_999):
            expected = reference_gumbel(seed, position, vocab_index)
            assert float(noise[row, vocab_index]) == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert seed_to_int64(2**64 - 1) == -1
    with pytest.raises(ValueError):
        seed_to_int64(2**64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_triton_sampler_draws_what_the_torch_sampler_draws_on_a_gpu():
    """On one GPU the kernels and the torch references make the same draws bit for bit (the same noise: torch's
    float32 log/log1p/exp are libdevice's there), for every kind of row in one batch; the CPU's noise agrees
    to float32 rounding."""
    from kernels.sampling_ops import triton_sampling_ops

    seeds, positions = torch.arange(64) * 7919, torch.arange(64) + 100
    cpu_noise = gumbel_noise(seeds, positions, 50_000)
    assert torch.allclose(cpu_noise, gumbel_noise(seeds.cuda(), positions.cuda(), 50_000).cpu(), rtol=1e-6, atol=1e-6)
    logits = (torch.randn(64, 50_000) * 3).cuda()
    tensors = SamplingTensors.from_host(
        temperature=[0.0, 0.9, 1.3, 0.5] * 16, top_k=[-1, 100, -1, 7, 0, 50, 2, -1] * 8,
        top_p=[1.0, 1.0, 0.9, 0.5] * 16, min_p=[0.0] * 60 + [0.1] * 4, seed=seeds.tolist(),
        position=positions.tolist(), num_top_logprobs=5, device="cuda",
    )
    fast, reference = sample(logits, tensors, triton_sampling_ops()), sample(logits, tensors, torch_sampling_ops())
    assert torch.equal(fast.token_ids, reference.token_ids)
    assert torch.equal(fast.ranks, reference.ranks) and torch.equal(fast.top_ids, reference.top_ids)
    torch.testing.assert_close(fast.logprobs, reference.logprobs)
    torch.testing.assert_close(fast.top_logprobs, reference.top_logprobs)
