"""Each row's sampled-token rank and its K best tokens, for the rows that ask for logprobs.

Reference: `kernels.sample_ref.logprob_details` (a compare-and-count and torch.topk).

Why: torch.topk sorts far more than K values whatever K, and counting the better tokens with a comparison and
a sum writes a [N, V] mask; together they cost a sizeable part of a decode step at a large vocabulary
(docs/benchmarks.md, "Kernel tuning"). Here one pass takes group maxes
for a lower bound of the K-th largest value (kernels/triton_kth_largest.py's filter), and one more counts the
tokens above the sampled one while it gathers the tokens at or above that bound (kernels/triton_gather.py)
into a small buffer that torch sorts. A row whose tokens at or above the bound overflow the buffer (ties)
finds its exact K-th value by radix select and gathers again; launching those costs little when no row
overflows, as their programs return at once. Ties at the K-th value beyond a buffer are dropped arbitrarily.
"""

from __future__ import annotations

import torch

from kernels.triton_gather import gather_at_least
from kernels.triton_kth_largest import filter_capacity, group_max_bound, radix_select


def logprob_details(
    logits: torch.Tensor, token_ids: torch.Tensor, log_normalizer: torch.Tensor, k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as kernels.sample_ref.logprob_details."""
    num_rows, vocab_size = logits.shape
    k = min(k, vocab_size)
    no_bound = torch.full((num_rows,), float("inf"), device=logits.device)
    if k <= 0:  # the rank alone
        return gather_at_least(logits, no_bound, 1, token_ids)[3], *_empty_top(num_rows, logits.device)
    ks = torch.full((num_rows,), k, dtype=torch.int64, device=logits.device)
    bound = group_max_bound(logits, ks, k) if k < vocab_size else torch.full_like(no_bound, float("-inf"))
    capacity = filter_capacity(k)
    values, ids, count, ranks = gather_at_least(logits, bound, capacity, token_ids)
    fits = count <= capacity
    # Overflowing rows only: the exact K-th value, and the values at or above it (others read nothing).
    exact = radix_select(logits, torch.where(fits, 0, ks))
    exact_values, exact_ids, _, _ = gather_at_least(logits, torch.where(fits, no_bound, exact), capacity)
    values = torch.where(fits.unsqueeze(-1), values, exact_values)
    ids = torch.where(fits.unsqueeze(-1), ids, exact_ids)
    # The buffer's order is the atomic slots': sort by id, then stably by value, for deterministic ties.
    ids, by_id = ids.sort(dim=-1)
    top_values, order = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return ranks, ids.gather(-1, order[:, :k]), top_values[:, :k] - log_normalizer.unsqueeze(-1)


def _empty_top(num_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros((num_rows, 0), dtype=torch.int64, device=device),
            torch.zeros((num_rows, 0), dtype=torch.float32, device=device))
