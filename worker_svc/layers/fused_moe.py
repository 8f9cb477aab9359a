"""The sparse mixture-of-experts block (Mixtral, Qwen3-MoE): a router and E gated-MLP experts, stacked.

Why stacked parameters instead of E GatedMLP modules: the fused MoE op (kernels/fused_moe_ref.py, Triton in
kernels/triton_fused_moe.py) reads all experts as two tensors, w13 [E, 2I, H] (each expert's gate rows then
up rows) and w2 [E, H, I], and picks each token's experts inside one kernel launch, not E Python calls.

Tensor parallel (as vLLM's FusedMoE without expert parallelism): every rank holds every expert, but only its
share of the intermediate dimension I, the gate and up rows `tp.shard(I)` of w13 and the same columns of w2,
just as GatedMLP splits its width; the router is replicated, so every rank routes alike, and the block's
output is all-reduced once. Each rank reads only its slices of the checkpoint.

Checkpoints name experts one by one (`experts.N.w1` gate / `w3` up / `w2` down in Mixtral's hub files,
`experts.N.gate_proj` / `up_proj` / `down_proj` in Qwen3-MoE's) or, as transformers 5 holds them in memory,
stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); `load` takes either (the model
file maps the names, worker_svc/models/sparse_moe_weights.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.layer_ops import LayerOps
from worker_svc.layers.checkpoint_tensor import CheckpointTensor, copy_into
from worker_svc.tensor_parallel import TensorParallel

GATE, UP = 0, 1  # parts of w13
ALL_EXPERTS = -1  # `load`'s expert for a stacked checkpoint tensor


class FusedMoE(nn.Module):
    """Router `gate` (a replicated [E, H] linear) and the stacked experts `w13_weight` [E, 2 * I / N, H] and
    `w2_weight` [E, H, I / N] of this rank. `renormalize`: divide the top-k weights by their sum (Mixtral;
    Qwen3-MoE's norm_topk_prob). `round_routing_weights`: the weights are cast to the activation dtype before
    they scale the expert outputs (Qwen3-MoE), or stay fp32 (Mixtral), as in transformers."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, top_k: int, renormalize: bool,
                 round_routing_weights: bool, ops: LayerOps, tp: TensorParallel):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
        self.ops, self.tp = ops, tp
        self.top_k, self.renormalize, self.round_routing_weights = top_k, renormalize, round_routing_weights
        self.intermediate_size = intermediate_size
        self.shard_start, self.shard_size = tp.shard(intermediate_size)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.shard_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.ops.linear(hidden, self.gate.weight, None)
        output = self.ops.fused_moe(hidden, router_logits, self.w13_weight, self.w2_weight, self.top_k,
                                    self.renormalize, self.round_routing_weights)
        return self.tp.all_reduce(output)

    def load(self, kind: str, checkpoint: CheckpointTensor, part: tuple[int, int] = (ALL_EXPERTS, GATE)) -> None:
        """Copies this rank's slice of a checkpoint tensor into `kind` ("w13_weight" or "w2_weight"). `part` is
        (expert, GATE or UP): one expert's [I, H] gate or up rows, or [H, I] down weight; expert ALL_EXPERTS for
        the stacked [E, 2I, H] gate|up or [E, H, I] down tensor (the projection part is then ignored)."""
        expert, projection = part
        start, size = self.shard_start, self.shard_size
        num_experts, hidden, inter = self.w13_weight.shape[0], self.w13_weight.shape[2], self.intermediate_size
        if kind not in ("w13_weight", "w2_weight"):
            raise ValueError(f"{kind} is not a parameter of the MoE block")
        down = kind == "w2_weight"
        if expert == ALL_EXPERTS:
            check_shape(checkpoint, (num_experts, hidden, inter) if down else (num_experts, 2 * inter, hidden))
            if down:
                copy_into(self.w2_weight, checkpoint.narrow(2, start, size))
            else:
                copy_into(self.w13_weight[:, :size], checkpoint.narrow(1, start, size))
                copy_into(self.w13_weight[:, size:], checkpoint.narrow(1, inter + start, size))
            return
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert {expert} is not one of the {num_experts} experts (num_experts)")
        check_shape(checkpoint, (hidden, inter) if down else (inter, hidden))
        if down:
            copy_into(self.w2_weight[expert], checkpoint.columns(start, size))
        else:
            copy_into(self.w13_weight[expert, projection * size : (projection + 1) * size],
                      checkpoint.rows(start, size))


def check_shape(checkpoint: CheckpointTensor, expected: tuple[int, ...]) -> None:
    """A sliced tensor's own shape must be the model's: a slice of a wider one would load silently."""
    if tuple(checkpoint.shape) != expected:
        raise ValueError(f"checkpoint shape {tuple(checkpoint.shape)} != {expected}")
