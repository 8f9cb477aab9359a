"""Weight loading: stream (HF name, checkpoint tensor) pairs from safetensors directories or GGUF files.

Why one iterator in HF naming: the model's `load_weights` knows one naming scheme and one orientation
([out, in]); everything format-specific (shards, GGUF dequantization, GGUF's name scheme, llama.cpp's
q/k row permutation) is undone here, one tensor at a time so peak memory stays about one tensor.

Tensors travel as `CheckpointTensor`s (layers/checkpoint_tensor.py): under tensor parallel a rank reads only
its slice from a safetensors file. GGUF tensors are dequantized whole and then sliced (the `gguf` package
reads a tensor whole, and a quantized block spans a row); GGUF models are the small ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from worker_svc.layers.checkpoint_tensor import CheckpointTensor
from worker_svc.model_config import ModelConfig, find_gguf_file

GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def iter_checkpoint(path: str | Path, config: ModelConfig) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of the checkpoint at `path`, HF-named, HF-oriented ([out, in]), read when sliced."""
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        for name, tensor in iter_gguf_weights(gguf_file, config):
            yield name, CheckpointTensor(tensor, tuple(tensor.shape))
    else:
        yield from iter_safetensors_slices(Path(path))


def iter_weights(path: str | Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint at `path`, whole (`iter_checkpoint` reads slices)."""
    for name, tensor in iter_checkpoint(path, config):
        yield name, tensor.full()


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    return files


def iter_safetensors_slices(directory: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    from safetensors import safe_open

    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                source = handle.get_slice(name)
                yield name, CheckpointTensor(source, tuple(source.get_shape()))


def iter_gguf_weights(file: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(file))
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        hf_shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        weights = dequantize(tensor.data, tensor.tensor_type).reshape(hf_shape)
        weights = torch.from_numpy(weights.copy()).float()
        if config.model_type == "llama":
            if ".attn_q." in tensor.name:
                weights = unpermute_rotary_rows(weights, config.num_attention_heads)
            elif ".attn_k." in tensor.name:
                weights = unpermute_rotary_rows(weights, config.num_key_value_heads)
        yield name, weights


def hf_name(gguf_name: str) -> str:
    match = GGUF_LAYER_PATTERN.fullmatch(gguf_name)
    if match is not None:
        layer, part, kind = match.groups()
        if part in GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{GGUF_LAYER_NAMES[part]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in GGUF_GLOBAL_NAMES:
            return f"{GGUF_GLOBAL_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart we support")


def unpermute_rotary_rows(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time q/k row permutation.

    llama.cpp stores each head's rotary pairs interleaved (GPT-J style: rows 0,1 are a pair) while HF's
    Llama rotates halves (rows i and i + head_dim/2 are a pair). Its converter did
    `w.reshape(heads, 2, head_dim // 2, ...).swapaxes(1, 2)`; swapping the same axes of the
    `(heads, head_dim // 2, 2, ...)` view undoes it. Works for weights [rows, in] and biases [rows].
    """
    rows = weights.shape[0]
    view = weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:])
    return view.transpose(1, 2).reshape(weights.shape).contiguous()
