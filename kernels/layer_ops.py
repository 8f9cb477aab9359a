"""LayerOps: the operations of a decoder layer beside attention (RMSNorm + residual, rotary, SiLU-and-mul,
Gemma's RMSNorm and GELU-and-mul, the fused mixture-of-experts MLP).

Why a set passed into the model, like the attention backend: on a GPU each of these is one fused Triton
kernel instead of five to ten torch launches (a decode step of a 28-layer model is otherwise hundreds of
tiny elementwise kernels that read and write the activations again and again); on the CPU the torch
references run, which are the model's exact Hugging Face math. Both sets share one contract per op, set
in the reference modules (kernels/*_ref.py), so the model code is the same whichever set it gets.

`fused_moe` sits here rather than in an op set of its own: it is chosen exactly as the others are (torch on the
CPU, Triton on a GPU, the same `--attention-backend` switch), and every model already receives this one set,
so a MoE model needs no new constructor argument, registry signature or worker wiring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels import fused_moe_ref, gelu_and_mul_ref, rmsnorm_ref, rotary_ref, silu_and_mul_ref

# (hidden [T, H], weight [H], eps, residual [T, H] | None) -> (normed, new_residual)
RmsNormFn = Callable[[torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]
# (positions [T], query [T, Hq, D], key [T, Hkv, D], cos_sin_cache fp32 [P, D]) -> (query, key) rotated
RotaryFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# gate_up [T, 2 * I] -> [T, I]
SiluAndMulFn = Callable[[torch.Tensor], torch.Tensor]
# (gate_up [T, 2 * I], approximate "tanh" | "none") -> [T, I]
GeluAndMulFn = Callable[[torch.Tensor, str], torch.Tensor]


class FusedMoeFn(Protocol):
    """Routing and rounding as kernels/fused_moe_ref.py states; float8 experts come with their scales, integer
    experts as kernels/wna16_ref.py's PackedExperts in place of w13 and w2."""

    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 top_k: int, renormalize: bool, round_routing_weights: bool, w13_scale: torch.Tensor | None = None,
                 w2_scale: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I] (w13_scale [E, 2I], w2_scale [E, H]:
        float8 experts) -> [T, H]."""


# (hidden [T, K], weight [N, K], bias [N] | None) -> [T, N]: every linear layer and the LM head
LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# (fn, x [T, ...]) -> fn(x): a row-wise function of the activations that no op above covers (Gemma 2's final
# logit soft-cap); batch-invariant sets apply it so that a row's result cannot depend on the other rows
PerRowFn = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]


def _whole(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return fn(x)


@dataclass(frozen=True)
class LayerOps:
    name: str
    rms_norm: RmsNormFn
    rotary_embedding: RotaryFn
    silu_and_mul: SiluAndMulFn
    gemma_rms_norm: RmsNormFn  # Gemma's (1 + w) in fp32
    gelu_and_mul: GeluAndMulFn
    fused_moe: FusedMoeFn
    linear: LinearFn = F.linear
    per_row: PerRowFn = _whole
    # True: each op gives a row bitwise the same result whatever the other rows are (--batch-invariant).
    batch_invariant: bool = False


def torch_layer_ops() -> LayerOps:
    """The references: exact HF math, any device."""
    return LayerOps(
        "torch", rmsnorm_ref.rms_norm, rotary_ref.rotary_embedding, silu_and_mul_ref.silu_and_mul,
        rmsnorm_ref.gemma_rms_norm, gelu_and_mul_ref.gelu_and_mul, fused_moe_ref.fused_moe,
    )


def triton_layer_ops() -> LayerOps:
    """Fused Triton kernels (GPU; CPU under TRITON_INTERPRET=1). Triton is imported only when asked for."""
    from kernels import triton_fused_moe, triton_rmsnorm, triton_rotary, triton_silu_and_mul

    return LayerOps(
        "triton", triton_rmsnorm.rms_norm, triton_rotary.rotary_embedding, triton_silu_and_mul.silu_and_mul,
        triton_rmsnorm.gemma_rms_norm, triton_silu_and_mul.gelu_and_mul, triton_fused_moe.fused_moe,
    )
