"""INT8 W8A8 linear method (compressed-tensors "int-quantized", llm-compressor's W8A8): int8 weights with float32
per-output-channel scales, activations quantized to int8 per token (or with the checkpoint's static per-tensor
scale). Math: kernels/int8_linear_ref.py.

Who owns what: the layer first holds the checkpoint's tensors under its names (so the model files' name mapping
loads them unchanged): `weight` int8 [rows, in]; `weight_scale` [rows, 1] for strategy "channel" (split like the
weight's rows) or one value per fused part, [parts], for "tensor"; for static activations `input_scale`, one per
fused part. Scales arrive in the checkpoint's dtype (the model's) and are stored float32. compressed-tensors
drops the zero points of symmetric schemes, the only ones served (worker_svc/int8_quantization.py).

After loading (`process_after_loading`) every layer holds `weight` int8 [N, K] and `weight_scale` float32
[1, N], one scale per output row: per-tensor scales of fused parts (q|k|v each with its own) are kept exactly by
giving each part's rows its part's scale, as Fp8Linear does. Static input scales of fused parts become their
largest (the fused matmul quantizes its input once; the largest clips none of the parts' calibrated ranges). A
row-parallel layer's scales are whole (its rows are the full output); under per-token activations each rank
quantizes its own share of the input row, as vLLM does.

Where it runs, chosen once at load: on a CUDA device the Triton per-token quantizer and torch._int_mm
(kernels/triton_int8_quant.py, imported only there); elsewhere (the CPU: CI) the torch reference, which
dequantizes and multiplies in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.int8_linear_ref import INT8_MAX, INT8_MIN, int8_linear_ref
from worker_svc.int8_quantization import Int8Scheme
from worker_svc.layers.checkpoint_tensor import TensorLayout
from worker_svc.layers.scaled_weights import create_scaled_weights, finish_scales, per_row_scales, scaled_layout

Int8Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                      torch.Tensor]
# `--load-format dummy`: int8 weights of standard deviation DUMMY_WEIGHT_STD times DUMMY_WEIGHT_SCALE dequantize
# to about N(0, 0.02), as the other methods' random weights; a static input scale covering +-6.35.
DUMMY_WEIGHT_STD = 32.0
DUMMY_WEIGHT_SCALE = 0.02 / DUMMY_WEIGHT_STD
DUMMY_INPUT_SCALE = 0.05


def _reference(x, weight, weight_scale_row, input_scale, bias):
    return int8_linear_ref(x, weight, weight_scale_row.reshape(-1), input_scale, bias)


class Int8Linear:
    """The INT8 W8A8 method of one model (module docstring); `int_mm`: run the Triton quantizer and
    torch._int_mm (a CUDA device), else the reference."""

    def __init__(self, scheme: Int8Scheme, int_mm: bool):
        self.scheme = scheme
        if int_mm:
            from kernels.triton_int8_quant import int8_scaled_mm

            self.kernel: Int8Kernel = int8_scaled_mm
        else:
            self.kernel = _reference

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int, num_parts: int,
                       dtype: torch.dtype | None) -> None:
        create_scaled_weights(layer, output_size, input_size, num_parts, torch.int8, self.scheme.weight_strategy,
                              not self.scheme.dynamic_activations)

    def layout(self, kind: str) -> TensorLayout:
        return scaled_layout(kind, self.scheme.weight_strategy)

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module, part_rows: list[int]) -> None:
        finish_scales(layer, per_row_scales(layer, part_rows, self.scheme.weight_strategy),
                      not self.scheme.dynamic_activations)

    def apply(self, layer: nn.Module, hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(hidden, layer.weight, layer.weight_scale, layer.input_scale, bias)

    @torch.no_grad()
    def fill_random(self, kind: str, parameter: torch.Tensor, generator: torch.Generator) -> None:
        """Random checkpoint tensors for `--load-format dummy` (the DUMMY_* constants)."""
        if kind == "weight":
            values = torch.empty(parameter.shape, device=parameter.device).normal_(generator=generator)
            parameter.copy_((values * DUMMY_WEIGHT_STD).round().clamp(INT8_MIN, INT8_MAX).to(torch.int8))
        else:
            parameter.fill_(DUMMY_WEIGHT_SCALE if kind == "weight_scale" else DUMMY_INPUT_SCALE)
