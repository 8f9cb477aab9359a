"""Each row's sampled-token rank and its K best tokens, for the rows that ask for logprobs.

Reference: `kernels.sample_ref.logprob_details` (a compare-and-count and torch.topk).

Why: torch.topk costs about 0.6 ms at [256, 152k] float32 on an H200 whatever K, and counting the better
tokens with a comparison and a sum another 0.3 ms (it writes a [N, V] mask). Here the K-th largest value
comes from the radix select (kernels/triton_kth_largest.py), then one pass per row counts the tokens above
the sampled one and gathers the tokens at or above the K-th value, in index order, into a small buffer that
torch sorts. Ties at the K-th value beyond the buffer are dropped in index order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_kth_largest import kth_largest


@triton.jit
def _rank_and_gather_kernel(
    logits_ptr, token_ptr, threshold_ptr, rank_ptr, gathered_values_ptr, gathered_ids_ptr, stride_row,
    vocab_size, CAPACITY: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    chosen = tl.load(row_ptr + tl.load(token_ptr + row))
    threshold = tl.load(threshold_ptr + row)
    offsets = tl.arange(0, BLOCK)
    better = tl.full((), 0, tl.int32)
    gathered = tl.full((), 0, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        index = start + offsets
        logits = tl.load(row_ptr + index, mask=index < vocab_size, other=float("-inf"))
        better += tl.sum((logits > chosen).to(tl.int32), 0)
        take = (index < vocab_size) & (logits >= threshold)
        if tl.sum(take.to(tl.int32), 0) > 0:  # few blocks hold any of the K best: skip the scan elsewhere
            slot = gathered + tl.cumsum(take.to(tl.int32), 0) - 1
            take = take & (slot < CAPACITY)
            tl.store(gathered_values_ptr + row * CAPACITY + slot, logits, mask=take)
            tl.store(gathered_ids_ptr + row * CAPACITY + slot, index.to(tl.int64), mask=take)
            gathered += tl.sum(take.to(tl.int32), 0)
    tl.store(rank_ptr + row, better.to(tl.int64) + 1)


def logprob_details(
    logits: torch.Tensor, token_ids: torch.Tensor, log_normalizer: torch.Tensor, k: int, block: int = 4096,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as kernels.sample_ref.logprob_details."""
    num_rows, vocab_size = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    k = min(k, vocab_size)
    if k > 0:
        threshold = kth_largest(logits, torch.full((num_rows,), k, dtype=torch.int32, device=logits.device))
    else:  # the rank alone
        threshold = torch.full((num_rows,), float("inf"), device=logits.device)
    capacity = triton.next_power_of_2(max(2 * k, 16))
    gathered_values = torch.full((num_rows, capacity), float("-inf"), device=logits.device)
    gathered_ids = torch.zeros((num_rows, capacity), dtype=torch.int64, device=logits.device)
    ranks = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        _rank_and_gather_kernel[(num_rows,)](
            logits, token_ids, threshold, ranks, gathered_values, gathered_ids, logits.stride(0), vocab_size,
            CAPACITY=capacity, BLOCK=min(block, triton.next_power_of_2(vocab_size)), num_warps=num_warps,
        )
    top_values, order = gathered_values.sort(dim=-1, descending=True, stable=True)
    top_ids = gathered_ids.gather(-1, order[:, :k])
    return ranks, top_ids, top_values[:, :k] - log_normalizer.unsqueeze(-1)
