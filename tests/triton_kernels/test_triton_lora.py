"""The batched multi-LoRA kernels (kernels/triton_lora.py) against the torch reference (kernels/lora_ref.py): fp32
and bf16; 1, 3, 17 and 40 tokens; one and three adapter slots with ranks 8 and 16 padded into R = 16 and 32; K and
N that are not block multiples; slots mixing -1 and several adapters; y a column slice of a wider output; the
shrink's K cut into slices (decode) and not, on the default tiles of each token count (`tiles_for`); and the padded ranks it refuses."""

from __future__ import annotations

import pytest
import torch

from kernels import lora_ref, lora_tiles, triton_lora

K, N = 100, 70  # neither a multiple of the shrink's block_k nor of the expand's block_n
LEFT, RIGHT = 5, 11  # the fused output's columns either side of y's slice
# Bounds on the largest difference, relative to the output's largest magnitude. fp32: the same math summed in
# another order. bf16: h, d and the scaled d are rounded to bf16 at the reference's points, but a sum in another
# order can round h an ulp apart, which moves d by about an ulp, and y rounds once more: 2**-7 (two bf16 ulps).
# Such flips are rare, so in bf16 at least BF16_BIT_EQUAL of the updated elements must equal the reference's bits
# (here, with conftest.py's rounding casts, all came out equal; dropping any one of the kernel's three roundings to
# bf16 left 77-87% equal, within the bound).
BOUND = {torch.float32: 1e-5, torch.bfloat16: 2**-7}
BF16_BIT_EQUAL = 0.98
# (padded rank R, each slot's adapter rank): zeros beyond an adapter's rank.
RANKS = {16: (8, 16, 8), 32: (16, 8, 16)}


def adapters(num_slots: int, padded_rank: int, dtype: torch.dtype, generator: torch.Generator):
    """Stacked A [S, R, K] and B [S, N, R] of ranks RANKS[R], and scalings [S], sized so that the update is of the
    order of the base output."""
    lora_a = torch.zeros(num_slots, padded_rank, K)
    lora_b = torch.zeros(num_slots, N, padded_rank)
    for slot in range(num_slots):
        rank = RANKS[padded_rank][slot]
        lora_a[slot, :rank] = torch.randn(rank, K, generator=generator) / K ** 0.5
        lora_b[slot, :, :rank] = torch.randn(N, rank, generator=generator) / rank ** 0.5
    scalings = torch.rand(num_slots, generator=generator) + 0.5
    return lora_a.to(dtype), lora_b.to(dtype), scalings


def mixed_slots(num_tokens: int, num_slots: int, slot_dtype: torch.dtype, generator: torch.Generator):
    """Slots -1 .. S-1 at random, with the first token on slot -1 and the second on the last slot when there are
    two tokens or more."""
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=generator)
    if num_tokens > 1:
        slots[0], slots[1] = -1, num_slots - 1
    return slots.to(slot_dtype)


def run_both(num_tokens, num_slots, padded_rank, dtype, slot_dtype, seed, tiles=None):
    """(kernel's fused output, reference's fused output, the output before, slots), y a column slice of both."""
    generator = torch.Generator().manual_seed(seed)
    lora_a, lora_b, scalings = adapters(num_slots, padded_rank, dtype, generator)
    slots = mixed_slots(num_tokens, num_slots, slot_dtype, generator)
    unused = torch.ones(num_slots, dtype=torch.bool)
    unused[slots[slots >= 0].long()] = False
    lora_a[unused], lora_b[unused] = float("nan"), float("nan")  # a slot no token uses must not be read
    x = torch.randn(num_tokens, K, generator=generator).to(dtype)
    x[slots < 0] = float("nan")  # nor a padding row's input
    fused = torch.randn(num_tokens, LEFT + N + RIGHT, generator=generator).to(dtype)
    got, expected = fused.clone(), fused.clone()
    triton_lora.lora_add(got[:, LEFT:LEFT + N], x, lora_a, lora_b, slots, scalings, tiles)
    lora_ref.lora_add(expected[:, LEFT:LEFT + N], x, lora_a, lora_b, slots, scalings)
    return got, expected, fused, slots


def assert_matches(got, expected, before, slots, bound):
    assert torch.equal(got[:, :LEFT], before[:, :LEFT]) and torch.equal(got[:, LEFT + N:], before[:, LEFT + N:])
    assert torch.equal(got[slots < 0], before[slots < 0])
    assert torch.isfinite(got).all()
    error = (got.float() - expected.float()).abs().max().item()
    assert error <= bound * expected.float().abs().max().item(), error
    updated = slots >= 0
    if updated.any():  # the update is there: not a test of y left alone
        assert not torch.equal(got[updated], before[updated])
        if got.dtype == torch.bfloat16:
            columns = slice(LEFT, LEFT + N)
            equal = (got[updated, columns] == expected[updated, columns]).float().mean().item()
            assert equal >= BF16_BIT_EQUAL, equal


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 40])
@pytest.mark.parametrize("num_slots", [1, 3])
@pytest.mark.parametrize("padded_rank", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_the_reference(dtype, padded_rank, num_slots, num_tokens):
    slot_dtype = torch.int32 if num_tokens % 2 else torch.int64
    got, expected, before, slots = run_both(num_tokens, num_slots, padded_rank, dtype, slot_dtype,
                                            seed=num_tokens * 10 + num_slots + padded_rank)
    assert_matches(got, expected, before, slots, BOUND[dtype])


@pytest.mark.parametrize("num_tokens", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_tokens_with_the_shrink_cut_into_k_slices_match_the_reference(dtype, num_tokens):
    tiles = lora_tiles.LoraTiles(block_k=16, split_columns=32)  # K = 100: 3 slices of 48, the last partly masked
    assert lora_tiles.shrink_splits(num_tokens, K, tiles) == 3
    assert lora_tiles.shrink_splits(tiles.block_m * lora_tiles.SHRINK_PROGRAMS, K, tiles) == 1
    got, expected, before, slots = run_both(num_tokens, 3, 16, dtype, torch.int32, seed=num_tokens, tiles=tiles)
    assert_matches(got, expected, before, slots, BOUND[dtype])


def test_only_padding_rows_leave_y_unchanged():
    generator = torch.Generator().manual_seed(3)
    lora_a, lora_b, scalings = adapters(3, 16, torch.float32, generator)
    y = torch.randn(5, N, generator=generator)
    before = y.clone()
    triton_lora.lora_add(y, torch.randn(5, K, generator=generator), lora_a, lora_b,
                         torch.full((5,), -1, dtype=torch.int32), scalings)
    assert torch.equal(y, before)


@pytest.mark.parametrize("padded_rank", [8, 24, 256])
def test_refuses_a_padded_rank_that_is_not_a_power_of_two_from_16_to_128(padded_rank):
    y, x = torch.zeros(2, N), torch.randn(2, K)
    with pytest.raises(ValueError, match="power of two"):
        triton_lora.lora_add(y, x, torch.zeros(1, padded_rank, K), torch.zeros(1, N, padded_rank),
                             torch.zeros(2, dtype=torch.int32), torch.ones(1))
