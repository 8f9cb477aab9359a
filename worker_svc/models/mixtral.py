"""Mixtral (MixtralForCausalLM): the Mistral decoder (Llama layout, every layer sliding when config.json sets
a `sliding_window`) with a sparse MoE block as every layer's MLP: `num_local_experts` experts of
`intermediate_size`, `num_experts_per_tok` chosen per token, their weights always renormalized and kept in
fp32 (transformers' MixtralTopKRouter). The block and its loading are shared (sparse_moe.py); the hub's files
name it `block_sparse_moe` with experts `w1` (gate), `w3` (up), `w2` (down).
"""

from __future__ import annotations

from worker_svc.model_config import ModelConfig
from worker_svc.models.sparse_moe import MoeShape, SparseMoeForCausalLM


class MixtralForCausalLM(SparseMoeForCausalLM):
    checkpoint_block = "block_sparse_moe"
    expert_projections = ("w1", "w3", "w2")

    @staticmethod
    def moe_shape(config: ModelConfig) -> MoeShape:
        raw = config.hf_config  # other activations are refused from config.json (models/feature_refusals.py)
        return MoeShape(
            num_experts=raw["num_local_experts"], top_k=raw["num_experts_per_tok"],
            intermediate_size=config.intermediate_size, renormalize=True, round_routing_weights=False,
            sparse_layers=frozenset(range(config.num_hidden_layers)),
        )
