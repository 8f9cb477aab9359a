"""The per-token INT8 quantization kernel against its torch reference, and the INT8 matmul path that uses it
(torch._int_mm, which torch also runs on the CPU, with the padding to 17 rows the CUDA kernel needs) against the
reference product (kernels/triton_int8_quant.py, kernels/int8_linear_ref.py). Interpreted, the kernel rounds by
the 1.5 * 2**23 addition (no libdevice); on a GPU by libdevice's rint: both ties to even."""

from __future__ import annotations

import pytest
import torch

from kernels.int8_linear_ref import HALF_RANGE, int8_linear_ref, quantize_per_token_int8, quantize_to_int8
from kernels.triton_int8_quant import BLOCK, INT_MM_MIN_ROWS, int8_scaled_mm
from kernels.triton_int8_quant import quantize_per_token_int8 as triton_quantize_per_token_int8


@pytest.mark.parametrize("width", [16, BLOCK - 1, BLOCK + 1, 2 * BLOCK + 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_quantization_equals_the_reference(width, dtype):
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(6, width, generator=generator) * torch.logspace(-3, 2, 6).reshape(-1, 1)).to(dtype)
    x[1] = 0  # an all-zero row: scale 1, not a division by zero
    x[4, -1] = 1e4  # the amax in the last (partial) block
    quantized, scales = triton_quantize_per_token_int8(x)
    expected, expected_scales = quantize_per_token_int8(x)
    assert torch.equal(scales, expected_scales) and scales[1].item() == 1.0
    assert quantized.dtype == torch.int8 and torch.equal(quantized, expected)
    assert quantized[4].max().item() == 127  # 127.5 clamps to 127 (compressed-tensors' range)


def test_halves_round_to_even_as_torch_round_does():
    x = torch.tensor([[127.5, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -127.5, 3.49, -3.51]])  # amax 127.5: scale 1
    quantized, scales = triton_quantize_per_token_int8(x)
    assert scales.item() == 127.5 / HALF_RANGE
    assert quantized.tolist() == [[127, 0, 2, 2, 0, -2, -2, -128, 3, -4]]


def test_static_quantization_clamps_gives_every_row_the_scale_and_zero_pads():
    x = torch.randn(5, 100) * 10
    scale = torch.tensor(0.01)  # clips everything beyond 1.27
    quantized, scales = triton_quantize_per_token_int8(x, scale, min_rows=INT_MM_MIN_ROWS)
    assert quantized.shape == (INT_MM_MIN_ROWS, 100) and not quantized[5:].any()
    assert torch.equal(scales, torch.full((5, 1), 0.01))
    assert torch.equal(quantized[:5], quantize_to_int8(x, scale))
    assert quantized.min().item() == -128 and quantized.max().item() == 127


def test_a_strided_activation_is_read_by_its_rows():
    x = torch.randn(4, 96)[:, ::2]
    quantized, _ = triton_quantize_per_token_int8(x)
    assert torch.equal(quantized, quantize_per_token_int8(x)[0])


@pytest.mark.parametrize("rows, width, out_features", [(1, 64, 32), (16, 64, 32), (33, 64, 32), (7, 60, 36)],
                         ids=["one_row", "16_rows", "33_rows", "not_multiples_of_8"])
@pytest.mark.parametrize("static", [False, True], ids=["per_token", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int_mm_path_computes_the_reference_product(rows, width, out_features, static, dtype):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, width, generator=generator).to(dtype)
    weight = torch.randint(-128, 128, (out_features, width), generator=generator, dtype=torch.int8)
    weight_scale = torch.rand(out_features, generator=generator) * 1e-3
    bias = torch.randn(out_features, generator=generator).to(dtype)
    input_scale = torch.tensor(0.02) if static else None
    ours = int8_scaled_mm(x, weight, weight_scale.reshape(1, -1), input_scale, bias)
    expected = int8_linear_ref(x, weight, weight_scale, input_scale, bias)
    assert ours.dtype == dtype and ours.shape == (2, rows, out_features)
    # The same integers and scales; the int32 sums are exact, the reference's float32 sums of scaled values
    # round: equal to float32 noise, or to one bf16 rounding of the output.
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours, expected, rtol=tolerance, atol=tolerance)
