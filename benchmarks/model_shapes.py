"""The benchmark model shapes of DESIGN.md, as Hugging Face configs (random weights: no hub on GPU machines)."""

from __future__ import annotations

from pathlib import Path

SHAPES = {
    "qwen2.5-1.5b": dict(
        architecture="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
    "llama-3.1-8b": dict(
        architecture="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500_000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
    ),
}


def hf_config(shape: str, **overrides):
    """The transformers config of `shape`, with `overrides` (e.g. num_hidden_layers) applied before it is built,
    so that fields derived from them (such as layer_types) follow."""
    from transformers import LlamaConfig, Qwen2Config

    fields = {**SHAPES[shape], **overrides}
    architecture = fields.pop("architecture")
    config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig}[architecture]
    model_class = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[architecture]
    return config_class(**fields, bos_token_id=1, eos_token_id=2, architectures=[model_class])


def write_config_dir(shape: str, directory: Path) -> Path:
    """A model directory holding only config.json: served with --load-format dummy."""
    directory.mkdir(parents=True, exist_ok=True)
    hf_config(shape).save_pretrained(directory)
    return directory


def parameter_bytes(shape: str, bytes_per_param: int = 2) -> int:
    s = SHAPES[shape]
    h, i, layers, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    head_dim = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    embeddings = v * h * (1 if s["tie_word_embeddings"] else 2)
    return (layers * per_layer + embeddings + h) * bytes_per_param


def kv_bytes_per_token(shape: str, bytes_per_value: int = 2) -> int:
    s = SHAPES[shape]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim * bytes_per_value
