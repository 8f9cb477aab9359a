"""Weight-only integer checkpoints (W4A16, W8A16): which AWQ, GPTQ and compressed-tensors configs are served.

Why one scheme for three formats: they store the same math (unsigned `bits`-bit integers, a float scale and an
integer zero point per group of input columns and output row; y = x W^T in the activation dtype) in three
layouts. The layers (worker_svc/layers/wna16_linear.py) load each checkpoint's own tensors and convert them to
one layout (kernels/wna16_ref.py); what differs between the formats and matters to them is here, parsed from
config.json's `quantization_config` as vLLM reads it. Plain Python (no torch): ModelConfig parses this before
any child starts (worker_svc/quantization_config.py dispatches on quant_method).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

AWQ, GPTQ, GPTQ_V2, PACK_QUANTIZED = "awq", "gptq", "gptq_v2", "pack-quantized"


def ignore_list_matches(entries: tuple[str, ...], layer_name: str) -> bool:
    """Whether a compressed-tensors `ignore` list (layer names, name suffixes, or "re:" regular expressions)
    names the checkpoint layer `layer_name` (e.g. "model.layers.0.self_attn.q_proj")."""
    for entry in entries:
        if entry.startswith("re:"):
            if re.match(entry[3:], layer_name):
                return True
        elif entry == layer_name or layer_name.endswith(f".{entry}"):
            return True
    return False


@dataclass(frozen=True)
class IntegerScheme:
    """Weight-only integer quantization as the linear layers apply it.

    `method`: the quant_method ("awq", "gptq", "compressed-tensors"); `checkpoint_format`: the tensors' layout
    ("awq": qweight packed along the output dim in AWQ's interleaved order; "gptq": packed along the input dim,
    qzeros stored as zero - 1; "gptq_v2": the same with qzeros as they are; "pack-quantized": compressed-tensors'
    weight_packed [out, in // pack]). `group_size`: input columns per scale (None: one scale per output channel);
    `symmetric`: no zero points (the zero is 2**(bits - 1)); `act_order`: the checkpoint's groups are listed per
    input column (g_idx), not contiguous; `ignore` (compressed-tensors names or "re:" expressions) and
    `modules_to_not_convert` (AWQ's, matched as substrings, as vLLM does): layers left unquantized."""

    method: str
    checkpoint_format: str
    bits: int
    group_size: int | None
    symmetric: bool
    act_order: bool = False
    ignore: tuple[str, ...] = ()
    modules_to_not_convert: tuple[str, ...] = ()

    def ignores(self, layer_name: str) -> bool:
        return (ignore_list_matches(self.ignore, layer_name)
                or any(module in layer_name for module in self.modules_to_not_convert))

    def describe(self) -> str:
        group = "per channel" if self.group_size is None else f"group {self.group_size}"
        kind = "symmetric" if self.symmetric else "asymmetric"
        order = ", act-order" if self.act_order else ""
        return f"{self.method} W{self.bits}A16 ({group}, {kind}{order})"


def parse_awq(config: Mapping[str, Any]) -> IntegerScheme:
    """AutoAWQ's GEMM checkpoints: 4-bit, a zero point per group unless `zero_point` is false."""
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not served (supported: 'gemm', AutoAWQ's default)")
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"AWQ with {bits}-bit weights is not served (supported: 4)")
    group_size = _group_size(config.get("group_size", config.get("q_group_size")), "AWQ")
    zero_point = bool(config.get("zero_point", True))
    return IntegerScheme(AWQ, AWQ, 4, group_size, symmetric=not zero_point,
                         modules_to_not_convert=tuple(config.get("modules_to_not_convert") or ()))


def parse_gptq(config: Mapping[str, Any]) -> IntegerScheme:
    """AutoGPTQ's and GPTQModel's checkpoints: 4 or 8 bits, per group or per channel (group_size -1), with or
    without act-order (desc_act), in the v1 (qzeros = zero - 1) or v2 layout."""
    bits = config.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits}-bit weights is not served (supported: 4, 8)")
    fmt = config.get("checkpoint_format") or GPTQ
    if fmt not in (GPTQ, GPTQ_V2):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not served (supported: 'gptq', 'gptq_v2')")
    if config.get("lm_head"):
        raise ValueError("GPTQ with a quantized lm_head is not served (the LM head is never quantized here)")
    if config.get("dynamic"):
        raise ValueError("GPTQ 'dynamic' (per-module bits or group sizes) is not served")
    group_size = _group_size(config.get("group_size"), "GPTQ")
    return IntegerScheme(GPTQ, fmt, bits, group_size, symmetric=bool(config.get("sym", True)),
                         act_order=bool(config.get("desc_act")) and group_size is not None)


def parse_compressed_tensors_int(config: Mapping[str, Any], group: Mapping[str, Any]) -> IntegerScheme:
    """llm-compressor's W4A16 / W8A16 (format pack-quantized): `group` is the config's one config group."""
    weights = group.get("weights") or {}
    if group.get("input_activations"):
        raise ValueError("compressed-tensors pack-quantized with input_activations is not served (supported: "
                         "weight-only W4A16, W8A16)")
    strategy = weights.get("strategy")
    served = (weights.get("type") == "int" and weights.get("num_bits") in (4, 8) and not weights.get("dynamic")
              and strategy in ("group", "channel"))
    if not served:
        raise ValueError(f"compressed-tensors weights {dict(weights)} are not served (supported: 4- or 8-bit int, "
                         f"static, strategy group or channel)")
    actorder = weights.get("actorder")
    if actorder not in (None, "group", "weight", "static"):
        raise ValueError(f"compressed-tensors actorder {actorder!r} is not served")
    group_size = _group_size(weights.get("group_size"), "compressed-tensors") if strategy == "group" else None
    return IntegerScheme("compressed-tensors", PACK_QUANTIZED, weights["num_bits"], group_size,
                         symmetric=weights.get("symmetric", True) is True,
                         act_order=actorder == "group" and group_size is not None,
                         ignore=tuple(config.get("ignore") or ()))


def _group_size(value: Any, method: str) -> int | None:
    """A group size as checkpoints write it: a positive integer, or -1 (None: one group per output channel)."""
    if value == -1:
        return None
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{method} group_size {value!r} is not served (a positive integer, or -1 per channel)")
    return value
