"""What the FP8 and INT8 W8A8 linear methods hold alike: an 8-bit weight with float32 scales, per output channel
or one per fused part, and for static activations one input scale per fused part.

Why shared: compressed-tensors stores both schemes the same way (float8 or int8 `weight`, `weight_scale` [rows, 1]
for strategy "channel" or [1] per projection for "tensor", `input_scale` [1] when static), and both kernels read
the same form after loading: `weight_scale` float32 [1, N], one scale per output row, and `input_scale` a float32
scalar or None. Per-tensor scales of fused parts are kept exactly by giving each part's rows its part's scale;
static input scales of fused parts become their largest (the fused matmul quantizes its input once, and the
largest clips none of the parts' calibrated ranges), as in vLLM.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc.layers.checkpoint_tensor import PER_OUTPUT_ROW, PER_PART, WEIGHT, TensorLayout


def create_scaled_weights(layer: nn.Module, output_size: int, input_size: int, num_parts: int,
                          weight_dtype: torch.dtype, weight_strategy: str, static_activations: bool) -> None:
    """Registers the checkpoint's `weight`, `weight_scale` and (static activations) `input_scale` on `layer`."""
    layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=weight_dtype), requires_grad=False)
    scale_shape = (output_size, 1) if weight_strategy == "channel" else (num_parts,)
    layer.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
    if static_activations:
        layer.input_scale = nn.Parameter(torch.empty(num_parts, dtype=torch.float32), requires_grad=False)


def scaled_layout(kind: str, weight_strategy: str) -> TensorLayout:
    """The weight splits by rows, a per-channel scale too; a per-tensor scale and an input scale are per part."""
    if kind == "weight":
        return WEIGHT
    return PER_OUTPUT_ROW if kind == "weight_scale" and weight_strategy == "channel" else PER_PART


def per_row_scales(layer: nn.Module, part_rows: list[int], weight_strategy: str) -> torch.Tensor:
    """The loaded weight scales as one per output row (`part_rows`: each fused part's rows on this rank)."""
    if weight_strategy == "channel":
        return layer.weight_scale.reshape(-1)
    counts = torch.tensor(part_rows, device=layer.weight_scale.device)
    return layer.weight_scale.repeat_interleave(counts)


def finish_scales(layer: nn.Module, scales: torch.Tensor, static_activations: bool) -> None:
    """Sets the form the kernels read: `weight_scale` float32 [1, N]; `input_scale` the parts' largest, or None."""
    layer.weight_scale = nn.Parameter(scales.float().reshape(1, -1).contiguous(), requires_grad=False)
    if static_activations:
        layer.input_scale = nn.Parameter(layer.input_scale.max().float(), requires_grad=False)
    else:
        layer.input_scale = None
