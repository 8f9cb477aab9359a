"""An EAGLE-1 head's config.json, read without torch: the launcher refuses a head it cannot serve before any
process starts (`eagle1_refusal`), and the workers build the head from it (models/eagle1.py).

The published layout (SafeAILab/EAGLE's `Model`, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B; vLLM's
EagleLlamaForCausalLM): a Llama config whose `num_hidden_layers` (1 in every published head) counts the head's own
layers, with the target's hidden size and vocabulary. Its architectures say LlamaForCausalLM (the EAGLE repo's) or
one of vLLM's names; an EAGLE-3 head is refused here with the method it needs. What every EAGLE head's config
shares lives in eagle3_config.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from worker_svc.model_config import ModelConfig
from worker_svc.models.eagle3_config import (EAGLE3_ARCHITECTURES, head_layers_config, head_refusal,
                                             read_head_config_json)

EAGLE1_ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle")


def read_eagle1_config(path: str | Path, target_positions: int = 0) -> ModelConfig:
    """The head's layers as a ModelConfig (their KV pool and attention are sized from it). Raises ValueError naming
    what it does not serve. `target_positions`: the target's max_position_embeddings (`head_layers_config`)."""
    raw = read_head_config_json(path)
    architectures = raw.get("architectures") or []
    if any(name in EAGLE3_ARCHITECTURES for name in architectures):
        raise ValueError(f"architectures {architectures}: an EAGLE-3 head (method eagle3)")
    if architectures and not any(name in EAGLE1_ARCHITECTURES for name in architectures):
        raise ValueError(f"architectures {architectures}: not an EAGLE-1 Llama head (served: "
                         f"{', '.join(EAGLE1_ARCHITECTURES)})")
    if raw.get("add_para_norm"):
        raise ValueError("add_para_norm (HASS) heads are not served (norms of the embedding and the state)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("EAGLE-1 heads with attention or MLP biases are not served")
    num_layers = raw.get("num_hidden_layers", 1)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_hidden_layers {num_layers!r}: an EAGLE-1 head has at least one layer")
    names = safetensors_names(path)
    if names is not None and "fc.weight" not in names:
        raise ValueError("its checkpoint has no fc.weight (not an EAGLE-1 head)")
    return head_layers_config(raw, path, EAGLE1_ARCHITECTURES[1], num_layers, target_positions)


def safetensors_names(path: str | Path) -> set[str] | None:
    """The tensor names of the directory's *.safetensors files, from their JSON headers (no torch); None when it
    has none (a pytorch_model.bin head: the worker checks its names when it loads them)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for file in files:
        with open(file, "rb") as handle:
            header = handle.read(8)
            if len(header) != 8:
                raise ValueError(f"{file.name}: not a safetensors file")
            (length,) = struct.unpack("<Q", header)
            names.update(name for name in json.loads(handle.read(length)) if name != "__metadata__")
    return names


def eagle1_refusal(head_dir: str | Path, target: ModelConfig, world_size: int) -> str | None:
    """Why the EAGLE-1 head at `head_dir` cannot run beside `target` at this tensor-parallel size, or None (the
    launcher asks before any process starts; the workers again at setup)."""
    return head_refusal("EAGLE-1", head_dir, target, world_size,
                        lambda: read_eagle1_config(head_dir, target.max_position_embeddings))
