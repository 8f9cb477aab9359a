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

from kernels import rmsnorm_ref
from kernels.triton_batch_invariant_matmul import linear
from kernels.triton_batch_invariant_norm import BLOCK_V, gemma_rms_norm, log_softmax, rms_norm

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
        for first in range(0, len(checked), batch_size):  # as many checked rows as fit, at random positions
            rows = checked[first: first + batch_size]
            positions = torch.randperm(batch_size, generator=generator)[: len(rows)].tolist()
            batch = torch.randn((batch_size,) + full.shape[1:], generator=generator).to(full.dtype)
            for row, position in zip(rows, positions):
                batch[position] = full[row]
            got = fn(batch)
            for row, position in zip(rows, positions):
                assert torch.equal(got[position], expected[row]), f"row {row} differs at batch size {batch_size}"
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


# --- RMSNorm and log_softmax ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True], ids=["no_residual", "residual"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rms_norm_rows_are_batch_invariant_and_match_the_reference(dtype, with_residual, gemma):
    hidden_size = 96
    weight = random_tensor((hidden_size,), dtype, 4)
    kernel, reference = (gemma_rms_norm, rmsnorm_ref.gemma_rms_norm) if gemma else (rms_norm, rmsnorm_ref.rms_norm)

    def normed_and_residual(batch, norm=kernel):
        # batch [T, 2, H]: hidden and residual side by side, so one embedded row carries both.
        residual = batch[:, 1] if with_residual else None
        normed, new_residual = norm(batch[:, 0], weight, 1e-6, residual)
        return torch.stack([normed.to(batch.dtype), new_residual], dim=1)

    rows = random_tensor((257, 2, hidden_size), dtype, 5)
    output = assert_rows_batch_invariant(normed_and_residual, rows)
    expected = normed_and_residual(rows, norm=reference)
    torch.testing.assert_close(output.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_log_softmax_rows_are_batch_invariant_and_match_torch():
    # Three vocabulary chunks, the last one partial; in some rows a whole chunk is masked to -inf.
    vocab_size = 2 * BLOCK_V + 452
    logits = random_tensor((257, vocab_size), torch.float32, 6) * 4
    logits[::2, BLOCK_V: 2 * BLOCK_V] = float("-inf")
    output = assert_rows_batch_invariant(log_softmax, logits)
    expected = torch.log_softmax(logits, dim=-1)
    assert torch.equal(torch.isinf(output), torch.isinf(expected))
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's log(0) and inf - inf, the point of the test
def test_log_softmax_of_a_row_of_only_minus_infinity_is_nan_as_torch():
    logits = torch.full((2, 40), float("-inf"))
    logits[1] = 0.0
    output = log_softmax(logits)
    assert torch.isnan(output[0]).all()
    torch.testing.assert_close(output[1], torch.log_softmax(logits[1], dim=-1))
