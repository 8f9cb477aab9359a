"""The FP8 W8A8 linear method: its torch reference against float64 math, the layers' loading of compressed-tensors
scales (fused parts, per-channel and per-tensor, static input scales), online quantization, and the split over
two tensor-parallel ranks (worker_svc/layers/fp8_linear.py, kernels/fp8_linear_ref.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_linear_ref import FP8_DTYPE, FP8_MAX, fp8_linear_ref, quantize_per_token, quantize_weight_per_channel
from tests.test_parallel_layers import run_ranks
from worker_svc.layers.checkpoint_tensor import CheckpointTensor
from worker_svc.layers.fp8_linear import Fp8Linear
from worker_svc.layers.linear_method import UNQUANTIZED
from worker_svc.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.quantization_config import COMPRESSED_TENSORS, ONLINE_FP8, QuantizationScheme
from worker_svc.tensor_parallel import SINGLE_RANK, TensorParallel

CHANNEL_DYNAMIC = QuantizationScheme(COMPRESSED_TENSORS, "channel", True)
TENSOR_STATIC = QuantizationScheme(COMPRESSED_TENSORS, "tensor", False)


def _checkpoint(tensor: torch.Tensor) -> CheckpointTensor:
    return CheckpointTensor(tensor, tuple(tensor.shape))


def _float64_fp8_linear(x, weight_fp8, weight_scale, x_fp8, x_scale, bias):
    """The same quantized product in float64: sum_k (q(x)[m,k] s_x[m]) (W[n,k] s_w[n]) + b[n]."""
    activation = x_fp8.double() * x_scale.double()
    weight = weight_fp8.double() * weight_scale.double().reshape(-1, 1)
    return activation @ weight.T + (0 if bias is None else bias.double())


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("static", [False, True], ids=["per_token", "static"])
def test_the_reference_computes_the_quantized_product_of_float64_math(rows, static):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator) * torch.logspace(-2, 1, rows).reshape(-1, 1)
    x[0, 3] = 700.0  # a row with an outlier: its other entries quantize coarsely, and the outlier saturates static
    weight, weight_scale = quantize_weight_per_channel(torch.randn(40, 96, generator=generator) * 0.05)
    bias = torch.randn(40, generator=generator)
    input_scale = torch.tensor(2.0 / FP8_MAX) if static else None
    ours = fp8_linear_ref(x, weight, weight_scale, input_scale, bias)
    if static:
        x_fp8, x_scale = (x / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), input_scale
    else:
        x_fp8, x_scale = quantize_per_token(x)
        assert torch.equal(x_scale.squeeze(1), x.abs().amax(1) / FP8_MAX)  # amax / 448 per token
        assert torch.equal(x_fp8.float().abs().amax(1), torch.full((rows,), FP8_MAX))  # each row's amax is 448
    expected = _float64_fp8_linear(x, weight, weight_scale, x_fp8, x_scale, bias)
    assert ((ours.double() - expected).norm() / expected.norm()).item() < 1e-3
    assert (ours.double() - expected).abs().max().item() < 1e-3 * expected.abs().max().item()
    # Not the unquantized product: the quantization is really applied (static clips the outlier row).
    unquantized = x.double() @ (weight.double() * weight_scale.double().reshape(-1, 1)).T + bias.double()
    assert (ours.double() - unquantized).abs().max() > 1e-4


def test_the_reference_keeps_the_activation_dtype_and_leading_axes():
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    weight, scale = quantize_weight_per_channel(torch.randn(16, 32))
    out = fp8_linear_ref(x, weight, scale, None, None)
    assert out.shape == (2, 3, 16) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, fp8_linear_ref(x.reshape(6, 32), weight, scale, None, None).reshape(2, 3, 16))


def test_online_weight_quantization_is_per_output_channel():
    weight = torch.randn(8, 64) * torch.logspace(-3, 1, 8).reshape(-1, 1)
    quantized, scales = quantize_weight_per_channel(weight)
    assert quantized.dtype == FP8_DTYPE and scales.shape == (8,)
    torch.testing.assert_close(scales, weight.abs().amax(1) / FP8_MAX)
    dequantized = quantized.float() * scales.reshape(-1, 1)
    assert ((dequantized - weight).abs() <= weight.abs().amax(1, keepdim=True) / 16).all()  # 3 mantissa bits


def _fused_qkv(method, dtype=torch.float32):
    """q|k|v rows 8, 4, 4 over a 32-wide input, on one rank, with `method`."""
    layer = ColumnParallelLinear(32, [(0, 8), (0, 4), (0, 4)], bias=True)
    with torch.device("meta"):
        layer.set_linear_method(method, dtype)
    return layer.to_empty(device="cpu")


def test_per_tensor_scales_of_fused_parts_are_kept_one_per_part_and_static_input_scales_become_their_max():
    generator = torch.Generator().manual_seed(1)
    parts = [torch.randn(rows, 32, generator=generator) * size for rows, size in ((8, 0.1), (4, 1.0), (4, 10.0))]
    layer = _fused_qkv(Fp8Linear(TENSOR_STATIC, tensor_cores=False))
    weights, weight_scales, input_scales = [], [], [0.01, 0.03, 0.02]
    for part, (weight, input_scale) in enumerate(zip(parts, input_scales)):
        scale = weight.abs().amax().reshape(1) / FP8_MAX
        quantized = (weight / scale).to(FP8_DTYPE)
        weights.append(quantized)
        weight_scales.append(scale)
        layer.load("weight", _checkpoint(quantized), part)
        layer.load("weight_scale", _checkpoint(scale.to(torch.bfloat16)), part)  # as llm-compressor writes it
        layer.load("input_scale", _checkpoint(torch.tensor([input_scale])), part)
        layer.load("bias", _checkpoint(torch.zeros(weight.shape[0])), part)
    layer.process_after_loading()
    expected_scales = torch.cat([s.to(torch.bfloat16).float().expand(w.shape[0]) for s, w in zip(weight_scales, parts)])
    assert torch.equal(layer.weight_scale, expected_scales.reshape(1, -1))  # each part's rows, its own scale
    assert torch.equal(layer.input_scale, torch.tensor(0.03))
    x = torch.randn(3, 32, generator=generator)
    expected = fp8_linear_ref(x, torch.cat(weights), expected_scales, torch.tensor(0.03), torch.zeros(16))
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    # Each part (their scales differ by 100x) stays near its float product: q's rows took q's scale.
    dequantized = [w.float() * s.to(torch.bfloat16).float() for w, s in zip(weights, weight_scales)]
    for got, weight in zip(layer(x).split([8, 4, 4], dim=1), dequantized):
        assert ((got - x @ weight.T).norm() / (x @ weight.T).norm()).item() < 0.1


def test_a_per_channel_checkpoint_loads_scales_split_like_the_weight_rows():
    generator = torch.Generator().manual_seed(2)
    layer = _fused_qkv(Fp8Linear(CHANNEL_DYNAMIC, tensor_cores=False))
    full = []
    for part, rows in enumerate((8, 4, 4)):
        weight, scale = quantize_weight_per_channel(torch.randn(rows, 32, generator=generator))
        layer.load("weight", _checkpoint(weight), part)
        layer.load("weight_scale", _checkpoint(scale.reshape(-1, 1)), part)  # compressed-tensors: [rows, 1]
        layer.load("bias", _checkpoint(torch.full((rows,), float(part))), part)
        full.append((weight, scale))
    layer.process_after_loading()
    assert not hasattr(layer, "input_scale") or layer.input_scale is None  # dynamic: no static scale
    x = torch.randn(5, 32, generator=generator)
    expected = fp8_linear_ref(x, torch.cat([w for w, _ in full]), torch.cat([s for _, s in full]), None,
                              torch.tensor([0.0] * 8 + [1.0] * 4 + [2.0] * 4))
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


def test_online_fp8_quantizes_the_loaded_weight_at_load():
    generator = torch.Generator().manual_seed(3)
    layer = _fused_qkv(Fp8Linear(QuantizationScheme(ONLINE_FP8), tensor_cores=False), dtype=torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and not hasattr(layer, "weight_scale")  # loads the bf16 weight
    weights = [torch.randn(rows, 32, generator=generator, dtype=torch.bfloat16) for rows in (8, 4, 4)]
    for part, weight in enumerate(weights):
        layer.load("weight", _checkpoint(weight), part)
        layer.load("bias", _checkpoint(torch.zeros(weight.shape[0], dtype=torch.bfloat16)), part)
    layer.process_after_loading()
    quantized, scales = quantize_weight_per_channel(torch.cat(weights))
    assert layer.weight.dtype == FP8_DTYPE and torch.equal(layer.weight.view(torch.uint8), quantized.view(torch.uint8))
    assert torch.equal(layer.weight_scale, scales.reshape(1, -1))
    x = torch.randn(4, 32, generator=generator, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16
    torch.testing.assert_close(layer(x), fp8_linear_ref(x, quantized, scales, None, torch.zeros(16)))


def test_the_unquantized_method_keeps_the_layers_parameters_and_product():
    layer = ColumnParallelLinear(16, [(0, 8), (0, 8)], bias=True)
    row = RowParallelLinear(16, 8, bias=False, tp=SINGLE_RANK)
    assert layer.linear_method is UNQUANTIZED and row.linear_method is UNQUANTIZED
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    assert [name for name, _ in row.named_parameters()] == ["weight"]
    calls = []
    layer.linear = lambda x, w, b: calls.append((w, b)) or torch.nn.functional.linear(x, w, b)  # LayerOps.linear
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert calls == [(layer.weight, layer.bias)]


def _check_fp8_layers(tp: TensorParallel) -> None:
    """Column-parallel (fused parts, per-channel dynamic) and row-parallel (per-channel dynamic, per-tensor
    static) FP8 layers split over the ranks compute what the reference computes on each rank's share."""
    generator = torch.Generator().manual_seed(0)
    hidden, inter = 32, 48
    x = torch.randn(5, hidden, generator=generator)
    gate, gate_scale = quantize_weight_per_channel(torch.randn(inter, hidden, generator=generator))
    up, up_scale = quantize_weight_per_channel(torch.randn(inter, hidden, generator=generator))
    column = ColumnParallelLinear.split(hidden, [inter, inter], bias=False, tp=tp)
    with torch.device("meta"):
        column.set_linear_method(Fp8Linear(CHANNEL_DYNAMIC, tensor_cores=False), torch.float32)
    column = column.to_empty(device="cpu")
    for part, (weight, scale) in enumerate(((gate, gate_scale), (up, up_scale))):
        column.load("weight", _checkpoint(weight), part)
        column.load("weight_scale", _checkpoint(scale.reshape(-1, 1)), part)
    column.process_after_loading()
    whole = fp8_linear_ref(x, torch.cat([gate, up]), torch.cat([gate_scale, up_scale]), None, None)
    start, rows = tp.shard(inter)
    local = torch.cat([whole[:, start : start + rows], whole[:, inter + start : inter + start + rows]], dim=1)
    torch.testing.assert_close(column(x), local, rtol=1e-6, atol=1e-6)

    down_float = torch.randn(hidden, inter, generator=generator)
    y = torch.randn(5, inter, generator=generator)
    start, count = tp.shard(inter)
    for scheme in (CHANNEL_DYNAMIC, TENSOR_STATIC):
        row = RowParallelLinear(inter, hidden, bias=True, tp=tp)
        with torch.device("meta"):
            row.set_linear_method(Fp8Linear(scheme, tensor_cores=False), torch.float32)
        row = row.to_empty(device="cpu")
        if scheme.weight_strategy == "channel":
            down, scale = quantize_weight_per_channel(down_float)
            row.load("weight_scale", _checkpoint(scale.reshape(-1, 1)))
        else:
            scale = down_float.abs().amax().reshape(1) / FP8_MAX
            down = (down_float / scale).to(FP8_DTYPE)
            row.load("weight_scale", _checkpoint(scale))
            row.load("input_scale", _checkpoint(torch.tensor([3.0 / FP8_MAX])))
        row.load("weight", _checkpoint(down))
        row.load("bias", _checkpoint(torch.ones(hidden)))
        row.process_after_loading()
        scales = scale.expand(hidden)
        got = row(y[:, start : start + count])
        if scheme.dynamic_activations:  # each rank's tokens are quantized over its own columns
            partial = [fp8_linear_ref(y[:, s : s + c], down[:, s : s + c], scales, None, None)
                       for s, c in ((0, inter // 2), (inter // 2, inter // 2))]
            expected = partial[0] + partial[1] + 1
        else:  # one static scale: the ranks' partial products sum to the whole product
            expected = fp8_linear_ref(y, down, scales, torch.tensor(3.0 / FP8_MAX), torch.ones(hidden))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fp8_layers_split_over_two_ranks_load_their_shares_of_the_scales():
    run_ranks(_check_fp8_layers)
