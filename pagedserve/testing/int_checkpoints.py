"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints of the tiny test models (weight-only int4 / int8),
written in the layouts AutoAWQ, GPTQModel and llm-compressor save.

Why our own writer: none of those tools is a dependency, and tests may not download. Each writer rounds every
decoder Linear (fp8_checkpoints.LINEAR_WEIGHT, and a MoE model's experts one by one under their hub names,
fp8_checkpoints.EXPERT_WEIGHT: Mixtral's `block_sparse_moe.experts.N.w1`, Qwen3-MoE's `mlp.experts.N.gate_proj`,
as AutoAWQ, GPTQModel and llm-compressor store them; embeddings, norms, the MoE router `gate` and lm_head stay as
they are) to the nearest
integer per group of `group_size` consecutive input columns (min/max with a zero point, or absmax around the
middle of the range; `quantize_groups`) and stores what the tool stores, per Linear `<layer>`:

- AWQ (AutoAWQ's WQLinear_GEMM, version "gemm", 4 bits): `qweight` int32 [in, out // 8], W^T packed along the
  OUTPUT dimension, eight columns a word in AutoAWQ's interleaved order: bits 4i..4i+3 of word j hold column
  8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]; `qzeros` int32 [in // G, out // 8] packed alike (unsigned zero points, no
  offset); `scales` float16 [in // G, out]; a bias as float16. zero_point=False: AutoAWQ's GEMM packer refuses
  it (it asserts zeros), GPTQModel's AWQ writes zero points of 2**(bits - 1): so do we. `modules_to_not_convert`
  (AutoAWQ's `exclude_layers_to_not_quantize`: a Linear whose name contains one of them) keeps `weight` as it is.
- GPTQ (GPTQModel, checkpoint_format "gptq", i.e. v1): `qweight` int32 [in // pack, out] packed along the INPUT
  dimension, the first row in the lowest bits; `qzeros` int32 [in // G, out // pack] packed along the output
  dimension holding zero - 1 (the v1 quirk; the reader adds 1), so a zero point of 0 cannot be stored (the
  writer refuses one); `scales` float16 [in // G, out]; `g_idx` int32 [in]: the group of each input row,
  i // G, or with desc_act the group of its place in the act-order permutation (`act_order_permutation`).
  checkpoint_format "gptq_v2" (GPTQModel's internal format, saved as such on request): the same with `qzeros`
  holding the zero points as they are (v1 = v2 - 1 per field: GPTQModel's convert_gptq_v2_to_v1_format_module).
- compressed-tensors pack-quantized: `weight_packed` int32 [out, in // pack] packed along the input dimension,
  the first column in the lowest bits, each value stored + 2**(bits - 1) (signed [-8, 7] -> [0, 15]);
  `weight_scale` [out, in // G] ([out, 1] per channel) in the model's dtype; asymmetric only,
  `weight_zero_point` int32 [out // pack, in // G], the zero points (+ 2**(bits - 1) alike) packed along the
  OUTPUT dimension; `weight_shape` int64 [2] = [out, in]. actorder "group": `weight_g_idx` int32 [in], the group
  of each input column (GPTQ's g_idx), the scales and zero points in group order, `weight_packed` in column order.

Checked against the real tools (compressed_tensors 0.20.0 run here; the others read, as none could be run):
- compressed-tensors: `PackedQuantizationCompressor.compress` of a tiny Llama's (hidden 128) linear weights with
  this writer's scales and zero points gave byte-identical `weight_packed` and `weight_zero_point`, the same
  names, dtypes and shapes, for int4 and int8, group 32/64/128 and channel, symmetric and asymmetric; its
  `decompress` equals our reader's weights; its `QuantizationConfig` parses our config to the same scheme.
  End to end (group 32 asymmetric): `apply_quantization_config`, our scales and zero points set,
  `ModelCompressor.compress_model`, `save_pretrained`, `update_config` wrote the same safetensors bytes and
  this quantization_config. tests/test_int_checkpoints.py keeps pack_to_int32's words of two tensors.
  actorder "group" was removed in 0.20.0 (its QuantizationArgs refuses it; its forward takes no g_idx): its layout
  is from the versions before (`_process_quantization`: sort the columns by g_idx, quantize groups of G
  consecutive sorted columns with scale[:, group], put the columns back) and vLLM's `weight_g_idx` [in];
  tests/test_int_real_tools.py runs 0.20.0's unpacking and `decompress` with that permutation around them.
- AWQ: AutoAWQ awq/modules/linear/gemm.py (`from_linear`: order_map, qweight [in, out // 8], qzeros, fp16
  scales and bias), awq/models/_config.py (`to_transformers_dict`: the config keys), GPTQModel's AWQ quantizer
  (symmetric zero points 2**(bits - 1)) and its AWQ_REVERSE_ORDER (0, 4, 1, 5, 2, 6, 3, 7), as vLLM unpacks.
- GPTQ: GPTQModel's `convert_gptq_v2_to_v1_format_module` (v1 qzeros = v2 words - 0x11111111 for 4 bits,
  - 0x01010101 for 8) and `QuantizeConfig.to_dict` (the config keys), vLLM's gptq.py (shapes of qweight,
  qzeros, scales, g_idx; its torch path unpacks qweight along the input dimension, adds 1 to each zero and
  dequantizes scales[g_idx] * (q - zeros[g_idx])).

The rest of each checkpoint (embeddings, norms, lm_head) keeps the source's dtype, so the reference runs the
same unquantized tensors. int_checkpoint_reader.dequantized_int_state_dict reads any of the three back.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedserve.testing.fp8_checkpoints import EXPERT_WEIGHT, LINEAR_WEIGHT

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bits 4i..4i+3 of an AWQ word hold column AWQ_ORDER[i] of its eight
# Act-order permutations are a function of (layer, the input a projection reads): projections reading the same
# input share one, as GPTQ's (from that input's Hessian) do.
LAYER_INPUT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "qkv_proj": 0, "o_proj": 1, "out_proj": 1,
               "gate_proj": 2, "up_proj": 2, "gate_up_proj": 2, "fc1": 2, "down_proj": 3, "fc2": 3}
# The meta GPTQModel's QuantizeConfig.to_dict writes; a GPTQModel version as the quantizer (transformers and
# optimum read it to accept v1 checkpoints with sym false, which GPTQModel >= 0.9.0 writes correctly).
GPTQMODEL_META = {"quantizer": ["gptqmodel:2.2.0"], "uri": "https://github.com/modelcloud/gptqmodel",
                  "damp_percent": 0.05, "damp_auto_increment": 0.01, "static_groups": False,
                  "true_sequential": True, "mse": 0.0}


@dataclass(frozen=True)
class GroupQuantized:
    """One Linear's weight W [out, in] as unsigned `bits`-bit integers per group of input columns:
    W[n, k] ~= (values[n, k] - zeros[n, k // G]) * scales[n, k // G]. Unsigned with explicit zero points
    (2**(bits - 1) when symmetric) because all three formats store unsigned fields."""

    values: torch.Tensor  # int64 [out, in], in [0, 2**bits)
    scales: torch.Tensor  # [out, in // G] in the stored dtype
    zeros: torch.Tensor  # int64 [out, in // G]


def quantize_groups(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                    scale_dtype: torch.dtype) -> GroupQuantized:
    """Round-to-nearest per group, compressed-tensors' arithmetic (so its compressor packs the same values):
    symmetric scale = absmax / ((2**bits - 1) / 2); asymmetric scale = (max - min) / (2**bits - 1) with min <= 0
    <= max and zero = round(-2**(bits - 1) - min / scale); q = round(clamp(W / scale + zero)) in the signed range.
    The scale is rounded up to `scale_dtype` first, so the stored scale is the one the values were rounded with."""
    out_features, in_features = weight.shape
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit weights are not written (4 or 8)")
    if in_features % group_size:
        raise ValueError(f"{in_features} input columns are not a multiple of the group size {group_size}")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if symmetric:
        scales = groups.abs().amax(dim=-1) / ((high - low) / 2)
    else:
        minimum, maximum = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        scales = (maximum - minimum) / (high - low)
    scales = torch.where(scales == 0, torch.finfo(scale_dtype).eps, scales)
    stored = scales.to(scale_dtype)  # rounded up, so the extremes stay in range: every error <= scale / 2
    scales = torch.where(stored.float() < scales, torch.nextafter(stored, torch.full_like(stored, torch.inf)), stored)
    zeros = torch.zeros_like(scales, dtype=torch.float32) if symmetric else \
        (low - minimum / scales.float()).clamp(low, high).round()
    values = (groups / scales.float().unsqueeze(-1) + zeros.unsqueeze(-1)).clamp(low, high).round()
    offset = 2 ** (bits - 1)
    return GroupQuantized(values.reshape(out_features, in_features).long() + offset, scales, zeros.long() + offset)


def pack_int32(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned values int [..., n] -> int32 [..., n // (32 // bits)] packed along the last dimension: bits
    bits*i.. of each word hold value order[i] of its run (order None: value i, the first in the lowest bits)."""
    pack = 32 // bits
    runs = values.long().reshape(*values.shape[:-1], values.shape[-1] // pack, pack)
    if order is not None:
        runs = runs[..., list(order)]
    words = (runs << (torch.arange(pack) * bits)).sum(dim=-1)  # < 2**32: each value in its own bits
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def act_order_permutation(layer: str, in_features: int) -> torch.Tensor:
    """The act-order (desc_act) permutation of `layer`'s input rows: seeded by the decoder layer's index and the
    input its projection reads, so q/k/v (and gate/up) share one, as GPTQ's Hessian-derived order does."""
    match = re.search(r"\.layers\.(\d+)\.(?:self_attn\.|mlp\.)?(\w+)$", layer)
    if match is None or match.group(2) not in LAYER_INPUT:
        raise ValueError(f"no act-order input for {layer}")
    generator = torch.Generator().manual_seed(1009 + 4 * int(match.group(1)) + LAYER_INPUT[match.group(2)])
    return torch.randperm(in_features, generator=generator)


def quantize_in_act_order(layer: str, weight: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                          scale_dtype: torch.dtype, act_order: bool) -> tuple[GroupQuantized, torch.Tensor]:
    """`quantize_groups` of W's input columns taken in `layer`'s act-order permutation (act_order; else in
    order): groups of `group_size` consecutive permuted columns, scales and zeros [out, in // G] in group order,
    the values put back in the checkpoint's column order (each column keeps its group). Also returns g_idx int32
    [in], the group of each input column, as GPTQ's `g_idx` and compressed-tensors' `weight_g_idx` store it."""
    in_features = weight.shape[1]
    order = act_order_permutation(layer, in_features) if act_order else torch.arange(in_features)
    q = quantize_groups(weight[:, order], bits, group_size, symmetric, scale_dtype)
    values = torch.empty_like(q.values)
    values[:, order] = q.values
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = torch.arange(in_features, dtype=torch.int32) // group_size
    return GroupQuantized(values, q.scales, q.zeros), g_idx


def write_awq_checkpoint(source: Path, target: Path, group_size: int = 128, zero_point: bool = True,
                         modules_to_not_convert: tuple[str, ...] = ()) -> Path:
    """Writes `source` (an HF directory) quantized as AutoAWQ's GEMM int4 checkpoint into `target`; Linears whose
    name contains one of `modules_to_not_convert` (AutoAWQ's substring match) keep their float weights."""
    def quantize(layer: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q = quantize_groups(weight, 4, _group(weight, group_size), not zero_point, torch.float16)
        return {"qweight": pack_int32(q.values.t(), 4, AWQ_ORDER), "qzeros": pack_int32(q.zeros.t(), 4, AWQ_ORDER),
                "scales": q.scales.t().contiguous()}

    def converts(layer: str) -> bool:
        return not any(module in layer for module in modules_to_not_convert)

    config = dict(quant_method="awq", zero_point=zero_point, group_size=group_size, bits=4, version="gemm",
                  modules_to_not_convert=list(modules_to_not_convert) or None)
    return _write(source, target, quantize, config, bias_dtype=torch.float16, converts=converts)


def write_gptq_checkpoint(source: Path, target: Path, bits: int = 4, group_size: int = 128, sym: bool = True,
                          desc_act: bool = False, checkpoint_format: str = "gptq") -> Path:
    """Writes `source` quantized as GPTQModel's checkpoint, `bits` 4 or 8, into `target`: checkpoint_format
    "gptq" (v1: zero points stored minus one) or "gptq_v2" (stored as they are)."""
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not written ('gptq' or 'gptq_v2')")
    stored_zero_offset = 1 if checkpoint_format == "gptq" else 0

    def quantize(layer: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, g_idx = quantize_in_act_order(layer, weight, bits, _group(weight, group_size), sym, torch.float16, desc_act)
        if stored_zero_offset and not sym and (q.zeros == 0).any():
            raise ValueError(f"{layer}: a zero point of 0 cannot be stored in GPTQ v1 (it stores zero - 1)")
        return {"qweight": pack_int32(q.values, bits).t().contiguous(),
                "qzeros": pack_int32(q.zeros.t() - stored_zero_offset, bits),
                "scales": q.scales.t().contiguous(), "g_idx": g_idx}

    config = dict(bits=bits, group_size=group_size, desc_act=desc_act, sym=sym, lm_head=False, quant_method="gptq",
                  checkpoint_format=checkpoint_format, pack_dtype="int32", meta=GPTQMODEL_META)
    return _write(source, target, quantize, config, bias_dtype=torch.float16)


def write_compressed_tensors_int_checkpoint(source: Path, target: Path, bits: int = 4, group_size: int | None = 128,
                                            symmetric: bool = True, actorder: bool = False) -> Path:
    """Writes `source` quantized as llm-compressor's W4A16 / W8A16 (pack-quantized) checkpoint into `target`;
    group_size None: one scale per output channel (strategy "channel"); actorder: GPTQModifier's actorder
    "group" (groups of permuted columns, a `weight_g_idx` per Linear)."""
    if actorder and group_size is None:
        raise ValueError("actorder 'group' needs groups (a group_size)")

    def quantize(layer: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, g_idx = quantize_in_act_order(layer, weight, bits, group_size or weight.shape[1], symmetric, weight.dtype,
                                         actorder)
        out = {"weight_packed": pack_int32(q.values, bits), "weight_scale": q.scales,
               "weight_shape": torch.tensor(weight.shape, dtype=torch.int64)}
        if not symmetric:
            out["weight_zero_point"] = pack_int32(q.zeros.t(), bits).t().contiguous()
        if actorder:
            out["weight_g_idx"] = g_idx
        return out

    weights = dict(num_bits=bits, type="int", symmetric=symmetric, group_size=group_size,
                   strategy="channel" if group_size is None else "group", dynamic=False)
    if actorder:
        weights["actorder"] = "group"
    scheme = dict(targets=["Linear"], weights=weights, input_activations=None, output_activations=None,
                  format="pack-quantized")
    config = dict(quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
                  config_groups={"group_0": scheme}, ignore=["lm_head"], kv_cache_scheme=None,
                  global_compression_ratio=None, moe_sparsity_config=None, sparsity_config={},
                  transform_config={}, version="0.20.0")
    return _write(source, target, quantize, config, bias_dtype=None)


def _group(weight: torch.Tensor, group_size: int) -> int:
    return weight.shape[1] if group_size == -1 else group_size  # AWQ / GPTQ: -1 is one group per output channel


def _write(source: Path, target: Path, quantize: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
           quantization_config: dict, bias_dtype: torch.dtype | None,
           converts: Callable[[str], bool] = lambda layer: True) -> Path:
    """Copies `source` into `target` with each decoder Linear's weight (of a layer that `converts`) replaced by
    `quantize(layer, weight)`'s tensors (named `<layer>.<key>`), its bias cast to `bias_dtype`, and config.json's
    quantization_config."""
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, target / file.name)
    weight_map = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors = load_file(file)
        out = {}
        for name, tensor in tensors.items():
            layer = name.rpartition(".")[0]
            if (LINEAR_WEIGHT.match(name) or EXPERT_WEIGHT.match(name)) and converts(layer):
                out.update({f"{layer}.{key}": value for key, value in quantize(layer, tensor).items()})
            elif bias_dtype is not None and name.endswith(".bias") and LINEAR_WEIGHT.match(f"{layer}.weight") \
                    and converts(layer):
                out[name] = tensor.to(bias_dtype)
            else:
                out[name] = tensor
        save_file(out, target / file.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, file.name))
    index = source / "model.safetensors.index.json"
    if index.exists():  # sharded: the index names the new tensors
        (target / index.name).write_text(json.dumps({**json.loads(index.read_text()), "weight_map": weight_map}))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
