"""The benchmark model shapes of DESIGN.md and issue 16, as Hugging Face configs (random weights: no hub on GPU
machines). Each shape names its transformers config class; the other keys are that config's.

Parameters are counted on our model of the shape built on the meta device (exact for every architecture).
MoE shapes (Qwen3-30B-A3B, Mixtral-8x7B): a decode step reads every non-expert weight and, in each sparse
layer, only the experts some token of the batch chose. `decode_weight_bytes` counts those, with the expected
number of distinct experts a batch of B tokens picks under uniform routing, E * (1 - (1 - k / E)^B): at
W1's 256 sequences that is every expert of both shapes (the floor is then all weight bytes), at batch 1 only k.
"""

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
    "llama-3.1-70b": dict(
        config_class="LlamaConfig", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
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
    "mistral-7b": dict(
        config_class="MistralConfig", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False,
        rope_theta=10_000.0, max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=4096,
    ),
    "gemma-3-4b": dict(
        config_class="Gemma3TextConfig", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208, tie_word_embeddings=True,
        max_position_embeddings=131072, rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=1024,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
    ),
    # Phi-3-mini-128k's widths and longrope (its 48 short and long factors replaced by a smooth ramp).
    "phi-3-mini-128k": dict(
        config_class="Phi3Config", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, tie_word_embeddings=False,
        max_position_embeddings=131072, original_max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                         "short_factor": [1.0 + 0.02 * i for i in range(48)],
                         "long_factor": [1.0 + 0.9 * i for i in range(48)]},
    ),
    "opt-125m": dict(
        config_class="OPTConfig", hidden_size=768, ffn_dim=3072, num_hidden_layers=12, num_attention_heads=12,
        vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=768, do_layer_norm_before=True,
        tie_word_embeddings=True,
    ),
    "qwen3-30b-a3b": dict(
        config_class="Qwen3MoeConfig", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
        rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    ),
    "mixtral-8x7b": dict(
        config_class="MixtralConfig", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False,
        rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-5,
        num_local_experts=8, num_experts_per_tok=2,
    ),
}
ARCHITECTURES = {
    "Qwen2Config": "Qwen2ForCausalLM", "LlamaConfig": "LlamaForCausalLM", "Qwen3Config": "Qwen3ForCausalLM",
    "Gemma2Config": "Gemma2ForCausalLM", "OPTConfig": "OPTForCausalLM", "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
    "MixtralConfig": "MixtralForCausalLM", "MistralConfig": "MistralForCausalLM",
    "Gemma3TextConfig": "Gemma3ForCausalLM", "Phi3Config": "Phi3ForCausalLM",
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


def experts(shape: str) -> tuple[int, int, int]:
    """(experts per sparse layer, chosen per token, expert width); (0, 0, 0) for a dense shape. Every layer of
    both MoE shapes is sparse."""
    s = SHAPES[shape]
    num_experts = s.get("num_experts") or s.get("num_local_experts") or 0
    if not num_experts:
        return 0, 0, 0
    return num_experts, s["num_experts_per_tok"], s.get("moe_intermediate_size") or s["intermediate_size"]


def _expert_parameters(shape: str, experts_per_layer: float) -> float:
    _, _, width = experts(shape)
    return SHAPES[shape]["num_hidden_layers"] * experts_per_layer * 3 * SHAPES[shape]["hidden_size"] * width


def _always_read_parameters(shape: str) -> int:
    """Parameters every step reads: attention, norms, routers, dense MLPs, embeddings and head."""
    return parameter_count(shape) - int(_expert_parameters(shape, experts(shape)[0]))


def expected_experts_read(shape: str, batch: int) -> float:
    """Distinct experts a sparse layer reads for `batch` tokens routed uniformly: E * (1 - (1 - k / E)^B)."""
    num_experts, top_k, _ = experts(shape)
    return num_experts * (1 - (1 - top_k / num_experts) ** batch) if num_experts else 0.0


def decode_weight_bytes(shape: str, batch: int, bytes_per_param: int = 2) -> float:
    """Weight bytes one decode step of `batch` sequences reads: all of a dense shape; for MoE the always-read
    parameters plus, per layer, 3 * hidden * width for each expert read (expected_experts_read)."""
    if not experts(shape)[0]:
        return parameter_bytes(shape, bytes_per_param)
    read = _always_read_parameters(shape) + _expert_parameters(shape, expected_experts_read(shape, batch))
    return read * bytes_per_param


def active_parameters_per_token(shape: str) -> int:
    """Parameters one token multiplies by (its k experts only): the prefill FLOPs are 2 per parameter."""
    return _always_read_parameters(shape) + int(_expert_parameters(shape, experts(shape)[1]))


def kv_bytes_per_token(shape: str, bytes_per_value: int = 2) -> int:
    s = SHAPES[shape]
    kv_heads = s.get("num_key_value_heads") or s["num_attention_heads"]
    return 2 * s["num_hidden_layers"] * kv_heads * head_dim(shape) * bytes_per_value
