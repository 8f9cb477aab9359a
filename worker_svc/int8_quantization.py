"""INT8 W8A8 checkpoints (compressed-tensors format "int-quantized", llm-compressor's W8A8 scheme): which configs
are served.

Why its own scheme: the layers' INT8 method (worker_svc/layers/int8_linear.py) holds int8 weights and
quantizes activations to int8, a different kernel from FP8's; choose_linear_method dispatches on the scheme's
type. Plain Python (no torch): ModelConfig parses this before any child starts (worker_svc/quantization_config.py
dispatches on the format).

What compressed-tensors 0.20.0 writes for the W8A8 preset (`preset_name_to_scheme("W8A8", ["Linear"])`): weights
{num_bits 8, type "int", symmetric, strategy "channel", dynamic false}, input_activations {num_bits 8, type
"int", symmetric, strategy "token", dynamic true}. Also served: per-tensor weights, and static per-tensor
symmetric activations (the checkpoint's `input_scale`). Refused by name: asymmetric weights or activations
(zero points; vLLM's azp path), group or block strategies, dynamic per-tensor activations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker_svc.integer_quantization import ignore_list_matches

INT_QUANTIZED = "int-quantized"


@dataclass(frozen=True)
class Int8Scheme:
    """INT8 W8A8 as the linear layers apply it: int8 weights with float scales (`weight_strategy` "channel": one
    per output row; "tensor": one per checkpoint projection), activations quantized to int8 per token at run
    time (`dynamic_activations`) or with the checkpoint's static per-tensor `input_scale`; `ignore`:
    compressed-tensors' ignore list of layers left unquantized."""

    weight_strategy: str = "channel"
    dynamic_activations: bool = True
    ignore: tuple[str, ...] = ()
    method: str = "compressed-tensors"  # vLLM's --quantization name, as ModelInfo reports it

    def ignores(self, layer_name: str) -> bool:
        return ignore_list_matches(self.ignore, layer_name)

    def describe(self) -> str:
        activations = "per-token" if self.dynamic_activations else "static"
        return f"INT8 W8A8 ({self.method}, per-{self.weight_strategy} weights, {activations} activations)"


def parse_compressed_tensors_int8(config: Mapping[str, Any], group: Mapping[str, Any]) -> Int8Scheme:
    """The scheme of an int-quantized config whose one config group is `group`, or ValueError naming what
    differs from what is served."""
    weights, activations = group.get("weights") or {}, group.get("input_activations") or {}
    if not _is_int8(weights) or weights.get("dynamic") or weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"compressed-tensors int-quantized weights {dict(weights)} are not served (supported: "
                         f"8-bit int, symmetric, static, strategy channel or tensor)")
    if not activations:
        raise ValueError("compressed-tensors int-quantized without input_activations (weight-only int8) is not "
                         "served in this format (supported: W8A16 as format pack-quantized)")
    if activations.get("type") == "int" and activations.get("symmetric") is False:
        raise ValueError("compressed-tensors int-quantized with asymmetric input_activations (zero points) is "
                         "not served (supported: symmetric)")
    dynamic = activations.get("dynamic") is True and activations.get("strategy") == "token"
    static = activations.get("dynamic") is False and activations.get("strategy") == "tensor"
    if not _is_int8(activations) or not (dynamic or static):
        raise ValueError(f"compressed-tensors int-quantized input_activations {dict(activations)} are not served "
                         f"(supported: 8-bit int, symmetric, dynamic per token or static per tensor)")
    return Int8Scheme(weights["strategy"], dynamic, tuple(config.get("ignore") or ()))


def _is_int8(args: Mapping[str, Any]) -> bool:
    return args.get("num_bits") == 8 and args.get("type") == "int" and args.get("symmetric", True) is True
