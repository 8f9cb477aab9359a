"""The one-pass temperature sampler draws exactly what worker_svc/sampler.py draws (CPU interpreter)."""

from __future__ import annotations

import torch

from kernels.triton_temperature_sample import temperature_sample
from worker_svc import sampler


def test_the_kernel_draws_the_reference_tokens_with_their_logprobs():
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(12, 3000, generator=generator) * 2
    temperature = torch.rand(12, generator=generator) + 0.3
    temperature[[0, 5]] = 0.0  # greedy rows
    seed = torch.tensor([0, 1, 2**40 + 3, -5, 2**63 - 1, -(2**63), 7, 8, 9, 10, 11, 12], dtype=torch.int64)
    position = torch.arange(12, dtype=torch.int64) * 1000 + 3
    expected_ids, expected_logprobs = sampler.temperature_sample(logits, temperature, seed, position)
    token_ids, logprobs = temperature_sample(logits, temperature, seed, position,
                                             greedy_below=sampler.GREEDY_TEMPERATURE, block=1024)
    assert torch.equal(token_ids, expected_ids)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=1e-5)
    assert not torch.equal(token_ids, logits.argmax(-1))
