"""The benchmark model shapes of DESIGN.md and issue 16, as Hugging Face configs (random weights: no hub on GPU
machines). Each shape names its transformers config class; the other keys are that config's."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

SHAPES = {
    "qwen2.5-1.5b": dict(
        config_class="Qwen2Config", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
    "llama-3.1-8b": dict(
        config_class="LlamaConfig", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500_000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
    ),
    "qwen3-8b": dict(
        config_class="Qwen3Config", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
        rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6, use_sliding_window=False,
    ),
    "gemma-2-9b": dict(
        config_class="Gemma2Config", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000, tie_word_embeddings=True,
        rope_theta=10_000.0, max_position_embeddings=8192, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
    ),
}
ARCHITECTURES = {
    "Qwen2Config": "Qwen2ForCausalLM", "LlamaConfig": "LlamaForCausalLM", "Qwen3Config": "Qwen3ForCausalLM",
    "Gemma2Config": "Gemma2ForCausalLM",
}


def hf_config(shape: str, **overrides):
    """The transformers config of `shape`, with `overrides` (e.g. num_hidden_layers) applied before it is built,
    so that fields derived from them (such as layer_types) follow."""
    import transformers

    fields = {**SHAPES[shape], **overrides}
    config_class = fields.pop("config_class")
    return getattr(transformers, config_class)(
        **fields, bos_token_id=1, eos_token_id=2, architectures=[ARCHITECTURES[config_class]]
    )


def write_config_dir(shape: str, directory: Path) -> Path:
    """A model directory holding only config.json: served with --load-format dummy."""
    directory.mkdir(parents=True, exist_ok=True)
    hf_config(shape).save_pretrained(directory)
    return directory


def head_dim(shape: str) -> int:
    s = SHAPES[shape]
    return s.get("head_dim") or s["hidden_size"] // s["num_attention_heads"]


@functools.cache
def parameter_count(shape: str) -> int:
    """Parameters of our model of `shape`, counted on the meta device (no memory): exact for any architecture."""
    import torch

    from worker_svc.model_config import ModelConfig
    from worker_svc.models.registry import build_model

    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(hf_config(shape).to_dict()))
        config = ModelConfig.from_hf_dir(directory)
    with torch.device("meta"):
        model = build_model(config)
    return sum(parameter.numel() for parameter in model.parameters())


def parameter_bytes(shape: str, bytes_per_param: int = 2) -> int:
    return parameter_count(shape) * bytes_per_param


def kv_bytes_per_token(shape: str, bytes_per_value: int = 2) -> int:
    s = SHAPES[shape]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim(shape) * bytes_per_value
