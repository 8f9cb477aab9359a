"""The unquantized state dict of an AWQ, GPTQ or compressed-tensors pack-quantized checkpoint: what transformers
runs as the reference for our integer linear layers.

Why separate from the writers (int_checkpoints.py) and from kernels/wna16_ref.py: this reads each format from
its own definition (AutoAWQ's interleaved nibbles along the output dimension; GPTQ's rows packed along the input
dimension with v1's zero - 1 and g_idx; compressed-tensors' offset values, zero points packed along the output
dimension, weight_g_idx) and shares no unpacking with either, so a layout mistake in a writer or in the loader's
conversion to the canonical layout shows up as a disagreement instead of cancelling out.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file

# Column c of each run of eight sits in bits 4 * AWQ_REVERSE_ORDER[c] of its word (vLLM's and GPTQModel's
# AWQ_REVERSE_ORDER: the inverse of AutoAWQ's packing order (0, 2, 4, 6, 1, 3, 5, 7)).
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
COMPRESSED_TENSORS_TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def dequantized_int_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """`directory`'s tensors with each quantized Linear's tensors replaced by `<layer>.weight`, W [out, in] in
    float32; every other tensor as stored."""
    config = json.loads((Path(directory) / "config.json").read_text())["quantization_config"]
    tensors = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(file))
    method = config["quant_method"]
    if method == "awq":
        suffix, dropped, dequantize = "qweight", GPTQ_TENSORS, _awq_weight
    elif method == "gptq":
        adds_one = config.get("checkpoint_format", "gptq") == "gptq"  # v1 stores zero - 1; gptq_v2 the zero
        suffix, dropped = "qweight", GPTQ_TENSORS
        dequantize = partial(_gptq_weight, bits=config["bits"], adds_one=adds_one)
    elif method == "compressed-tensors" and config["format"] == "pack-quantized":
        (group,) = config["config_groups"].values()
        suffix, dropped = "weight_packed", COMPRESSED_TENSORS_TENSORS
        dequantize = partial(_compressed_tensors_weight, bits=group["weights"]["num_bits"])
    else:
        raise ValueError(f"not an integer weight-only checkpoint: {method} {config.get('format')}")
    layers = [name.removesuffix(f".{suffix}") for name in tensors if name.endswith(f".{suffix}")]
    out = {name: tensor for name, tensor in tensors.items() if name.rpartition(".")[2] not in dropped}
    out.update({f"{layer}.weight": dequantize(tensors, layer) for layer in layers})
    return out


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., m] -> int64 [..., m * 32 // bits]: each word's fields, the lowest bits first."""
    shifts = torch.arange(0, 32, bits)
    fields = ((words.long() & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.flatten(-2)


def _awq_weight(tensors: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
    """AutoAWQ GEMM: W^T[k, n] = (q[k, n] - zero[k // G, n]) * scale[k // G, n], q and zero 4-bit fields along n."""
    def columns(words):  # [rows, out // 8] -> [rows, out] in column order
        fields = _unpack(words, 4).reshape(words.shape[0], -1, 8)
        return fields[..., list(AWQ_REVERSE_ORDER)].flatten(-2)

    q, zeros = columns(tensors[f"{layer}.qweight"]), columns(tensors[f"{layer}.qzeros"])
    scales = tensors[f"{layer}.scales"].float()
    group_size = q.shape[0] // scales.shape[0]
    per_row = [t.repeat_interleave(group_size, dim=0) for t in (zeros, scales)]
    return ((q - per_row[0]) * per_row[1]).t().contiguous()


def _gptq_weight(tensors: dict[str, torch.Tensor], layer: str, bits: int, adds_one: bool) -> torch.Tensor:
    """GPTQ: W^T[k, n] = (q[k, n] - zero[g, n]) * scale[g, n] with g = g_idx[k]; q packed along k, zeros along n."""
    q = _unpack(tensors[f"{layer}.qweight"].t(), bits).t()  # [in, out]
    zeros = _unpack(tensors[f"{layer}.qzeros"], bits) + (1 if adds_one else 0)  # [groups, out]
    g_idx = tensors[f"{layer}.g_idx"].long()
    return ((q - zeros[g_idx]) * tensors[f"{layer}.scales"].float()[g_idx]).t().contiguous()


def _compressed_tensors_weight(tensors: dict[str, torch.Tensor], layer: str, bits: int) -> torch.Tensor:
    """pack-quantized: W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with g = k // G, or weight_g_idx[k] when
    stored (actorder "group"); q packed along k and zero along n, both stored + 2**(bits - 1) (so symmetric,
    without zero points, is zero 2**(bits - 1))."""
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit fields straddle words; only 4 and 8 bits are read here")
    out_features, in_features = tensors[f"{layer}.weight_shape"].tolist()
    q = _unpack(tensors[f"{layer}.weight_packed"], bits)[:, :in_features]
    scales = tensors[f"{layer}.weight_scale"].float()
    packed_zeros = tensors.get(f"{layer}.weight_zero_point")
    zeros = torch.full(scales.shape, 2 ** (bits - 1)) if packed_zeros is None else \
        _unpack(packed_zeros.t(), bits).t()[:out_features]
    g_idx = tensors.get(f"{layer}.weight_g_idx")
    if g_idx is None:
        g_idx = torch.arange(in_features) // (in_features // scales.shape[1])
    per_column = [t[:, g_idx.long()] for t in (zeros, scales)]
    return (q - per_column[0]) * per_column[1]
