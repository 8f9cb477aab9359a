"""Top-k, min_p and top-p without sorting: the Gumbel-max winner of the row's kept set, found by rejection.

Reference: `kernels.sample_ref.nucleus` (a sort-based mask, then the same Gumbel-max).

The kept set of a row is K ∩ nucleus. K holds the tokens with processed logit >= the top-k threshold (from
kernels/triton_kth_largest.py; -inf when off) and x >= max(x) + log(min_p) (min_p 0: off).
The nucleus holds the tokens of K whose strictly better tokens weigh less than top_p of K's mass (the smallest
set of best tokens reaching top_p, ties included). With the noise fixed, the draw is the argmax of
(x + noise) over the kept set, x = logit * (1 / temperature). Every kept token beats every dropped one of K in x,
so that argmax is found without knowing the nucleus' boundary: take a candidate (the first pass's draw over
the whole vocabulary); if it is in K and the mass above it is below top_p of K's, it is the winner; if not,
every kept token lies above it, so the next candidate is the argmax over the tokens above it, and one pass
over the row both measures the current candidate and finds the next. A candidate is kept with probability
about top_p, so most rows take one pass and few take three; rows without a restriction take none.

Masses are sums of exp(x - max) in float64 (exp from libdevice, the function torch's float32 exp calls on a
GPU), so the comparison with top_p agrees with the reference except within float64 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_gumbel import accurate_exp, accurate_log, gumbel_noise, row_keys
from kernels.triton_numerics import has_libdevice
from kernels.triton_sample import running_argmax


@triton.jit
def _nucleus_kernel(
    processed_ptr, token_ptr, max_scaled_ptr, temperature_ptr, seed_ptr, position_ptr, top_p_ptr, min_p_ptr,
    top_k_threshold_ptr, stride_row, vocab_size, greedy_below, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    top_k_threshold = tl.load(top_k_threshold_ptr + row)
    restricted = (top_p < 1.0) | (min_p > 0.0) | (top_k_threshold > float("-inf"))
    if (temperature >= greedy_below) & restricted:
        row_ptr = processed_ptr + row * stride_row
        inverse = 1.0 / temperature  # x = logit * inverse, as kernels/sample_ref.py scales
        max_scaled = tl.load(max_scaled_ptr + row)
        min_p_threshold = tl.where(min_p > 0.0, max_scaled + accurate_log(min_p, LIBDEVICE), float("-inf"))
        key_a, key_b = row_keys(tl.load(seed_ptr + row), tl.load(position_ptr + row))
        offsets = tl.arange(0, BLOCK)
        candidate = tl.load(token_ptr + row).to(tl.int32)
        candidate_logit = tl.load(row_ptr + candidate)
        candidate_x = candidate_logit * inverse
        in_k = (candidate_logit >= top_k_threshold) & (candidate_x >= min_p_threshold)
        done = in_k & (top_p >= 1.0)
        floor = tl.full((), float("-inf"), tl.float32)  # every kept token's x is above it
        while not done:
            # If the candidate is in K and rejected, the kept tokens are all above it.
            next_floor = tl.where(in_k, candidate_x, floor)
            mass = tl.full((), 0.0, tl.float64)
            mass_above = tl.full((), 0.0, tl.float64)
            best_score = tl.full((), float("-inf"), tl.float32)
            best_index = tl.full((), 0, tl.int32)
            for start in range(0, vocab_size, BLOCK):
                index = start + offsets
                logits = tl.load(row_ptr + index, mask=index < vocab_size, other=float("-inf"))
                x = logits * inverse
                kept = (index < vocab_size) & (logits >= top_k_threshold) & (x >= min_p_threshold)
                weight = tl.where(kept, accurate_exp(x - max_scaled, LIBDEVICE), 0.0).to(tl.float64)
                mass += tl.sum(weight, 0)
                mass_above += tl.sum(tl.where(x > candidate_x, weight, 0.0), 0)
                score = tl.where(kept & (x > next_floor), x + gumbel_noise(key_a, key_b, index, LIBDEVICE), float("-inf"))
                best_score, best_index = running_argmax(score, index, vocab_size, best_score, best_index)
            if in_k & (mass_above < top_p.to(tl.float64) * mass):
                done = True
            else:
                floor = next_floor
                candidate = best_index
                candidate_logit = tl.load(row_ptr + candidate)
                candidate_x = candidate_logit * inverse
                in_k = (candidate_logit >= top_k_threshold) & (candidate_x >= min_p_threshold)
                done = in_k & (top_p >= 1.0)
        tl.store(token_ptr + row, candidate.to(tl.int64))


def nucleus(
    processed: torch.Tensor, token_ids: torch.Tensor, max_scaled: torch.Tensor, temperature: torch.Tensor,
    seed: torch.Tensor, position: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    top_k_threshold: torch.Tensor, greedy_below: float, block: int = 8192, num_warps: int = 16,
) -> torch.Tensor:
    """Same contract as kernels.sample_ref.nucleus (updates and returns `token_ids`)."""
    num_rows, vocab_size = processed.shape
    assert processed.dtype == torch.float32 and processed.stride(1) == 1
    if num_rows:
        _nucleus_kernel[(num_rows,)](
            processed, token_ids, max_scaled, temperature, seed, position, top_p, min_p, top_k_threshold,
            processed.stride(0), vocab_size, greedy_below, LIBDEVICE=has_libdevice(),
            BLOCK=min(block, triton.next_power_of_2(vocab_size)), num_warps=num_warps,
        )
    return token_ids
