"""The quantized layers' compiled kernels on a GPU, against their torch references: the W4A16/W8A16 GEMM
(kernels/triton_wna16_gemm.py) in bf16 and fp16 at Llama-3.1-8B projection widths, both variants, and a split-K
call replayed from a CUDA graph; the INT8 W8A8 path (per-token Triton quantizer and torch._int_mm); the fused MoE
experts in float8; and every layer of tiny AWQ and GPTQ models loaded on the GPU giving the CPU reference's
product.

Why here: CI runs these kernels only under Triton's interpreter, whose bf16 arithmetic is not the GPU's and which
never compiles a kernel (register and shared-memory limits, float8 conversions, libdevice rounding)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe_ref import fused_moe as fused_moe_ref
from kernels.int8_linear_ref import int8_linear_ref
from kernels.triton_fused_moe import fused_moe
from kernels.triton_int8_quant import int8_scaled_mm
from kernels.triton_wna16_gemm import wna16_gemm
from kernels.triton_wna16_gemv import wna16_gemv
from kernels.wna16_ref import pack_rows, wna16_linear_ref
from pagedserve.testing.int_checkpoints import write_awq_checkpoint, write_gptq_checkpoint
from pagedserve.testing.tiny_models import make_tiny_model
from worker_svc.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.models.model_loader import load_model

DEVICE = torch.device("cuda")


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def _weights(k_size: int, n_size: int, bits: int, group_size: int, asymmetric: bool, dtype: torch.dtype):
    generator = torch.Generator(device=DEVICE).manual_seed(k_size + n_size + bits)
    values = torch.randint(0, 2**bits, (k_size, n_size), generator=generator, device=DEVICE)
    scales = (torch.rand(k_size // group_size, n_size, generator=generator, device=DEVICE) * 0.02 + 0.002).to(dtype)
    zeros = torch.randint(0, 2**bits, scales.shape, generator=generator, device=DEVICE).to(dtype) \
        if asymmetric else None
    return pack_rows(values, bits), scales, zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group_size,asymmetric", [(4, 128, False), (4, 128, True), (8, 4096, False)])
@pytest.mark.parametrize("rows", [1, 16, 17, 64, 300])
def test_the_compiled_wna16_gemm_equals_the_reference(dtype, bits, group_size, asymmetric, rows):
    k_size, n_size = 4096, 1024  # an 8B projection's K; N narrowed to keep the test quick
    qweight, scales, zeros = _weights(k_size, n_size, bits, group_size, asymmetric, dtype)
    x = torch.randn(rows, k_size, device=DEVICE, dtype=dtype)
    bias = torch.randn(n_size, device=DEVICE, dtype=dtype)
    got = wna16_gemm(x, qweight, scales, zeros, bits, group_size, bias=bias)
    want = wna16_linear_ref(x, qweight, scales, zeros, bits, group_size, bias=bias)
    assert got.dtype == dtype and got.shape == (rows, n_size)
    assert _relative_error(got, want) < 1e-2  # the same dequantized weight; fp32 accumulation in both


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group_size,asymmetric", [(4, 128, False), (4, 32, True), (8, 4096, False)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_the_compiled_wna16_gemv_equals_the_reference(dtype, bits, group_size, asymmetric, rows):
    """kernels/triton_wna16_gemv.py: the mantissa trick and the fp32 scale product, compiled."""
    k_size, n_size = 4096, 1000  # N not a multiple of any BLOCK_N: the masked path
    qweight, scales, zeros = _weights(k_size, n_size, bits, group_size, asymmetric, dtype)
    x = torch.randn(rows, k_size, device=DEVICE, dtype=dtype)
    bias = torch.randn(n_size, device=DEVICE, dtype=dtype)
    got = wna16_gemv(x, qweight, scales, zeros, bits, group_size, bias=bias)
    want = wna16_linear_ref(x, qweight, scales, zeros, bits, group_size, bias=bias)
    assert got.dtype == dtype and got.shape == (rows, n_size)
    assert _relative_error(got, want) < 1e-2


def test_a_split_k_call_replayed_from_a_cuda_graph_equals_the_eager_call_bitwise():
    qweight, scales, zeros = _weights(4096, 1024, 4, 128, True, torch.bfloat16)
    static_x = torch.randn(4, 4096, device=DEVICE, dtype=torch.bfloat16)
    wna16_gemm(static_x, qweight, scales, zeros, 4, 128)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = wna16_gemm(static_x, qweight, scales, zeros, 4, 128)
    for seed in range(3):
        x = torch.randn(4, 4096, device=DEVICE, dtype=torch.bfloat16, generator=torch.Generator(DEVICE).manual_seed(seed))
        static_x.copy_(x)
        graph.replay()
        assert torch.equal(static_y, wna16_gemm(x, qweight, scales, zeros, 4, 128))


@pytest.mark.parametrize("rows", [1, 16, 17, 300])
@pytest.mark.parametrize("static", [False, True])
def test_the_int8_path_on_the_tensor_cores_equals_the_reference(rows, static):
    generator = torch.Generator(device=DEVICE).manual_seed(rows)
    weight = torch.randint(-127, 128, (1024, 4096), generator=generator, device=DEVICE, dtype=torch.int8)
    weight_scale = torch.rand(1024, generator=generator, device=DEVICE) * 1e-3 + 1e-4
    input_scale = torch.tensor(0.05, device=DEVICE) if static else None
    x = torch.randn(rows, 4096, generator=generator, device=DEVICE).to(torch.bfloat16)
    got = int8_scaled_mm(x, weight, weight_scale.reshape(1, -1), input_scale, None)
    want = int8_linear_ref(x, weight, weight_scale, input_scale, None)
    assert _relative_error(got, want) < 1e-2


def test_float8_experts_in_the_compiled_fused_moe_equal_the_reference():
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    tokens, hidden, intermediate, experts = 40, 512, 256, 8
    x = torch.randn(tokens, hidden, generator=generator, device=DEVICE).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=generator, device=DEVICE)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator, device=DEVICE).to(torch.float8_e4m3fn)
    w2 = torch.randn(experts, hidden, intermediate, generator=generator, device=DEVICE).to(torch.float8_e4m3fn)
    w13_scale = torch.rand(experts, 2 * intermediate, generator=generator, device=DEVICE) * 0.01 + 0.01
    w2_scale = torch.rand(experts, hidden, generator=generator, device=DEVICE) * 0.01 + 0.01
    got = fused_moe(x, logits, w13, w2, 2, True, False, w13_scale, w2_scale)
    want = fused_moe_ref(x, logits, w13, w2, 2, True, False, w13_scale, w2_scale)
    assert _relative_error(got, want) < 2e-2


@pytest.mark.parametrize("writer, kwargs", [(write_awq_checkpoint, dict(group_size=32)),
                                            (write_gptq_checkpoint, dict(bits=8, group_size=32, sym=False,
                                                                         desc_act=True))])
def test_every_integer_layer_loaded_on_the_gpu_gives_the_cpu_references_product(tmp_path, writer, kwargs):
    model_dir = writer(make_tiny_model(tmp_path, "qwen2", seed=3), tmp_path / "quantized", **kwargs)
    on_cpu, _ = load_model(model_dir, torch.float32, "cpu")
    on_gpu, config = load_model(model_dir, torch.float32, DEVICE)
    assert config.quantization is not None
    gpu_layers = dict(on_gpu.named_modules())
    compared = 0
    for name, layer in on_cpu.named_modules():
        if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            continue
        x = torch.randn(9, layer.qweight.shape[0] * 32 // kwargs.get("bits", 4),
                        generator=torch.Generator().manual_seed(compared))
        with torch.inference_mode():
            want, got = layer(x), gpu_layers[name](x.to(DEVICE)).cpu()
        assert _relative_error(got, want) < 1e-4, name  # float32 on both: only the summation order differs
        compared += 1
    assert compared == 3 * 4  # qkv, o, gate_up, down of each layer
