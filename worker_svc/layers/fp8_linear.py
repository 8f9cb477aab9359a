"""FP8 W8A8 linear method: float8_e4m3fn weights with float32 per-output-channel scales, activations
quantized per token (or with the checkpoint's static per-tensor scale). Math: kernels/fp8_linear_ref.py.

Two sources, one method:
- compressed-tensors checkpoints: the layer holds the checkpoint's `weight` (float8 [rows, in]),
  `weight_scale` ([rows, 1] for strategy "channel", split like the weight's rows; or one value per fused part,
  [parts], for "tensor") and, for static activations, `input_scale` (one per fused part). Scales arrive in the
  checkpoint's dtype and are stored float32.
- online fp8 (`--quantization fp8`): the layer loads the unquantized `weight` in the model's dtype and
  `process_after_loading` quantizes it per output channel (vLLM's "fp8" method).

After loading every layer holds the same form: `weight` float8 [N, K] and `weight_scale` float32 [1, N], one
scale per output row. Per-tensor scales of fused parts (q|k|v each with its own) are kept exactly, one per
part, by giving each part's rows its part's scale: nothing is requantized (vLLM instead requantizes the
parts to their largest scale, which rounds the weights once more). Static input scales of fused parts become
their largest, as in vLLM: the fused matmul quantizes its input once, and the largest scale clips none of
the parts' calibrated ranges. A row-parallel layer's scales are whole (its rows are the full output).

Where it runs, chosen once at load from the device: on a CUDA device with FP8 tensor cores (compute
capability 8.9+: Ada, Hopper) the Triton per-token quantization, then per call by the number of rows (a
function of the shape: a CUDA graph captures one branch) the split-K Triton GEMM up to FEW_ROWS rows
(kernels/triton_fp8_gemm.py: decode, where torch._scaled_mm was slower than bf16 on an H200) and
torch._scaled_mm beyond (kernels/triton_fp8_quant.py); elsewhere (the CPU: CI) the torch reference, which
dequantizes and multiplies in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.fp8_linear_ref import FP8_DTYPE, fp8_linear_ref, quantize_weight_per_channel
from worker_svc.layers.checkpoint_tensor import TensorLayout
from worker_svc.layers.scaled_weights import create_scaled_weights, finish_scales, per_row_scales, scaled_layout
from worker_svc.quantization_config import ONLINE_FP8, QuantizationScheme

Fp8Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                     torch.Tensor]


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _reference(x, weight, weight_scale_row, input_scale, bias):
    return fp8_linear_ref(x, weight, weight_scale_row.reshape(-1), input_scale, bias)


def tensor_core_kernel() -> Fp8Kernel:
    """The kernel on FP8 tensor cores: the few-row Triton GEMM up to FEW_ROWS rows, torch._scaled_mm beyond."""
    from kernels.triton_fp8_gemm import FEW_ROWS, fp8_fewrow_mm
    from kernels.triton_fp8_quant import fp8_scaled_mm

    def by_rows(x, weight, weight_scale_row, input_scale, bias):
        kernel = fp8_fewrow_mm if x.numel() <= FEW_ROWS * x.shape[-1] else fp8_scaled_mm
        return kernel(x, weight, weight_scale_row, input_scale, bias)

    return by_rows


class Fp8Linear:
    """The FP8 W8A8 method of one model (module docstring); `tensor_cores`: run the Triton GEMM (few rows) or
    torch._scaled_mm, else the reference."""

    def __init__(self, scheme: QuantizationScheme, tensor_cores: bool):
        self.scheme = scheme
        self.online = scheme.method == ONLINE_FP8
        self.kernel: Fp8Kernel = tensor_core_kernel() if tensor_cores else _reference

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int, num_parts: int,
                       dtype: torch.dtype | None) -> None:
        if self.online:
            layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
            return
        create_scaled_weights(layer, output_size, input_size, num_parts, FP8_DTYPE, self.scheme.weight_strategy,
                              not self.scheme.dynamic_activations)

    def layout(self, kind: str) -> TensorLayout:
        return scaled_layout(kind, self.scheme.weight_strategy)

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module, part_rows: list[int]) -> None:
        if self.online:
            weight, scales = quantize_weight_per_channel(layer.weight)
            layer.weight = nn.Parameter(weight, requires_grad=False)
        else:
            scales = per_row_scales(layer, part_rows, self.scheme.weight_strategy)
        finish_scales(layer, scales, not self.online and not self.scheme.dynamic_activations)

    def apply(self, layer: nn.Module, hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(hidden, layer.weight, layer.weight_scale, layer.input_scale, bias)
