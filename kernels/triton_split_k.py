"""Split-K for few-row GEMMs: how many K slices a launch takes, and the ordered reduce that adds them.

Why split K: a decode step's few rows give a GEMM only N / BLOCK_N programs (64 for a 4096-wide projection),
too few to keep the card's memory system busy while the step is bound by reading the weights. A third grid
dimension cuts K into slices; each program writes its slice's fp32 partial sums to a [splits, M, N] buffer and
`sum_splits` adds the slices in slice order, adds the bias and rounds once to the output's dtype.

Why a second reduce and not atomic adds into an fp32 buffer: the atomics would add the slices in whatever order
the programs finish, so a token's logits would change bits from run to run (greedy outputs not reproducible);
they also need the buffer zeroed first and a cast after (a memset plus a third launch against the reduce's one),
and bf16 atomics fail in the interpreter. The buffer is small at M <= 16 (splits x M x N fp32).

Used by the weight-only integer GEMM (kernels/triton_wna16_gemm.py) and the FP8 W8A8 GEMM
(kernels/triton_fp8_gemm.py). The slice count is a function of the shapes alone, so a CUDA graph captures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Aim for this many programs (about two waves on a 132-SM H100/H200), at most this many slices.
SPLIT_TARGET_PROGRAMS = 256
MAX_SPLITS = 16
REDUCE_BLOCK_N = 512


def split_count(tile_programs: int, k_tiles: int, forced: int | None = None,
                target_programs: int = SPLIT_TARGET_PROGRAMS) -> int:
    """K slices for `tile_programs` output tiles over `k_tiles` BLOCK_K steps: `forced` when given (ValueError
    below 1), else enough for `target_programs` programs and at most MAX_SPLITS; never more slices than steps.
    Each slice takes cdiv(k_tiles, slices) steps, so the last slices may get none (a forced 4 over 6 steps): they
    write zero partials."""
    if forced is not None and forced < 1:
        raise ValueError(f"splits {forced} must be at least 1")
    wanted = forced if forced is not None else min(MAX_SPLITS, triton.cdiv(target_programs, max(1, tile_programs)))
    return max(1, min(wanted, k_tiles))


@triton.jit
def _sum_splits_kernel(partials_ptr, bias_ptr, out_ptr, n_size, num_splits, stride_split, stride_partial,
                       stride_out, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[row, cols] = sum over slices in slice order of the fp32 partials (+ bias), rounded once to y's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_size
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    partials = partials_ptr + row * stride_partial + cols  # a pointer stepped by the slice stride: 64-bit sums
    for _ in range(0, num_splits):
        acc += tl.load(partials, mask=col_mask, other=0.0)
        partials += stride_split
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def sum_splits(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] (any float dtype, rows contiguous) = the fp32 `partials` [splits, M, N] summed in slice order,
    plus `bias` [N] (contiguous) when given."""
    num_splits, num_rows, n_size = partials.shape
    _sum_splits_kernel[(num_rows, triton.cdiv(n_size, REDUCE_BLOCK_N))](
        partials, bias if bias is not None else partials, out, n_size, num_splits, partials.stride(0),
        partials.stride(1), out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=REDUCE_BLOCK_N, num_warps=4,
    )
