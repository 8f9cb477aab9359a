"""The LoRA adapters a server serves (`--lora-modules`) and what each PEFT adapter directory says about itself.

Why here, in the shared runtime: the scheduler parses the flag (it maps each request's `lora_name` to its
adapter), the launcher and the offline LLM refuse a bad adapter before any child starts, and the worker reads
the same adapter_config.json when it loads the weights. Standard library only: every service imports this.

An adapter is what PEFT's `save_pretrained` writes: `adapter_config.json` and `adapter_model.safetensors`. This
slice serves LoRA on the attention and MLP projections (q/k/v/o_proj, gate/up/down_proj), with PEFT's scaling
(`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`), and refuses, naming the adapter and the key,
everything it would otherwise serve wrongly: DoRA, `modules_to_save`, biases, embedding or lm_head targets,
per-module rank or alpha patterns, a rank above `--max-lora-rank`.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The projections this slice serves, by their HF names (the Llama family's).
SERVED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True)
class LoraModule:
    """One `--lora-modules` entry: the name requests use (`model` in the OpenAI API, `lora_name` over gRPC), the
    adapter directory, and the base model it was trained on (vLLM's JSON form; /v1/models shows it as the
    adapter's `parent`; None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None
    # Which load of `name` this is: 0 for --lora-modules, then 1, 2, ... for each runtime load of the name
    # (api/lora_registry.py). Part of the adapter's identity in the GPU slots, the workers' host copies and the
    # prefix cache, so an adapter rewritten on disk and loaded again under the same name and path is another one.
    generation: int = 0

    def to_flag(self) -> str:
        """How the entry is written on a child's command line (parsed back by `lora_module`)."""
        if self.base_model_name is None and "=" not in self.name:
            return f"{self.name}={self.path}"
        return json.dumps({"name": self.name, "path": self.path, "base_model_name": self.base_model_name})


def lora_module(text: str) -> LoraModule:
    """One `--lora-modules` value: `name=path`, or vLLM's JSON '{"name": ..., "path": ..., "base_model_name": ...}'.
    Raises ValueError naming what is wrong (argparse turns it into a usage error)."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON: {error}") from None
        unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)} (name, path, base_model_name)")
        if not isinstance(fields.get("name"), str) or not isinstance(fields.get("path"), str):
            raise ValueError("the JSON form needs string 'name' and 'path'")
        module = LoraModule(fields["name"], fields["path"], fields.get("base_model_name"))
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"{text!r}: expected name=path or a JSON object")
        module = LoraModule(name, path)
    if not module.name or not module.path:
        raise ValueError(f"{text!r}: the name and the path must not be empty")
    return module


@dataclass(frozen=True)
class LoraAdapterConfig:
    """What the worker needs of an adapter's adapter_config.json: its rank, its scaling and the projections it
    targets (HF names, a subset of SERVED_TARGETS; which layers actually hold weights is the weights file's)."""

    rank: int
    scaling: float
    target_modules: tuple[str, ...]


def read_adapter_config(module: LoraModule, max_lora_rank: int) -> LoraAdapterConfig:
    """The adapter's config, or ValueError naming the adapter and the key it cannot serve."""
    where = f"LoRA adapter {module.name!r} ({module.path})"
    config_path = os.path.join(module.path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path) or not os.path.isfile(os.path.join(module.path, ADAPTER_WEIGHTS)):
        raise ValueError(f"{where}: not a PEFT adapter directory (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    with open(config_path, encoding="utf-8") as file:
        config = json.load(file)

    def refuse(key: str, why: str) -> ValueError:
        return ValueError(f"{where}: {key}: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"{config['peft_type']!r} is not served (LORA only)")
    if config.get("use_dora"):
        raise refuse("use_dora", "DoRA adapters are not served")
    if config.get("modules_to_save"):
        raise refuse("modules_to_save", f"{config['modules_to_save']} (fully trained modules) are not served")
    if config.get("bias", "none") != "none":
        raise refuse("bias", f"{config['bias']!r}: adapters that train biases are not served (only 'none')")
    for key in ("rank_pattern", "alpha_pattern", "layer_replication", "target_parameters", "lora_bias",
                "fan_in_fan_out", "megatron_config", "trainable_token_indices"):
        if config.get(key):
            raise refuse(key, f"{config[key]!r} is not served")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise refuse("r", f"{rank!r} is not a positive rank")
    if rank > max_lora_rank:
        raise refuse("r", f"rank {rank} is above --max-lora-rank {max_lora_rank}")
    targets = config.get("target_modules")
    if isinstance(targets, str):  # PEFT's regex form: which modules it hit is read from the weights file
        targets = list(SERVED_TARGETS)
    if not targets:
        raise refuse("target_modules", "names no module")
    unserved = sorted(set(targets) - set(SERVED_TARGETS))
    if unserved:
        raise refuse("target_modules", f"{unserved}: LoRA is served on {', '.join(SERVED_TARGETS)} only "
                     "(not embeddings, lm_head or other modules)")
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraAdapterConfig(rank, float(scaling), tuple(t for t in SERVED_TARGETS if t in targets))


def adapters_refusal(modules: tuple[LoraModule, ...], max_lora_rank: int) -> str | None:
    """Why one of the adapters cannot be served (a missing directory, a refused key), or None: read before any
    process starts (the launcher, the offline LLM), so a bad adapter fails the start naming it."""
    for module in modules:
        try:
            read_adapter_config(module, max_lora_rank)
        except (ValueError, OSError) as error:
            return str(error)
    return None


_PEFT_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight$")


@dataclass(frozen=True)
class ProjectionShapes:
    """The base model's decoder layers and each served projection's (input, output) features, unsharded, from
    its config.json: what a runtime-loaded adapter's tensors must match, checked before any worker loads them (a
    worker that found a mismatch inside a step would fail as in a crash, again for every request of the
    adapter)."""

    num_layers: int
    features: dict[str, tuple[int, int]]


def read_projection_shapes(model_path: str) -> ProjectionShapes | None:
    """The shapes of a Llama-family model directory's projections; None where there is no config.json (a GGUF
    file: the worker's own check is then the only one)."""
    try:
        with open(os.path.join(model_path, "config.json")) as file:
            config = json.load(file)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        intermediate, layers = config["intermediate_size"], config["num_hidden_layers"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    attention, kv = heads * head_dim, kv_heads * head_dim
    return ProjectionShapes(layers, {"q_proj": (hidden, attention), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                                     "o_proj": (attention, hidden), "gate_proj": (hidden, intermediate),
                                     "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)})


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def read_adapter_tensor_names(module: LoraModule, rank: int, shapes: ProjectionShapes | None = None) -> None:
    """Refuses (ValueError naming the adapter and the tensor) a weights file holding anything but LoRA A/B of the
    served projections with the config's rank (and, given the model's `shapes`, of its layers and sizes), from
    the safetensors header alone (8 bytes of length, then JSON): a runtime load (`/v1/load_lora_adapter`) is
    refused before any worker reads it. Without `shapes` (a GGUF model) only the worker checks the sizes
    (worker_svc/lora_adapters.py)."""
    where = f"LoRA adapter {module.name!r} ({module.path})"
    with open(os.path.join(module.path, ADAPTER_WEIGHTS), "rb") as file:
        header_size = int.from_bytes(file.read(8), "little")
        try:
            header = json.loads(file.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{where}: {ADAPTER_WEIGHTS} is not a safetensors file") from None
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        match = _PEFT_TENSOR.match(key)
        if match is None or match["module"].rpartition(".")[2] not in SERVED_TARGETS:
            raise ValueError(f"{where}: tensor {key!r} is not served (LoRA A/B of {', '.join(SERVED_TARGETS)} only)")
        shape = entry.get("shape", [])
        if len(shape) != 2 or shape[0 if match["kind"] == "lora_A" else 1] != rank:
            raise ValueError(f"{where}: {key}: shape {shape} does not have rank {rank}")
        if shapes is not None:
            layer = _LAYER_INDEX.search(match["module"])
            if layer is None or int(layer[1]) >= shapes.num_layers:
                raise ValueError(f"{where}: {key}: the model has no such layer (it has {shapes.num_layers})")
            inputs, outputs = shapes.features[match["module"].rpartition(".")[2]]
            expected = [rank, inputs] if match["kind"] == "lora_A" else [outputs, rank]
            if shape != expected:
                raise ValueError(f"{where}: {key}: shape {shape}, the model's projection needs {expected}")
