"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints of the tiny test models (weight-only int4 / int8),
written in the layouts AutoAWQ, GPTQModel and llm-compressor save.

Why our own writer: none of those tools is a dependency, and tests may not download. Each writer rounds every
decoder Linear (fp8_checkpoints.LINEAR_WEIGHT; embeddings, norms and lm_head stay as they are) to the nearest
integer per group of `group_size` consecutive input columns (min/max with a zero point, or absmax around the
middle of the range; `quantize_groups`) and stores what the tool stores, per Linear `<layer>`:

- AWQ (AutoAWQ's WQLinear_GEMM, version "gemm", 4 bits): `qweight` int32 [in, out // 8], W^T packed along the
  OUTPUT dimension, eight columns a word in AutoAWQ's interleaved order: bits 4i..4i+3 of word j hold column
  8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]; `qzeros` int32 [in // G, out // 8] packed alike (unsigned zero points, no
  offset); `scales` float16 [in // G, out]; a bias as float16. zero_point=False: AutoAWQ's GEMM packer refuses
  it (it asserts zeros), GPTQModel's AWQ writes zero points of 2**(bits - 1): so do we.
- GPTQ (GPTQModel, checkpoint_format "gptq", i.e. v1): `qweight` int32 [in // pack, out] packed along the INPUT
  dimension, the first row in the lowest bits; `qzeros` int32 [in // G, out // pack] packed along the output
  dimension holding zero - 1 (the v1 quirk; the reader adds 1), so a zero point of 0 cannot be stored (the
  writer refuses one); `scales` float16 [in // G, out]; `g_idx` int32 [in]: the group of each input row,
  i // G, or with desc_act the group of its place in the act-order permutation (`act_order_permutation`).
- compressed-tensors pack-quantized: `weight_packed` int32 [out, in // pack] packed along the input dimension,
  the first column in the lowest bits, each value stored + 2**(bits - 1) (signed [-8, 7] -> [0, 15]);
  `weight_scale` [out, in // G] ([out, 1] per channel) in the model's dtype; asymmetric only,
  `weight_zero_point` int32 [out // pack, in // G], the zero points (+ 2**(bits - 1) alike) packed along the
  OUTPUT dimension; `weight_shape` int64 [2] = [out, in].

Checked against the real tools (compressed_tensors 0.20.0 run here; the others read, as none could be run):
- compressed-tensors: `PackedQuantizationCompressor.compress` of the tiny Llama's linear weights with this
  writer's scales and zero points gave byte-identical `weight_packed` and `weight_zero_point`, the same
  names, dtypes and shapes (int4 and int8, group 32/64/128 and channel, symmetric and asymmetric), and its
  `QuantizationConfig` parses this config's group to the same scheme; `unpack_from_int32` of our words gives
  our values - 2**(bits - 1). tests/test_int_checkpoints.py keeps pack_to_int32's words of one tensor.
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

from pagedserve.testing.fp8_checkpoints import LINEAR_WEIGHT

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bits 4i..4i+3 of an AWQ word hold column AWQ_ORDER[i] of its eight
# Act-order permutations are a function of (layer, the input a projection reads): projections reading the same
# input share one, as GPTQ's (from that input's Hessian) do.
LAYER_INPUT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "qkv_proj": 0, "o_proj": 1, "out_proj": 1,
               "gate_proj": 2, "up_proj": 2, "gate_up_proj": 2, "fc1": 2, "down_proj": 3, "fc2": 3}
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
    The scale is rounded to `scale_dtype` first, so the stored scale is the one the values were rounded with."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"{in_features} input columns are not a multiple of the group size {group_size}")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if symmetric:
        scales = groups.abs().amax(dim=-1) / ((high - low) / 2)
    else:
        minimum, maximum = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        scales = (maximum - minimum) / (high - low)
    scales = torch.where(scales == 0, torch.finfo(scale_dtype).eps, scales).to(scale_dtype)
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


def write_awq_checkpoint(source: Path, target: Path, group_size: int = 128, zero_point: bool = True) -> Path:
    """Writes `source` (an HF directory) quantized as AutoAWQ's GEMM int4 checkpoint into `target`."""
    def quantize(layer: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q = quantize_groups(weight, 4, _group(weight, group_size), not zero_point, torch.float16)
        return {"qweight": pack_int32(q.values.t(), 4, AWQ_ORDER), "qzeros": pack_int32(q.zeros.t(), 4, AWQ_ORDER),
                "scales": q.scales.t().contiguous()}

    config = dict(quant_method="awq", zero_point=zero_point, group_size=group_size, bits=4, version="gemm",
                  modules_to_not_convert=None)
    return _write(source, target, quantize, config, bias_dtype=torch.float16)


def write_gptq_checkpoint(source: Path, target: Path, bits: int = 4, group_size: int = 128, sym: bool = True,
                          desc_act: bool = False) -> Path:
    """Writes `source` quantized as GPTQModel's v1 ("gptq") checkpoint, `bits` 4 or 8, into `target`."""
    def quantize(layer: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        in_features = weight.shape[1]
        order = act_order_permutation(layer, in_features) if desc_act else torch.arange(in_features)
        q = quantize_groups(weight[:, order], bits, _group(weight, group_size), sym, torch.float16)
        if not sym and (q.zeros == 0).any():
            raise ValueError(f"{layer}: a zero point of 0 cannot be stored in GPTQ v1 (it stores zero - 1)")
        values = torch.empty_like(q.values)
        values[:, order] = q.values  # back to the checkpoint's row order; each row keeps its group
        g_idx = torch.empty(in_features, dtype=torch.int32)
        g_idx[order] = torch.arange(in_features, dtype=torch.int32) // _group(weight, group_size)
        return {"qweight": pack_int32(values, bits).t().contiguous(), "qzeros": pack_int32(q.zeros.t() - 1, bits),
                "scales": q.scales.t().contiguous(), "g_idx": g_idx}

    config = dict(bits=bits, group_size=group_size, desc_act=desc_act, sym=sym, lm_head=False, quant_method="gptq",
                  checkpoint_format="gptq", pack_dtype="int32", meta=GPTQMODEL_META)
    return _write(source, target, quantize, config, bias_dtype=torch.float16)


def write_compressed_tensors_int_checkpoint(source: Path, target: Path, bits: int = 4, group_size: int | None = 128,
                                            symmetric: bool = True) -> Path:
    """Writes `source` quantized as llm-compressor's W4A16 / W8A16 (pack-quantized) checkpoint into `target`;
    group_size None: one scale per output channel (strategy "channel")."""
    def quantize(layer: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q = quantize_groups(weight, bits, group_size or weight.shape[1], symmetric, weight.dtype)
        out = {"weight_packed": pack_int32(q.values, bits), "weight_scale": q.scales,
               "weight_shape": torch.tensor(weight.shape, dtype=torch.int64)}
        if not symmetric:
            out["weight_zero_point"] = pack_int32(q.zeros.t(), bits).t().contiguous()
        return out

    weights = dict(num_bits=bits, type="int", symmetric=symmetric, group_size=group_size,
                   strategy="channel" if group_size is None else "group", dynamic=False)
    scheme = dict(targets=["Linear"], weights=weights, input_activations=None, output_activations=None,
                  format="pack-quantized")
    config = dict(quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
                  config_groups={"group_0": scheme}, ignore=["lm_head"], kv_cache_scheme=None,
                  global_compression_ratio=None)
    return _write(source, target, quantize, config, bias_dtype=None)


def _group(weight: torch.Tensor, group_size: int) -> int:
    return weight.shape[1] if group_size == -1 else group_size  # AWQ / GPTQ: -1 is one group per output channel


def _write(source: Path, target: Path, quantize: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
           quantization_config: dict, bias_dtype: torch.dtype | None) -> Path:
    """Copies `source` into `target` with each decoder Linear's weight replaced by `quantize(layer, weight)`'s
    tensors (named `<layer>.<key>`), its bias cast to `bias_dtype`, and config.json's quantization_config."""
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
            if LINEAR_WEIGHT.match(name):
                out.update({f"{layer}.{key}": value for key, value in quantize(layer, tensor).items()})
            elif bias_dtype is not None and name.endswith(".bias") and LINEAR_WEIGHT.match(f"{layer}.weight"):
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
