"""What a checkpoint's config.json may ask for that the model files cannot serve, refused from config.json alone.

Why here and not in each model's constructor: ModelConfig applies these (model_config.py), and the launcher
reads ModelConfig before any child starts (pagedserve/serve_checks.py resolve_servable_model), without torch. A
feature refused only when the worker builds the model surfaced as the worker's traceback after the scheduler
and the gateway had started, once per restart. So this module imports nothing heavy, and the model files take
what passes here as given.

Quantization (a checkpoint's `quantization_config`, `--quantization`) is decided in
worker_svc/quantization_config.py: compressed-tensors FP8 is served, every other method refused.

`FAMILY_REFUSALS`: per model file (models/registry.py's module names), the config.json keys it cannot honour,
each found by a function of (config.json as read, tie_word_embeddings as ModelConfig resolved it) that
returns the reason or None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# Gemma's GeGLU: the HF activation names worker_svc/layers/gated_mlp.py computes (besides the Llama family's silu).
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
OPT_ACTIVATIONS = ("relu", "gelu")


def _gemma(raw: Mapping[str, Any], tied: bool) -> str | None:
    if not tied:
        return "Gemma checkpoints tie the head to the embeddings (tie_word_embeddings=False given)"
    if raw.get("use_bidirectional_attention"):
        return "use_bidirectional_attention=True (an encoder) is not supported"
    key = "hidden_act" if raw.get("model_type") == "gemma" else "hidden_activation"
    if raw.get(key) is not None and raw[key] not in GEMMA_ACTIVATIONS:
        return f"{key} {raw[key]!r} is not supported; supported: {list(GEMMA_ACTIVATIONS)}"
    return None


def _opt(raw: Mapping[str, Any], tied: bool) -> str | None:
    activation = raw.get("activation_function", "relu")
    if activation not in OPT_ACTIVATIONS:
        return f"activation_function {activation!r} is not supported; supported: {list(OPT_ACTIVATIONS)}"
    if not tied:
        return "OPT with an untied lm_head (tie_word_embeddings=False) is not supported"
    return None


def _silu_experts(raw: Mapping[str, Any], num_experts: int) -> str | None:
    """What both MoE families refuse: an activation other than SiLU, a top-k outside the experts."""
    if raw.get("hidden_act", "silu") != "silu":
        return f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')"
    top_k = raw.get("num_experts_per_tok")
    if not isinstance(top_k, int) or not 0 < top_k <= num_experts:
        return f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts"
    return None


def _mixtral(raw: Mapping[str, Any], tied: bool) -> str | None:
    return _silu_experts(raw, raw.get("num_local_experts") or 0)


def _qwen3_moe(raw: Mapping[str, Any], tied: bool) -> str | None:
    if raw.get("shared_expert_intermediate_size"):
        size = raw["shared_expert_intermediate_size"]
        return f"shared experts (shared_expert_intermediate_size {size}) are not supported"
    if raw.get("use_sliding_window"):
        return "use_sliding_window=true is not supported for qwen3_moe (only full attention)"
    # The hub's config.json says num_experts; transformers 5 writes it as num_local_experts.
    return _silu_experts(raw, raw.get("num_experts") or raw.get("num_local_experts") or 0)


FAMILY_REFUSALS: dict[str, Callable[[Mapping[str, Any], bool], str | None]] = {
    "gemma": _gemma, "opt": _opt, "mixtral": _mixtral, "qwen3_moe": _qwen3_moe,
}


def feature_refusal(module: str, raw: Mapping[str, Any], tie_word_embeddings: bool) -> str | None:
    """Why the model file `module` cannot serve this config.json, or None."""
    refusal = FAMILY_REFUSALS.get(module)
    return None if refusal is None else refusal(raw, tie_word_embeddings)
