"""Native Llama-family decoder (Llama 2/3/3.1, SmolLM2, TinyLlama, Mistral without sliding window, Qwen2).

Why our own modules instead of transformers' modeling code: the worker runs a flattened token axis (no
batch dimension, no padding) against a paged KV cache described by AttentionMetadata, and attention goes
through a swappable backend (torch reference on CPU, Triton on GPU). Numerics follow HF exactly where it
matters for token-exact greedy output: RMSNorm's cast order, fp32 rotary tables cast to the activation
dtype, neox-style (halves) rotation, attention math in fp32. In bf16/fp16 every op rounds where HF's
modules round (kernels/*_ref.py say where; the layers are in worker_svc/layers/), and attention rounds its probabilities as flash attention,
the kernel HF's sdpa uses on a GPU: tests/test_models.py holds our bf16 logits to HF's (bit-identical
on the CPU).

Parameter names equal HF's, so `load_weights` is a name-to-parameter copy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kernels.attention_backend import AttentionBackend, TorchReferenceBackend
from kernels.attention_metadata import AttentionMetadata
from kernels.layer_ops import LayerOps, torch_layer_ops
from worker_svc.layers.attention import Attention
from worker_svc.layers.gated_mlp import GatedMLP
from worker_svc.layers.rms_norm import RMSNorm
from worker_svc.layers.rotary_embedding import RotaryEmbedding
from worker_svc.model_config import ModelConfig


class DecoderLayer(nn.Module):
    """One layer over the residual stream. The residual add is fused into the next norm (as vLLM does):
    a layer takes (hidden, residual) and returns the MLP output and the residual stream before it, and the
    caller's next norm adds them. The first layer gets residual None (the embeddings are the stream)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        # HF Llama's attention_bias also covers o_proj; Qwen2's o_proj never has one.
        self.self_attn = Attention(config, backend, output_bias=config.attention_bias and config.architecture == "llama")
        self.mlp = GatedMLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self, hidden, residual, positions, rotary, kv_cache, metadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.input_layernorm(hidden, residual)
        attn_out = self.self_attn(normed, positions, rotary, kv_cache, metadata)
        normed, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, ops) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary_emb = RotaryEmbedding(config, ops)


class LlamaForCausalLM(nn.Module):
    """Decoder over a flattened token axis: `forward` returns hidden states, `compute_logits` the logits.

    `attention_backend` and `layer_ops` default to the torch references; the worker passes the Triton
    ones on GPU. Checkpoints name q/k/v and gate/up separately (HF); `load_weights` stacks them into
    the fused projections.
    """

    def __init__(
        self,
        config: ModelConfig,
        attention_backend: AttentionBackend | None = None,
        layer_ops: LayerOps | None = None,
    ):
        super().__init__()
        self.config = config
        backend = attention_backend if attention_backend is not None else TorchReferenceBackend()
        self.model = LlamaModel(config, backend, layer_ops if layer_ops is not None else torch_layer_ops())
        # Tied: no lm_head at all (logits read embed_tokens), so no module conversion can untie them.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: one [2, blocks, block_size, Hkv, D] per layer."""
        hidden, residual = self.model.embed_tokens(input_ids), None
        rotary = self.model.rotary_emb
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, rotary, kv_cache, metadata)
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32 of the hidden states [N, hidden] the caller selected.

        The product runs in the model dtype and is then widened: HF's logits are rounded to it too."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our parameters (q/k/v and gate/up into their slice of the fused
        projection); raise on unknown, misshapen or missing ones."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, rows = self._fused_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            param = params[target] if rows is None else params[target][rows[0] : rows[1]]
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        expected = {source for param in params for source in self._checkpoint_names(param)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")

    def _fused_slices(self) -> dict[str, tuple[str, list[tuple[int, int]]]]:
        """Checkpoint projection -> (fused projection, its rows in the fused output)."""
        config = self.config
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        inter = config.intermediate_size
        return {
            "self_attn.q_proj": ("self_attn.qkv_proj", (0, q_size)),
            "self_attn.k_proj": ("self_attn.qkv_proj", (q_size, q_size + kv_size)),
            "self_attn.v_proj": ("self_attn.qkv_proj", (q_size + kv_size, q_size + 2 * kv_size)),
            "mlp.gate_proj": ("mlp.gate_up_proj", (0, inter)),
            "mlp.up_proj": ("mlp.gate_up_proj", (inter, 2 * inter)),
        }

    def _fused_target(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """Our parameter for a checkpoint tensor name, and its row range when it is a fused slice."""
        for source, (fused, rows) in self._fused_slices().items():
            marker = f".{source}."
            if marker in name:
                return name.replace(marker, f".{fused}."), rows
        return name, None

    def _checkpoint_names(self, param: str) -> list[str]:
        """The checkpoint tensors that fill our parameter `param`."""
        sources = [
            param.replace(f".{fused}.", f".{source}.")
            for source, (fused, _) in self._fused_slices().items()
            if f".{fused}." in param
        ]
        return sources or [param]
