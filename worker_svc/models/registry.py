"""The model registry: which class serves each architecture, in one table.

Keyed by the names in a checkpoint's config.json `architectures` (as vLLM's registry is), each naming its
module in models/ and its class there. The table imports nothing: ModelConfig checks a checkpoint against it
before torch is loaded (the launcher does, to refuse early), and `build_model` imports only the class it
builds.

Adding an architecture: a file in models/ built from worker_svc/layers/, with `forward`, `compute_logits` and
`load_weights` (its layers' own `load` takes each rank's slice), and one line here (docs/adding_a_model.md).
Every class takes (config, attention_backend, layer_ops, tensor_parallel).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from kernels.attention_backend import AttentionBackend
    from kernels.layer_ops import LayerOps
    from worker_svc.model_config import ModelConfig
    from worker_svc.tensor_parallel import TensorParallel

# HF architecture name -> (module in worker_svc/models/, class in it).
MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


def model_class(architecture: str) -> type[nn.Module]:
    """The class serving `architecture` (an HF architectures name); raise naming the supported ones."""
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_CLASSES)}")
    module, name = MODEL_CLASSES[architecture]
    return getattr(importlib.import_module(f"worker_svc.models.{module}"), name)


def build_model(
    config: ModelConfig,
    attention_backend: AttentionBackend | None = None,
    layer_ops: LayerOps | None = None,
    tensor_parallel: TensorParallel | None = None,
) -> nn.Module:
    from worker_svc.tensor_parallel import SINGLE_RANK

    tp = SINGLE_RANK if tensor_parallel is None else tensor_parallel
    return model_class(config.architecture)(config, attention_backend, layer_ops, tp)
