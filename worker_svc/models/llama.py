"""Native Llama-family decoder (Llama 2/3/3.1, SmolLM2, TinyLlama, Mistral, Qwen2; sliding windows per layer).

Why our own modules instead of transformers' modeling code: the worker runs a flattened token axis (no
batch dimension, no padding) against a paged KV cache described by AttentionMetadata, and attention goes
through a swappable backend (torch reference on CPU, Triton on GPU). Numerics follow HF exactly where it
matters for token-exact greedy output: RMSNorm's cast order, fp32 rotary tables cast to the activation
dtype, neox-style (halves) rotation, attention math in fp32. In bf16/fp16 every op rounds where HF's
modules round (kernels/*_ref.py say where; the layers are in worker_svc/layers/), and attention rounds its probabilities as flash attention,
the kernel HF's sdpa uses on a GPU: tests/test_models.py holds our bf16 logits to HF's (bit-identical
on the CPU).

Parameter names equal HF's, so `load_weights` is a name-to-layer copy (each layer takes its slice).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kernels.attention_backend import AttentionBackend, TorchReferenceBackend
from kernels.attention_metadata import AttentionMetadata, with_lora_tokens
from kernels.layer_ops import LayerOps, torch_layer_ops
from worker_svc.layers.attention import Attention
from worker_svc.layers.checkpoint_tensor import CheckpointTensor, load_whole
from worker_svc.layers.gated_mlp import GatedMLP
from worker_svc.layers.rms_norm import RMSNorm
from worker_svc.layers.rotary_embedding import RotaryEmbedding
from worker_svc.layers.vocab_parallel_embedding import VocabParallelEmbedding
from worker_svc.model_config import ModelConfig
from worker_svc.tensor_parallel import SINGLE_RANK, TensorParallel


class DecoderLayer(nn.Module):
    """One layer over the residual stream. The residual add is fused into the next norm (as vLLM does):
    a layer takes (hidden, residual) and returns the MLP output and the residual stream before it, and the
    caller's next norm adds them. The first layer gets residual None (the embeddings are the stream)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps, tp: TensorParallel,
                 qk_norm: bool, layer_index: int, mlp: nn.Module):
        super().__init__()
        # HF Llama's and Qwen3's (and Qwen3-MoE's) attention_bias also covers o_proj; Qwen2's o_proj never has one.
        output_bias = config.attention_bias and config.model_type in ("llama", "qwen3", "qwen3_moe")
        self.self_attn = Attention(  # Mistral's layers and Qwen2's upper ones may slide
            config, backend, output_bias, tp, qk_norm=ops if qk_norm else None,
            sliding_window=config.layer_sliding_window(layer_index),
        )
        self.mlp = mlp  # GatedMLP, or a MoE block (LlamaForCausalLM.make_mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self, hidden, residual, positions, rotary, kv_cache, metadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.input_layernorm(hidden, residual)
        attn_out = self.self_attn(normed, positions, rotary, kv_cache, metadata)
        normed, residual = self.post_attention_layernorm(attn_out, residual)
        if metadata.lora_tokens is not None:  # LoRA is served only where the MLP is a GatedMLP (lora_adapters.py)
            return self.mlp(normed, metadata.lora_tokens), residual
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps, tp: TensorParallel,
                 qk_norm: bool, make_mlp: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, ops, tp, qk_norm, index, make_mlp(index))
            for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary_emb = RotaryEmbedding(config, ops)


class LlamaForCausalLM(nn.Module):
    """Decoder over a flattened token axis: `forward` returns hidden states, `compute_logits` the logits.

    `attention_backend` and `layer_ops` default to the torch references; the worker passes the Triton
    ones on GPU. Checkpoints name q/k/v and gate/up separately (HF); `load_weights` hands each to its part
    of the fused projection. `tensor_parallel`: this rank's place in its group; every projection, the
    embedding and the head are the parallel layers of worker_svc/layers/, so each rank holds and reads only
    its shard.
    """

    # Per-head RMSNorm of queries and keys before rotary (a subclass's family, e.g. Qwen3; qwen3.py).
    qk_norm = False
    # The decoder stack (a subclass's family may arrange its layers otherwise, e.g. gemma.py); built from
    # (config, backend, ops, tp, qk_norm, make_mlp), it has embed_tokens, layers, norm and rotary_emb.
    model_class = LlamaModel

    def __init__(
        self,
        config: ModelConfig,
        attention_backend: AttentionBackend | None = None,
        layer_ops: LayerOps | None = None,
        tensor_parallel: TensorParallel = SINGLE_RANK,
    ):
        super().__init__()
        self.config = config
        backend = attention_backend if attention_backend is not None else TorchReferenceBackend()
        ops = layer_ops if layer_ops is not None else torch_layer_ops()
        self.per_row = ops.per_row
        self.model = self.model_class(config, backend, ops, tensor_parallel, self.qk_norm,
                                      lambda index: self.make_mlp(config, ops, tensor_parallel, index))
        # Tied: no lm_head at all (logits read embed_tokens), so no module conversion can untie them.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tensor_parallel)
        )
        # An EAGLE-3 head reads the residual stream entering these layers (set at setup: eagle_head.py): `forward`
        # then returns them (in layer order) after the final hidden states, [T, (1 + n) * hidden]. Empty: as ever.
        self.aux_hidden_layers: tuple[int, ...] = ()

    def make_mlp(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel, layer_index: int) -> nn.Module:
        """Layer `layer_index`'s MLP: the gated MLP here; a MoE family's sparse block where it has one."""
        return GatedMLP(config, ops, tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: one [2, blocks, block_size, Hkv, D] per layer."""
        hidden, residual = self.model.embed_tokens(input_ids), None
        metadata = with_lora_tokens(metadata)  # the step's tokens sorted by LoRA slot, once for every layer
        rotary = self.model.rotary_emb
        positions = rotary.rope_positions(positions, metadata)  # longrope's table choice; else the positions
        aux_layers, aux = self.aux_hidden_layers, []
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            if index in aux_layers:  # a layer named twice gives its state twice
                aux += [hidden if residual is None else hidden + residual] * aux_layers.count(index)
            hidden, residual = layer(hidden, residual, positions, rotary, kv_cache, metadata)
        hidden = self.model.norm(hidden, residual)[0]
        return torch.cat([hidden, *aux], dim=-1) if aux else hidden  # aux in layer order (vLLM's)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32 of the hidden states [N, hidden] the caller selected.

        The product runs in the model dtype and is then widened: HF's logits are rounded to it too."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Load HF-named checkpoint tensors: each into its layer (its part of a fused projection, this rank's
        slice of a parallel one); raise on unknown, misshapen or missing ones."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, part = self._fused_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            module_name, _, kind = target.rpartition(".")
            module = self.get_submodule(module_name)
            try:
                if hasattr(module, "load"):  # a parallel layer: it takes its own slice
                    module.load(kind, tensor, part)
                else:
                    load_whole(params[target], tensor)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            loaded.update(self._covered_names(name))
        expected = {source for param in params for source in self._checkpoint_names(param)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")

    def _fused_slices(self) -> dict[str, tuple[str, int]]:
        """Checkpoint projection -> (fused projection, its part in it)."""
        return {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", 1),
            "self_attn.v_proj": ("self_attn.qkv_proj", 2),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0),
            "mlp.up_proj": ("mlp.gate_up_proj", 1),
        }

    def _fused_target(self, name: str) -> tuple[str, int]:
        """Our parameter for a checkpoint tensor name, and its part when it is fused (else 0)."""
        for source, (fused, part) in self._fused_slices().items():
            marker = f".{source}."
            if marker in name:
                return name.replace(marker, f".{fused}."), part
        return name, 0

    def _covered_names(self, name: str) -> list[str]:
        """The checkpoint names (as `_checkpoint_names` lists them) that tensor `name` fills: itself, or for a
        tensor stacking several (a MoE's stacked experts) each of them."""
        return [name]

    def _checkpoint_names(self, param: str) -> list[str]:
        """The checkpoint tensors that fill our parameter `param`."""
        sources = [
            param.replace(f".{fused}.", f".{source}.")
            for source, (fused, _) in self._fused_slices().items()
            if f".{fused}." in param
        ]
        return sources or [param]
