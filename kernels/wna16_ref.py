"""Torch reference of the weight-only integer linear layer (W4A16, W8A16): unpack, dequantize, plain matmul.

Why one canonical layout: AWQ, GPTQ and compressed-tensors' pack-quantized checkpoints store the same math in
three layouts (packed along the output or the input dimension, zero points offset or not, nibbles
interleaved or not). The loader (worker_svc/layers/) turns each into this one at load, so the kernels
(this reference; kernels/triton_wna16_gemm.py on the GPU) read a single form:

- `qweight` int32 [K // pack, N], pack = 32 // bits: the unsigned `bits`-bit integers of W^T packed along the
  input dimension K, the first of each 32-bit word in its lowest bits: q[k, n] = (qweight[k // pack, n] >>
  (bits * (k % pack))) & (2**bits - 1).
- `scales` [K // group_size, N] in the activation dtype: one scale per group of `group_size` consecutive input
  rows and output column (group_size == K: one per output channel).
- `zeros` [K // group_size, N] in the scales' dtype, the zero point of each group as a float (an integer
  value), or None: symmetric, zero point 2**(bits - 1) everywhere.

Then W[n, k] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n], and y = x W^T + b. The
reference computes W in float32, casts it to x's dtype and calls F.linear: transformers running the same
dequantized weights computes the same product, so greedy tokens are exact in float32.

Act-order (GPTQ desc_act) checkpoints group input rows out of order; the loader permutes K so the groups are
contiguous and permutes x's columns alike before the product (not this file's concern).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

SUPPORTED_BITS = (4, 8)


def pack_factor(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits}-bit weights are not served (supported: {SUPPORTED_BITS})")
    return 32 // bits


def unpack_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K // pack, N] -> int32 [K, N] of the unsigned values, in K order."""
    pack = pack_factor(bits)
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32) * bits
    values = (qweight.unsqueeze(1) >> shifts.reshape(1, pack, 1)) & ((1 << bits) - 1)
    return values.reshape(qweight.shape[0] * pack, qweight.shape[1])


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `unpack_rows`: unsigned values int [K, N] (K a multiple of the pack factor) -> int32
    [K // pack, N]."""
    pack = pack_factor(bits)
    if values.shape[0] % pack:
        raise ValueError(f"{values.shape[0]} input rows are not a multiple of the pack factor {pack}")
    shifts = torch.arange(pack, device=values.device, dtype=torch.int64) * bits
    grouped = values.to(torch.int64).reshape(-1, pack, values.shape[1]) << shifts.reshape(1, pack, 1)
    words = grouped.sum(dim=1)  # < 2**32: each value sits in its own bits
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize_wna16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                     group_size: int) -> torch.Tensor:
    """W [N, K] in float32 from the canonical layout (module docstring)."""
    q = unpack_rows(qweight, bits).float()
    zero = torch.full_like(scales, 2 ** (bits - 1), dtype=torch.float32) if zeros is None else zeros.float()
    per_row = [t.float().repeat_interleave(group_size, dim=0) for t in (zero, scales)]  # [K // G, N] -> [K, N]
    return ((q - per_row[0]) * per_row[1]).t()


def wna16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     bits: int, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b with W dequantized (float32, then x's dtype): x [*, K] -> [*, N] in x's dtype."""
    weight = dequantize_wna16(qweight, scales, zeros, bits, group_size).to(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


@dataclass(frozen=True)
class PackedExperts:
    """One projection of E MoE experts (gate|up, or down) in the canonical layout, stacked on a leading expert
    axis: qweight int32 [E, K // pack, N], scales [E, K // G, N], zeros [E, K // G, N] or None (symmetric).

    Why a bundle: the fused MoE ops (kernels/fused_moe_ref.py, kernels/triton_fused_moe.py) take it where they
    take a float expert tensor [E, N, K], so one signature serves float, FP8 and integer experts. The bundle is
    read only; the MoE block (worker_svc/layers/fused_moe.py) owns the tensors."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int

    @property
    def input_size(self) -> int:
        return self.qweight.shape[1] * pack_factor(self.bits)

    @property
    def output_size(self) -> int:
        return self.qweight.shape[2]

    @property
    def group_size(self) -> int:
        return self.input_size // self.scales.shape[1]

    def dequantize(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s W [N, K] in float32, row-major (as a float checkpoint's weight: the same matmul path)."""
        return dequantize_wna16(self.qweight[expert], self.scales[expert],
                                None if self.zeros is None else self.zeros[expert], self.bits,
                                self.group_size).contiguous()
