"""Rotary position embedding: inverse frequencies as HF computes them (llama3 scaling included) and the
neox-style rotation through the layer ops."""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels.layer_ops import LayerOps
from worker_svc.model_config import ModelConfig


def rotary_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, with llama3 scaling applied as HF computes it."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    params = config.rope_scaling_params()
    if params is None:
        return inv_freq
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary with an fp32 `cos_sin_cache` [max_positions, head_dim] (cos half | sin half).

    The cache stays fp32 whatever dtype the model is cast to (see `_apply`); it is cast to the
    activation dtype when applied, which is where HF casts too.
    """

    def __init__(self, config: ModelConfig, ops: LayerOps):
        super().__init__()
        self.ops = ops
        inv_freq = rotary_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def _apply(self, fn, recurse=True):
        # Follow device moves only: probe what `fn` does to an fp32 tensor on our device.
        probe = fn(torch.empty(0, dtype=torch.float32, device=self.cos_sin_cache.device))
        self.cos_sin_cache = self.cos_sin_cache.to(device=probe.device)
        return super()._apply(fn, recurse)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated copies of query [T, Hq, D] and key [T, Hkv, D] (strided views allowed)."""
        return self.ops.rotary_embedding(positions, query, key, self.cos_sin_cache)
