"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k RMSNorm, explicit head_dim; qwen3.py)
with a sparse MoE block as the MLP of the layers `decoder_sparse_step` and `mlp_only_layers` choose (as
transformers: layer i is sparse when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0),
a dense GatedMLP of `intermediate_size` in the others. The block: `num_experts` experts of
`moe_intermediate_size`, `num_experts_per_tok` per token, renormalized when `norm_topk_prob`, the routing
weights cast to the activation dtype (transformers' Qwen3MoeTopKRouter). Its hub files name the block `mlp`
with experts `gate_proj` / `up_proj` / `down_proj`.

Refused from config.json (models/feature_refusals.py), naming the key: shared experts
(`shared_expert_intermediate_size`, Qwen2-MoE's; Qwen3-MoE has none), `use_sliding_window` (transformers
would slide every layer) and activations other than SiLU.
"""

from __future__ import annotations

from worker_svc.model_config import ModelConfig
from worker_svc.models.sparse_moe import MoeShape, SparseMoeForCausalLM


class Qwen3MoeForCausalLM(SparseMoeForCausalLM):
    qk_norm = True
    checkpoint_block = "mlp"
    expert_projections = ("gate_proj", "up_proj", "down_proj")

    @staticmethod
    def moe_shape(config: ModelConfig) -> MoeShape:
        raw = config.hf_config
        # The hub's config.json says num_experts; transformers 5 writes it as num_local_experts.
        num_experts = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
        step = raw.get("decoder_sparse_step", 1)
        dense = set(raw.get("mlp_only_layers") or ())
        return MoeShape(
            num_experts=num_experts, top_k=raw["num_experts_per_tok"],
            intermediate_size=raw["moe_intermediate_size"], renormalize=bool(raw.get("norm_topk_prob", False)),
            round_routing_weights=True,
            sparse_layers=frozenset(
                i for i in range(config.num_hidden_layers)
                if i not in dense and num_experts > 0 and (i + 1) % step == 0
            ),
        )
