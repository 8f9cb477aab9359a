"""Self-attention over the paged KV cache: the QKV and output projections around the attention backend."""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention_backend import AttentionBackend
from kernels.attention_metadata import AttentionMetadata
from worker_svc.layers.rotary_embedding import RotaryEmbedding
from worker_svc.model_config import ModelConfig


class Attention(nn.Module):
    """Self-attention with one fused QKV projection (one matmul, one read of the activations), rotary
    positions, and the paged KV cache through the attention backend. `qkv_proj` has a bias when the config's
    `attention_bias` says so; `o_proj` has one when `output_bias` says so (the model file knows its family)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, output_bias: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.backend = backend
        hidden = config.hidden_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=output_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        query, key = rotary(positions, query, key)
        self.backend.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        output = self.backend.paged_attention(query, kv_cache, metadata, self.scale)
        return self.o_proj(output.reshape(num_tokens, self.q_size))
