"""The W4A16 / W8A16 GEMV (kernels/triton_wna16_gemv.py) against its torch reference (kernels/wna16_ref.py): 4-
and 8-bit weights, symmetric and with zero points, groups of 32 / 64 / 128 and per channel (K not a multiple of
the step), 1 to 4 rows, N not a multiple of BLOCK_N, bias, any number of K slices; and what it refuses."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_wna16_gemv import GemvTiles, launch_plan, wna16_gemv
from kernels.wna16_ref import wna16_linear_ref
from tests.triton_kernels.test_triton_wna16_gemm import (
    FP32_BOUND, GROUPINGS, HALF_BOUND, N, PER_CHANNEL, assert_matches_reference, quantized_layer,
)

SMALL_TILES = GemvTiles(block_n=64, warps=2, target_programs=8)  # two column blocks over N = 100


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("group_size,k_size", GROUPINGS)
@pytest.mark.parametrize("asymmetric", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_fp32_equals_the_reference(bits, asymmetric, group_size, k_size, rows):
    """The 1 + q / 2**BITS mantissa trick loses about BITS bits of fp32's 24: still within fp32's bound here."""
    group_size = k_size if group_size == PER_CHANNEL else group_size
    layer = quantized_layer(bits, k_size, N, group_size, asymmetric, torch.float32, seed=rows + k_size + bits)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k_size, generator=generator)
    bias = torch.randn(N, generator=generator) if rows % 2 else None
    got = wna16_gemv(x, **layer, bias=bias, tiles=SMALL_TILES)
    assert_matches_reference(got, wna16_linear_ref(x, **layer, bias=bias), 4 * FP32_BOUND)


@pytest.mark.parametrize("bits,asymmetric,dtype", [(4, True, torch.bfloat16), (8, False, torch.float16)])
def test_16_bit_activations_match_the_reference(bits, asymmetric, dtype):
    """The reference rounds W to x's dtype before its product; the GEMV keeps the fp32 scale product: within
    one output ulp."""
    layer = quantized_layer(bits, 192, N, 64, asymmetric, dtype, seed=bits)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 192, generator=generator).to(dtype)
    bias = torch.randn(N, generator=generator).to(dtype)
    assert_matches_reference(wna16_gemv(x, **layer, bias=bias), wna16_linear_ref(x, **layer, bias=bias),
                             2 * HALF_BOUND)


@pytest.mark.parametrize("splits", [1, 2, 5, 50])
def test_any_number_of_k_slices_gives_the_same_product(splits):
    """K = 384 in groups of 128 is three steps: 2 slices leave one with one step, 5 and 50 are clamped to 3."""
    layer = quantized_layer(4, 384, N, 128, True, torch.float32, seed=7)
    x = torch.randn(1, 384, generator=torch.Generator().manual_seed(3))
    expected = wna16_linear_ref(x, **layer)
    assert_matches_reference(wna16_gemv(x, **layer, splits=splits, tiles=SMALL_TILES), expected, 4 * FP32_BOUND)


def test_a_step_stays_inside_one_group():
    wide = GemvTiles(block_n=128, warps=1, target_programs=4096, step_words=16)
    assert launch_plan(1, 4096, 4096, 4, 128, tiles=wide).step_words == 16  # 128 values: one group per step
    assert launch_plan(1, 4096, 4096, 4, 32, tiles=wide).step_words == 4
    assert launch_plan(1, 4096, 4096, 8, 32, tiles=wide).step_words == 8
    assert launch_plan(1, 4096, 200, 4, 200, tiles=wide).step_words == 16  # per channel: K is one group
    assert launch_plan(1, 4096, 4096, 4, 128).step_words == 8  # the default tiles' steps


def test_one_row_splits_k_into_up_to_32_slices():
    """The 8B shape's projections at one row: qkv (48 tiles of 128 columns) and down (32) take 32 slices,
    gate_up (224 tiles) 19."""
    assert launch_plan(1, 6144, 4096, 4, 128).splits == 32
    assert launch_plan(1, 4096, 14336, 4, 128).splits == 32
    assert launch_plan(1, 28672, 4096, 4, 128).splits == 19


def test_refuses_more_rows_than_it_serves():
    layer = quantized_layer(4, 128, N, 128, False, torch.float32, seed=0)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        wna16_gemv(torch.randn(5, 128), **layer)
