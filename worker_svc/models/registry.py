"""The model registry: which class serves each architecture, in one table.

Adding an architecture: a file in models/ built from worker_svc/layers/, with `forward`, `compute_logits` and
`load_weights` (its layers' own `load` takes each rank's slice), and one line in MODEL_CLASSES.
Every class takes (config, attention_backend, layer_ops, tensor_parallel).
"""

from __future__ import annotations

from torch import nn

from kernels.attention_backend import AttentionBackend
from kernels.layer_ops import LayerOps
from worker_svc.model_config import ModelConfig
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.qwen3 import Qwen3ForCausalLM
from worker_svc.tensor_parallel import SINGLE_RANK, TensorParallel

MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}


def build_model(
    config: ModelConfig,
    attention_backend: AttentionBackend | None = None,
    layer_ops: LayerOps | None = None,
    tensor_parallel: TensorParallel = SINGLE_RANK,
) -> nn.Module:
    if config.architecture not in MODEL_CLASSES:
        raise ValueError(f"no model for architecture {config.architecture!r}")
    return MODEL_CLASSES[config.architecture](config, attention_backend, layer_ops, tensor_parallel)
