"""Which quantization a checkpoint is served with, decided once from its config.json and `--quantization`.

Why here, without torch: ModelConfig parses this (model_config.py), and the launcher reads ModelConfig before
any child starts, so every refusal (a method we do not serve, a flag that contradicts the checkpoint, an integer
method the MoE experts have no kernel for) is one line before the scheduler starts, and the worker's load refuses alike (exit 78).

Served:
- compressed-tensors FP8 W8A8 (llm-compressor's FP8 / FP8_DYNAMIC schemes): config.json's
  `quantization_config` has `quant_method: "compressed-tensors"`, `format: "float-quantized"` (or
  "naive-quantized"), one config group targeting "Linear" with 8-bit float weights (strategy "channel" or
  "tensor", symmetric, static) and 8-bit float input activations (dynamic per "token", or static per
  "tensor"); `ignore` names layers left unquantized ("lm_head", which is never quantized here).
- online fp8 (`--quantization fp8` on an unquantized checkpoint): vLLM's "fp8" method, weights quantized
  per output channel at load, activations per token.
- compressed-tensors INT8 W8A8 (format "int-quantized", llm-compressor's W8A8): parsed in
  worker_svc/int8_quantization.py into an `Int8Scheme`.
- both FP8 sources on MoE models (Mixtral, Qwen3-MoE) too: their fused experts hold float8 weights, weight-only
  (worker_svc/layers/fused_moe.py); per-token activations only (the experts would ignore static input scales).
- weight-only integer checkpoints (W4A16, W8A16): AWQ (quant_method "awq"), GPTQ ("gptq") and compressed-tensors
  format "pack-quantized", parsed in worker_svc/integer_quantization.py into an `IntegerScheme`; on MoE models
  the experts too (worker_svc/layers/wna16_experts.py; INT8 W8A8 stays refused there).
The layers read the result as a `QuantizationScheme`, an `Int8Scheme` or an `IntegerScheme`
(worker_svc/layers/linear_method.py chooses the method).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker_svc.int8_quantization import INT_QUANTIZED, Int8Scheme, parse_compressed_tensors_int8
from worker_svc.integer_quantization import (
    AWQ, GPTQ, PACK_QUANTIZED, IntegerScheme, ignore_list_matches, parse_awq, parse_compressed_tensors_int,
    parse_gptq,
)

COMPRESSED_TENSORS, ONLINE_FP8, GGUF = "compressed-tensors", "fp8", "gguf"
# vLLM's names for AWQ and GPTQ checkpoints served by its Marlin kernels: the same checkpoints, our kernel.
FLAG_ALIASES = {"awq_marlin": AWQ, "gptq_marlin": GPTQ}
QUANTIZATION_FLAG_VALUES = (GGUF, ONLINE_FP8, COMPRESSED_TENSORS, AWQ, GPTQ, *FLAG_ALIASES)
FP8_FORMATS = ("float-quantized", "naive-quantized")
# Model files whose experts are fused (worker_svc/layers/fused_moe.py): FP8 and integer weight-only are their
# quantized methods (INT8 W8A8 is refused there).
FUSED_EXPERT_MODULES = ("mixtral", "qwen3_moe")
SERVED = ("gguf (as a .gguf file); compressed-tensors FP8 W8A8 (format float-quantized, per-channel or "
          "per-tensor weights, per-token or static activations), INT8 W8A8 (format int-quantized, likewise) and "
          "W4A16/W8A16 (format pack-quantized); awq "
          "(4-bit, version gemm); gptq (4- or 8-bit); fp8 (--quantization fp8: online, from an unquantized "
          "checkpoint)")


@dataclass(frozen=True)
class QuantizationScheme:
    """FP8 W8A8 as the linear layers apply it. `method`: "compressed-tensors" (float8 tensors and scales in the
    checkpoint) or "fp8" (quantized at load); `weight_strategy`: "channel" (a scale per output row) or "tensor";
    `dynamic_activations`: per-token scales at run time (else the checkpoint's static `input_scale`);
    `ignore`: compressed-tensors' ignore list (layer names, or "re:" regular expressions) of layers left
    unquantized."""

    method: str
    weight_strategy: str = "channel"
    dynamic_activations: bool = True
    ignore: tuple[str, ...] = ()

    def ignores(self, layer_name: str) -> bool:
        """Whether the checkpoint layer `layer_name` (e.g. "model.layers.0.self_attn.q_proj") is unquantized."""
        return ignore_list_matches(self.ignore, layer_name)

    def describe(self) -> str:
        return f"FP8 ({self.method})"


def parse_quantization(raw: Mapping[str, Any], flag: str | None,
                       module: str) -> QuantizationScheme | Int8Scheme | IntegerScheme | None:
    """The scheme of an HF checkpoint's config.json `raw` given `--quantization` `flag` (None: not given), for the
    model file `module`; None: unquantized. Raises ValueError naming why it is refused."""
    given, flag = flag, FLAG_ALIASES.get(flag, flag)  # the message names what the user typed
    declared = raw.get("quantization_config")
    if declared is not None:
        method = declared.get("quant_method") if isinstance(declared, Mapping) else None
        if flag == ONLINE_FP8:
            raise ValueError(f"--quantization fp8 quantizes an unquantized checkpoint at load, but this one is "
                             f"already quantized (quantization_config quant_method {method!r})")
        if flag is not None and flag != method:
            raise ValueError(f"--quantization {given} was given, but the checkpoint's quantization_config says "
                             f"quant_method {method!r}")
        parse = {COMPRESSED_TENSORS: _compressed_tensors, AWQ: parse_awq, GPTQ: parse_gptq}.get(method)
        if parse is None:
            raise ValueError(f"its config.json declares quantization_config quant_method {method!r}, which this "
                             f"engine does not serve (supported: {SERVED})")
        scheme = parse(declared)
    elif flag == ONLINE_FP8:
        scheme = QuantizationScheme(ONLINE_FP8)
    elif flag in (COMPRESSED_TENSORS, AWQ, GPTQ):
        raise ValueError(f"--quantization {given} was given, but the checkpoint's config.json declares no "
                         f"quantization_config")
    elif flag == GGUF:
        raise ValueError("--quantization gguf needs a .gguf model file")
    else:
        return None
    if isinstance(scheme, IntegerScheme):
        return scheme  # MoE experts too (worker_svc/layers/wna16_experts.py; act-order there is refused at load)
    if module in FUSED_EXPERT_MODULES and isinstance(scheme, Int8Scheme):
        raise ValueError(f"{scheme.describe()} is not served for {module} models: their fused MoE experts have no "
                         f"INT8 kernel yet (worker_svc/layers/fused_moe.py); serve the unquantized checkpoint, an "
                         f"FP8 one or a weight-only integer one (W4A16 / W8A16)")
    if module in FUSED_EXPERT_MODULES and not scheme.dynamic_activations:
        raise ValueError(f"FP8 with static input scales is not served for {module} models: their fused MoE experts "
                         f"are weight-only FP8 and would ignore the scales; serve an FP8_DYNAMIC checkpoint "
                         f"(per-token activations)")
    return scheme


def _compressed_tensors(config: Mapping[str, Any]) -> QuantizationScheme | Int8Scheme | IntegerScheme:
    """The scheme of a compressed-tensors quantization_config (FP8 W8A8, INT8 W8A8, or integer weight-only), or
    ValueError naming what differs."""
    fmt = config.get("format")
    if fmt not in (*FP8_FORMATS, INT_QUANTIZED, PACK_QUANTIZED):
        raise ValueError(f"compressed-tensors format {fmt!r} is not served (supported: FP8 W8A8, format "
                         f"{' or '.join(FP8_FORMATS)}; INT8 W8A8, format {INT_QUANTIZED}; W4A16/W8A16, format "
                         f"{PACK_QUANTIZED})")
    if config.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme (a quantized KV cache) is not served")
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise ValueError(f"compressed-tensors sparsity_config format {sparsity.get('format')!r} is not served")
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1 or not isinstance(groups[0], Mapping) or groups[0].get("targets") != ["Linear"]:
        raise ValueError("compressed-tensors: only one config group targeting [\"Linear\"] is served")
    group = groups[0]
    if group.get("output_activations"):
        raise ValueError("compressed-tensors output_activations quantization is not served")
    if fmt == PACK_QUANTIZED:
        return parse_compressed_tensors_int(config, group)
    if fmt == INT_QUANTIZED:
        return parse_compressed_tensors_int8(config, group)
    weights, activations = group.get("weights") or {}, group.get("input_activations") or {}
    if not _is_fp8(weights) or weights.get("dynamic") or weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"compressed-tensors weights {dict(weights)} are not served (supported: 8-bit float, "
                         f"symmetric, static, strategy channel or tensor)")
    dynamic = activations.get("dynamic") is True and activations.get("strategy") == "token"
    static = activations.get("dynamic") is False and activations.get("strategy") == "tensor"
    if not _is_fp8(activations) or not (dynamic or static):
        raise ValueError(f"compressed-tensors input_activations {dict(activations)} are not served (supported: "
                         f"8-bit float, symmetric, dynamic per token or static per tensor; weight-only FP8 is not "
                         f"served yet)")
    return QuantizationScheme(COMPRESSED_TENSORS, weights["strategy"], dynamic, tuple(config.get("ignore") or ()))


def _is_fp8(args: Mapping[str, Any]) -> bool:
    return args.get("num_bits") == 8 and args.get("type") == "float" and args.get("symmetric", True) is True
