"""The weight-only integer linear's two ways (kernels/triton_wna16_linear.py) in the interpreter: the whole-weight
dequantization gives the reference's weight bit for bit, and the linear takes the GEMM up to 16 rows and the
dequantized weight beyond, both equal to the reference."""

import pytest
import torch

import kernels.triton_wna16_linear as linear
from kernels.wna16_ref import dequantize_wna16, wna16_linear_ref
from tests.triton_kernels.test_triton_wna16_gemm import quantized_layer

N = 100


@pytest.mark.parametrize("bits,group_size,k_size,asymmetric", [
    (4, 32, 96, True), (4, 128, 256, False), (8, 64, 128, True), (4, 200, 200, False), (8, 16, 48, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_gives_the_reference_weight(bits, group_size, k_size, asymmetric, dtype):
    layer = quantized_layer(bits, k_size, N, group_size, asymmetric, dtype, seed=k_size + bits)
    got = linear.wna16_dequantize(layer["qweight"], layer["scales"], layer["zeros"], bits, group_size, dtype)
    expected = dequantize_wna16(layer["qweight"], layer["scales"], layer["zeros"], bits, group_size).to(dtype).t()
    assert got.shape == (k_size, N) and got.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("rows,way", [(1, "gemv"), (2, "gemm"), (16, "gemm"), (17, "dequantize"), (40, "dequantize")])
def test_the_linear_takes_the_gemv_for_a_row_the_gemm_for_few_and_the_dequantized_weight_for_more(rows, way,
                                                                                               monkeypatch):
    layer = quantized_layer(4, 96, N, 32, True, torch.float32, seed=rows)
    taken = []
    for name in ("wna16_gemv", "wna16_gemm", "wna16_dequantize"):
        original = getattr(linear, name)
        monkeypatch.setattr(linear, name, lambda *a, _o=original, _n=name, **k: taken.append(_n) or _o(*a, **k))
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N)
    y = linear.wna16_linear(x, **layer, bias=bias)
    assert taken == [f"wna16_{way}"]
    torch.testing.assert_close(y, wna16_linear_ref(x, **layer, bias=bias), rtol=1e-5, atol=4e-5)
