"""Tiny random Hugging Face checkpoints for tests and benchmarks: real config.json + safetensors, no tokenizer.

Why: token-exact comparisons against transformers need a real HF checkpoint, but tests may not
download. These models are small enough to run in milliseconds on a CPU and random enough that greedy
output depends on the context (large `initializer_range`), so a wrong position or block shows up.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

BASE_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=None,
)
ARCH_DEFAULTS = {
    "llama": dict(tie_word_embeddings=False, rope_theta=10000.0),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False),
    # head_dim 32, not hidden / heads (16): Qwen3's is explicit.
    "qwen3": dict(tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False, head_dim=32),
    # Every layer slides; a window of 20 (not a block multiple) is shorter than most test prompts.
    "mistral": dict(tie_word_embeddings=False, rope_theta=10000.0, sliding_window=20),
}
# Qwen2 with its upper layers sliding (overrides for make_tiny_model(arch="qwen2")): layers from
# max_window_layers on attend through a window of 12; transformers writes them out as layer_types.
QWEN2_SLIDING_WINDOW = dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)


def make_tiny_model(tmp_dir, arch="llama", seed=0, **overrides) -> Path:
    """Save a random tiny HF model (`arch` "llama", "qwen2", "qwen3" or "mistral") under `tmp_dir`; return its
    directory.

    Defaults: vocab 512, hidden 64, 3 layers, 4 heads / 2 KV heads (GQA), head_dim 16, max positions
    512, initializer_range 0.2, bos 1 and no EOS (so generation always runs to its token limit; pass
    `eos_token_id=...` to have one). Llama: untied lm_head. Qwen2: q/k/v bias, tied embeddings,
    rope_theta 1e6. Qwen3: q/k norms, head_dim 32, tied embeddings. Mistral: Llama's layout with a sliding
    window of 20 on every layer. `overrides` are config keys (e.g. `rope_scaling={...}`, `num_hidden_layers=2`),
    except `max_shard_size` (e.g. "100KB"), which is passed to `save_pretrained` to get sharded files.
    Weights are a pure function of (arch, seed, overrides); the directory name is too, so calls with
    different arguments can share one `tmp_dir`.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    max_shard_size = overrides.pop("max_shard_size", None)
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
    kwargs = {**BASE_CONFIG, **ARCH_DEFAULTS[arch], **overrides}
    digest = hashlib.sha1(
        json.dumps([kwargs, max_shard_size], sort_keys=True, default=str).encode()
    ).hexdigest()[:10]
    path = Path(tmp_dir) / f"tiny-{arch}-seed{seed}-{digest}"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**kwargs), dtype=torch.float32)
    perturb_norms_and_biases(model)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return path


def perturb_norms_and_biases(model: torch.nn.Module) -> None:
    """HF initializes norm weights to 1 and biases to 0, which would hide a swapped norm or a dropped
    bias; give them random values (from the already seeded global generator) instead."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
