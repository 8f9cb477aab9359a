"""A random EAGLE-3 head in the published checkpoint layout (config.json + model.safetensors: fc, midlayer.*,
norm, lm_head, d2t, t2d), for a tiny target made by tiny_models.make_tiny_model: what the tests and the
speculative benchmark load with `{"method": "eagle3", "model": DIR}`. Untrained, so its proposals are
arbitrary tokens (few are kept): it checks the mechanism and measures its cost, not a trained head's gains."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch


def make_tiny_eagle3_head(tmp_dir, target_dir, seed: int = 0, draft_vocab_size: int | None = None,
                          aux_layer_ids: list[int] | None = None, own_embeddings: bool = False,
                          std: float = 0.2, dtype: torch.dtype = torch.float32) -> Path:
    """Writes a random head for the target at `target_dir` (its hidden size, heads and vocabulary) under
    `tmp_dir`; returns its directory. `draft_vocab_size` below the target's picks a random subset of the
    target's ids (d2t maps to them); `aux_layer_ids` None leaves the config without eagle_config (vLLM's
    default layers). `dtype`: the stored floats' (the benchmark's large shapes store bfloat16)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target.get("num_key_value_heads") or target["num_attention_heads"]
    head_dim = target.get("head_dim") or hidden // heads
    inter = target["intermediate_size"]
    draft_vocab = draft_vocab_size or vocab
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator) * std

    ids = torch.sort(torch.randperm(vocab, generator=generator)[:draft_vocab]).values
    tensors = {
        "fc.weight": randn(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": randn(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": randn(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": randn(inter, hidden),
        "midlayer.mlp.up_proj.weight": randn(inter, hidden),
        "midlayer.mlp.down_proj.weight": randn(hidden, inter),
        "midlayer.input_layernorm.weight": 1 + randn(hidden),
        "midlayer.hidden_norm.weight": 1 + randn(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + randn(hidden),
        "norm.weight": 1 + randn(hidden),
        "lm_head.weight": randn(draft_vocab, hidden) * 5,
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True),
    }
    if own_embeddings:
        tensors["embed_tokens.weight"] = randn(vocab, hidden) * 5
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": 1, "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": target.get("rope_theta", 10000.0), "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "tie_word_embeddings": False,
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    key = json.dumps([str(target_dir), seed, draft_vocab, aux_layer_ids, own_embeddings, std, str(dtype)])
    path = Path(tmp_dir) / f"tiny-eagle3-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    from safetensors.torch import save_file

    save_file({name: (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
               for name, tensor in tensors.items()}, str(path / "model.safetensors"))
    return path


def make_echo_eagle3_head(tmp_dir, target_dir, dtype: torch.dtype = torch.float32) -> Path:
    """A head that proposes, again and again, the token at its state's position: fc passes the target's state
    entering layer 0 (the token's embedding) through, the layer adds nothing (o_proj and down_proj zero), and
    lm_head is the target's embedding matrix. Beside a repeater target (tiny_models.make_repeater_model: greedy
    output repeats the last token) its proposals come true, so drafts are kept through the processes."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    source = make_tiny_eagle3_head(tmp_dir, target_dir, seed=0, aux_layer_ids=[0, 0, 0], dtype=dtype)
    path = Path(tmp_dir) / f"{source.name}-echo"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text((source / "config.json").read_text())
    weights = load_file(source / "model.safetensors")
    hidden = weights["fc.weight"].shape[0]
    weights["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, 2 * hidden)], dim=1).to(dtype)
    for name in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
        weights[name] = torch.zeros_like(weights[name])
    weights["norm.weight"] = torch.ones(hidden, dtype=dtype)
    for shard in sorted(Path(target_dir).glob("*.safetensors")):  # the target's embeddings, in whichever shard
        with safe_open(str(shard), "pt") as tensors:
            if "model.embed_tokens.weight" in tensors.keys():
                weights["lm_head.weight"] = tensors.get_tensor("model.embed_tokens.weight").to(dtype)
    save_file(weights, str(path / "model.safetensors"))
    return path
