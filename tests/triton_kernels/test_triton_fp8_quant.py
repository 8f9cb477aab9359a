"""The per-token FP8 quantization kernel against its torch reference, and the FP8 matmul path that uses it
(torch._scaled_mm, which torch also runs on the CPU) against the reference product (kernels/triton_fp8_quant.py,
kernels/fp8_linear_ref.py). Interpreted, the kernel's float32 -> float8 cast is torch's (triton_fp8_quant.py
says why); the scale, the saturation and the row/column indexing are the kernel's."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_linear_ref import FP8_MAX, MIN_SCALE, fp8_linear_ref, quantize_per_token, quantize_to_fp8
from kernels.fp8_linear_ref import quantize_weight_per_channel
from kernels.triton_fp8_quant import BLOCK, fp8_scaled_mm
from kernels.triton_fp8_quant import quantize_per_token as triton_quantize_per_token


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


@pytest.mark.parametrize("width", [16, BLOCK - 1, BLOCK + 1, 2 * BLOCK + 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_quantization_equals_the_reference(width, dtype):
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(6, width, generator=generator) * torch.logspace(-3, 2, 6).reshape(-1, 1)).to(dtype)
    x[1] = 0  # an all-zero row takes the smallest scale, not a division by zero
    x[4, -1] = 1e4  # the amax in the last (partial) block
    quantized, scales = triton_quantize_per_token(x)
    expected, expected_scales = quantize_per_token(x)
    assert torch.equal(scales, expected_scales) and scales[1].item() == pytest.approx(MIN_SCALE)
    assert torch.equal(_bits(quantized), _bits(expected))


def test_static_quantization_saturates_and_gives_every_row_the_scale():
    x = torch.randn(5, 100) * 10
    scale = torch.tensor(0.01)  # clips everything beyond 4.48
    quantized, scales = triton_quantize_per_token(x, scale)
    assert torch.equal(scales, torch.full((5, 1), 0.01))
    assert torch.equal(_bits(quantized), _bits(quantize_to_fp8(x, scale)))
    assert quantized.float().abs().max().item() == FP8_MAX


def test_a_strided_activation_is_read_by_its_rows():
    x = torch.randn(4, 96)[:, ::2]
    quantized, scales = triton_quantize_per_token(x)
    assert torch.equal(_bits(quantized), _bits(quantize_per_token(x)[0]))


@pytest.mark.parametrize("static", [False, True], ids=["per_token", "static"])
def test_the_scaled_mm_path_computes_the_reference_product(static):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=generator, dtype=torch.bfloat16)
    weight, scales = quantize_weight_per_channel(torch.randn(32, 64, generator=generator))
    bias = torch.randn(32, generator=generator, dtype=torch.bfloat16)
    input_scale = torch.tensor(0.01) if static else None
    ours = fp8_scaled_mm(x, weight, scales.reshape(1, -1), input_scale, bias)
    expected = fp8_linear_ref(x, weight, scales, input_scale, bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == (7, 32)
    assert ((ours.float() - expected.float()).norm() / expected.float().norm()).item() < 1e-2  # bf16 output
