"""SiLU(gate) * up (and Gemma's tanh-GELU(gate) * up) in Triton over a fused `[T, 2 * I]` gate_up row; grid
(tokens, column tiles).

Torch references: kernels/silu_and_mul_ref.py (`silu_and_mul`, llama.py's MLP activation) and
kernels/gelu_and_mul_ref.py (`gelu_and_mul`, Gemma's; the exact-erf GELU runs the reference).

Rounding follows torch: SiLU is computed in fp32 and rounded to the activation dtype, then the product
rounds again. Arithmetic is explicit fp32, so no interpreter upcast flag is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gelu_and_mul_ref


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_gate_up,
    stride_out,
    intermediate_size,
    GELU_TANH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    row = gate_up_ptr + token * stride_gate_up
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + intermediate_size + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if GELU_TANH:  # torch's form, 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3); tanh from exp
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        inner = tl.minimum(tl.maximum(inner, -20.0), 20.0)  # tanh is +-1 in fp32 there; exp stays finite
        activated = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:
        activated = gate / (1.0 + tl.exp(-gate))
    activated = activated.to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, (activated * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Same contract as kernels/silu_and_mul_ref.py: [T, 2 * I] -> [T, I]."""
    return _launch(gate_up, gelu_tanh=False, block=block)


def gelu_and_mul(gate_up: torch.Tensor, approximate: str = "tanh", block: int = 1024) -> torch.Tensor:
    """Same contract as kernels/gelu_and_mul_ref.py; the exact ("none") GELU runs the reference."""
    if approximate != "tanh":
        return gelu_and_mul_ref.gelu_and_mul(gate_up, approximate)
    return _launch(gate_up, gelu_tanh=True, block=block)


def _launch(gate_up: torch.Tensor, gelu_tanh: bool, block: int) -> torch.Tensor:
    num_tokens, width = gate_up.shape
    intermediate_size = width // 2
    assert gate_up.stride(1) == 1
    out = torch.empty((num_tokens, intermediate_size), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate_size, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), intermediate_size,
        GELU_TANH=gelu_tanh, BLOCK=block, num_warps=4,
    )
    return out
