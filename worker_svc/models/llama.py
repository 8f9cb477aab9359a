"""Native Llama-family decoder (Llama 2/3/3.1, SmolLM2, TinyLlama, Mistral without sliding window, Qwen2).

Why our own modules instead of transformers' modeling code: the worker runs a flattened token axis (no
batch dimension, no padding) against a paged KV cache described by AttentionMetadata, and attention goes
through a swappable backend (torch reference on CPU, Triton on GPU). Numerics follow HF exactly where it
matters for token-exact greedy output: RMSNorm's cast order, fp32 rotary tables cast to the activation
dtype, neox-style (halves) rotation, attention math in fp32. In bf16/fp16 every op rounds where HF's
modules round (kernels/*_ref.py say where), and attention rounds its probabilities as flash attention,
the kernel HF's sdpa uses on a GPU: tests/test_models.py holds our bf16 logits to HF's (bit-identical
on the CPU).

Parameter names equal HF's, so `load_weights` is a name-to-parameter copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from kernels.attention_backend import AttentionBackend, TorchReferenceBackend
from kernels.attention_metadata import AttentionMetadata
from kernels.layer_ops import LayerOps, torch_layer_ops
from worker_svc.model_config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm with an optional residual add fused in: `norm(hidden, residual)` returns (normed, the sum)."""

    def __init__(self, hidden_size: int, eps: float, ops: LayerOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(hidden, self.weight, self.eps, residual)


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


class Attention(nn.Module):
    """Self-attention with one fused QKV projection (one matmul, one read of the activations)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend):
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
        # HF Llama's attention_bias also covers o_proj; Qwen2's o_proj never has one.
        self.o_proj = nn.Linear(self.q_size, hidden, bias=bias and config.architecture == "llama")

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


class MLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one projection whose output halves feed silu_and_mul."""

    def __init__(self, config: ModelConfig, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(hidden)))


class DecoderLayer(nn.Module):
    """One layer over the residual stream. The residual add is fused into the next norm (as vLLM does):
    a layer takes (hidden, residual) and returns the MLP output and the residual stream before it, and the
    caller's next norm adds them. The first layer gets residual None (the embeddings are the stream)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.self_attn = Attention(config, backend)
        self.mlp = MLP(config, ops)
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
