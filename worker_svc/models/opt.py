"""OPT (facebook/opt-125m ... opt-66b): the first model of the documents this project starts from.

What differs from the Llama family, each as transformers computes it:
- Learned absolute positions (`embed_positions`, a table of max_position_embeddings + 2 rows: OPT offsets
  position p to row p + 2) added to the token embeddings; no rotary.
- LayerNorm with bias (torch's, as HF's), biases on q/k/v/out_proj and fc1/fc2 (`enable_bias`), a plain
  fc1 -> ReLU -> fc2 MLP (`activation_function`).
- `do_layer_norm_before`: pre-norm (125m, 1.3b and up) or post-norm (350m: the norms follow the residual adds,
  and there is no final norm).
- `word_embed_proj_dim` != hidden_size (350m): token embeddings of that width, `project_in` to the hidden width
  before the layers and `project_out` back before the tied head.
Checkpoints name tensors "model.decoder.*" (transformers' save_pretrained) or "decoder.*" (the hub's files);
both load. Tensor parallel: heads and fc1/fc2 split, the vocabulary split by rows; positions, norms and the
projections in and out are replicated (small).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kernels.attention_backend import AttentionBackend
from kernels.layer_ops import LayerOps
from worker_svc.layers.attention import Attention
from worker_svc.layers.checkpoint_tensor import CheckpointTensor
from worker_svc.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.layers.vocab_parallel_embedding import VocabParallelEmbedding
from worker_svc.model_config import ModelConfig
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.tensor_parallel import SINGLE_RANK, TensorParallel

POSITION_OFFSET = 2
ACTIVATIONS = {"relu": nn.functional.relu, "gelu": nn.functional.gelu}


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel):
        super().__init__()
        hf = config.hf_config
        bias = hf.get("enable_bias", True)
        affine = hf.get("layer_norm_elementwise_affine", True)
        self.pre_norm = hf.get("do_layer_norm_before", True)
        self.activation = ACTIVATIONS[hf.get("activation_function", "relu")]
        self.self_attn = Attention(config, backend, bias, tp, qkv_bias=bias)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine, bias=affine)
        self.fc1 = ColumnParallelLinear.split(config.hidden_size, [config.intermediate_size], bias=bias, tp=tp)
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, tp)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine, bias=affine)

    def forward(self, hidden, positions, kv_cache, metadata) -> torch.Tensor:
        attn_in = self.self_attn_layer_norm(hidden) if self.pre_norm else hidden
        hidden = hidden + self.self_attn(attn_in, positions, None, kv_cache, metadata)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        mlp_in = self.final_layer_norm(hidden) if self.pre_norm else hidden
        hidden = hidden + self.fc2(self.activation(self.fc1(mlp_in)))
        return hidden if self.pre_norm else self.final_layer_norm(hidden)


class OPTDecoder(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel):
        super().__init__()
        hf = config.hf_config
        hidden, width = config.hidden_size, hf.get("word_embed_proj_dim") or config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, width, tp)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, hidden)
        self.project_in = nn.Linear(width, hidden, bias=False) if width != hidden else None
        self.project_out = nn.Linear(hidden, width, bias=False) if width != hidden else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, backend, tp) for _ in range(config.num_hidden_layers))
        final_norm = hf.get("do_layer_norm_before", True) and not hf.get("_remove_final_layer_norm", False)
        affine = hf.get("layer_norm_elementwise_affine", True)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine, bias=affine) if final_norm else None


class OPTModel(nn.Module):
    """Holds `decoder`, as HF's OPTModel does, so parameter names equal the checkpoint's (its MLP is its own:
    llama.py's `make_mlp` hook is not used)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps, tp: TensorParallel,
                 qk_norm: bool = False, make_mlp: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.decoder = OPTDecoder(config, backend, tp)


class OPTForCausalLM(LlamaForCausalLM):
    """OPT over the paged cache; loading is llama.py's (q/k/v into the fused projection, out_proj as o_proj)."""

    model_class = OPTModel

    def __init__(self, config: ModelConfig, attention_backend: AttentionBackend | None = None,
                 layer_ops: LayerOps | None = None, tensor_parallel: TensorParallel = SINGLE_RANK):
        # Other activations and an untied head are refused from config.json (models/feature_refusals.py).
        if layer_ops is not None and layer_ops.batch_invariant:
            # Its LayerNorms and activations are its own modules, not LayerOps: nothing would make them so.
            raise ValueError("--batch-invariant does not cover OPT models yet (their LayerNorm is not batch-invariant)")
        super().__init__(config, attention_backend, layer_ops, tensor_parallel)

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        decoder = self.model.decoder
        hidden = decoder.embed_tokens(input_ids)
        if decoder.project_in is not None:
            hidden = decoder.project_in(hidden)
        hidden = hidden + decoder.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in zip(decoder.layers, kv_caches, strict=True):
            hidden = layer(hidden, positions, kv_cache, metadata)
        if decoder.final_layer_norm is not None:
            hidden = decoder.final_layer_norm(hidden)
        return hidden if decoder.project_out is None else decoder.project_out(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.decoder.embed_tokens.logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """The hub's files name tensors "decoder.*", save_pretrained's "model.decoder.*": both load."""
        super().load_weights((f"model.{name}" if name.startswith("decoder.") else name, t) for name, t in weights)

    def _fused_slices(self) -> dict[str, tuple[str, int]]:
        return {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", 1),
            "self_attn.v_proj": ("self_attn.qkv_proj", 2),
            "self_attn.out_proj": ("self_attn.o_proj", 0),
        }
