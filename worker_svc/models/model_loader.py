"""Build a model for a checkpoint and load its weights (or random ones of its shape) on the device.

What the checks on the way raise (ValueError: a config feature, a tensor the model has no parameter for, a
shape that does not match, a missing tensor; FileNotFoundError: no weights) leaves here as LoadRefused
(service_runtime/load_refusal.py): the checkpoint cannot be served, which no restart changes. Only what our
own code raises counts as a check: a ValueError raised inside torch, numpy or safetensors, and anything else,
is a bug, and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from kernels.attention_backend import AttentionBackend
from kernels.layer_ops import LayerOps
from service_runtime.load_refusal import LoadRefused
from worker_svc.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.layers.vocab_parallel_embedding import VocabParallelEmbedding
from worker_svc.model_config import ModelConfig
from worker_svc.models.kv_scales import apply_kv_scales, split_kv_scales
from worker_svc.models.registry import build_model
from worker_svc.models.weight_loader import iter_checkpoint
from worker_svc.tensor_parallel import SINGLE_RANK, TensorParallel

_REPO_ROOT = Path(__file__).resolve().parents[2]
_OUR_PACKAGES = ("worker_svc", "kernels", "service_runtime")  # (a virtual environment may sit in the repo too)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    attention_backend: AttentionBackend | None = None,
    load_format: str = "auto",
    layer_ops: LayerOps | None = None,
    tensor_parallel: TensorParallel = SINGLE_RANK,
) -> tuple[nn.Module, ModelConfig]:
    """Build on the meta device (no init cost, no fp32 copy), allocate in `dtype` on `device`, load.

    Every parameter is overwritten by the checkpoint (`load_weights` raises on missing ones), so the
    uninitialized allocation is never read. load_format "dummy" (as in vLLM) fills the weights with random
    values instead: benchmarks of a model's shape need only its config.json. Under tensor parallel each
    rank builds and fills only its shards (`tensor_parallel`), reading its slices of the checkpoint. The
    checkpoint's KV cache scales, if any, go to the attention layers (models/kv_scales.py).
    """
    with refused_as_load_refusal():
        config = ModelConfig.from_path(path)
        with torch.device("meta"):
            model = build_model(config, attention_backend, layer_ops, tensor_parallel)
    if layer_ops is not None:
        for module in model.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                module.linear = layer_ops.linear
    model = model.to(dtype).to_empty(device=device)
    if load_format == "dummy":
        _fill_random(model)
    else:
        with refused_as_load_refusal():
            kv_scales: dict[int, dict[str, float]] = {}
            model.load_weights(split_kv_scales(iter_checkpoint(path, config), kv_scales))
            apply_kv_scales(model, kv_scales)
    return model.eval(), config


@contextlib.contextmanager
def refused_as_load_refusal() -> Iterator[None]:
    """Turns the refusals a model check raises (module docstring) into LoadRefused, with the same message."""
    try:
        yield
    except LoadRefused:
        raise
    except (ValueError, FileNotFoundError) as error:
        if not _raised_by_our_code(error):
            raise
        raise LoadRefused(str(error)) from None


def _raised_by_our_code(error: BaseException) -> bool:
    """Whether the innermost frame of `error`'s traceback is in this repository's code (a check), not in a
    library's (a bug that reached it)."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    if frame is None:
        return False
    path = Path(frame.tb_frame.f_code.co_filename).resolve()
    return path.is_relative_to(_REPO_ROOT) and path.relative_to(_REPO_ROOT).parts[0] in _OUR_PACKAGES


@torch.no_grad()
def _fill_random(model: nn.Module) -> None:
    """Random weights of a realistic scale: norms near 1, matrices N(0, 0.02); seeded by each parameter's
    name, so every rank fills a replicated parameter (a norm) alike whatever the shapes of its shards."""
    for name, parameter in model.named_parameters():
        generator = torch.Generator(device=parameter.device).manual_seed(zlib.crc32(name.encode()))
        parameter.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.02, generator=generator)
