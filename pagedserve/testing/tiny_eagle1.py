"""A random EAGLE-1 head in the published checkpoint layout (config.json + model.safetensors: fc, layers.N.*, where
layer 0 has no input_layernorm; optionally fc.bias, embed_tokens, lm_head), for a tiny target made by
tiny_models.make_tiny_model: what the tests load with `{"method": "eagle", "model": DIR}`. Untrained, so its
proposals are arbitrary tokens (few are kept): it checks the mechanism, not a trained head's gains."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch


def make_tiny_eagle1_head(tmp_dir, target_dir, seed: int = 0, num_layers: int = 1, fc_bias: bool = True,
                          own_embeddings: bool = False, own_lm_head: bool = False, std: float = 0.2) -> Path:
    """Writes a random head for the target at `target_dir` (its hidden size, heads and vocabulary) under
    `tmp_dir`; returns its directory. `fc_bias`: the EAGLE repo's default (its `bias` config key)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target.get("num_key_value_heads") or target["num_attention_heads"]
    head_dim = target.get("head_dim") or hidden // heads
    inter = target["intermediate_size"]
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator) * std

    tensors = {"fc.weight": randn(hidden, 2 * hidden)}
    if fc_bias:
        tensors["fc.bias"] = randn(hidden)
    for index in range(num_layers):
        prefix = f"layers.{index}."
        tensors.update({
            f"{prefix}self_attn.q_proj.weight": randn(heads * head_dim, hidden),
            f"{prefix}self_attn.k_proj.weight": randn(kv_heads * head_dim, hidden),
            f"{prefix}self_attn.v_proj.weight": randn(kv_heads * head_dim, hidden),
            f"{prefix}self_attn.o_proj.weight": randn(hidden, heads * head_dim),
            f"{prefix}mlp.gate_proj.weight": randn(inter, hidden),
            f"{prefix}mlp.up_proj.weight": randn(inter, hidden),
            f"{prefix}mlp.down_proj.weight": randn(hidden, inter),
            f"{prefix}post_attention_layernorm.weight": 1 + randn(hidden),
        })
        if index > 0:
            tensors[f"{prefix}input_layernorm.weight"] = 1 + randn(hidden)
    if own_embeddings:
        tensors["embed_tokens.weight"] = randn(vocab, hidden) * 5
    if own_lm_head:
        tensors["lm_head.weight"] = randn(vocab, hidden) * 5
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": num_layers, "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": target.get("rope_theta", 10000.0), "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": vocab, "bias": fc_bias, "tie_word_embeddings": False,
    }
    key = json.dumps([str(target_dir), seed, num_layers, fc_bias, own_embeddings, own_lm_head, std])
    path = Path(tmp_dir) / f"tiny-eagle1-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    return _write(path, config, tensors)


def make_echo_eagle1_head(tmp_dir, target_dir) -> Path:
    """A head whose output state is the target's state it reads: fc passes the state through (the token's
    embedding gets weight zero), and its layer adds nothing (o_proj and down_proj zero). Its proposals are then the
    target's own greedy next token after the state's position, again and again: beside a repeater target
    (tiny_models.make_repeater_model: greedy output repeats the last token) they come true, so drafts are kept
    through the processes. It reads the target's embeddings and LM head (the published layout)."""
    from safetensors.torch import load_file

    source = make_tiny_eagle1_head(tmp_dir, target_dir, seed=0, fc_bias=False)
    weights = load_file(source / "model.safetensors")
    hidden = weights["fc.weight"].shape[0]
    weights["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        weights[name] = torch.zeros_like(weights[name])
    return _write(Path(tmp_dir) / f"{source.name}-echo", json.loads((source / "config.json").read_text()), weights)


def _write(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path / "model.safetensors"))
    return path
