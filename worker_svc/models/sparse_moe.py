"""What the MoE families (Mixtral, Qwen3-MoE) share: the Llama-family decoder with a sparse MoE block as the
MLP of some layers, and the mapping of the checkpoints' expert names onto the block's stacked weights.

Who owns what: a family file (mixtral.py, qwen3_moe.py) reads its config.json keys into a `MoeShape` and
refuses what it does not support; this class builds the blocks (worker_svc/layers/fused_moe.py) and loads
them. Our parameters are `model.layers.L.mlp.{gate.weight, w13_weight, w2_weight}` whatever the family calls
the block (Mixtral's hub files say `block_sparse_moe`; transformers 5 renames it `mlp` too), for an FP8
checkpoint `w13_scale`, `w2_scale`, filled from each expert projection's `weight_scale`, and for an integer one
`w13_<tensor>`, `w2_<tensor>` from each expert projection's `<tensor>` (qweight, scales, ...: FusedMoE.parameter_kind).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from kernels.layer_ops import LayerOps
from worker_svc.layers.fused_moe import ALL_EXPERTS, GATE, UP, FusedMoE
from worker_svc.model_config import ModelConfig
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.tensor_parallel import TensorParallel

# model.layers.L.<block>.experts.N.<projection>.<tensor> (hub files: .weight; an FP8 checkpoint's also
# .weight_scale; an integer one's .qweight, .scales, ...) / model.layers.L.<block>.experts.<stacked> (transformers
# 5's in-memory layout) / model.layers.L.<block>.gate.weight (the router)
PER_EXPERT = re.compile(r"(model\.layers\.\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.(\w+)")
STACKED = re.compile(r"(model\.layers\.\d+)\.(\w+)\.experts\.(gate_up_proj|down_proj)")
ROUTER = re.compile(r"(model\.layers\.\d+)\.(\w+)\.gate\.weight")
# Our parameters of a block.
BLOCK_PARAM = re.compile(r"(model\.layers\.\d+)\.mlp\.((?:w13|w2)_\w+|gate\.weight)")


@dataclass(frozen=True)
class MoeShape:
    """A MoE family's expert configuration, read from config.json by its model file. `sparse_layers`: the
    layers whose MLP is the MoE block (the others are a dense GatedMLP of intermediate_size)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    round_routing_weights: bool
    sparse_layers: frozenset[int]


class SparseMoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose `moe_shape(config).sparse_layers` have a FusedMoE block as their MLP.

    A family sets `moe_shape` (a staticmethod reading its keys), `checkpoint_block` (its hub files' name of the
    block) and `expert_projections` (its names of the gate, up and down projections of one expert)."""

    checkpoint_block: str
    expert_projections: tuple[str, str, str]

    def make_mlp(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel, layer_index: int) -> nn.Module:
        shape = self.moe_shape(config)
        if layer_index not in shape.sparse_layers:
            return super().make_mlp(config, ops, tp, layer_index)
        return FusedMoE(config.hidden_size, shape.num_experts, shape.intermediate_size, shape.top_k,
                        shape.renormalize, shape.round_routing_weights, ops, tp)

    def _fused_target(self, name: str) -> tuple[str, object]:
        """Per-expert tensors (weights, FP8 scales) go to their expert's slot of w13 (gate or up) or w2, or of
        their scales; stacked ones whole."""
        if (match := self._block_match(PER_EXPERT, name)) is not None:
            layer, _, expert, projection, tensor = match.groups()
            if projection not in self.expert_projections:
                raise ValueError(f"checkpoint tensor {name!r}: expert projection {projection!r} is not one of "
                                 f"{self.expert_projections} (gate, up, down)")
            gate, up, down = self.expert_projections
            kind = self.get_submodule(f"{layer}.mlp").parameter_kind(tensor, down=projection == down)
            return f"{layer}.mlp.{kind}", (int(expert), UP if projection == up else GATE)
        if (match := self._block_match(STACKED, name)) is not None:
            layer, _, stacked = match.groups()
            kind = "w13_weight" if stacked == "gate_up_proj" else "w2_weight"
            return f"{layer}.mlp.{kind}", (ALL_EXPERTS, GATE)
        if (match := self._block_match(ROUTER, name)) is not None:
            return f"{match.group(1)}.mlp.gate.weight", (ALL_EXPERTS, GATE)
        return super()._fused_target(name)

    def _covered_names(self, name: str) -> list[str]:
        """A stacked tensor (or the router under transformers 5's block name) stands for the hub's names."""
        if not any(self._block_match(pattern, name) for pattern in (PER_EXPERT, STACKED, ROUTER)):
            return [name]
        target, (expert, projection) = self._fused_target(name)
        names = self._checkpoint_names(target)  # expert-major: (gate, up) per expert, or down per expert
        if expert == ALL_EXPERTS:
            return names
        per_expert = len(names) // self.moe_shape(self.config).num_experts
        return [names[expert * per_expert + (projection if per_expert == 2 else 0)]]

    def _checkpoint_names(self, param: str) -> list[str]:
        """The hub's per-expert names that fill a block parameter (what a complete checkpoint must give)."""
        match = BLOCK_PARAM.fullmatch(param)
        if match is None:
            return super()._checkpoint_names(param)
        layer, kind = match.groups()
        block = f"{layer}.{self.checkpoint_block}"
        if kind == "gate.weight":
            return [f"{block}.gate.weight"]
        gate, up, down = self.expert_projections
        projections = [down] if kind.startswith("w2") else [gate, up]
        tensor = FusedMoE.checkpoint_kind(kind)
        num_experts = self.moe_shape(self.config).num_experts
        return [f"{block}.experts.{e}.{p}.{tensor}" for e in range(num_experts) for p in projections]

    def _block_match(self, pattern: re.Pattern, name: str) -> re.Match | None:
        """`pattern`'s match of `name` when the block it names is a sparse layer's, under a name we accept."""
        match = pattern.fullmatch(name)
        if match is None or match.group(2) not in (self.checkpoint_block, "mlp"):
            return None
        layer_index = int(match.group(1).rsplit(".", 1)[1])
        return match if layer_index in self.moe_shape(self.config).sparse_layers else None
