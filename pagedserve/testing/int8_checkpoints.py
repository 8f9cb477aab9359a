"""Compressed-tensors INT8 W8A8 ("int-quantized") checkpoints of the tiny test models, in the layout
llm-compressor saves for its W8A8 scheme.

Why our own writer: llm-compressor is not a dependency, and tests may not download. Like fp8_checkpoints.py,
this quantizes each decoder Linear (fp8_checkpoints.LINEAR_WEIGHT; embeddings, norms and lm_head stay as they
are) as compressed-tensors' minmax observer and its int-quantized compressor do:

- `weight_scale` = amax(|W|) / 127.5 (compressed-tensors' symmetric scale: the absolute maximum over half the
  int8 range), per output row ([out, 1], strategy "channel") or over the tensor ([1], "tensor"), in the model's
  dtype;
- `weight` int8 [out, in] = round(clamp(W / weight_scale, -128, 127)), the quotient in the model's dtype, ties
  to even (`IntQuantizationCompressor.compress`);
- for static activations, `input_scale` [1] in the model's dtype: amax(|x|) / 127.5 of each Linear's input over
  calibration prompts (`calibrated_input_scales`, what llm-compressor's static_minmax observer computes; the
  projections of one fused layer see the same input, so their scales are made to differ, by 1.0, 1.25 and 1.5
  times, for the test of the layer taking their largest); no zero points (symmetric schemes drop them);
- config.json's `quantization_config`: quant_method "compressed-tensors", format "int-quantized", one config
  group targeting "Linear" with the W8A8 preset's weights and input_activations (or static per-tensor ones),
  `ignore: ["lm_head"]`.

tests/test_int8_models.py checks it against compressed-tensors 0.20.0 itself: its compressor, given our scales,
writes our int8 weights byte for byte, its decompressor reads them to our dequantized weights, and its
QuantizationScheme parses our config group. `dequantized_int8_state_dict` gives those weights (W_q * scale,
float32), the ones the reference runs with.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kernels.int8_linear_ref import HALF_RANGE, INT8_MAX, INT8_MIN
from pagedserve.testing.fp8_checkpoints import LINEAR_WEIGHT
from worker_svc.int8_quantization import INT_QUANTIZED, Int8Scheme


def int8_config_group(weight_strategy: str, dynamic: bool) -> dict:
    """The config group compressed-tensors writes for llm-compressor's W8A8 (channel, dynamic) and its static
    variants."""
    int8 = dict(num_bits=8, type="int", symmetric=True, group_size=None, block_structure=None, actorder=None,
                observer_kwargs={})
    activations = ({**int8, "dynamic": True, "strategy": "token", "observer": None} if dynamic
                   else {**int8, "dynamic": False, "strategy": "tensor", "observer": "static_minmax"})
    return dict(targets=["Linear"], weights={**int8, "dynamic": False, "strategy": weight_strategy,
                                             "observer": "minmax"},
                input_activations=activations, output_activations=None, format=INT_QUANTIZED)


def quantize_weight_int8(weight: torch.Tensor, weight_strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], weight_scale [out, 1] or [1] in the weight's dtype), as module docstring says."""
    if weight_strategy == "channel":
        scale = (weight.abs().amax(dim=1, keepdim=True) / HALF_RANGE)
    else:
        scale = (weight.abs().amax() / HALF_RANGE).reshape(1)
    quotient = weight / (scale if weight_strategy == "channel" else scale.reshape(1, 1))
    return torch.round(quotient.clamp(INT8_MIN, INT8_MAX)).to(torch.int8), scale


# Fused parts (q|k|v, gate|up) read one input: their calibrated scales are spread by these factors so they differ.
PART_SPREAD = {"q_proj": 1.0, "k_proj": 1.25, "v_proj": 1.5, "gate_proj": 1.0, "up_proj": 1.5}
CALIBRATION_PROMPTS = ([1, 17, 300, 42, 9, 255, 7, 88, 3, 140], [1, 5, 5, 480, 2, 61, 99, 100, 3, 7, 12, 400])


@torch.no_grad()
def calibrated_input_scales(source: Path, prompts: Sequence[Sequence[int]] = CALIBRATION_PROMPTS
                            ) -> dict[str, float]:
    """Each decoder Linear's static input scale, amax(|input|) / 127.5 over `prompts` run through transformers'
    float32 model of `source`, times its PART_SPREAD factor; keyed by layer name."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    for name, module in model.named_modules():
        if LINEAR_WEIGHT.match(f"{name}.weight"):
            module.register_forward_pre_hook(
                lambda module, args, name=name: amax.update({name: max(amax.get(name, 0.0),
                                                                       args[0].abs().max().item())}))
    for prompt in prompts:
        model(torch.tensor([list(prompt)]))
    return {name: value / HALF_RANGE * PART_SPREAD.get(name.rpartition(".")[2], 1.0) for name, value in amax.items()}


def write_int8_checkpoint(source: Path, target: Path, weight_strategy: str = "channel", dynamic: bool = True,
                          ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """Writes `source` (an HF directory, one or more safetensors files) quantized to INT8 W8A8 into `target`."""
    input_scales = {} if dynamic else calibrated_input_scales(source)
    ignored = Int8Scheme(ignore=ignore).ignores  # names or "re:" expressions
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, target / file.name)
    for file in sorted(source.glob("*.safetensors")):
        out = {}
        for name, tensor in load_file(file).items():
            layer = name.removesuffix(".weight")
            if not LINEAR_WEIGHT.match(name) or ignored(layer):
                out[name] = tensor
                continue
            out[name], out[f"{layer}.weight_scale"] = quantize_weight_int8(tensor, weight_strategy)
            if not dynamic:
                out[f"{layer}.input_scale"] = torch.tensor([input_scales[layer]], dtype=tensor.dtype)
        save_file(out, target / file.name, metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = dict(
        quant_method="compressed-tensors", format=INT_QUANTIZED, quantization_status="compressed",
        config_groups={"group_0": int8_config_group(weight_strategy, dynamic)}, ignore=list(ignore),
        kv_cache_scheme=None, global_compression_ratio=None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def dequantized_int8_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each int8 weight replaced by weight * weight_scale (float32), scales
    dropped: an unquantized state dict of the same model."""
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale"):
            continue
        if tensor.dtype == torch.int8:
            scale = tensors[name.removesuffix(".weight") + ".weight_scale"].float()
            out[name] = tensor.float() * (scale if scale.dim() == 2 else scale.reshape(1, 1))
        else:
            out[name] = tensor
    return out
