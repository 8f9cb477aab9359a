"""A checkpoint's KV cache scales (`--kv-cache-dtype fp8`): taken out of the weight stream and given to the
attention layers.

Why beside the loader and not in each model's `load_weights`: the scales are no parameter of any layer (they
are host floats the kernels take, kernels/kv_quant.py), and every model family names them alike. The names
are vLLM's (`maybe_remap_kv_scale_name`): per attention layer `self_attn.k_scale` / `self_attn.v_scale`, the
same under `self_attn.attn.`, ModelOpt's `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale`, and the
deprecated single `self_attn.kv_scale` (for both K and V). A layer the checkpoint gives no scale keeps 1.0.
With a KV cache of the model's dtype the scales are loaded and ignored, as vLLM's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

from torch import nn

from kernels.kv_quant import KVScales
from worker_svc.layers.attention import Attention
from worker_svc.layers.checkpoint_tensor import CheckpointTensor

logger = logging.getLogger(__name__)

KV_SCALE_NAME = re.compile(
    r"(?:^|.*\.)layers\.(\d+)\.self_attn\.(?:attn\.|k_proj\.(?=k_scale)|v_proj\.(?=v_scale))?(k_scale|v_scale|kv_scale)"
)


def split_kv_scales(weights: Iterable[tuple[str, CheckpointTensor]],
                    found: dict[int, dict[str, float]]) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of `weights` but the KV cache scales, which go into `found` (layer -> {name: value})."""
    for name, tensor in weights:
        match = KV_SCALE_NAME.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        values = tensor.full().float().reshape(-1)
        if values.numel() != 1:
            raise ValueError(f"{name}: a KV cache scale is one number per layer, not {tuple(values.shape)}")
        found.setdefault(int(match.group(1)), {})[match.group(2)] = float(values[0])


def apply_kv_scales(model: nn.Module, found: dict[int, dict[str, float]]) -> None:
    """Each layer's scales onto its attention layer (the model's attention layers in layer order)."""
    if not found:
        return
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    for layer, scales in sorted(found.items()):
        if layer >= len(layers):
            raise ValueError(f"checkpoint has KV cache scales for layer {layer}; the model has {len(layers)} layers")
        both = scales.get("kv_scale", 1.0)
        layers[layer].kv_scales = KVScales(scales.get("k_scale", both), scales.get("v_scale", both))
    logger.info("KV cache scales from the checkpoint for %d of %d layers", len(found), len(layers))
