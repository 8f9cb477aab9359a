"""Gemma 1, 2 and 3 (text): the Llama layout with Gemma's numerics and, from Gemma 2 on, sandwich norms.

What differs from llama.py, each as transformers computes it:
- RMSNorm weights are offsets from 1, multiplied in fp32 before the one rounding (`unit_offset` norms).
- The embedding is scaled by sqrt(hidden_size), rounded to the activation dtype first.
- The MLP is GeGLU: GELU(gate) * up, GELU tanh-approximated unless the config names the exact one (Gemma 1
  reads `hidden_act`, Gemma 2/3 `hidden_activation`).
- Attention scales by query_pre_attn_scalar^-0.5 when the config has one (Gemma 2/3), else head_dim^-0.5.
- Gemma 2/3: a norm after attention and around the MLP (post_attention, pre_ and post_feedforward), layers
  alternating local (sliding window) and global attention (config.layer_types); Gemma 2 soft-caps attention
  scores and the final logits (tanh); Gemma 3 normalizes q and k per head and takes each layer type's own
  rope base (rope_parameters keyed by layer type).
Embeddings are always tied (an untied config is refused from config.json: models/feature_refusals.py).
Loading and tensor parallelism are llama.py's: the names are Llama's plus the extra norms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from kernels.attention_backend import AttentionBackend
from kernels.layer_ops import LayerOps
from worker_svc.layers.attention import Attention
from worker_svc.layers.gated_mlp import GatedMLP
from worker_svc.layers.rms_norm import RMSNorm
from worker_svc.layers.rotary_embedding import RotaryEmbedding
from worker_svc.layers.vocab_parallel_embedding import VocabParallelEmbedding
from worker_svc.model_config import FULL_ATTENTION, ModelConfig, parse_hf_rope
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.tensor_parallel import SINGLE_RANK, TensorParallel


def is_sandwich(config: ModelConfig) -> bool:
    """Gemma 2 and 3 norm each sublayer's output as well as its input."""
    return config.model_type != "gemma"


class GemmaDecoderLayer(nn.Module):
    """One layer, in llama.py's (hidden, residual) convention: the residual add is fused into the next norm
    that takes the stream (input_layernorm here, and pre_feedforward_layernorm or post_attention_layernorm)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps, tp: TensorParallel,
                 layer_index: int):
        super().__init__()
        hf = config.hf_config
        eps, hidden = config.rms_norm_eps, config.hidden_size
        scalar = hf.get("query_pre_attn_scalar")
        self.self_attn = Attention(
            config, backend, config.attention_bias, tp,
            qk_norm=ops if config.model_type == "gemma3_text" else None, qk_norm_unit_offset=True,
            sliding_window=config.layer_sliding_window(layer_index),
            logit_softcap=hf.get("attn_logit_softcapping"),
            scale=None if scalar is None else scalar**-0.5,
        )
        activation = hf.get("hidden_act" if config.model_type == "gemma" else "hidden_activation")
        self.mlp = GatedMLP(config, ops, tp, activation or "gelu_pytorch_tanh")
        self.sandwich = is_sandwich(config)
        self.input_layernorm = RMSNorm(hidden, eps, ops, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops, unit_offset=True)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, ops, unit_offset=True)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, ops, unit_offset=True)

    def forward(self, hidden, residual, positions, rotary, kv_cache, metadata):
        normed, residual = self.input_layernorm(hidden, residual)
        attn_out = self.self_attn(normed, positions, rotary, kv_cache, metadata)
        if not self.sandwich:  # Gemma 1: post_attention_layernorm is the MLP's input norm, as in Llama
            normed, residual = self.post_attention_layernorm(attn_out, residual)
            return self.mlp(normed), residual
        attn_out = self.post_attention_layernorm(attn_out)[0]
        normed, residual = self.pre_feedforward_layernorm(attn_out, residual)
        return self.post_feedforward_layernorm(self.mlp(normed))[0], residual


class GemmaModel(nn.Module):
    """The decoder stack; `rotary_embs` holds one rotary per layer type (Gemma 3's differ in base). Every layer's
    MLP is the GeGLU one (`make_mlp`, llama.py's hook for MoE families, is not used)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps, tp: TensorParallel,
                 qk_norm: bool = False, make_mlp: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, backend, ops, tp, index) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, unit_offset=True)
        self.layer_types = config.layer_types or (FULL_ATTENTION,) * config.num_hidden_layers
        self.rotary_embs = nn.ModuleDict(
            {kind: RotaryEmbedding(layer_type_rope(config, kind), ops) for kind in sorted(set(self.layer_types))}
        )


def layer_type_rope(config: ModelConfig, layer_type: str) -> ModelConfig:
    """`config` with the rope base and scaling of `layer_type` (Gemma 3 keys rope_parameters by layer type;
    Gemma 1/2 have one set for all layers)."""
    params = config.hf_config.get("rope_parameters") or {}
    if layer_type not in params:
        return config
    raw = {"rope_parameters": params[layer_type], "max_position_embeddings": config.max_position_embeddings}
    rope_theta, rope_scaling = parse_hf_rope(raw)
    return dataclasses.replace(config, rope_theta=rope_theta, rope_scaling=rope_scaling)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1/2/3 (text). `forward` scales the embeddings and gives each layer its type's rotary;
    `compute_logits` soft-caps when the config says so (Gemma 2's final_logit_softcapping)."""

    model_class = GemmaModel

    def __init__(self, config: ModelConfig, attention_backend: AttentionBackend | None = None,
                 layer_ops: LayerOps | None = None, tensor_parallel: TensorParallel = SINGLE_RANK):
        super().__init__(config, attention_backend, layer_ops, tensor_parallel)
        self.final_logit_softcap = config.hf_config.get("final_logit_softcapping")
        self._embed_scales: dict[torch.dtype, float] = {}

    def embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) rounded to `dtype`, as HF multiplies by a tensor of that dtype."""
        if dtype not in self._embed_scales:
            self._embed_scales[dtype] = torch.tensor(self.config.hidden_size**0.5, dtype=dtype).item()
        return self._embed_scales[dtype]

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        hidden, residual = hidden * self.embed_scale(hidden.dtype), None
        rotary = self.model.rotary_embs
        for layer, kind, kv_cache in zip(self.model.layers, self.model.layer_types, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, rotary[kind], kv_cache, metadata)
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Soft-capped in the model dtype, then widened: HF caps the head's rounded output."""
        logits = self.model.embed_tokens.logits(hidden)
        if self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = self.per_row(lambda rows: torch.tanh(rows / cap) * cap, logits)
        return logits.float()
