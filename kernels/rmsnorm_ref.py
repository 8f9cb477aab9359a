"""Torch reference of RMSNorm with an optional residual add: the math of worker_svc/models/llama.py's RMSNorm.

Why a standalone function: the Triton kernel (kernels/triton_rmsnorm.py) is tested against it, and
tests/triton_kernels/ checks it equals the model module bit for bit, so the kernel is held to the same
cast order Hugging Face uses (to fp32, normalize, back to the input dtype, times weight). In bf16 that
rounds three times, where HF's decoder layer does: the residual sum (HF adds in the activation dtype and
normalizes the rounded sum), the normalized row, and its product with the weight.
"""

from __future__ import annotations

import torch


def rms_norm(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `hidden` [T, H] (of `hidden + residual` when a residual is given).

    Returns (normed, new_residual): new_residual is the sum the norm was taken of (a decoder layer's
    next residual stream), or `hidden` itself without a residual.
    """
    if residual is not None:
        hidden = hidden + residual
    input_dtype = hidden.dtype
    normed = hidden.to(torch.float32)
    variance = normed.pow(2).mean(-1, keepdim=True)
    normed = normed * torch.rsqrt(variance + eps)
    return weight * normed.to(input_dtype), hidden


def gemma_rms_norm(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm (same contract as `rms_norm`): the weight is stored as an offset from 1 and the
    product is taken in fp32 before the one rounding, `(normed * (1 + w)).to(dtype)` (Llama rounds the
    normalized row first): HF's GemmaRMSNorm, also the q/k norm of Gemma 3."""
    if residual is not None:
        hidden = hidden + residual
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(hidden), hidden
