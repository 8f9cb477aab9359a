"""An EAGLE-3 head's config.json, read without torch: the launcher refuses a head it cannot serve before any
process starts (`eagle3_refusal`), and the workers build the head from it (models/eagle3.py). What every EAGLE
head's config shares (its keys, its layers' ModelConfig, the targets it can run beside) is here too, for
eagle1_config.py.

Which target layers feed the head: `eagle_config.eagle_aux_hidden_state_layer_ids` when the config names them,
else vLLM's default (2, L // 2, L - 3); each is the residual stream entering that layer (Hugging Face's
`hidden_states[i]`), concatenated in layer order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

from worker_svc.model_config import ModelConfig, parse_hf_rope

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Targets whose forward pass returns the states a head reads (LlamaForCausalLM's decoder loop: llama.py).
EAGLE3_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's choice when the head's config names none: the states entering layers 2, L // 2 and L - 3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def read_head_config_json(path: str | Path) -> dict:
    """An EAGLE head's config.json, with the keys every head's layers are built from (ValueError naming those
    it lacks)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    missing = [key for key in ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
                               "max_position_embeddings") if key not in raw]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    return raw


def head_layers_config(raw: dict, path: str | Path, architecture: str, num_layers: int,
                       target_positions: int) -> ModelConfig:
    """An EAGLE head's `num_layers` Llama layers as a ModelConfig (their KV pool and attention are sized from it).
    The head runs at the target's positions, so its rotary table covers at least the target's
    max_position_embeddings (`target_positions`; published heads often say 2048 for a 128k target: a shorter
    table was read out of bounds past it); RoPE is a function of the position, so the longer table is the same
    math."""
    hidden, num_heads = raw["hidden_size"], raw["num_attention_heads"]
    rope_theta, rope_scaling = parse_hf_rope(raw)
    return ModelConfig(
        architecture=architecture, model_type="llama", name=Path(path).name,
        vocab_size=raw["vocab_size"], hidden_size=hidden, intermediate_size=raw["intermediate_size"],
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden // num_heads, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=max(raw["max_position_embeddings"], target_positions),
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_ids=(),
        hf_config=MappingProxyType(raw))


def head_refusal(kind: str, head_dir: str | Path, target: ModelConfig, world_size: int,
                 read_layers_config: Callable[[], ModelConfig]) -> str | None:
    """Why an EAGLE head (`kind`: "EAGLE-3", "EAGLE-1") at `head_dir` cannot run beside `target` at this
    tensor-parallel size, or None: its layers are not sharded, only the Llama family's forward pass returns its
    states, and its layers' config (`read_layers_config`, ValueError naming what it does not serve) must have
    the target's hidden size and vocabulary."""
    if world_size > 1:
        return f"an {kind} head is served at --tensor-parallel-size 1 only (its layer is not sharded)"
    if target.architecture not in EAGLE3_TARGETS:
        return (f"an {kind} head needs a Llama-family target ({', '.join(EAGLE3_TARGETS)}); "
                f"{target.architecture} is not served with one")
    try:
        config = read_layers_config()
    except (ValueError, KeyError, OSError) as error:
        return f"cannot serve the {kind} head {head_dir}: {error}"
    if config.hidden_size != target.hidden_size or config.vocab_size != target.vocab_size:
        return (f"the {kind} head's hidden_size {config.hidden_size} and vocab_size {config.vocab_size} must be "
                f"the target's ({target.hidden_size}, {target.vocab_size})")
    return None


def read_eagle3_config(path: str | Path, num_target_layers: int,
                       target_positions: int = 0) -> tuple[ModelConfig, int, tuple[int, ...]]:
    """The head's layer as a ModelConfig (one layer: its KV pool and attention are sized from it), its draft
    vocabulary size and the target layers it reads. Raises ValueError naming what it does not serve.
    `target_positions`: the target's max_position_embeddings (`head_layers_config`)."""
    raw = read_head_config_json(path)
    architectures = raw.get("architectures") or []
    if not any(name in EAGLE3_ARCHITECTURES for name in architectures):
        raise ValueError(f"architectures {architectures}: not an EAGLE-3 Llama head (served: "
                         f"{', '.join(EAGLE3_ARCHITECTURES)})")
    if raw.get("norm_before_residual"):
        raise ValueError("norm_before_residual heads are not served (the residual takes the state unnormed)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("EAGLE-3 heads with attention or MLP biases are not served")
    config = head_layers_config(raw, path, EAGLE3_ARCHITECTURES[0], 1, target_positions)
    layer_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layer_ids = tuple(layer_ids) if layer_ids else default_aux_layer_ids(num_target_layers)
    if len(layer_ids) != 3 or not all(0 <= i < num_target_layers for i in layer_ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(layer_ids)}: three layers of the target's "
                         f"{num_target_layers} are needed")
    return config, raw.get("draft_vocab_size") or raw["vocab_size"], layer_ids


def eagle3_refusal(head_dir: str | Path, target: ModelConfig, world_size: int) -> str | None:
    """Why the EAGLE-3 head at `head_dir` cannot run beside `target` at this tensor-parallel size, or None (the
    launcher asks before any process starts; the workers again at setup)."""
    return head_refusal("EAGLE-3", head_dir, target, world_size, lambda: read_eagle3_config(
        head_dir, target.num_hidden_layers, target.max_position_embeddings)[0])
