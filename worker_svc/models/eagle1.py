"""An EAGLE-1 draft head (speculative decoding): Llama decoder layers that predict the target's next feature from
the target's own final hidden state and the next token, in the published checkpoint layout (SafeAILab/EAGLE's
`Model`, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B; vLLM's EagleLlamaForCausalLM reads the same tensors).

The math, per token position i (the head's input at i pairs a state at i with the token at i + 1):
- the state is the target's output hidden state at i, after its final norm (what the head was trained on: the
  EAGLE repo's training data is transformers' `hidden_states[-1]`, which is normed, and vLLM feeds the target
  model's forward output, also normed); later passes feed the head's own output state instead;
- `fc` [H, 2H] (with `fc.bias` when the checkpoint has one) maps concat(embed(token i + 1), state) to H;
- decoder layers `layers.N.*`: layer 0 has no input_layernorm (its input is fc's output as is), the others are
  plain Llama layers; there is no final norm: the last layer's output state is both fed back and read by the
  LM head (the target's, unless the checkpoint has `lm_head.weight`), whose argmax over the target's vocabulary
  is the proposal.
Embeddings are the target's unless the checkpoint has `embed_tokens.weight` (the EAGLE repo's heads ship a frozen
copy of the target's: worker_svc/eagle_head.py drops it when it equals the target's).

Why a module of its own (not a LlamaForCausalLM): two inputs per token, no final norm, a first layer without its
norm, and the target's LM head. It reuses our decoder layer (paged KV cache, rotary), so its KV pool and attention
metadata are the target's kind (worker_svc/eagle_head.py owns the pool and the passes, shared with EAGLE-3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.attention_backend import AttentionBackend
from kernels.attention_metadata import AttentionMetadata
from kernels.layer_ops import LayerOps
from worker_svc.layers.gated_mlp import GatedMLP
from worker_svc.layers.rotary_embedding import RotaryEmbedding
from worker_svc.model_config import ModelConfig
from worker_svc.models.eagle1_config import read_eagle1_config
from worker_svc.models.eagle3 import read_checkpoint
from worker_svc.models.llama import DecoderLayer
from worker_svc.tensor_parallel import SINGLE_RANK

# The checkpoint's projections -> our fused ones (the part each fills, in order).
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


class UnnormedInput(nn.Module):
    """EAGLE-1's first layer reads fc's output as is, where a Llama layer normalizes its input: in the place of
    that norm, (the input, the residual stream) with the residual add fused in like RMSNorm's."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        summed = hidden if residual is None else hidden + residual
        return summed, summed


class Eagle1Head(nn.Module):
    """fc, the layers, and the embeddings and LM head when the checkpoint has its own (else None: the target's
    embeddings, which eagle_head.py looks up, and its `target_logits`, no parameters of the head). The same
    surface as Eagle3Head (`combine`, `forward`, `greedy_target_ids`) for eagle_head.py."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps, fc_bias: bool,
                 own_embeddings: bool, own_lm_head: bool, target_logits: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, ops, SINGLE_RANK, False, index, GatedMLP(config, ops, SINGLE_RANK))
            for index in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = UnnormedInput()
        self.rotary_emb = RotaryEmbedding(config, ops)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embeddings else None
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False) if own_lm_head else None
        self._target_logits = target_logits  # a bound method: no module of the target's among the head's

    def combine(self, target_states: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states [T, H] are the head's input states as they are."""
        return target_states

    def forward(self, embeds: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(state for the logits, output state to feed back), both [T, H]: the same tensor (no final norm)."""
        hidden, residual = self.fc(torch.cat([embeds, state], dim=-1)), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, self.rotary_emb, kv_cache, metadata)
        output = hidden + residual
        return output, output

    def greedy_target_ids(self, state: torch.Tensor) -> torch.Tensor:
        """The argmax of each row's logits over the target's vocabulary."""
        logits = self._target_logits(state) if self.lm_head is None else self.lm_head(state)
        return torch.argmax(logits.float(), dim=-1)

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The head's checkpoint tensors (`read_checkpoint` of models/eagle3.py; consumed), q/k/v and gate/up fused
        as our layers hold them; raises ValueError on missing, unknown or misshapen tensors."""
        for name in [name for name in tensors if name.endswith("rotary_emb.inv_freq")]:
            del tensors[name]  # older transformers saved the rotary buffer: ours is computed
        state = {}
        try:
            for index in range(len(self.layers)):
                prefix = f"layers.{index}."
                for fused, parts in _FUSED.items():
                    state[f"{prefix}{fused}.weight"] = torch.cat([tensors.pop(f"{prefix}{part}.weight")
                                                                   for part in parts])
                norms = ("post_attention_layernorm",) if index == 0 else ("input_layernorm", "post_attention_layernorm")
                for name in ("self_attn.o_proj", "mlp.down_proj", *norms):
                    state[f"{prefix}{name}.weight"] = tensors.pop(f"{prefix}{name}.weight")
            state["fc.weight"] = tensors.pop("fc.weight")
        except KeyError as error:
            raise ValueError(f"EAGLE-1 checkpoint lacks {error.args[0]}") from None
        for name, module in (("fc.bias", self.fc.bias), ("embed_tokens.weight", self.embed_tokens),
                             ("lm_head.weight", self.lm_head)):
            if (name in tensors) != (module is not None):
                built = "without" if module is None else "with"
                raise ValueError(f"{name}: the head was built for a checkpoint {built} it")
            if name in tensors:
                state[name] = tensors.pop(name)
        if tensors:
            raise ValueError(f"EAGLE-1 checkpoint tensors not served: {sorted(tensors)[:5]}")
        own = self.state_dict()
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(own[name].shape)}")
        self.load_state_dict(state, strict=True)


def load_eagle1_head(path: str, target_model: nn.Module, backend: AttentionBackend, ops: LayerOps,
                     target_positions: int) -> Eagle1Head:
    """The head at `path` beside `target_model` (on the CPU; the caller moves it to the device and dtype).
    Embeddings the head ships that equal the target's in its dtype are dropped for the target's: the EAGLE repo's
    heads carry a frozen copy (1 GiB for Llama 3 8B), and the same values give the same proposals. Raises
    ValueError on what it does not serve."""
    config = read_eagle1_config(path, target_positions)
    tensors = read_checkpoint(path)
    embed, target_embed = tensors.get("embed_tokens.weight"), target_model.model.embed_tokens.weight
    if embed is not None and embed.shape == target_embed.shape and torch.equal(
            embed.to(device=target_embed.device, dtype=target_embed.dtype), target_embed):
        del tensors["embed_tokens.weight"]
    head = Eagle1Head(config, backend, ops, fc_bias="fc.bias" in tensors,
                      own_embeddings="embed_tokens.weight" in tensors, own_lm_head="lm_head.weight" in tensors,
                      target_logits=target_model.compute_logits)
    head.load_tensors(tensors)
    return head
