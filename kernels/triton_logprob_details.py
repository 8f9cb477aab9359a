"""Each row's sampled-token rank and its K best tokens, for the rows that ask for logprobs.

Reference: `kernels.sample_ref.logprob_details` (a compare-and-count and torch.topk).

Why: torch.topk costs about 0.6 ms at [256, 152k] float32 on an H200 whatever K, and counting the better
tokens with a comparison and a sum another 0.3 ms (it writes a [N, V] mask). Here the K-th largest value
comes from kernels/triton_kth_largest.py, then one pass per row counts the tokens above the sampled one and
gathers the tokens at or above the K-th value (kernels/triton_gather.py) into a small buffer that torch
sorts. Ties at the K-th value beyond the buffer (2K wide) are dropped arbitrarily.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton_gather import gather_at_least
from kernels.triton_kth_largest import kth_largest


def logprob_details(
    logits: torch.Tensor, token_ids: torch.Tensor, log_normalizer: torch.Tensor, k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as kernels.sample_ref.logprob_details."""
    num_rows, vocab_size = logits.shape
    k = min(k, vocab_size)
    if k > 0:
        threshold = kth_largest(logits, torch.full((num_rows,), k, dtype=torch.int64, device=logits.device), k)
        threshold = threshold.threshold
    else:  # the rank alone
        threshold = torch.full((num_rows,), float("inf"), device=logits.device)
    values, ids, _, ranks = gather_at_least(logits, threshold, triton.next_power_of_2(max(2 * k, 16)), token_ids)
    # The buffer's order is the atomic slots': sort by id, then stably by value, for deterministic ties.
    ids, by_id = ids.sort(dim=-1)
    top_values, order = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return ranks, ids.gather(-1, order[:, :k]), top_values[:, :k] - log_normalizer.unsqueeze(-1)
