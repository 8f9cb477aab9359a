"""The few-row FP8 W8A8 GEMM (kernels/triton_fp8_gemm.py) against the reference math (kernels/fp8_linear_ref.py):
every row count a decode step takes, K and N that are not multiples of the blocks, bias or none, per-channel and
per-tensor weight scales, forced K slices; its refusals; and Fp8Linear's choice of it for few rows on FP8 tensor
cores (torch._scaled_mm, which torch also runs on the CPU, beyond)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_linear_ref import FP8_DTYPE, FP8_MAX, fp8_linear_ref, quantize_per_token, quantize_to_fp8
from kernels.fp8_linear_ref import quantize_weight_per_channel
from kernels.triton_fp8_gemm import FEW_ROWS, Fp8Tiles, fp8_fewrow_mm, fp8_gemm
from kernels.triton_fp8_quant import fp8_scaled_mm
from worker_svc.layers.fp8_linear import tensor_core_kernel

SMALL_TILES = Fp8Tiles(32, 128, 4, 3)  # the smallest candidate: tiny shapes still span several tiles and steps


def _weights(n_size: int, k_size: int, per_tensor: bool, generator: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 W [N, K], float32 scales [N]): per output channel, or one scale repeated on every row."""
    weight = torch.randn(n_size, k_size, generator=generator) * torch.logspace(-2, 0, n_size).reshape(-1, 1)
    if not per_tensor:
        return quantize_weight_per_channel(weight)
    scale = weight.abs().amax() / FP8_MAX
    return quantize_to_fp8(weight, scale), scale.expand(n_size).clone()


def _assert_fp32_close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    # Same quantized values; the reference scales each product before summing, the kernel after: fp32 rounding.
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("rows", range(1, FEW_ROWS + 1))
def test_every_decode_row_count_computes_the_reference_product(rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 300, generator=generator) * torch.logspace(-1, 1, rows).reshape(-1, 1)
    weight, scales = _weights(70, 300, False, generator)
    bias = torch.randn(70, generator=generator)
    ours = fp8_fewrow_mm(x, weight, scales.reshape(1, -1), None, bias, tiles=SMALL_TILES)
    assert ours.dtype == torch.float32 and ours.shape == (rows, 70)
    _assert_fp32_close(ours, fp8_linear_ref(x, weight, scales, None, bias))


@pytest.mark.parametrize("k_size,n_size", [(128, 64), (64, 32), (257, 33), (384, 95)])
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("per_tensor,with_bias", [(False, True), (True, False)], ids=["channel_bias", "tensor"])
def test_forced_k_slices_and_ragged_shapes_compute_the_reference_product(k_size, n_size, splits, per_tensor,
                                                                         with_bias):
    generator = torch.Generator().manual_seed(k_size * n_size + splits)
    x = torch.randn(5, k_size, generator=generator)
    weight, scales = _weights(n_size, k_size, per_tensor, generator)
    bias = torch.randn(n_size, generator=generator) if with_bias else None
    x_fp8, x_scales = quantize_per_token(x)
    ours = fp8_gemm(x_fp8, x_scales, weight, scales.reshape(1, -1), bias, torch.float32, SMALL_TILES, splits)
    _assert_fp32_close(ours, fp8_linear_ref(x, weight, scales, None, bias))


def test_more_slices_than_k_steps_and_the_default_tiles_give_the_same_product():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 200, generator=generator)
    weight, scales = _weights(40, 200, False, generator)
    expected = fp8_linear_ref(x, weight, scales, None, None)
    _assert_fp32_close(fp8_fewrow_mm(x, weight, scales.reshape(1, -1), None, None, SMALL_TILES, splits=50), expected)
    _assert_fp32_close(fp8_fewrow_mm(x, weight, scales.reshape(1, -1), None, None), expected)


@pytest.mark.parametrize("splits", [1, 2])
def test_bfloat16_output_is_the_reference_rounded_once(splits):
    generator = torch.Generator().manual_seed(11 + splits)
    x = torch.randn(2, 3, 160, generator=generator).bfloat16()  # leading dims are kept
    weight, scales = _weights(48, 160, False, generator)
    bias = torch.randn(48, generator=generator).bfloat16()
    ours = fp8_fewrow_mm(x, weight, scales.reshape(1, -1), None, bias, SMALL_TILES, splits)
    expected = fp8_linear_ref(x, weight, scales, None, bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == (2, 3, 48)
    # Both round an fp32 value once to bf16; the fp32 values differ in their last bits: at most one bf16 ulp.
    torch.testing.assert_close(ours.float(), expected.float(), rtol=2 ** -7, atol=1e-6)


def test_a_static_input_scale_quantizes_every_row_with_it():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(4, 130, generator=generator) * 10
    weight, scales = _weights(36, 130, False, generator)
    input_scale = torch.tensor(0.01)  # clips everything beyond 4.48
    ours = fp8_fewrow_mm(x, weight, scales.reshape(1, -1), input_scale, None, SMALL_TILES, splits=2)
    _assert_fp32_close(ours, fp8_linear_ref(x, weight, scales, input_scale, None))


def test_no_rows_give_an_empty_output():
    weight, scales = _weights(8, 32, False, torch.Generator().manual_seed(0))
    assert fp8_fewrow_mm(torch.empty(0, 32), weight, scales.reshape(1, -1), None, None).shape == (0, 8)


def _operands():
    generator = torch.Generator().manual_seed(1)
    weight, scales = _weights(16, 64, False, generator)
    x_fp8, x_scales = quantize_per_token(torch.randn(3, 64, generator=generator))
    return {"x_fp8": x_fp8, "x_scales": x_scales, "weight": weight, "weight_scale_row": scales.reshape(1, -1),
            "bias": None, "out_dtype": torch.bfloat16}


@pytest.mark.parametrize("name,bad,message", [
    ("x_fp8", lambda o: o["x_fp8"].float(), "x must be"),
    ("weight", lambda o: o["weight"].float(), "weight must be"),
    ("weight", lambda o: o["weight"][:, :32], "input features"),
    ("weight", lambda o: o["weight"].t().contiguous().t(), "contiguous along K"),
    ("x_scales", lambda o: o["x_scales"][:2], "x_scales"),
    ("x_scales", lambda o: o["x_scales"].double(), "x_scales"),
    ("weight_scale_row", lambda o: o["weight_scale_row"].reshape(-1), "weight_scale_row"),
    ("bias", lambda o: torch.zeros(15), "bias"),
    ("out_dtype", lambda o: torch.int32, "output dtype"),
])
def test_bad_operands_are_refused(name, bad, message):
    operands = _operands()
    operands[name] = bad(operands)
    with pytest.raises(ValueError, match=message):
        fp8_gemm(**operands)


def test_zero_k_slices_are_refused():
    with pytest.raises(ValueError, match="splits"):
        fp8_gemm(**_operands(), splits=0)


@pytest.mark.parametrize("rows", [1, FEW_ROWS, FEW_ROWS + 1])
def test_fp8_linear_on_tensor_cores_takes_the_triton_gemm_up_to_few_rows_and_scaled_mm_beyond(rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)  # float32: _scaled_mm's output is bf16, the Triton GEMM's not
    weight, scales = _weights(24, 96, False, generator)
    scale_row = scales.reshape(1, -1)
    ours = tensor_core_kernel()(x, weight, scale_row, None, None)
    triton_gemm = fp8_fewrow_mm(x, weight, scale_row, None, None)
    scaled_mm = fp8_scaled_mm(x, weight, scale_row, None, None)
    assert not torch.equal(triton_gemm, scaled_mm)
    assert torch.equal(ours, triton_gemm if rows <= FEW_ROWS else scaled_mm)
