"""Fused RMSNorm (+ residual add) in Triton: one program per token.

Torch reference: kernels/rmsnorm_ref.py (`rms_norm`), which is llama.py's RMSNorm.

Why fused: a decoder layer does `residual = hidden + residual; normed = norm(residual)` twice per layer;
one pass reads hidden and residual once and writes both results. Numerics follow HF's cast order
exactly: the residual add rounds to the activation dtype (as torch's add does), the sum of squares and
the normalization run in fp32, the normalized row is cast back to the activation dtype, then multiplied
by the weight in the promoted dtype. All arithmetic is explicit fp32 with casts for the roundings, so
no interpreter upcast flag is needed (16-bit values are only loaded, stored and cast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    hidden_ptr,
    residual_ptr,
    weight_ptr,
    normed_ptr,
    residual_out_ptr,
    stride_hidden,
    stride_residual,
    stride_normed,
    stride_residual_out,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    activation_dtype = hidden_ptr.dtype.element_ty
    hidden = tl.load(hidden_ptr + token * stride_hidden + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + token * stride_residual + cols, mask=mask, other=0.0)
        hidden = (hidden.to(tl.float32) + residual.to(tl.float32)).to(activation_dtype)
        tl.store(residual_out_ptr + token * stride_residual_out + cols, hidden, mask=mask)
    hidden = hidden.to(tl.float32)
    variance = tl.sum(hidden * hidden, 0) / hidden_size
    normed = hidden * tl.rsqrt(variance + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: (1 + w) times the fp32 row, one rounding
        normed = normed * (1.0 + weight)
    else:  # Llama: round the row, then times w
        normed = weight * normed.to(activation_dtype).to(tl.float32)
    tl.store(normed_ptr + token * stride_normed + cols, normed.to(normed_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels/rmsnorm_ref.py's `rms_norm`: (normed, new_residual) of hidden [T, H]."""
    return _launch(hidden, weight, eps, residual, unit_offset=False)


def gemma_rms_norm(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels/rmsnorm_ref.py's `gemma_rms_norm` (weight offset from 1, fp32 product)."""
    return _launch(hidden, weight, eps, residual, unit_offset=True)


def _launch(hidden, weight, eps, residual, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, hidden_size = hidden.shape
    assert hidden.stride(1) == 1 and weight.is_contiguous()
    out_dtype = hidden.dtype if unit_offset else torch.promote_types(weight.dtype, hidden.dtype)
    normed = torch.empty((num_tokens, hidden_size), dtype=out_dtype, device=hidden.device)
    if residual is None:
        new_residual = hidden
        residual_in = residual_out = hidden  # unused when HAS_RESIDUAL is False
    else:
        assert residual.dtype == hidden.dtype and residual.stride(1) == 1
        new_residual = torch.empty_like(hidden)
        residual_in, residual_out = residual, new_residual
    if num_tokens == 0:
        return normed, new_residual
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        hidden, residual_in, weight, normed, residual_out,
        hidden.stride(0), residual_in.stride(0), normed.stride(0), residual_out.stride(0),
        hidden_size, eps,
        HAS_RESIDUAL=residual is not None,
        UNIT_OFFSET=unit_offset,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return normed, new_residual
