"""Gathers, per row, the values at or above a per-row threshold into a small buffer, and
optionally counts the values strictly above a chosen token's: the compaction step of the top-k threshold
(kernels/triton_kth_largest.py) and of the top logprobs (kernels/triton_logprob_details.py).

Why a kernel: a mask, nonzero and gather in torch write a [N, V] mask and sync the host for the sizes. Here a
few programs per row (kernels/row_split.py) stream its values once, and the kept values take slots from a
per-row atomic counter. The
set gathered is exact when it fits (the caller checks count <= capacity); its order in the buffer is not
deterministic, so callers sort it (or need only the set); past the capacity an arbitrary subset is kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.row_split import programs_per_row


@triton.jit
def _gather_kernel(
    values_ptr, threshold_ptr, token_ptr, gathered_values_ptr, gathered_ids_ptr, count_ptr, rank_ptr,
    stride_row, vocab_size, CAPACITY: tl.constexpr, RANK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (row, part) takes the row's blocks part, part + parts, ... (kernels/row_split.py)."""
    row = tl.program_id(0).to(tl.int64)
    part, parts = tl.program_id(1), tl.num_programs(1)
    row_ptr = values_ptr + row * stride_row
    threshold = tl.load(threshold_ptr + row)
    chosen = float("inf")
    if RANK:
        chosen = tl.load(row_ptr + tl.load(token_ptr + row))
    offsets = tl.arange(0, BLOCK)
    better = tl.full((), 0, tl.int32)
    # A row that gathers nothing (threshold +inf) and counts nothing reads nothing.
    if (threshold < float("inf")) | tl.full((), RANK, tl.int1):
        for start in range(part * BLOCK, vocab_size, parts * BLOCK):
            index = start + offsets
            values = tl.load(row_ptr + index, mask=index < vocab_size, other=float("-inf"))
            if RANK:
                better += tl.sum((values > chosen).to(tl.int32), 0)
            take = (index < vocab_size) & (values >= threshold)
            if tl.sum(take.to(tl.int32), 0) > 0:
                # Slots from an atomic counter: a block-wide prefix scan cost more than the whole pass.
                slot = tl.atomic_add(count_ptr + row + tl.zeros_like(index), 1, mask=take)
                store = take & (slot < CAPACITY)
                tl.store(gathered_values_ptr + row * CAPACITY + slot, values, mask=store)
                tl.store(gathered_ids_ptr + row * CAPACITY + slot, index.to(tl.int64), mask=store)
    if RANK:
        tl.atomic_add(rank_ptr + row, better)


def gather_at_least(
    values: torch.Tensor, threshold: torch.Tensor, capacity: int, token_ids: torch.Tensor | None = None,
    block: int = 1024, num_warps: int = 4, parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(gathered values float32 [N, capacity] (-inf padded), their ids int64 [N, capacity], count int32 [N]
    of values >= threshold (+inf: gather nothing), and, when `token_ids` is given, rank int64 [N] = 1 + the
    number of values strictly above the token's). `parts`: programs per row (default: kernels/row_split.py)."""
    num_rows, vocab_size = values.shape
    assert values.dtype == torch.float32 and values.stride(1) == 1
    device = values.device
    block = min(block, triton.next_power_of_2(vocab_size))
    gathered_values = torch.full((num_rows, capacity), float("-inf"), device=device)
    gathered_ids = torch.zeros((num_rows, capacity), dtype=torch.int64, device=device)
    count = torch.zeros(num_rows, dtype=torch.int32, device=device)
    rank = None if token_ids is None else torch.ones(num_rows, dtype=torch.int32, device=device)
    if num_rows:
        parts = parts or programs_per_row(num_rows, -(-vocab_size // block), device)
        _gather_kernel[(num_rows, parts)](
            values, threshold, count if token_ids is None else token_ids, gathered_values, gathered_ids, count,
            count if rank is None else rank, values.stride(0), vocab_size, CAPACITY=capacity,
            RANK=token_ids is not None, BLOCK=block, num_warps=num_warps,
        )
    return gathered_values, gathered_ids, count, None if rank is None else rank.long()
