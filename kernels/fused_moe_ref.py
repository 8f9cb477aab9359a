"""Torch reference of a sparse mixture-of-experts MLP: routing, each expert's gated MLP, the weighted sum.

The CPU path of the MoE layer and the oracle of the Triton kernel (kernels/triton_fused_moe.py). Numerics are
transformers' (its default `grouped_mm` experts path, the one `from_pretrained` runs):

- routing: softmax of the router logits in fp32 over all experts, top-k, divided by the top-k sum when
  `renormalize` (Mixtral always; Qwen3-MoE when `norm_topk_prob`). Qwen3-MoE then casts the weights to the
  activation dtype (`round_routing_weights`); Mixtral keeps them fp32.
- each chosen expert: gate|up in one product rounded to the activation dtype, SiLU rounded, times up rounded,
  the down product rounded (HF's `act_fn(gate) * up` and linears);
- the expert output times its routing weight: in the activation dtype when the weights were cast (one more
  rounding), in fp32 otherwise (activation * fp32 promotes);
- the k products summed in fp32 and rounded once (HF's `.view(T, k, H).sum(dim=1)`, which accumulates
  16-bit values in fp32, then `.to(dtype)`).

Weights are stacked per expert as the GEMMs read them: w13 [E, 2I, H] (gate rows, then up rows) and
w2 [E, H, I]. Under tensor parallel each rank passes its slice of I and all-reduces the result.

FP8 experts (weight-only): w13 and w2 are float8_e4m3fn with one float32 scale per expert and output row,
w13_scale [E, 2I] and w2_scale [E, H]. Each chosen expert's weight is dequantized (W * scale, float32) and
multiplied with the activation widened to float32, the product rounded to the activation dtype where the
unquantized linear rounds; everything else is the math above. The activations are not quantized.

Integer experts (weight-only W4A16 / W8A16: AWQ, GPTQ, compressed-tensors pack-quantized) come as
kernels/wna16_ref.py's `PackedExperts`, the canonical packed layout stacked per expert. Each chosen expert is
dequantized to float32 (`dequantize_wna16`), rounded to the activation dtype and multiplied there, as the dense
integer reference (`wna16_linear_ref`) and transformers running the dequantized weights do.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kernels.silu_and_mul_ref import silu_and_mul
from kernels.wna16_ref import PackedExperts


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, round_routing_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [T, k], expert ids [T, k] int64) from router logits [T, E], as transformers routes.

    Weights are fp32, or the logits' dtype when `round_routing_weights`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_routing_weights:
        weights = weights.to(router_logits.dtype)
    return weights, expert_ids


def weighted_sum_over_choices(weighted: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T * k, H] weighted expert outputs (row t * k + j: token t's j-th choice) -> [T, H] in `dtype`, summed
    in fp32 and rounded once."""
    return weighted.view(-1, top_k, weighted.shape[-1]).sum(dim=1, dtype=torch.float32).to(dtype)


def expert_linear(x: torch.Tensor, weights: torch.Tensor | PackedExperts, expert: int,
                  scales: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] @ expert `expert`'s weight [N, K]^T in x's dtype: a float weight as it is; a float8 one (`scales`
    [E, N]) or an integer one (PackedExperts) dequantized to float32 first, then multiplied as the unquantized
    reference of its kind does (float8: in float32, rounded after; integer: W rounded to x's dtype, as
    kernels/wna16_ref.py's linear)."""
    if isinstance(weights, PackedExperts):
        return F.linear(x, weights.dequantize(expert).to(x.dtype))
    if scales is None:
        return F.linear(x, weights[expert])
    return F.linear(x.float(), weights[expert].float() * scales[expert].float().unsqueeze(1)).to(x.dtype)


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor | PackedExperts,
    w2: torch.Tensor | PackedExperts,
    top_k: int,
    renormalize: bool,
    round_routing_weights: bool,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I] -> [T, H] in hidden's dtype; with
    float8 experts their scales w13_scale [E, 2I] and w2_scale [E, H]; integer experts as PackedExperts (w13's
    N = 2I, K = H; w2's N = H, K = I) (module docstring)."""
    weights, expert_ids = select_experts(router_logits, top_k, renormalize, round_routing_weights)
    flat_experts = expert_ids.reshape(-1)
    flat_weights = weights.reshape(-1, 1)
    product_dtype = torch.result_type(hidden, weights)
    weighted = torch.zeros(flat_experts.numel(), hidden.shape[1], dtype=product_dtype, device=hidden.device)
    for expert in torch.unique(flat_experts).tolist():  # only the experts chosen (a host sync: the CPU path)
        rows = (flat_experts == expert).nonzero().squeeze(1)
        gate_up = expert_linear(hidden[rows // top_k], w13, expert, w13_scale)
        down = expert_linear(silu_and_mul(gate_up), w2, expert, w2_scale)
        weighted[rows] = down * flat_weights[rows]
    return weighted_sum_over_choices(weighted, top_k, hidden.dtype)
