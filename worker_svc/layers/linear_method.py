"""The linear method: what a parallel linear layer holds and how it multiplies, one object per scheme.

Why a seam: quantization is a property of the shared layers (ColumnParallelLinear, RowParallelLinear in
parallel_linear.py), not of the model files. A layer keeps what is about the tensor-parallel split (which
rows or columns of a checkpoint tensor are this rank's, the fused parts, the all-reduce, the bias) and asks
its method for the rest: which parameters it holds, where each checkpoint tensor keeps the layer's output and
input dimensions (`TensorLayout`: so the layer can take its rank's slice of any format), what to do once
everything is loaded, and the product itself. So every model file, and every shard, serves any method
unchanged.

The method is chosen once per model, at load, from ModelConfig.quantization and the device
(`choose_linear_method`; models/model_loader.py sets it on every parallel linear layer the checkpoint does
not `ignore`). `UnquantizedLinear` is what the layers had before the seam: the parameters `weight` and
`bias`, and `layer.linear(x, weight, bias)` (F.linear, or LayerOps.linear: the batch-invariant matmul).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from worker_svc.layers.fp8_linear import Fp8Linear, has_fp8_tensor_cores
from worker_svc.layers.checkpoint_tensor import WEIGHT, TensorLayout
from worker_svc.layers.int8_linear import Int8Linear
from worker_svc.layers.wna16_linear import Wna16Linear
from worker_svc.int8_quantization import Int8Scheme
from worker_svc.integer_quantization import IntegerScheme
from worker_svc.quantization_config import QuantizationScheme


class LinearMethod(Protocol):
    def create_weights(self, layer: nn.Module, output_size: int, input_size: int, num_parts: int,
                       dtype: torch.dtype | None) -> None:
        """Registers on `layer` the parameters this rank's shard holds (`weight` [output_size, input_size] and
        any scales), in the dtypes the method stores; `dtype` is the model's (None: torch's default). The
        layer registers `bias` itself. `num_parts`: the fused parts (q|k|v: 3), each of which may carry its
        own per-tensor values."""

    def layout(self, kind: str) -> TensorLayout:
        """Where the checkpoint tensor `kind` ("weight", "weight_scale", "qweight", ...; not "bias", which the
        layer places itself) keeps the layer's output and input dimensions (TensorLayout in layers/checkpoint_tensor.py)."""

    def process_after_loading(self, layer: nn.Module, part_rows: list[int]) -> None:
        """Turns the loaded parameters into what `apply` reads (online fp8: quantizes the weight);
        `part_rows`: the output rows of each fused part on this rank, in order."""

    def apply(self, layer: nn.Module, hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """hidden [*, input_size] -> [*, output_size] (+ bias when given)."""


class UnquantizedLinear:
    """y = layer.linear(x, W, b) in the model's dtype: the layers' behaviour before the seam, unchanged."""

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int, num_parts: int,
                       dtype: torch.dtype | None) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))

    def layout(self, kind: str) -> TensorLayout:
        return WEIGHT

    def process_after_loading(self, layer: nn.Module, part_rows: list[int]) -> None:
        return None

    def apply(self, layer: nn.Module, hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.linear(hidden, layer.weight, bias)


UNQUANTIZED = UnquantizedLinear()


def choose_linear_method(scheme: QuantizationScheme | Int8Scheme | IntegerScheme | None,
                         device: torch.device) -> LinearMethod:
    """The method every quantized layer of a model gets: unquantized; FP8 on the tensor cores where the device
    has them (else its torch reference); INT8 W8A8 (torch._int_mm on a CUDA device, else the torch reference);
    weight-only integer (the Triton GEMM on a CUDA device, else the torch reference)."""
    if scheme is None:
        return UNQUANTIZED
    if isinstance(scheme, IntegerScheme):
        return Wna16Linear(scheme, triton=device.type == "cuda")
    if isinstance(scheme, Int8Scheme):
        return Int8Linear(scheme, int_mm=device.type == "cuda")
    return Fp8Linear(scheme, tensor_cores=has_fp8_tensor_cores(device))
