"""Batch-invariant Triton kernels (--batch-invariant, issue 21): a row's bits do not depend on the batch.

Each kernel computes a fixed set of rows once in one big batch and again embedded, at different positions,
among random rows in batches of 1, 3, 64 and 257; every row must be bitwise equal (torch.equal) across
them, and close to the torch reference. `assert_rows_batch_invariant` is shown to catch a kernel whose
reduction order depends on the batch size (a split-K linear), so these checks would fail on the
non-invariant paths they replace.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.triton_batch_invariant_matmul import linear

BATCH_SIZES = (1, 3, 64, 257)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def assert_rows_batch_invariant(fn, full: torch.Tensor, batch_sizes=BATCH_SIZES, seed=0):
    """fn(batch [T, ...]) -> [T, ...]: every checked row of `full` [R, ...] gives the same bits in fn(full)
    and when placed at some position of a batch of T random rows, for each T. Returns fn(full)."""
    generator = torch.Generator().manual_seed(seed)
    expected = fn(full)
    num_rows = full.shape[0]
    checked = sorted({0, 1, num_rows // 2, num_rows - 1})
    for batch_size in batch_sizes:
        for row in checked:
            position = (row * 7 + batch_size) % batch_size
            batch = torch.randn((batch_size,) + full.shape[1:], generator=generator).to(full.dtype)
            batch[position] = full[row]
            got = fn(batch)[position]
            assert torch.equal(got, expected[row]), f"row {row} differs at batch size {batch_size}"
    return expected


def random_tensor(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- linear ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_linear_rows_are_batch_invariant_and_match_f_linear(dtype, with_bias):
    # K and N not multiples of the tiles (32, 64): a partial last K tile and a partial N tile.
    hidden = random_tensor((257, 80), dtype, 1)
    weight = random_tensor((72, 80), dtype, 2) * 0.1
    bias = random_tensor((72,), dtype, 3) if with_bias else None
    output = assert_rows_batch_invariant(lambda batch: linear(batch, weight, bias), hidden)
    assert output.dtype == dtype and output.shape == (257, 72)
    expected = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(output.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_linear_of_zero_rows():
    weight = random_tensor((8, 16), torch.float32, 0)
    assert linear(torch.empty(0, 16), weight).shape == (0, 8)


def test_the_invariance_check_catches_a_split_k_linear():
    """A linear that splits K in two for small batches (as a GEMM library's split-K path does) sums each row
    in another order there: the check must fail on it, or it proves nothing about `linear`."""
    weight = random_tensor((72, 80), torch.float32, 2)

    def split_k_for_small_batches(batch):
        if batch.shape[0] >= 64:
            return batch @ weight.T
        return batch[:, :40] @ weight[:, :40].T + batch[:, 40:] @ weight[:, 40:].T

    with pytest.raises(AssertionError, match="differs"):
        assert_rows_batch_invariant(split_k_for_small_batches, random_tensor((257, 80), torch.float32, 1))
