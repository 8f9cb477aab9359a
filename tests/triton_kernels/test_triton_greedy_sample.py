"""The one-pass greedy sampler equals argmax and log_softmax at the argmax (CPU interpreter)."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_greedy_sample import greedy_sample


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab_size", [1, 100, 4096, 5000])
def test_greedy_sample_equals_argmax_and_log_softmax(dtype, vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    logits = (torch.randn(7, vocab_size, generator=generator) * 4).to(dtype)
    token_ids, logprobs = greedy_sample(logits, block=1024)
    expected_ids = logits.float().argmax(-1)
    assert torch.equal(token_ids, expected_ids)
    expected = logits.float().log_softmax(-1).gather(-1, expected_ids[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)


def test_ties_go_to_the_lowest_index_across_blocks_and_strided_rows():
    logits = torch.full((3, 3000), -5.0)
    logits[0, [7, 2500]] = 3.0  # tie across blocks of 1024
    logits[1, [1500, 1501]] = 3.0  # tie within a block
    logits[2, 2999] = 9.0  # the very last entry
    wide = torch.zeros(3, 4000)
    wide[:, :3000] = logits
    token_ids, _ = greedy_sample(wide[:, :3000], block=1024)
    assert token_ids.tolist() == [7, 1500, 2999]
