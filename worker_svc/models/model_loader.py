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
from worker_svc.layers.fp8_linear import has_fp8_tensor_cores
from worker_svc.integer_quantization import IntegerScheme
from worker_svc.layers.fused_moe import FusedMoE
from worker_svc.layers.linear_method import choose_linear_method
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
    quantization: str | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Build on the meta device (no init cost, no fp32 copy), allocate in `dtype` on `device`, load.

    Every parameter is overwritten by the checkpoint (`load_weights` raises on missing ones), so the
    uninitialized allocation is never read. load_format "dummy" (as in vLLM) fills the weights with random
    values instead: benchmarks of a model's shape need only its config.json. Under tensor parallel each
    rank builds and fills only its shards (`tensor_parallel`), reading its slices of the checkpoint. The
    checkpoint's KV cache scales, if any, go to the attention layers (models/kv_scales.py).
    `quantization`: the --quantization flag; the checkpoint's quantization_config and it give each linear
    layer its method (`set_linear_methods`), which prepares its weights once they are loaded.
    """
    with refused_as_load_refusal():
        config = ModelConfig.from_path(path, quantization)
        if config.quantization is not None and layer_ops is not None and layer_ops.batch_invariant:
            raise ValueError(f"{config.quantization.describe()} has no batch-invariant matmul: serve it without "
                             f"--batch-invariant, or serve the unquantized checkpoint")
        with torch.device("meta"):
            model = build_model(config, attention_backend, layer_ops, tensor_parallel)
    if layer_ops is not None:
        for module in model.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                module.linear = layer_ops.linear
    model = model.to(dtype)
    with refused_as_load_refusal():
        set_linear_methods(model, config, dtype, torch.device(device), tensor_parallel)
    model = model.to_empty(device=device)
    if load_format == "dummy":
        _fill_random(model)
    else:
        with refused_as_load_refusal():
            kv_scales: dict[int, dict[str, float]] = {}
            model.load_weights(split_kv_scales(iter_checkpoint(path, config), kv_scales))
            apply_kv_scales(model, kv_scales)
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, FusedMoE)):
            module.process_after_loading()
    return model.eval(), config


def set_linear_methods(model: nn.Module, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                       tensor_parallel: TensorParallel = SINGLE_RANK) -> None:
    """Gives every parallel linear layer of `model` (still on the meta device) its linear method: the one
    `config.quantization` chooses, unless the checkpoint `ignore`s the layer. A fused layer (q|k|v) is
    quantized only if none of its checkpoint projections is ignored, and refused if only some are; a layer
    whose shard the method cannot hold (a split packed int32 or group) is refused naming it. A MoE block's
    experts (FP8 or weight-only integer: ModelConfig refuses INT8 W8A8 there) are quantized alike, all of a block or none;
    its router never is. Integer experts (worker_svc/layers/wna16_experts.py) are refused naming the block when
    act-order or this rank's share of the intermediate size cannot be served."""
    if config.quantization is None:
        return
    method = choose_linear_method(config.quantization, device)
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            weights = [f"{name}.w13_weight", f"{name}.w2_weight"]
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            weights = [f"{name}.weight"]
        else:
            continue
        sources = [source.removesuffix(".weight") for weight in weights for source in model._checkpoint_names(weight)]
        ignored = [config.quantization.ignores(source) for source in sources]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(f"the checkpoint's quantization ignore list leaves some of {sources} unquantized, but "
                             f"they are fused into one matmul ({name}); ignore all of them or none")
        if isinstance(module, FusedMoE) and isinstance(config.quantization, IntegerScheme):
            try:
                with torch.device("meta"):
                    module.quantize_integer(config.quantization, dtype)
            except ValueError as error:
                raise ValueError(f"{config.quantization.describe()} cannot serve the experts of {name} over "
                                 f"{tensor_parallel.world_size} tensor-parallel rank(s): {error}") from None
            continue
        if isinstance(module, FusedMoE):
            if device.type == "cuda" and not has_fp8_tensor_cores(device):
                raise ValueError(f"{config.quantization.describe()} MoE experts need a GPU of compute capability "
                                 f"8.9 or more (Triton reads float8_e4m3fn only there); serve the unquantized "
                                 f"checkpoint")
            with torch.device("meta"):
                module.quantize_fp8(config.quantization)
            continue
        try:
            with torch.device("meta"):
                module.set_linear_method(method, dtype)
        except ValueError as error:
            raise ValueError(f"{config.quantization.describe()} cannot split {name} over "
                             f"{tensor_parallel.world_size} tensor-parallel rank(s): {error}") from None


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
    """Random weights of a realistic scale: norms near 1, matrices N(0, 0.02) (an integer layer's random
    integers and small scales dequantize to about that: its method fills them); seeded by each parameter's
    name, so every rank fills a replicated parameter (a norm) alike whatever the shapes of its shards."""
    modules = dict(model.named_modules())
    for name, parameter in model.named_parameters():
        generator = torch.Generator(device=parameter.device).manual_seed(zlib.crc32(name.encode()))
        module_name, _, kind = name.rpartition(".")
        module = modules[module_name]
        method = getattr(module, "linear_method", None)
        if isinstance(module, FusedMoE) and module.integer is not None:
            module.integer.fill_random(kind, parameter, generator)  # integer experts' tensors
        elif hasattr(method, "fill_random") and kind != "bias":  # an integer method's own tensors
            method.fill_random(kind, parameter, generator)
        elif name.endswith("_scale"):  # an FP8 layer's scales: its float8 weights N(0, 1) dequantize to N(0, 0.02)
            parameter.fill_(0.02)
        elif parameter.dtype == torch.float8_e4m3fn:
            parameter.copy_(torch.empty(parameter.shape, device=parameter.device).normal_(generator=generator))
        else:
            parameter.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.02, generator=generator)
