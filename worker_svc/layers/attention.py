"""Self-attention over the paged KV cache: the QKV and output projections around the attention backend."""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention_backend import AttentionBackend
from kernels.attention_metadata import AttentionMetadata
from kernels.kv_quant import UNIT_KV_SCALES
from kernels.layer_ops import LayerOps
from worker_svc.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.layers.rms_norm import RMSNorm
from worker_svc.layers.rotary_embedding import RotaryEmbedding
from worker_svc.model_config import ModelConfig
from worker_svc.tensor_parallel import TensorParallel


class Attention(nn.Module):
    """Self-attention with one fused QKV projection (one matmul, one read of the activations), rotary
    positions, and the paged KV cache through the attention backend. `qkv_proj` has a bias when the config's
    `attention_bias` says so; `o_proj` has one when `output_bias` says so (the model file knows its family).

    Tensor parallel: each rank owns whole heads, its share of the query heads and of the KV heads (one
    replicated KV head when there are fewer KV heads than ranks), so attention itself runs on this rank's
    heads alone and its KV cache holds only them; o_proj's all-reduce joins the heads' outputs.

    `qk_norm` (Qwen3, Gemma 3): an RMSNorm over each query and key head (weights [head_dim], shared by the
    heads) before rotary, `q_norm` and `k_norm` as in the checkpoint; Gemma's kind with `qk_norm_unit_offset`.

    Per layer, from the model file: `sliding_window` (this layer attends to the last W positions only),
    `logit_softcap` (Gemma 2's tanh bound on the scores) and `scale` (default head_dim^-0.5; Gemma's is
    query_pre_attn_scalar^-0.5), `qkv_bias` (default: the config's attention_bias; OPT's enable_bias). `forward`
    takes rotary None for models with other positions (OPT).

    `kv_scales`: this layer's K/V scales for an fp8 KV cache (kernels/kv_quant.py), 1.0 unless the checkpoint
    has them (worker_svc/models/kv_scales.py sets them after loading)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, output_bias: bool, tp: TensorParallel,
                 qk_norm: LayerOps | None = None, *, sliding_window: int | None = None,
                 logit_softcap: float | None = None, scale: float | None = None, qk_norm_unit_offset: bool = False,
                 qkv_bias: bool | None = None):
        super().__init__()
        self.num_heads = tp.shard(config.num_attention_heads)[1]
        self.num_kv_heads = tp.kv_heads(config.num_key_value_heads)
        self.head_dim = head_dim = config.head_dim
        self.scale = config.head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.backend = backend
        self.kv_scales = UNIT_KV_SCALES
        hidden = config.hidden_size
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        q_shard = (tp.shard(config.num_attention_heads)[0] * head_dim, self.q_size)
        kv_shard = (tp.kv_head_start(config.num_key_value_heads) * head_dim, self.kv_size)
        bias = config.attention_bias if qkv_bias is None else qkv_bias
        self.qkv_proj = ColumnParallelLinear(hidden, [q_shard, kv_shard, kv_shard], bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden, output_bias, tp)
        eps, offset = config.rms_norm_eps, qk_norm_unit_offset
        self.q_norm = None if qk_norm is None else RMSNorm(head_dim, eps, qk_norm, offset)
        self.k_norm = None if qk_norm is None else RMSNorm(head_dim, eps, qk_norm, offset)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden, metadata.lora_tokens)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            query = self.q_norm(query.reshape(-1, self.head_dim))[0].view(num_tokens, self.num_heads, self.head_dim)
            key = self.k_norm(key.reshape(-1, self.head_dim))[0].view(num_tokens, self.num_kv_heads, self.head_dim)
        if rotary is not None:
            query, key = rotary(positions, query, key)
        self.backend.write_kv_cache(key, value, kv_cache, metadata.slot_mapping, self.kv_scales)
        output = self.backend.paged_attention(
            query, kv_cache, metadata, self.scale, self.sliding_window, self.logit_softcap, kv_scales=self.kv_scales
        )
        return self.o_proj(output.reshape(num_tokens, self.q_size), metadata.lora_tokens)
