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
over the row measures the current candidate (masses only) and, if it is rejected, another finds the next
(with the noise). A candidate is kept with probability about top_p, so most rows take one cheap pass and few
take more; rows without a restriction take none. Top-k rows whose candidates were gathered
(kernels/triton_kth_largest.py) run over those few values instead of the whole row.

Masses are sums of exp(x - max): float32 sums of the fast exp over each block, added up in float64. The
reference sums torch's exp in float64; the two differ by about 1e-6 of the mass, so a draw can differ from
the reference's only where the mass above a candidate lies that close to top_p of K's. (Why not libdevice's
exp and float64 sums throughout: they made this pass several times slower than a plain pass over the logits.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sample_ref import TopKCandidates
from kernels.triton_gumbel import accurate_log, row_keys
from kernels.triton_numerics import has_libdevice
from kernels.triton_sample import running_gumbel_argmax


@triton.jit
def _nucleus_kernel(
    values_ptr, ids_ptr, token_ptr, max_scaled_ptr, temperature_ptr, seed_ptr, position_ptr, top_p_ptr,
    min_p_ptr, top_k_threshold_ptr, on_candidates_ptr, stride_row, width, greedy_below,
    ON_CANDIDATES: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row. ON_CANDIDATES: the row is its gathered top-k candidates (values, vocab ids); the
    launch takes the rows flagged in on_candidates_ptr, the other launch the rest."""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    top_k_threshold = tl.load(top_k_threshold_ptr + row)
    restricted = (top_p < 1.0) | (min_p > 0.0) | (top_k_threshold > float("-inf"))
    mine = tl.load(on_candidates_ptr + row) != 0
    if not ON_CANDIDATES:
        mine = ~mine
    if (temperature >= greedy_below) & restricted & mine:
        row_ptr = values_ptr + row * stride_row
        inverse = 1.0 / temperature  # x = logit * inverse, as kernels/sample_ref.py scales
        max_scaled = tl.load(max_scaled_ptr + row)
        min_p_threshold = tl.where(min_p > 0.0, max_scaled + accurate_log(min_p, LIBDEVICE), float("-inf"))
        key_a, key_b = row_keys(tl.load(seed_ptr + row), tl.load(position_ptr + row))
        offsets = tl.arange(0, BLOCK)
        if ON_CANDIDATES:  # no first candidate: the first pass's draw is a vocabulary index
            candidate = tl.full((), 0, tl.int32)
            candidate_x = tl.full((), float("inf"), tl.float32)
            in_k = False
        else:
            candidate = tl.load(token_ptr + row).to(tl.int32)
            candidate_logit = tl.load(row_ptr + candidate)
            candidate_x = candidate_logit * inverse
            in_k = (candidate_logit >= top_k_threshold) & (candidate_x >= min_p_threshold)
        done = in_k & (top_p >= 1.0)
        floor = tl.full((), float("-inf"), tl.float32)  # every kept token's x is above it
        while not done:
            if in_k:  # is the candidate in the nucleus? (masses only: no noise in this pass)
                mass = tl.full((), 0.0, tl.float64)
                mass_above = tl.full((), 0.0, tl.float64)
                for start in range(0, width, BLOCK):
                    index = start + offsets
                    logits = tl.load(row_ptr + index, mask=index < width, other=float("-inf"))
                    x = logits * inverse
                    kept = (index < width) & (logits >= top_k_threshold) & (x >= min_p_threshold)
                    weight = tl.where(kept, tl.exp(x - max_scaled), 0.0)
                    mass += tl.sum(weight, 0).to(tl.float64)
                    mass_above += tl.sum(tl.where(x > candidate_x, weight, 0.0), 0).to(tl.float64)
                done = mass_above < top_p.to(tl.float64) * mass
            if not done:  # rejected: every kept token lies above it; the next candidate is their best draw
                if in_k:
                    floor = candidate_x
                best_score = tl.full((), float("-inf"), tl.float32)
                best_index = tl.full((), 0, tl.int32)
                for start in range(0, width, BLOCK):
                    index = start + offsets
                    logits = tl.load(row_ptr + index, mask=index < width, other=float("-inf"))
                    vocab_index = index
                    if ON_CANDIDATES:
                        vocab_index = tl.load(ids_ptr + row * stride_row + index, mask=index < width,
                                              other=0).to(tl.int32)
                    x = logits * inverse
                    kept = (index < width) & (logits >= top_k_threshold) & (x >= min_p_threshold) & (x > floor)
                    best_score, best_index = running_gumbel_argmax(x, kept, index, width, vocab_index, key_a, key_b,
                                                                   best_score, best_index, LIBDEVICE)
                candidate = best_index
                candidate_logit = tl.load(row_ptr + candidate)
                candidate_x = candidate_logit * inverse
                in_k = (candidate_logit >= top_k_threshold) & (candidate_x >= min_p_threshold)
                done = in_k & (top_p >= 1.0)
        token = candidate.to(tl.int64)
        if ON_CANDIDATES:
            token = tl.load(ids_ptr + row * stride_row + candidate)
        tl.store(token_ptr + row, token)


def nucleus(
    processed: torch.Tensor, token_ids: torch.Tensor, max_scaled: torch.Tensor, temperature: torch.Tensor,
    seed: torch.Tensor, position: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    top_k_threshold: torch.Tensor, greedy_below: float, candidates: TopKCandidates | None = None,
    block: int = 8192, num_warps: int = 16,
) -> torch.Tensor:
    """Same contract as kernels.sample_ref.nucleus (updates and returns `token_ids`). `candidates`: the top-k
    candidates kernels/triton_kth_largest.py gathered; the rows whose candidates fit are drawn from them."""
    num_rows, vocab_size = processed.shape
    assert processed.dtype == torch.float32 and processed.stride(1) == 1
    if num_rows == 0:
        return token_ids
    common = (token_ids, max_scaled, temperature, seed, position, top_p, min_p, top_k_threshold)
    fits = torch.zeros(num_rows, dtype=torch.bool, device=processed.device) if candidates is None else candidates.fits
    _nucleus_kernel[(num_rows,)](processed, processed, *common, fits, processed.stride(0), vocab_size,
                                 greedy_below, ON_CANDIDATES=False, LIBDEVICE=has_libdevice(),
                                 BLOCK=min(block, triton.next_power_of_2(vocab_size)), num_warps=num_warps)
    if candidates is not None:
        width = candidates.values.shape[1]
        _nucleus_kernel[(num_rows,)](candidates.values, candidates.ids, *common, fits, width, width, greedy_below,
                                     ON_CANDIDATES=True, LIBDEVICE=has_libdevice(),
                                     BLOCK=min(1024, triton.next_power_of_2(width)), num_warps=4)
    return token_ids
