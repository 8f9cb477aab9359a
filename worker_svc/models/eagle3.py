"""An EAGLE-3 draft head (speculative decoding): one decoder layer that predicts the target's next tokens from the
target's own hidden states, in the published checkpoint layout (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).

The math, per token position i (the head's input at i pairs the target's state at i with the token at i + 1):
- `fc` [H, 3H] mixes three target hidden states at i (the residual stream entering the target's layers
  `aux_layer_ids`, concatenated) into one H-vector; later passes feed the head's own output state instead.
- the layer's attention takes [input_layernorm(embed(token i + 1)), hidden_norm(state)] (2H wide) and adds its
  output to the state (the residual); post_attention_layernorm, the gated MLP, the residual again: the head's
  output state at i (fed back for the next position), and `norm` of it gives the logits over the draft vocabulary
  (`lm_head` [draft_vocab, H]); draft id d is target id d + d2t[d].
Embeddings are the target's unless the checkpoint has `embed_tokens.weight`.

Why a module of its own (not a LlamaForCausalLM): its layer's q/k/v read 2H inputs, it has no embedding stage of
its own and two inputs per token. It reuses our attention (paged KV cache, rotary), norms and MLP, so its KV pool
and attention metadata are the target's kind (worker_svc/eagle_head.py owns the pool and the passes).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kernels.attention_backend import AttentionBackend
from kernels.attention_metadata import AttentionMetadata
from kernels.layer_ops import LayerOps
from worker_svc.layers.attention import Attention
from worker_svc.layers.gated_mlp import GatedMLP
from worker_svc.layers.parallel_linear import ColumnParallelLinear
from worker_svc.layers.rms_norm import RMSNorm
from worker_svc.layers.rotary_embedding import RotaryEmbedding
from worker_svc.model_config import ModelConfig
from worker_svc.tensor_parallel import SINGLE_RANK

# Checkpoints name the one layer `midlayer` (the EAGLE repo's) or `layers.0` (vLLM's renaming).
_LAYER_PREFIXES = ("midlayer.", "layers.0.")


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [normed embeddings, normed state] (2H wide), then the MLP, each
    added to the state."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.self_attn = Attention(config, backend, False, SINGLE_RANK)
        self.self_attn.qkv_proj = ColumnParallelLinear(2 * config.hidden_size, self.self_attn.qkv_proj.shards,
                                                       bias=False)
        self.mlp = GatedMLP(config, ops, SINGLE_RANK)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.hidden_norm = RMSNorm(config.hidden_size, eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops)

    def forward(self, embeds, state, positions, rotary, kv_cache, metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual before it): their sum is the layer's output state."""
        both = torch.cat([self.input_layernorm(embeds)[0], self.hidden_norm(state)[0]], dim=-1)
        attn_out = self.self_attn(both, positions, rotary, kv_cache, metadata)
        normed, residual = self.post_attention_layernorm(attn_out, state)
        return self.mlp(normed), residual


class Eagle3Head(nn.Module):
    """fc, the layer, norm and lm_head; `draft_to_target` [draft_vocab] (d2t) maps its ids to the target's.
    `embed_tokens` is None when the head reads the target's embeddings."""

    def __init__(self, config: ModelConfig, draft_vocab_size: int, backend: AttentionBackend, ops: LayerOps,
                 own_embeddings: bool):
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(config, backend, ops)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, ops)
        self.rotary_emb = RotaryEmbedding(config, ops)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embeddings else None
        self.register_buffer("draft_to_target", torch.zeros(draft_vocab_size, dtype=torch.long))

    def combine(self, target_states: torch.Tensor) -> torch.Tensor:
        """The target's three states [T, 3H] (concatenated in aux layer order) -> the head's input state [T, H]."""
        return self.fc(target_states)

    def forward(self, embeds: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed state for the logits, output state to feed back), both [T, H]."""
        mlp_out, residual = self.midlayer(embeds, state, positions, self.rotary_emb, kv_caches[0], metadata)
        normed, output_state = self.norm(mlp_out, residual)
        return normed, output_state

    def greedy_target_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """The argmax over the draft vocabulary of each row's logits, as target token ids."""
        draft_ids = torch.argmax(self.lm_head(normed).float(), dim=-1)
        return draft_ids + self.draft_to_target[draft_ids]

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The head's checkpoint tensors (`read_checkpoint`; consumed), q/k/v and gate/up fused as our layers hold
        them; raises ValueError on missing, unknown or misshapen tensors."""
        layer = {}
        for name in list(tensors):
            for prefix in _LAYER_PREFIXES:
                if name.startswith(prefix):
                    layer[name[len(prefix):]] = tensors.pop(name)
        try:
            state = {
                "fc.weight": tensors.pop("fc.weight"),
                "norm.weight": tensors.pop("norm.weight"),
                "lm_head.weight": tensors.pop("lm_head.weight"),
                "midlayer.self_attn.qkv_proj.weight": torch.cat([layer.pop(f"self_attn.{p}_proj.weight")
                                                                 for p in "qkv"]),
                "midlayer.self_attn.o_proj.weight": layer.pop("self_attn.o_proj.weight"),
                "midlayer.mlp.gate_up_proj.weight": torch.cat([layer.pop("mlp.gate_proj.weight"),
                                                               layer.pop("mlp.up_proj.weight")]),
                "midlayer.mlp.down_proj.weight": layer.pop("mlp.down_proj.weight"),
            }
            for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
                state[f"midlayer.{norm}.weight"] = layer.pop(f"{norm}.weight")
        except KeyError as error:
            raise ValueError(f"EAGLE-3 checkpoint lacks {error.args[0]}") from None
        d2t = tensors.pop("d2t", None)
        tensors.pop("t2d", None)  # target -> draft membership: the proposals never need it
        if d2t is None and self.lm_head.out_features != self.config.vocab_size:
            raise ValueError("EAGLE-3 checkpoint has a reduced draft vocabulary but no d2t map")
        state["draft_to_target"] = (torch.zeros(self.lm_head.out_features, dtype=torch.long) if d2t is None
                                    else d2t.long())
        embed = tensors.pop("embed_tokens.weight", None)
        if (embed is not None) != (self.embed_tokens is not None):
            raise ValueError("embed_tokens.weight: the head was built for the other embedding source")
        if embed is not None:
            state["embed_tokens.weight"] = embed
        unknown = sorted(tensors) + sorted(f"midlayer.{name}" for name in layer)
        if unknown:
            raise ValueError(f"EAGLE-3 checkpoint tensors not served: {unknown[:5]}")
        own = self.state_dict()
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(own[name].shape)}")
        self.load_state_dict(state, strict=True)


def read_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's checkpoint (model.safetensors shards or pytorch_model.bin), on the CPU (a head
    is one layer); `embed_tokens.weight` among them means the head has embeddings of its own."""
    directory = Path(directory)
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if files:
        return {name: tensor for file in files for name, tensor in load_file(file).items()}
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"{directory}: no *.safetensors or pytorch_model*.bin")
    return {name: tensor for file in bins
            for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items()}
