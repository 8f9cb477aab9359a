"""The W4A16 / W8A16 GEMM kernel (kernels/triton_wna16_gemm.py) against its torch reference (kernels/wna16_ref.py):
4- and 8-bit weights, symmetric and with zero points, groups of 32 / 64 / 128 rows and per channel, decode row
counts (split-K) and a prefill-sized one (plain tiles), K and N that are not powers of two, with and without
bias; and the shapes it refuses."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_wna16_gemm import Tiles, launch_plan, wna16_gemm
from kernels.wna16_ref import pack_rows, wna16_linear_ref

PER_CHANNEL = "per_channel"
# (group size, K): K a multiple of the group and not a power of two; per channel, K not a multiple of BLOCK_K.
GROUPINGS = [(32, 96), (64, 192), (128, 384), (PER_CHANNEL, 200)]
N = 100  # neither a power of two nor a multiple of any BLOCK_N
# Bounds, relative to the output's largest magnitude: fp32 is the reference's math summed in another order. bf16
# and fp16: W is rounded to x's dtype at the reference's point and the sums are fp32, so only the output's one
# rounding may land an ulp apart: 2**-8 (one bf16 ulp; in this interpreter, whose casts conftest.py makes round
# as a GPU does, bf16 came out bit-equal and fp16 within 6e-5).
FP32_BOUND, HALF_BOUND = 1e-5, 2**-8


def quantized_layer(bits: int, k_size: int, n_size: int, group_size: int, asymmetric: bool, dtype: torch.dtype,
                    seed: int) -> dict:
    """Random weights in the canonical layout: qweight, scales, zeros (or None), bits, group_size."""
    generator = torch.Generator().manual_seed(seed)
    groups = k_size // group_size
    values = torch.randint(0, 2**bits, (k_size, n_size), generator=generator)
    scales = (torch.rand(groups, n_size, generator=generator) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 2**bits, (groups, n_size), generator=generator).to(dtype) if asymmetric else None
    return {"qweight": pack_rows(values, bits), "scales": scales, "zeros": zeros, "bits": bits,
            "group_size": group_size}


def assert_matches_reference(y: torch.Tensor, expected: torch.Tensor, bound: float) -> None:
    assert y.dtype == expected.dtype and y.shape == expected.shape
    assert torch.isfinite(y).all()
    error = (y.float() - expected.float()).abs().max().item()
    assert error <= bound * expected.float().abs().max().item(), error


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("group_size,k_size", GROUPINGS)
@pytest.mark.parametrize("asymmetric", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_fp32_equals_the_reference(bits, asymmetric, group_size, k_size, rows):
    group_size = k_size if group_size == PER_CHANNEL else group_size
    layer = quantized_layer(bits, k_size, N, group_size, asymmetric, torch.float32, seed=rows + k_size + bits)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k_size, generator=generator)
    bias = torch.randn(N, generator=generator) if rows % 2 else None  # odd row counts with, even without
    assert (launch_plan(rows, N, k_size, group_size).splits > 1) == (rows <= 16)  # decode rows split K
    assert_matches_reference(wna16_gemm(x, **layer, bias=bias), wna16_linear_ref(x, **layer, bias=bias),
                             FP32_BOUND)


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("bits,asymmetric,dtype,grouping", [
    (4, False, torch.bfloat16, (64, 192)), (4, True, torch.bfloat16, (64, 192)), (8, True, torch.bfloat16, (64, 192)),
    (4, True, torch.float16, (64, 192)), (8, False, torch.bfloat16, (64, 192)), (8, False, torch.float16, (64, 192)),
    (4, True, torch.bfloat16, (PER_CHANNEL, 200)), (8, False, torch.float16, (PER_CHANNEL, 200)),
])
def test_16_bit_activations_match_the_reference(bits, asymmetric, dtype, grouping, rows):
    """Per channel: K = 200, one group, a partial last BLOCK_K step; 8-bit symmetric: no zeros, the 128 offset."""
    group_size, k_size = grouping
    group_size = k_size if group_size == PER_CHANNEL else group_size
    layer = quantized_layer(bits, k_size, N, group_size, asymmetric, dtype, seed=bits)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k_size, generator=generator).to(dtype)
    bias = torch.randn(N, generator=generator).to(dtype)
    assert_matches_reference(wna16_gemm(x, **layer, bias=bias), wna16_linear_ref(x, **layer, bias=bias),
                             HALF_BOUND)


@pytest.mark.parametrize("splits", [1, 2, 4, 6, 50])
def test_any_number_of_k_slices_gives_the_same_product(splits):
    """K = 192 in steps of 32 is six BLOCK_K steps: 4 slices of two steps leave the last slice empty (it must
    write zeros), 50 is clamped to six."""
    layer = quantized_layer(4, 192, N, 32, True, torch.float32, seed=7)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(8))
    bias = torch.randn(N)
    tiles = Tiles(16, 64, 32, 4, 3, split_k=True)
    assert launch_plan(5, N, 192, 32, splits, tiles).splits == min(splits, 6)
    assert_matches_reference(wna16_gemm(x, **layer, bias=bias, splits=splits, tiles=tiles),
                             wna16_linear_ref(x, **layer, bias=bias), FP32_BOUND)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("bits,group_size,k_size", [(4, 32, 192), (8, 200, 200)])
def test_swapped_operands_give_the_same_product(rows, bits, group_size, k_size):
    """SWAP_AB (y^T = W x^T, W as tl.dot's first operand) against the reference, split and not."""
    layer = quantized_layer(bits, k_size, N, group_size, True, torch.float32, seed=rows + bits)
    x = torch.randn(rows, k_size, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N)
    for splits in (1, 3):
        tiles = Tiles(16, 64, 32, 4, 3, split_k=True, swap_ab=True)
        assert_matches_reference(wna16_gemm(x, **layer, bias=bias, splits=splits, tiles=tiles),
                                 wna16_linear_ref(x, **layer, bias=bias), FP32_BOUND)


@pytest.mark.parametrize("rows", [2, 40])
def test_reads_no_activation_beyond_k(rows):
    """Per channel with K = 200 (a partial last BLOCK_K step): x is a view whose rows continue with NaN, which must
    not reach the product. (The weight's rows beyond K are masked too, but only so that no read leaves the
    allocation: times the zeros read for x they could not change a finite product.)"""
    layer = quantized_layer(4, 200, N, 200, False, torch.float32, seed=3)
    padded_x = torch.full((rows, 256), float("nan"))
    padded_x[:, :200] = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows))
    x = padded_x[:, :200]
    assert_matches_reference(wna16_gemm(x, **layer), wna16_linear_ref(x, **layer), FP32_BOUND)


def test_leading_axes_are_flattened_and_restored():
    layer = quantized_layer(8, 96, N, 32, False, torch.float32, seed=11)
    x = torch.randn(2, 3, 96)
    y = wna16_gemm(x, **layer)
    assert y.shape == (2, 3, N)
    assert_matches_reference(y, wna16_linear_ref(x, **layer), FP32_BOUND)


def test_no_rows_give_an_empty_output():
    layer = quantized_layer(4, 96, N, 32, False, torch.bfloat16, seed=1)
    y = wna16_gemm(torch.empty(0, 96, dtype=torch.bfloat16), **layer)
    assert y.shape == (0, N) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("change,message", [
    ({"bits": 3}, "3-bit"),
    ({"group_size": 50}, "group_size 50"),
    ({"group_size": 24, "scales": torch.rand(4, N)}, "group_size 24"),
    ({"x": torch.randn(2, 96, dtype=torch.float64)}, "float64"),
    ({"x": torch.randn(2, 64)}, "64 input features"),
    ({"scales": torch.rand(2, N)}, r"scales of shape \(2, 100\)"),
    ({"zeros": torch.zeros(3, N - 1)}, r"zeros of shape \(3, 99\)"),
    ({"bias": torch.zeros(N + 1)}, r"bias of shape \(101,\)"),
    ({"qweight": torch.zeros(12, N, dtype=torch.int64)}, "torch.int64"),
])
def test_refuses_what_it_cannot_compute(change, message):
    """group_size 50 does not divide K = 96; 24 divides it but is neither a multiple of the smallest BLOCK_K (16)
    nor a power-of-two fraction of a step."""
    call = {"x": torch.randn(2, 96), **quantized_layer(4, 96, N, 32, False, torch.float32, seed=2), **change}
    with pytest.raises(ValueError, match=message):
        wna16_gemm(**call)


def test_decode_rows_split_k_until_about_1024_programs():
    """Llama-3.1-8B, groups of 128, decode tiles 128 columns wide: a 4096-wide output gives 32 column tiles, so
    one row splits K in 16 (the most: 512 programs); 6144 wide too; a 28672-wide one (224 tiles) in 5; 40 rows
    use the plain tiles."""
    assert launch_plan(1, 4096, 14336, 128).splits == 16
    assert launch_plan(16, 6144, 4096, 128).splits == 16
    assert launch_plan(1, 28672, 4096, 128).splits == 5
    assert launch_plan(40, 4096, 4096, 128).splits == 1
    plan = launch_plan(1, 4096, 4096, 32)  # a step of 64 rows holds two whole groups of 32
    assert (plan.block_k, plan.group_k) == (64, 32)
    assert launch_plan(1, 4096, 4096, 96).block_k == 32  # 96 is no power-of-two fraction: steps inside a group
