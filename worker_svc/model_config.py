"""ModelConfig: the shape and numerics of a decoder-only model, read from an HF directory or a GGUF file.

Why our own frozen dataclass instead of transformers' config: the worker must not import transformers,
one type covers both checkpoint formats, and refusing unsupported features (unknown rope scaling, a
quantization_config, what a model file cannot honour: models/feature_refusals.py) happens here, once, with a
clear message instead of silently wrong tokens or a worker's traceback later. The quantization the linear
layers apply (worker_svc/quantization_config.py) is parsed here too, from config.json and `--quantization`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from worker_svc.models.feature_refusals import feature_refusal
from worker_svc.models.registry import MODEL_CLASSES
from worker_svc.int8_quantization import Int8Scheme
from worker_svc.integer_quantization import IntegerScheme
from worker_svc.quantization_config import GGUF, QuantizationScheme, parse_quantization

# GGUF `general.architecture` -> the HF architecture whose class reads it.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# The model types whose transformers config class ties the head to the embeddings when config.json omits
# `tie_word_embeddings` (every other family's default is untied).
TIED_BY_DEFAULT = ("opt", "gemma", "gemma2", "gemma3_text")


@dataclass(frozen=True)
class ModelConfig:
    """What the native model code, the cache sizing and the launcher need of any decoder-only model.

    `architecture` is the HF architectures name the registry serves it with (models/registry.py), e.g.
    "MistralForCausalLM"; `model_type` is config.json's (the family: "llama", "mistral", "qwen2", ...; a GGUF's
    `general.architecture`). The fields every family has are parsed here; what only one family has (OPT's
    `do_layer_norm_before`, Gemma's soft-capping) its model file reads from `hf_config`, the checkpoint's
    config.json as read (empty for GGUF), so adding an architecture does not touch this file.
    `attention_bias` means q/k/v projections have a bias (Qwen2); for "llama" it also gives o_proj one,
    as in HF's LlamaAttention. `rope_scaling` is None or the scaling parameters (linear, llama3, yarn,
    longrope: `parse_hf_rope`) as sorted (key, value) pairs (hashable; see `rope_scaling_params`).
    `eos_token_ids` is a tuple (HF allows int or list).
    `layer_types` gives each layer's attention ("full_attention" or "sliding_attention", as transformers
    names them); `sliding_window` is the window of the sliding ones (None when no layer slides): a query
    at position p sees keys p - sliding_window + 1 .. p.
    `quantization`: the scheme every linear layer applies, FP8 W8A8, INT8 W8A8 or weight-only integer (None:
    unquantized; a GGUF's own quantization is dequantized at load and is not this), from the checkpoint's
    quantization_config or `--quantization fp8`.
    """

    architecture: str
    model_type: str
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
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    quantization: QuantizationScheme | Int8Scheme | IntegerScheme | None = None
    hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The window layer `layer_index` attends through, or None for full attention."""
        sliding = self.layer_types and self.layer_types[layer_index] == SLIDING_ATTENTION
        return self.sliding_window if sliding else None

    def rope_scaling_params(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_path(cls, path: str | Path, quantization: str | None = None) -> ModelConfig:
        """A .gguf file, a directory holding exactly one .gguf and no config.json, or an HF directory;
        `quantization`: the --quantization flag (None: what the checkpoint says)."""
        gguf_file = find_gguf_file(path)
        if gguf_file is None:
            return cls.from_hf_dir(path, quantization)
        if quantization not in (None, GGUF):
            raise ValueError(f"--quantization {quantization}: {gguf_file.name} is a GGUF file, whose quantization "
                             f"is read from the file (--quantization gguf or none)")
        return cls.from_gguf(gguf_file)

    @classmethod
    def from_hf_dir(cls, path: str | Path, quantization: str | None = None) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        architectures = raw.get("architectures") or []
        supported = [a for a in architectures if a in MODEL_CLASSES]
        if not supported:
            raise ValueError(f"unsupported architectures {architectures}; supported: {sorted(MODEL_CLASSES)}")
        model_type = raw.get("model_type", "")
        if raw.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        tie_word_embeddings = bool(raw.get("tie_word_embeddings", model_type in TIED_BY_DEFAULT))
        module = MODEL_CLASSES[supported[0]][0]
        scheme = parse_quantization(raw, quantization, module)
        refusal = feature_refusal(module, raw, tie_word_embeddings)
        if refusal is not None:
            raise ValueError(refusal)
        rope_theta, rope_scaling = parse_hf_rope(raw)
        num_heads = raw["num_attention_heads"]
        num_layers = raw["num_hidden_layers"]
        layer_types, sliding_window = parse_layer_types(raw, num_layers)
        return cls(
            architecture=supported[0],
            model_type=model_type,
            name=raw.get("_name_or_path") or Path(path).name,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw.get("intermediate_size") or raw.get("ffn_dim"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=as_token_ids(raw.get("eos_token_id")),
            layer_types=layer_types,
            sliding_window=sliding_window,
            quantization=scheme,
            hf_config=MappingProxyType(raw),
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
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}")
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
        num_layers = field(f"{arch}.block_count")
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            model_type=arch,
            name=field("general.name") or Path(path).stem,
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=field(f"{arch}.feed_forward_length"),
            num_hidden_layers=num_layers,
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
            layer_types=(FULL_ATTENTION,) * num_layers,
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


def parse_layer_types(raw: dict, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(each layer's attention type, the sliding window or None), as transformers reads config.json.

    `layer_types` when present (transformers >= 4.54 writes it for Qwen2, Gemma 2/3); else Qwen2's older
    `use_sliding_window` + `max_window_layers` (layers from that index on slide); else a `sliding_window`
    (Mistral, Mixtral: every layer slides). A window no shorter than the context slides nothing."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is None:
        enabled = window is not None and raw.get("use_sliding_window", True)
        first_sliding = raw.get("max_window_layers") or 0 if "use_sliding_window" in raw else 0
        types = [SLIDING_ATTENTION if enabled and i >= first_sliding else FULL_ATTENTION for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ValueError(f"layer_types {types} is not {num_layers} of {FULL_ATTENTION!r} / {SLIDING_ATTENTION!r}")
    if SLIDING_ATTENTION not in types:
        return tuple(types), None
    if not window or window <= 0:
        raise ValueError(f"sliding_attention layers need a positive sliding_window (config has {window!r})")
    if window >= raw["max_position_embeddings"]:  # no context is longer: the window never cuts
        return (FULL_ATTENTION,) * num_layers, None
    return tuple(types), int(window)


ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}


def parse_hf_rope(raw: dict) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, scaling parameters or None) from either `rope_parameters` (transformers >= 5) or the older
    `rope_theta` + `rope_scaling` keys. The parameters are sorted (key, value) pairs with lists made tuples
    (hashable), `rope_type` and `original_max_position_embeddings` always among them; longrope's `factor`
    defaults to max / original positions, as transformers'. Types other than ROPE_REQUIRED_KEYS' are refused,
    and so is a partial rotary (`partial_rotary_factor` < 1): our rotary turns whole heads."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if FULL_ATTENTION in params:  # keyed by layer type (Gemma 3): the model file reads each; here the global one
        positions = raw["max_position_embeddings"]
        for layer_type in sorted(set(params) - {FULL_ATTENTION}):  # refused here, not when the model file reads it
            parse_hf_rope({"rope_parameters": params[layer_type], "max_position_embeddings": positions})
        params = dict(params[FULL_ATTENTION])
    rope_theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (rotary over whole heads only)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    if rope_type not in ROPE_REQUIRED_KEYS:
        raise ValueError(f"rope_scaling rope_type {rope_type!r} is not supported; supported: "
                         f"{['default', *ROPE_REQUIRED_KEYS]}")
    missing = [key for key in ROPE_REQUIRED_KEYS[rope_type] if params.get(key) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}")
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    params["original_max_position_embeddings"] = original or raw["max_position_embeddings"]
    if rope_type == "longrope" and params.get("factor") is None:
        params["factor"] = raw["max_position_embeddings"] / params["original_max_position_embeddings"]
    params = {key: tuple(value) if isinstance(value, list) else value for key, value in params.items()
              if key not in ("type", "rope_theta", "partial_rotary_factor")}
    return rope_theta, tuple(sorted({**params, "rope_type": rope_type}.items()))


def as_token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def quantization_name(path: str | Path, config: ModelConfig) -> str:
    """The checkpoint's quantization in vLLM's --quantization names, as ModelInfo reports it: "gguf" for a GGUF
    file (dequantized at load), the linear layers' method otherwise, "" when unquantized."""
    if find_gguf_file(path) is not None:
        return GGUF
    return "" if config.quantization is None else config.quantization.method
