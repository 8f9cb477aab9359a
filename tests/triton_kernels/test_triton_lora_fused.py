"""The per-layer multi-LoRA kernels (kernels/triton_lora.lora_add_fused) against the torch reference
(kernels/lora_ref.lora_add_fused): fused layouts q|k|v with GQA sizes, gate|up and one part, with part boundaries
that are not multiples of the expand's column tile; adapters of ranks 8 and 16 padded into R = 16 and 32; 1, 17
and 300 tokens mixing base rows (slot -1) and several slots, in fp32 and bf16; the shrink cut into K slices and
expand programs of several column blocks; the few-token path (1, 2 or 4 tokens per program, no `tl.dot`) at 1-16
tokens, with every tile configuration the GPU sweep tries; a step of base rows only; and the step's order of tokens
by slot (kernels/lora_ref.LoraTokens)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lora_kernels_gpu import SWEEP_CASES, candidate_tiles
from kernels import lora_ref, lora_tiles, triton_lora
from kernels.lora_ref import LoraTokens

K = 100  # not a multiple of the shrink's block_k
# Output rows of each part: q|k|v with 4 query heads per KV head (head size 10), gate|up, one part.
LAYOUTS = {"qkv": (40, 10, 10), "gate_up": (45, 45), "single": (70,)}
NUM_SLOTS = 4
# Each slot's rank within the padded rank R.
ADAPTER_RANKS = {16: (8, 16, 8, 16), 32: (16, 8, 32, 8), 64: (16, 64, 32, 64), 128: (16, 128, 64, 128)}
BOUND = {torch.float32: 1e-5, torch.bfloat16: 2**-7}  # as tests/triton_kernels/test_triton_lora.py (why there)
BF16_BIT_EQUAL = 0.98


def stacked_adapters(part_rows, padded_rank, dtype, generator):
    """Stacked A [S, P*R, K], B [S, N, R] (zeros beyond each slot's rank) and scalings [S]."""
    num_parts, n_size = len(part_rows), sum(part_rows)
    lora_a = torch.zeros(NUM_SLOTS, num_parts * padded_rank, K)
    lora_b = torch.zeros(NUM_SLOTS, n_size, padded_rank)
    for slot, rank in enumerate(ADAPTER_RANKS[padded_rank]):
        for part in range(num_parts):
            first = part * padded_rank
            lora_a[slot, first : first + rank] = torch.randn(rank, K, generator=generator) / K ** 0.5
        lora_b[slot, :, :rank] = torch.randn(n_size, rank, generator=generator) / rank ** 0.5
    return lora_a.to(dtype), lora_b.to(dtype), torch.rand(NUM_SLOTS, generator=generator) + 0.5


def run_both(layout, padded_rank, num_tokens, dtype, seed, slots=None, tiles=None):
    """(kernel's y, reference's y, y before, slots) for random slots in -1 .. S-2 (slot S-1 unused, NaN: a
    kernel that reads it fails), NaN inputs on base rows."""
    part_rows = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(seed)
    lora_a, lora_b, scalings = stacked_adapters(part_rows, padded_rank, dtype, generator)
    lora_a[NUM_SLOTS - 1], lora_b[NUM_SLOTS - 1] = float("nan"), float("nan")
    if slots is None:
        slots = torch.randint(-1, NUM_SLOTS - 1, (num_tokens,), generator=generator)
        if num_tokens > 2:
            slots[0], slots[1] = -1, NUM_SLOTS - 2
    x = torch.randn(num_tokens, K, generator=generator).to(dtype)
    x[slots < 0] = float("nan")
    before = torch.randn(num_tokens, sum(part_rows), generator=generator).to(dtype)
    got, expected = before.clone(), before.clone()
    tokens = LoraTokens.of(slots)
    triton_lora.lora_add_fused(got, x, lora_a, lora_b, part_rows, tokens, scalings, tiles)
    lora_ref.lora_add_fused(expected, x, lora_a, lora_b, part_rows, tokens, scalings)
    return got, expected, before, slots


def assert_matches(got, expected, before, slots, bound):
    assert torch.equal(got[slots < 0], before[slots < 0])
    assert torch.isfinite(got).all()
    error = (got.float() - expected.float()).abs().max().item()
    assert error <= bound * expected.float().abs().max().item(), error
    updated = slots >= 0
    if updated.any():
        assert not torch.equal(got[updated], before[updated])
        if got.dtype == torch.bfloat16:
            assert (got[updated] == expected[updated]).float().mean().item() >= BF16_BIT_EQUAL


@pytest.mark.parametrize("num_tokens", [1, 17, 300])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_part_of_a_fused_layer_matches_the_reference(dtype, layout, num_tokens):
    got, expected, before, slots = run_both(layout, 16, num_tokens, dtype, seed=num_tokens + len(layout))
    assert_matches(got, expected, before, slots, BOUND[dtype])


@pytest.mark.parametrize("layout", ["qkv", "gate_up"])
def test_a_padded_rank_of_32_matches_the_reference(layout):
    got, expected, before, slots = run_both(layout, 32, 40, torch.float32, seed=5)
    assert_matches(got, expected, before, slots, BOUND[torch.float32])


@pytest.mark.parametrize("num_tokens", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_tokens_with_the_shrink_cut_into_k_slices_match_the_reference(dtype, num_tokens):
    tiles = lora_tiles.LoraTiles(block_k=16, split_columns=32)  # K = 100: 3 slices of 48, the last partly masked
    assert lora_tiles.shrink_splits(num_tokens, K, tiles) == 3
    got, expected, before, slots = run_both("qkv", 16, num_tokens, dtype, seed=7, tiles=tiles)
    assert_matches(got, expected, before, slots, BOUND[dtype])


@pytest.mark.parametrize("layout", ["qkv", "gate_up"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_many_tokens_with_k_slices_and_expand_programs_of_several_column_blocks_match_the_reference(
        monkeypatch, dtype, layout):
    # As at 256 tokens of a wide layer on a GPU: the shrink's K cut into 3 slices beyond one token tile, and each
    # expand program covering 32-column blocks across the parts' boundaries.
    tiles = lora_tiles.LoraTiles(block_k=16, split_columns=32, block_n=32)
    monkeypatch.setattr(lora_tiles, "EXPAND_PROGRAMS", 8)
    assert lora_tiles.shrink_splits(300, K, tiles) == 3
    assert lora_tiles.expand_columns(300, sum(LAYOUTS[layout]), tiles) > 32
    got, expected, before, slots = run_both(layout, 16, 300, dtype, seed=11, tiles=tiles)
    assert_matches(got, expected, before, slots, BOUND[dtype])


# The few-token path at 1 and 4 tokens per program with K = 100 in 3 slices of 48 columns (the last partly masked),
# summed by the expand in one [4, block_m, P*R] load (its fourth slice masked), and 32-column expand blocks that
# cross the parts' boundaries.
FEW_TOKEN_TILES = [lora_tiles.LoraTiles(block_m=block_m, block_k=16, split_columns=32, max_splits=4, block_n=32,
                                         num_warps=2, num_stages=1) for block_m in (1, 4)]


def decode_slots(num_tokens, several_slots):
    """A decode step's slots: every token on slot 2, or on slots 0-2 in turn; from 2 tokens on, the second is a
    base row (slot -1)."""
    slots = torch.arange(num_tokens) % 3 if several_slots else torch.full((num_tokens,), 2)
    if num_tokens > 1:
        slots[1] = -1
    return slots


@pytest.mark.parametrize("tiles", FEW_TOKEN_TILES, ids=lambda tiles: f"block_m{tiles.block_m}")
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("several_slots", [False, True], ids=["one-slot", "several-slots"])
@pytest.mark.parametrize("layout", ["single", "qkv"])
@pytest.mark.parametrize("padded_rank", [16, 64])
def test_the_few_token_path_matches_the_reference(padded_rank, layout, several_slots, num_tokens, tiles):
    assert lora_tiles.shrink_splits(num_tokens, K, tiles) == 3
    got, expected, before, slots = run_both(layout, padded_rank, num_tokens, torch.float32, seed=num_tokens,
                                            slots=decode_slots(num_tokens, several_slots), tiles=tiles)
    assert_matches(got, expected, before, slots, BOUND[torch.float32])


@pytest.mark.parametrize("tiles", FEW_TOKEN_TILES, ids=lambda tiles: f"block_m{tiles.block_m}")
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_the_few_token_path_keeps_the_bf16_rounding_points(num_tokens, tiles):
    got, expected, before, slots = run_both("qkv", 16, num_tokens, torch.bfloat16, seed=3,
                                            slots=decode_slots(num_tokens, True), tiles=tiles)
    assert_matches(got, expected, before, slots, BOUND[torch.bfloat16])


def test_decode_steps_take_the_few_token_path_by_default():
    bounds = [most for most, _ in lora_tiles.TILES_BY_TOKENS]
    assert bounds == sorted(bounds) and bounds[-1] == lora_tiles.FEW_TOKENS
    for num_tokens in range(1, lora_tiles.FEW_TOKENS + 1):
        assert lora_tiles.tiles_for(num_tokens).block_m < lora_tiles.DOT_BLOCK_M
    assert lora_tiles.tiles_for(lora_tiles.FEW_TOKENS + 1) == lora_tiles.MANY_TOKEN_TILES


def test_the_few_token_tiles_shrink_to_fit_registers_at_a_large_rank_and_still_match_the_reference():
    tiles = lora_tiles.tiles_for(3)
    assert lora_tiles.fit_registers(tiles, 64) == tiles  # rank 16 q|k|v: as chosen
    fitted = lora_tiles.fit_registers(tiles, 512)  # rank 128 q|k|v: 384 stacked ranks, padded
    most = lora_tiles.PRODUCT_ELEMENTS_PER_THREAD[tiles.block_m] * 32 * tiles.num_warps
    assert max(fitted.block_k, fitted.block_n, fitted.max_splits) * 512 <= most < tiles.block_k * 512
    got, expected, before, slots = run_both("qkv", 128, 3, torch.float32, seed=17, slots=decode_slots(3, True))
    assert_matches(got, expected, before, slots, BOUND[torch.float32])


@pytest.mark.parametrize("tiles", list(dict.fromkeys(tiles for num_tokens, _ in SWEEP_CASES
                                                     for tiles in candidate_tiles(num_tokens))), ids=str)
def test_every_tile_configuration_the_gpu_sweep_times_matches_the_reference(tiles):
    got, expected, before, slots = run_both("qkv", 16, 5, torch.float32, seed=13, slots=decode_slots(5, True),
                                            tiles=tiles)
    assert_matches(got, expected, before, slots, BOUND[torch.float32])


@pytest.mark.parametrize("fields", [dict(block_m=3), dict(block_m=32), dict(block_k=8), dict(split_columns=96),
                                    dict(num_warps=3), dict(block_m=1, block_k=128, split_columns=64)])
def test_refuses_tiles_the_kernels_cannot_run(fields):
    with pytest.raises(ValueError):
        lora_tiles.LoraTiles(**fields)


def test_slot_runs_meeting_inside_a_token_tile_each_get_their_own_adapter():
    # Sorted, the 7 tokens of slot 0 and the 20 of slot 1 share the first 16-row tile, and slot 2 starts inside
    # the second: programs run one dot per slot present.
    shuffle = torch.randperm(35, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([1] * 20 + [0] * 7 + [2] * 5 + [-1] * 3)[shuffle]
    got, expected, before, _ = run_both("gate_up", 16, 35, torch.float32, seed=9, slots=slots)
    assert_matches(got, expected, before, slots, BOUND[torch.float32])


def test_a_step_of_base_rows_only_reads_no_input_or_adapter_and_leaves_the_output_as_it_was():
    part_rows = LAYOUTS["qkv"]
    nan = float("nan")
    y = torch.randn(20, sum(part_rows))
    before = y.clone()
    triton_lora.lora_add_fused(y, torch.full((20, K), nan), torch.full((2, 48, K), nan),
                               torch.full((2, sum(part_rows), 16), nan), part_rows,
                               LoraTokens.of(torch.full((20,), -1)), torch.ones(2))
    assert torch.equal(y, before)


def test_the_step_order_groups_tokens_by_slot_stably_with_base_tokens_last():
    tokens = LoraTokens.of(torch.tensor([2, -1, 0, 2, -1, 0, 1]))
    assert tokens.order.tolist() == [2, 5, 6, 0, 3, 1, 4]
    assert tokens.sorted_slots.tolist() == [0, 0, 1, 2, 2, -1, -1]
    assert tokens.order.dtype == tokens.sorted_slots.dtype == torch.int32


def test_refuses_parts_that_do_not_fit_the_output_or_the_stacked_a():
    y, x = torch.zeros(2, 60), torch.randn(2, K)
    tokens = LoraTokens.of(torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="do not fit"):
        triton_lora.lora_add_fused(y, x, torch.zeros(1, 48, K), torch.zeros(1, 60, 16), (40, 10), tokens,
                                   torch.ones(1))
    with pytest.raises(ValueError, match="do not fit"):
        triton_lora.lora_add_fused(y, x, torch.zeros(1, 32, K), torch.zeros(1, 60, 16), (40, 10, 10), tokens,
                                   torch.ones(1))
