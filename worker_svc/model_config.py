"""ModelConfig: the shape and numerics of a decoder-only model, read from an HF directory or a GGUF file.

Why our own frozen dataclass instead of transformers' config: the worker must not import transformers,
one type covers both checkpoint formats, and refusing unsupported features (sliding window, unknown rope
scaling) happens here, once, with a clear message instead of silently wrong tokens later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
GGUF_ARCHITECTURES = ("llama", "qwen2")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the native model code needs to build and run a Llama-family model.

    `architecture` is "llama" (Llama 2/3, Mistral without sliding window, SmolLM2, TinyLlama), "qwen2" or
    "qwen3" (dense; its per-head q/k norms are the model class's, models/qwen3.py).
    `attention_bias` means q/k/v projections have a bias (Qwen2); for "llama" it also gives o_proj one,
    as in HF's LlamaAttention. `rope_scaling` is None or the llama3 parameters as sorted (key, value)
    pairs (hashable; see `rope_scaling_params`). `eos_token_ids` is a tuple (HF allows int or list).
    """

    architecture: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def rope_scaling_params(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """A .gguf file, a directory holding exactly one .gguf and no config.json, or an HF directory."""
        gguf_file = find_gguf_file(path)
        return cls.from_gguf(gguf_file) if gguf_file is not None else cls.from_hf_dir(path)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        architectures = raw.get("architectures") or []
        supported = [a for a in architectures if a in HF_ARCHITECTURES]
        if not supported:
            raise ValueError(
                f"unsupported architectures {architectures}; supported: {sorted(HF_ARCHITECTURES)}"
            )
        architecture = HF_ARCHITECTURES[supported[0]]
        refuse_sliding_window(raw)
        if raw.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        rope_theta, rope_scaling = parse_hf_rope(raw)
        num_heads = raw["num_attention_heads"]
        return cls(
            architecture=architecture,
            name=raw.get("_name_or_path") or Path(path).name,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=architecture == "qwen2" or bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=as_token_ids(raw.get("eos_token_id")),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> ModelConfig:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))

        def field(key: str, default: Any = None) -> Any:
            found = reader.fields.get(key)
            return default if found is None else found.contents()

        arch = field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {GGUF_ARCHITECTURES}")
        tensor_names = {tensor.name for tensor in reader.tensors}
        scaling_type = field(f"{arch}.rope.scaling.type", "none")
        if scaling_type not in ("none", None) or "rope_freqs.weight" in tensor_names:
            raise ValueError(f"GGUF rope scaling ({scaling_type}, rope_freqs) is not supported")
        sliding_window = field(f"{arch}.attention.sliding_window")
        context_length = field(f"{arch}.context_length")
        if sliding_window and sliding_window < context_length:
            raise ValueError(f"sliding-window attention ({sliding_window}) is not supported")
        hidden_size = field(f"{arch}.embedding_length")
        num_heads = field(f"{arch}.attention.head_count")
        vocab_size = field(f"{arch}.vocab_size")
        if vocab_size is None:
            vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
        return cls(
            architecture=arch,
            name=field("general.name") or Path(path).stem,
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=field(f"{arch}.feed_forward_length"),
            num_hidden_layers=field(f"{arch}.block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=field(f"{arch}.attention.head_count_kv", num_heads),
            head_dim=field(f"{arch}.attention.key_length") or hidden_size // num_heads,
            rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=None,
            max_position_embeddings=context_length,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=arch == "qwen2",
            bos_token_id=field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=as_token_ids(field("tokenizer.ggml.eos_token_id")),
        )


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names, or None when `path` is an HF-style directory."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf")
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"no model at {path}")
    if (path / "config.json").exists():
        return None
    candidates = sorted(path.glob("*.gguf"))
    if len(candidates) != 1:
        raise ValueError(f"{path} has no config.json and {len(candidates)} .gguf files (need exactly 1)")
    return candidates[0]


def refuse_sliding_window(raw: dict) -> None:
    """Raise when the checkpoint attends through a window shorter than its context (not implemented)."""
    window = raw.get("sliding_window")
    enabled = raw.get("use_sliding_window", True)  # Mistral has no flag; Qwen2 has one
    if "sliding_attention" in (raw.get("layer_types") or []):
        enabled, window = True, window or 0
    if enabled and window is not None and window < raw["max_position_embeddings"]:
        raise ValueError(
            f"sliding-window attention (window {window} < max_position_embeddings "
            f"{raw['max_position_embeddings']}) is not supported"
        )


def parse_hf_rope(raw: dict) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, llama3 scaling or None) from either `rope_parameters` (transformers >= 5) or the
    older `rope_theta` + `rope_scaling` keys."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (only llama3)")
    params.setdefault("original_max_position_embeddings", raw["max_position_embeddings"])
    scaling = {key: params[key] for key in LLAMA3_ROPE_KEYS}
    return rope_theta, tuple(sorted({"rope_type": "llama3", **scaling}.items()))


def as_token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)
