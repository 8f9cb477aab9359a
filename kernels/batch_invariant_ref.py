"""Batch-invariant torch ops (`--batch-invariant` on the CPU): every row of the activations, and every query of
attention, computed by calls whose shapes depend on that row alone.

Why: a CPU kernel's reduction order, and even which code computes an element, depends on the shapes it is
given. A GEMM blocks its rows and columns by the matrix's size (MKL and oneDNN pick kernels by M); a reduction
over a row may be split across threads when there are few rows; an elementwise exp or tanh is vectorized
(SLEEF) in the body of a thread's range and scalar (libm) at its tail, and the ranges follow the tensor's
size. So the same token gives other bits among 15 other requests than alone, or in a decode step than in its
prompt's prefill. Called with one row at a time, each op sees exactly the same shapes for a row whatever else
the step holds, and the same data in gives the same bits out: that is the whole guarantee, with no claim about
how a BLAS orders its sums. Attention goes one query at a time over exactly the keys it sees (0 .. its
position), so a token computed in a whole prefill, in a chunk, over a cached prefix or in a decode step runs
the same calls on the same values.

Cost: one call per row per op, so a CPU step is slower by about the number of rows; the mode is for
reproducibility, and the GPU has kernels built for it (kernels/batch_invariant_layer_ops.py). Elementwise ops
without transcendental functions (rotary with its cached cos/sin, residual adds, embeddings) are exact per
element already and run whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import fused_moe_ref, gelu_and_mul_ref, paged_attention_ref, rmsnorm_ref, rotary_ref, silu_and_mul_ref
from kernels.attention_metadata import AttentionMetadata
from kernels.kv_quant import UNIT_KV_SCALES, KVScales
from kernels.layer_ops import LayerOps


def per_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn applied to each row of x (a [1, ...] slice at a time), concatenated."""
    if x.shape[0] == 0:
        return fn(x)
    return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])


def linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return per_row(lambda row: F.linear(row, weight, bias), hidden)


def _norm(norm: Callable) -> Callable:
    def rowwise(hidden, weight, eps, residual=None):
        if hidden.shape[0] == 0:
            return norm(hidden, weight, eps, residual)
        rows = [norm(hidden[i : i + 1], weight, eps, None if residual is None else residual[i : i + 1])
                for i in range(hidden.shape[0])]
        return torch.cat([normed for normed, _ in rows]), torch.cat([kept for _, kept in rows])

    return rowwise


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return per_row(silu_and_mul_ref.silu_and_mul, gate_up)


def gelu_and_mul(gate_up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    return per_row(lambda row: gelu_and_mul_ref.gelu_and_mul(row, approximate), gate_up)


def fused_moe(hidden, router_logits, w13, w2, top_k, renormalize, round_routing_weights) -> torch.Tensor:
    """Each token through its experts alone (the reference groups tokens by expert, so a token's products
    would otherwise be rows of GEMMs whose height is the number of tokens routed alike)."""
    if hidden.shape[0] == 0:
        return fused_moe_ref.fused_moe(hidden, router_logits, w13, w2, top_k, renormalize, round_routing_weights)
    return torch.cat([fused_moe_ref.fused_moe(hidden[i : i + 1], router_logits[i : i + 1], w13, w2, top_k,
                                              renormalize, round_routing_weights)
                      for i in range(hidden.shape[0])])


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    kv_scales: KVScales = UNIT_KV_SCALES,
) -> torch.Tensor:
    """kernels/paged_attention_ref.py's attention, one query at a time over the keys 0 .. its position (an fp8
    cache dequantized elementwise with `kv_scales`)."""
    output = torch.zeros_like(query)
    for start, end, key, value in paged_attention_ref.sequences(kv_cache, metadata, kv_scales, query.dtype):
        first_position = key.shape[0] - (end - start)
        for j in range(end - start):
            seen = first_position + j + 1
            output[start + j : start + j + 1] = paged_attention_ref.attend(
                query[start + j : start + j + 1], key[:seen], value[:seen], scale, sliding_window, logit_softcap)
    return output


class BatchInvariantTorchBackend:
    """The AttentionBackend of `--batch-invariant` on the CPU (kernels/attention_backend.py's protocol)."""

    def write_kv_cache(self, key, value, kv_cache, slot_mapping, kv_scales=UNIT_KV_SCALES) -> None:
        paged_attention_ref.write_kv_cache(key, value, kv_cache, slot_mapping, kv_scales)

    def paged_attention(self, query, kv_cache, metadata, scale, sliding_window=None, logit_softcap=None,
                        kv_scales=UNIT_KV_SCALES):
        return paged_attention(query, kv_cache, metadata, scale, sliding_window, logit_softcap, kv_scales)


def batch_invariant_torch_layer_ops() -> LayerOps:
    return LayerOps(
        "torch-batch-invariant", _norm(rmsnorm_ref.rms_norm), rotary_ref.rotary_embedding, silu_and_mul,
        _norm(rmsnorm_ref.gemma_rms_norm), gelu_and_mul, fused_moe, linear=linear, per_row=per_row,
        batch_invariant=True,
    )
