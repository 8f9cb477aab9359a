"""Rotary position embedding: inverse frequencies as HF computes them (every scaling type of rope_scaling.py) and
the neox-style rotation through the layer ops."""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention_metadata import AttentionMetadata
from kernels.layer_ops import LayerOps
from worker_svc.layers.rope_scaling import longrope_inv_freq, scaled_inv_freq
from worker_svc.model_config import ModelConfig


def rotary_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, scaled as the config says (longrope: the short set)."""
    return scaled_inv_freq(config.rope_scaling_params(), config.rope_theta, config.head_dim)[0]


def cos_sin(inv_freq: torch.Tensor, num_positions: int, attention_factor: float) -> torch.Tensor:
    positions = torch.arange(num_positions, device="cpu").float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary with an fp32 `cos_sin_cache` [max_positions, head_dim] (cos half | sin half), scaled by
    the rope type's attention factor as transformers scales its cos and sin.

    The cache stays fp32 whatever dtype the model is cast to (see `_apply`); it is cast to the activation
    dtype when applied, which is where HF casts too.

    Longrope (Phi-3) keeps two tables one after the other, the short factors' rows then the long ones', and a
    token reads the long ones when its sequence is longer than original_max_position_embeddings after this step
    (`rope_positions`). That is transformers' rule for a sequence generated normally: it takes the long set when
    the forward's largest position is past the original context, so a prompt longer than it is rotated with the
    long set throughout and decoding switches at that length. Two cases differ from it: a long prompt prefilled
    in chunks (its first chunks use the short set here; transformers, unchunked, the long one), and keys cached
    before the switch (kept as they were rotated, here and in transformers alike). vLLM chooses per batch.
    """

    def __init__(self, config: ModelConfig, ops: LayerOps):
        super().__init__()
        self.ops = ops
        params = config.rope_scaling_params()
        inv_freq, attention_factor = scaled_inv_freq(params, config.rope_theta, config.head_dim)
        self.cos_sin_cache = cos_sin(inv_freq, config.max_position_embeddings, attention_factor)
        self.long_from = None  # longrope: sequences longer than this read the long table
        if params is not None and params["rope_type"] == "longrope":
            long = longrope_inv_freq(params, config.rope_theta, config.head_dim, params["long_factor"])
            long_table = cos_sin(long, config.max_position_embeddings, attention_factor)
            self.cos_sin_cache = torch.cat([self.cos_sin_cache, long_table])
            self.long_from = params["original_max_position_embeddings"]
            self.long_offset = config.max_position_embeddings

    def _apply(self, fn, recurse=True):
        # Follow device moves only: probe what `fn` does to an fp32 tensor on our device.
        probe = fn(torch.empty(0, dtype=torch.float32, device=self.cos_sin_cache.device))
        self.cos_sin_cache = self.cos_sin_cache.to(device=probe.device)
        return super()._apply(fn, recurse)

    def rope_positions(self, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The cache rows the tokens read: their positions, or for longrope the long table's rows for the tokens
        of sequences longer than the original context. No host sync (CUDA-graph safe)."""
        if self.long_from is None:
            return positions
        token = torch.arange(positions.shape[0], device=positions.device, dtype=metadata.query_start_loc.dtype)
        sequence = torch.searchsorted(metadata.query_start_loc[1:], token, right=True)
        sequence = sequence.clamp_max(max(metadata.num_seqs - 1, 0))  # padding tokens past every sequence
        is_long = metadata.seq_lens[sequence] > self.long_from
        return positions + is_long.to(positions.dtype) * self.long_offset

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated copies of query [T, Hq, D] and key [T, Hkv, D] (strided views allowed); `positions` are
        cache rows (`rope_positions`)."""
        return self.ops.rotary_embedding(positions, query, key, self.cos_sin_cache)
