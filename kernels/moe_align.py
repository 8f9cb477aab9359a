"""Token-to-expert alignment for the grouped GEMMs of the fused MoE kernel (vLLM's moe_align_block_size).

Why: a grouped GEMM program multiplies BLOCK_M rows by one expert's weights, so the (token, choice) rows are
sorted by expert and each expert's run is padded to a multiple of BLOCK_M; a tile then never mixes experts.

Why torch on the device and fixed sizes: every output has a size that depends only on (T * k, E, BLOCK_M),
never on the routing, and nothing is read back to the host, so the same code runs under a CUDA graph. The
number of tiles is an upper bound; tiles past the padded total carry expert -1 and the kernel skips them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertAlignment:
    """Rows of the flattened [T * k] (token, choice) axis in expert order, padded per expert to BLOCK_M.

    `sorted_rows` [num_tiles * BLOCK_M] int64: row t * k + j of token t's j-th choice, or T * k for padding.
    `tile_experts` [num_tiles] int64: the expert of each BLOCK_M tile of `sorted_rows`, -1 for unused tiles.
    """

    sorted_rows: torch.Tensor
    tile_experts: torch.Tensor
    block_m: int


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Tiles enough for any routing: each expert that gets rows pads at most BLOCK_M - 1 of them."""
    padded = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return -(-padded // block_m)


def align_rows_to_experts(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sorts the flattened choices `expert_ids` [T, k] by expert, each expert's run padded to `block_m`."""
    flat = expert_ids.reshape(-1)
    num_rows, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    unpadded_starts = counts.cumsum(0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank_in_expert = torch.arange(num_rows, device=device) - unpadded_starts[sorted_experts]
    destination = padded_ends[sorted_experts] - padded[sorted_experts] + rank_in_expert
    num_tiles = max_tiles(num_rows, num_experts, block_m)
    sorted_rows = torch.full((num_tiles * block_m,), num_rows, dtype=torch.int64, device=device)
    sorted_rows[destination] = order
    tile_starts = torch.arange(num_tiles, device=device) * block_m
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1)
    return ExpertAlignment(sorted_rows, tile_experts, block_m)
