"""The k-th largest value of each row (k per row): the threshold of top-k (keep the values >= it, ties
included, as vLLM does) and of the top logprobs.

Reference: `kernels.sample_ref.kth_largest` (a sort; the kernels are exact, so the two agree bit for bit).

Why not torch.topk: it costs the same whatever k, a good part of a decode step at a large vocabulary, and a
full sort several times more (docs/benchmarks.md, "Kernel tuning").
The exact tool here is a radix select (`_radix_select_kernel`): each float32 is mapped to a uint32 key that
sorts like the float, and four passes over the row, one per 8-bit digit from the top, count the keys that
match the digits found so far in a 256-bin histogram; the bin where the running count from the top reaches
k is the next digit. Its four histogram passes over the whole row cost more than the filter below, so the
full row goes through it only as a fallback. First a filter: the rows are cut into at least 4 * k_max groups and each
group's max is taken (one pass); the k-th largest group max, L, is a lower bound of the k-th largest value
(k groups have a max >= L), so the values >= L, typically a few times k of them, hold the answer. They are
gathered (kernels/triton_gather.py) and radix-selected in a small buffer. A row whose values >= L overflow
the buffer (ties, or k near the group count) is radix-selected over its whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.row_split import programs_per_row
from kernels.sample_ref import TopK, TopKCandidates
from kernels.triton_gather import gather_at_least

# Above this k the filter's buffer (4 k floats per row) stops paying: the whole rows are radix-selected.
MAX_FILTERED_K = 1024


@triton.jit
def order_key(values):
    """uint32 keys that order like the float32 values (negative floats have their bits reversed)."""
    bits = values.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit
def _from_order_key(key):
    bits = tl.where((key >> 31) != 0, key & 0x7FFFFFFF, ~key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _radix_digit(row_ptr, vocab_size, prefix, remaining, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Finds the 8-bit digit at SHIFT of the remaining-th largest key among the keys whose higher digits
    equal `prefix`'s: returns (prefix with that digit set, how many matching keys lie above its bin)."""
    offsets = tl.arange(0, BLOCK)
    histogram = tl.zeros((256,), dtype=tl.int32)
    unmatched = tl.full((), 0, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        index = start + offsets
        in_row = index < vocab_size
        key = order_key(tl.load(row_ptr + index, mask=in_row, other=0.0))
        match = in_row
        if SHIFT < 24:
            match = match & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        # Unmatched keys are counted in bin 0 and taken out after (no masked histogram needed).
        histogram += tl.histogram(tl.where(match, (key >> SHIFT) & 0xFF, 0).to(tl.int32), 256)
        unmatched += tl.sum((~match).to(tl.int32), 0)
    bins = tl.arange(0, 256)
    histogram -= tl.where(bins == 0, unmatched, 0)
    at_or_above = tl.cumsum(histogram, 0, reverse=True)
    digit = tl.max(tl.where(at_or_above >= remaining, bins, 0), 0)
    above = tl.sum(tl.where(bins == digit, at_or_above - histogram, 0), 0)
    return prefix | (digit.to(tl.uint32) << SHIFT), remaining - above


@triton.jit
def _radix_select_kernel(values_ptr, k_ptr, out_ptr, stride_row, vocab_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.load(k_ptr + row).to(tl.int32)
    threshold = float("-inf")
    if (k > 0) & (k < vocab_size):
        row_ptr = values_ptr + row * stride_row
        prefix = tl.full((), 0, tl.uint32)
        prefix, k = _radix_digit(row_ptr, vocab_size, prefix, k, 24, BLOCK)
        prefix, k = _radix_digit(row_ptr, vocab_size, prefix, k, 16, BLOCK)
        prefix, k = _radix_digit(row_ptr, vocab_size, prefix, k, 8, BLOCK)
        prefix, k = _radix_digit(row_ptr, vocab_size, prefix, k, 0, BLOCK)
        threshold = _from_order_key(prefix)
    tl.store(out_ptr + row, threshold)


@triton.jit
def _group_max_kernel(values_ptr, out_ptr, stride_row, vocab_size, num_groups, GROUP: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Program (row, part) takes the row's blocks part, part + parts, ... (kernels/row_split.py)."""
    row = tl.program_id(0).to(tl.int64)
    part, parts = tl.program_id(1), tl.num_programs(1)
    offsets = tl.arange(0, BLOCK)
    groups = tl.arange(0, BLOCK // GROUP)
    for start in range(part * BLOCK, vocab_size, parts * BLOCK):
        index = start + offsets
        values = tl.load(values_ptr + row * stride_row + index, mask=index < vocab_size, other=float("-inf"))
        group = start // GROUP + groups
        tl.store(out_ptr + row * num_groups + group, tl.max(tl.reshape(values, (BLOCK // GROUP, GROUP)), 1),
                 mask=group < num_groups)


def kth_largest(values: torch.Tensor, k: torch.Tensor, k_max: int) -> TopK:
    """Same contract as kernels.sample_ref.kth_largest; `k_max` >= every row's k (host-side, sizes buffers).
    The candidates come along when the filter ran."""
    num_rows, vocab_size = values.shape
    assert values.dtype == torch.float32 and values.stride(1) == 1
    if num_rows == 0 or k_max <= 0:
        return TopK(torch.full((num_rows,), float("-inf"), device=values.device))
    if k_max > MAX_FILTERED_K:
        return TopK(radix_select(values, k))
    restricts = (k > 0) & (k < vocab_size)
    bound = torch.where(restricts, group_max_bound(values, k, k_max), float("inf"))
    candidates, ids, count, _ = gather_at_least(values, bound, filter_capacity(k_max))
    fits = restricts & (count <= candidates.shape[1])
    # Rows whose candidates did not fit are radix-selected over the whole row.
    threshold = torch.where(fits, radix_select(candidates, k), radix_select(values, torch.where(fits, 0, k)))
    return TopK(threshold, TopKCandidates(candidates, ids, fits))


def group_max_bound(values: torch.Tensor, k: torch.Tensor, k_max: int, parts: int | None = None) -> torch.Tensor:
    """A lower bound of each row's k-th largest value (k <= k_max <= MAX_FILTERED_K): the k-th largest of the
    maxes of at least 4 * k_max groups, one pass over the values (-inf where k <= 0 or k >= the group count).
    `parts`: programs per row (default: kernels/row_split.py)."""
    num_rows, vocab_size = values.shape
    group = max(16, min(4096, triton.next_power_of_2(vocab_size // (4 * k_max)) // 2))
    num_groups = -(-vocab_size // group)
    block = max(group, 8192)
    group_max = torch.empty((num_rows, num_groups), device=values.device)
    parts = parts or programs_per_row(num_rows, -(-vocab_size // block), values.device)
    _group_max_kernel[(num_rows, parts)](values, group_max, values.stride(0), vocab_size, num_groups, GROUP=group,
                                         BLOCK=block, num_warps=16)
    return radix_select(group_max, k)


def filter_capacity(k_max: int) -> int:
    """The buffer a group-max bound's values are gathered into: typically a few times k of them pass it."""
    return triton.next_power_of_2(4 * k_max + 64)


def radix_select(values: torch.Tensor, k: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """The exact k-th largest of each row by radix select over the whole row (-inf where k <= 0 or k >= V)."""
    num_rows, vocab_size = values.shape
    out = torch.empty(num_rows, dtype=torch.float32, device=values.device)
    if num_rows:
        _radix_select_kernel[(num_rows,)](values, k, out, values.stride(0), vocab_size,
                                          BLOCK=min(block, triton.next_power_of_2(vocab_size)), num_warps=8)
    return out
