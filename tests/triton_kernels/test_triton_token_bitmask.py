"""The grammar-mask kernel against its torch reference (kernels/token_bitmask_ref.py) in Triton's interpreter:
the same logits bit for bit, for vocabularies that are not multiples of 32 or of the block, bitmasks shorter
than the vocabulary (a padded model vocabulary: the tail is masked) and longer, words with the sign bit set,
and rows left untouched."""

from __future__ import annotations

import pytest
import torch

from kernels import token_bitmask_ref
from kernels.triton_token_bitmask import apply_token_bitmask


def case(vocab: int, words: int, num_rows: int = 6, masked_rows=(4, 1, 2), seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=generator)
    bitmask = torch.randint(-(2 ** 31), 2 ** 31, (len(masked_rows), words), generator=generator, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, 0] = -1  # every bit of a word, the sign bit included
    bitmask[-1, -1] = 0
    return logits, bitmask, torch.tensor(masked_rows, dtype=torch.int64)


@pytest.mark.parametrize("vocab, words, block", [(1000, 32, 256), (1000, 30, 256), (1000, 40, 128),
                                                 (33, 2, 16), (4096, 128, 1024), (31, 1, 1024)])
def test_kernel_equals_reference_bit_for_bit(vocab, words, block):
    logits, bitmask, rows = case(vocab, words)
    expected = logits.clone()
    token_bitmask_ref.apply_token_bitmask(expected, bitmask, rows)
    actual = logits.clone()
    apply_token_bitmask(actual, bitmask, rows, block=block)
    assert torch.equal(actual.isinf(), expected.isinf())
    assert torch.equal(actual.nan_to_num(neginf=-1e30), expected.nan_to_num(neginf=-1e30))
    assert torch.equal(actual[[0, 3, 5]], logits[[0, 3, 5]])  # rows without a bitmask untouched


def test_reference_allows_exactly_the_set_bits_and_masks_the_tail():
    logits = torch.zeros(1, 70)
    bitmask = torch.tensor([[0b101, -(2 ** 31)]], dtype=torch.int32)  # tokens 0, 2 and 63; 64..69 past the mask
    token_bitmask_ref.apply_token_bitmask(logits, bitmask, torch.tensor([0]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2, 63]
