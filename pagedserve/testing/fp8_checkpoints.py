"""Compressed-tensors FP8 W8A8 checkpoints of the tiny test models, written in the layout llm-compressor saves.

Why our own writer: llm-compressor (`oneshot(model, recipe=QuantizationModifier(targets="Linear",
scheme="FP8_DYNAMIC", ignore=["lm_head"]))`) is not a dependency of this project. This writes what it
writes for the FP8 (static per-tensor) and FP8_DYNAMIC (per-channel weights, per-token activations) schemes:
each Linear's `weight` (a MoE model's experts' projections too, one by one, as llm-compressor's Linear
targets reach them) as float8_e4m3fn (round-to-nearest of W / scale, saturated at 448), `weight_scale`
([out, 1] per channel; [1] per tensor) and for static activations `input_scale` ([1]) in the model's dtype,
no zero points (symmetric schemes drop them), and config.json's `quantization_config` with
quant_method "compressed-tensors", format "float-quantized", one config group targeting "Linear",
and `ignore: ["lm_head"]`. Checked once by hand against compressed-tensors 0.20.0 itself
(`apply_quantization_config` of the FP8_DYNAMIC and FP8 presets on a bf16 tiny Llama, weight scales set to
amax / 448 as the minmax observer does, `ModelCompressor.compress_model`, `save_pretrained`): the same tensor
names, dtypes, shapes and bytes, and config groups that parse to the same scheme.

`dequantized_state_dict` gives the same checkpoint's weights dequantized (W_q * scale), the weights the
reference (transformers, or our own float32 math) runs with.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kernels.fp8_linear_ref import FP8_DTYPE, FP8_MAX
from worker_svc.quantization_config import COMPRESSED_TENSORS, QuantizationScheme

# The Linear layers of the decoder layers (Llama family, OPT); embeddings, norms and lm_head stay as they are.
LINEAR_WEIGHT = re.compile(r".*\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$|.*\.layers\.\d+\.fc[12]\.weight$")
# The experts of a MoE block, per expert as the hub's files name them (Mixtral's block_sparse_moe.experts.N.w1,
# Qwen3-MoE's mlp.experts.N.gate_proj); the router (`gate`) stays unquantized. Apart from LINEAR_WEIGHT: the
# integer writer (int_checkpoints.py) uses both too.
EXPERT_WEIGHT = re.compile(r".*\.layers\.\d+\.(mlp|block_sparse_moe)\.experts\.\d+\.\w+\.weight$")
# Static activation scales, a different one per projection so fused parts differ (the layer takes their max).
STATIC_INPUT_SCALES = {"q_proj": 3.0, "k_proj": 4.0, "v_proj": 5.0, "o_proj": 2.0, "gate_proj": 4.0,
                       "up_proj": 6.0, "down_proj": 1.0}


def _scheme(weight_strategy: str, dynamic: bool) -> dict:
    fp8 = dict(num_bits=8, type="float", symmetric=True, group_size=None, block_structure=None, actorder=None,
               observer_kwargs={})
    activations = ({**fp8, "dynamic": True, "strategy": "token", "observer": None} if dynamic
                   else {**fp8, "dynamic": False, "strategy": "tensor", "observer": "static_minmax"})
    return dict(targets=["Linear"], weights={**fp8, "dynamic": False, "strategy": weight_strategy,
                                             "observer": "minmax"},
                input_activations=activations, output_activations=None, format="float-quantized")


def write_fp8_checkpoint(source: Path, target: Path, weight_strategy: str = "channel", dynamic: bool = True,
                         ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """Writes `source` (an HF directory, one or more safetensors files) quantized to FP8 W8A8 into `target`."""
    ignored = QuantizationScheme(COMPRESSED_TENSORS, ignore=ignore).ignores  # names or "re:" expressions
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, target / file.name)
    for file in sorted(source.glob("*.safetensors")):
        tensors = load_file(file)
        out = {}
        for name, tensor in tensors.items():
            layer = name.removesuffix(".weight")
            if not (LINEAR_WEIGHT.match(name) or EXPERT_WEIGHT.match(name)) or ignored(layer):
                out[name] = tensor
                continue
            amax = tensor.float().abs().amax(dim=1, keepdim=True) if weight_strategy == "channel" else \
                tensor.float().abs().amax().reshape(1)
            scale = (amax / FP8_MAX).to(tensor.dtype)
            # W / scale in the weight's dtype, then rounded to float8: compressed-tensors' own order (a bf16
            # model's quotient is rounded to bf16 first), so the bytes equal what llm-compressor writes.
            quotient = tensor / (scale.reshape(-1, 1) if weight_strategy == "channel" else scale)
            out[name] = quotient.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out[f"{layer}.weight_scale"] = scale
            if not dynamic:
                projection = layer.rpartition(".")[2]
                out[f"{layer}.input_scale"] = torch.tensor([STATIC_INPUT_SCALES.get(projection, 4.0) / FP8_MAX],
                                                           dtype=tensor.dtype)
        save_file(out, target / file.name, metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = dict(
        quant_method="compressed-tensors", format="float-quantized", quantization_status="compressed",
        config_groups={"group_0": _scheme(weight_strategy, dynamic)}, ignore=list(ignore), kv_cache_scheme=None,
        global_compression_ratio=None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def dequantized_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each float8 weight replaced by weight * weight_scale (float32), scales
    dropped: an unquantized state dict of the same model."""
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(("_scale",)):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors[name.removesuffix(".weight") + ".weight_scale"].float()
            out[name] = tensor.float() * (scale if scale.dim() == 2 else scale.reshape(1, 1))
        else:
            out[name] = tensor
    return out
