"""The batch-invariant Triton LayerOps set (--batch-invariant on a GPU).

Why a set of its own: in batch-invariant mode a token's logits must have the same bits whatever else is in
the step, so every op that reduces over a row must take that row's sum in an order fixed by the row alone.
Op by op, and why each qualifies:

- linear: kernels/triton_batch_invariant_matmul.py (no split-K; cuBLAS picks its kernel by the number of
  rows). Its tile follows the row count only on a device where `tiles_agree` (checked here, once).
- rms_norm, gemma_rms_norm: kernels/triton_rmsnorm.py as it is (one program per token, a fixed BLOCK per
  hidden size; see kernels/triton_batch_invariant_norm.py).
- rotary_embedding, silu_and_mul, gelu_and_mul: the existing Triton kernels. They are elementwise (each
  output element a function of its own inputs and, for rotary, its own position): no reduction, nothing
  to reorder, invariant as they are.
- fused_moe: kernels/triton_fused_moe.py with its row tile fixed (`block_m=MOE_BLOCK_M`); by default it picks
  16 or 64 rows by the batch size, which changes the GEMM tile shape. Routing (softmax and top-k over one
  token's experts) and the fp32 sum over the k choices are per-token torch ops on small rows.
- per_row: `fn` row by row. The one user is Gemma 2's final logit soft-cap (tanh), which is elementwise,
  but torch's vectorized and scalar code paths for a tensor's tail can differ in the last bit, and which
  elements fall in the tail depends on the tensor's size; row by row, every row is its own tensor.

Attention is not here: kernels/triton_batch_invariant_attention.py is its backend. Nor is the sampler's
log-softmax: kernels/triton_batch_invariant_norm.py's `log_softmax` is for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from kernels.layer_ops import LayerOps

logger = logging.getLogger(__name__)

# The fused MoE's one row tile in batch-invariant mode: a decode step's few rows per expert waste less of a
# 16-row tile than of a 64-row one, at some cost to prefill speed.
MOE_BLOCK_M = 16


def apply_row_by_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) computed one row (x[i:i+1]) at a time, so no row's result can depend on the others."""
    if x.shape[0] == 0:
        return fn(x)
    return torch.cat([fn(x[row: row + 1]) for row in range(x.shape[0])])


def batch_invariant_triton_layer_ops(device: torch.device | str = "cpu") -> LayerOps:
    """Triton kernels whose per-row results do not depend on the batch (GPU; CPU under TRITON_INTERPRET=1).
    `device`: where the linear's tiles are checked for agreement (one tile for every row count if they differ)."""
    from kernels import triton_fused_moe, triton_rotary, triton_silu_and_mul
    from kernels.triton_batch_invariant_matmul import TILE, linear, tile_by_rows, tiles_agree

    agree = tiles_agree(device)
    tile = tile_by_rows if agree else TILE
    logger.info("batch-invariant linear on %s: %s", device,
                "tile by row count (the tiles give the same bits)" if agree else "one tile (the tiles' bits differ)")
    from kernels.triton_batch_invariant_norm import gemma_rms_norm, rms_norm

    return LayerOps(
        "triton-batch-invariant",
        rms_norm,
        triton_rotary.rotary_embedding,
        triton_silu_and_mul.silu_and_mul,
        gemma_rms_norm,
        triton_silu_and_mul.gelu_and_mul,
        partial(triton_fused_moe.fused_moe, block_m=MOE_BLOCK_M),
        linear=partial(linear, tile=tile),
        per_row=apply_row_by_row,
        batch_invariant=True,
    )
