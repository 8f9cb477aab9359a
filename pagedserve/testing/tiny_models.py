"""Tiny random Hugging Face checkpoints for tests and benchmarks: real config.json + safetensors, no tokenizer.

Why: token-exact comparisons against transformers need a real HF checkpoint, but tests may not
download. These models are small enough to run in milliseconds on a CPU and random enough that greedy
output depends on the context (large `initializer_range`), so a wrong position or block shows up.
"""

from __future__ import annotations

import hashlib
import json
import shutil
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
    # 4 experts of 128, top 2 (weights renormalized, as Mixtral always does); untied.
    "mixtral": dict(tie_word_embeddings=False, rope_theta=1000000.0, num_local_experts=4, num_experts_per_tok=2),
    # 8 experts of 32, top 2, unnormalized (norm_topk_prob false, transformers' default); layer 1 dense (128).
    "qwen3_moe": dict(tie_word_embeddings=False, rope_theta=1000000.0, use_sliding_window=False, head_dim=32,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[1]),
    # Gemma: explicit head_dim (its default is 256), tied; 2 and 3 alternate windowed (8 tokens, shorter than
    # the tests' prompts) and global layers, scale by query_pre_attn_scalar (not head_dim); 2 soft-caps at
    # values the random scores reach (greedy output changes without the attention cap); 3 gives each layer
    # type its own rope base. Smaller initializers: sqrt(hidden)-scaled embeddings at 0.2 saturate the
    # caps and the output repeats one token.
    # Every layer slides; a window of 20 (not a block multiple) is shorter than most test prompts.
    "mistral": dict(tie_word_embeddings=False, rope_theta=10000.0, sliding_window=20),
    "gemma": dict(head_dim=16, hidden_act="gelu_pytorch_tanh"),
    # Phi-3 with longrope whose original context (24) the tests' prompts and generations pass, so both factor
    # sets are used; fused qkv_proj / gate_up_proj in the checkpoint.
    "phi3": dict(
        tie_word_embeddings=False, pad_token_id=0, original_max_position_embeddings=24,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                         "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]},
    ),
    "gemma2": dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        initializer_range=0.05,
    ),
    "gemma3": dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    ),
}
# OPT names its sizes otherwise and has no GQA: its own base (a 3-layer pre-norm opt-125m in miniature, with
# OPT's special token ids); OPT_350M_OVERRIDES give 350m's post-norm layers and projections in and out.
OPT_350M_OVERRIDES = dict(do_layer_norm_before=False, word_embed_proj_dim=32, init_std=0.1)
OPT_CONFIG = dict(
    vocab_size=512, hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
    max_position_embeddings=512, init_std=0.2, bos_token_id=2, eos_token_id=None, pad_token_id=1,
)


CONFIG_CLASSES = {
    "llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
    "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "opt": "OPTConfig",
    "mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig", "phi3": "Phi3Config",
}
# Qwen2 with its upper layers sliding (overrides for make_tiny_model(arch="qwen2")): layers from
# max_window_layers on attend through a window of 12; transformers writes them out as layer_types.
QWEN2_SLIDING_WINDOW = dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)


def make_tiny_model(tmp_dir, arch="llama", seed=0, **overrides) -> Path:
    """Save a random tiny HF model (`arch` a key of CONFIG_CLASSES) under `tmp_dir`; return its directory.

    Defaults: vocab 512, hidden 64, 3 layers, 4 heads / 2 KV heads (GQA), head_dim 16, max positions
    512, initializer_range 0.2, bos 1 and no EOS (so generation always runs to its token limit; pass
    `eos_token_id=...` to have one). Llama: untied lm_head. Qwen2: q/k/v bias, tied embeddings,
    rope_theta 1e6. Qwen3: q/k norms, head_dim 32, tied embeddings. Mistral: Llama's layout with a sliding
    window of 20 on every layer. Gemma 1/2/3, Mixtral, Qwen3-MoE: see
    ARCH_DEFAULTS (the MoE router's initializer_range 0.2 spreads the tokens over the experts); OPT: OPT_CONFIG.
    `overrides` are config keys (e.g. `rope_scaling={...}`, `num_hidden_layers=2`),
    except `max_shard_size` (e.g. "100KB"), which is passed to `save_pretrained` to get sharded files.
    Weights are a pure function of (arch, seed, overrides); the directory name is too, so calls with
    different arguments can share one `tmp_dir`.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    max_shard_size = overrides.pop("max_shard_size", None)
    config_class = getattr(transformers, CONFIG_CLASSES[arch])
    base = OPT_CONFIG if arch == "opt" else {**BASE_CONFIG, **ARCH_DEFAULTS[arch]}
    kwargs = {**base, **overrides}
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


def add_embedded_tokenizer(model_dir) -> Path:
    """Gives a tiny model the embedded default model's tokenizer (SmolLM2's 49152-token BPE, from its GGUF, as the
    scheduler loads it) as tokenizer.json + tokenizer_config.json, with <|im_end|> (id 2) as EOS in both configs.
    Why: features that read token text (structured outputs, stop strings) need a real tokenizer, and a random
    model as small as these runs far faster than the real 135M one. Make the model with vocab_size >= 49152
    (larger pads the vocabulary past the tokenizer's) and eos_token_id=2."""
    from scheduler_svc.text.tokenizer_loading import load_tokenizer
    from service_runtime.model_source import resolve_model

    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(resolve_model(None).path)
    (model_dir / "tokenizer.json").write_text(tokenizer.to_json())
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": tokenizer.chat_template}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return model_dir


def make_repeater_model(tmp_dir, arch="qwen2", seed=0) -> Path:
    """`make_tiny_model`'s model (tied embeddings: qwen2 or qwen3) with every layer's o_proj and down_proj zero:
    the layers add nothing to the embedding, so greedy decoding repeats the last token, and every n-gram draft
    of a repeated token comes true (speculative decoding's acceptance, deterministically)."""
    from safetensors.torch import load_file, save_file

    source = make_tiny_model(tmp_dir, arch, seed)
    target = Path(tmp_dir) / f"{source.name}-repeater"
    shutil.copytree(source, target, dirs_exist_ok=True)
    weights = load_file(target / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target
