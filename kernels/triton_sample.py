"""The sampler's first pass over the logits, one program per row: the greedy argmax, the Gumbel-max draw over
the whole vocabulary, the row's max of logits * (1 / temperature), and the logsumexp of the raw logits (for the
chosen token's logprob).

Reference: `kernels.sample_ref.first_pass` (the same noise, kernels/triton_gumbel.py, and the same float32
ops: the draws agree bit for bit where torch's and libdevice's log agree, i.e. on a GPU).

Why one pass: at batch 256 and a 152k vocabulary the logits are 156 MB of float32; the eager path (argmax,
noise, add, argmax, logsumexp) reads and writes them about ten times. Rows that restrict their vocabulary
(top-k, top-p, min_p) keep this draw if it falls inside their kept set, which kernels/triton_nucleus.py
checks; the max computed here is what min_p and the top-p masses are measured from.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_gumbel import noise_of_uniform, row_keys, uniform_of_index
from kernels.triton_numerics import has_libdevice


@triton.jit
def running_argmax(values, index, vocab_size, running_max, best):
    """One block's step of a running max and its first index (lowest index on ties, as torch.argmax)."""
    block_max = tl.max(values, 0)
    block_best = tl.min(tl.where(values == block_max, index, vocab_size), 0)
    best = tl.where(block_max > running_max, block_best, best)
    return tl.maximum(running_max, block_max), best


@triton.jit
def running_gumbel_argmax(x, kept, index, width, vocab_index, key_a, key_b, best_score, best_index,
                          LIBDEVICE: tl.constexpr):
    """One block's step of a Gumbel-max draw: the running argmax of x + noise over the `kept` entries (lowest
    `index` on ties; `vocab_index` keys the noise).

    Why the bound: the accurate noise (two libdevice logs an entry) made the draw compute-bound, yet after the
    first blocks few entries can still beat the running best. The noise of w is at most -log(w), since
    -log1p(-w) >= w; with the fast log, a block where no entry's x - log(w) reaches the best (less a margin
    far above the fast log's error and float32's rounding of x) cannot change the winner, and skips the logs.
    The draw is the same, bit for bit. (A block with no kept entry reaches -inf and is skipped.)"""
    w = uniform_of_index(key_a, key_b, vocab_index)
    reach = tl.max(tl.where(kept, x - tl.log(w), float("-inf")), 0)
    if reach + (1e-3 + tl.abs(reach) * 1e-6) >= best_score:
        score = tl.where(kept, x + noise_of_uniform(w, LIBDEVICE), float("-inf"))
        best_score, best_index = running_argmax(score, index, width, best_score, best_index)
    return best_score, best_index


@triton.jit
def running_sum_exp(values, running_max, running_sum):
    """One block's step of the online softmax normalizer: (max, sum of exp(x - max)), rescaled as max grows."""
    new_max = tl.maximum(running_max, tl.max(values, 0))
    running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(values - new_max), 0)
    return new_max, running_sum


@triton.jit
def _first_pass_kernel(
    processed_ptr, raw_ptr, temperature_ptr, seed_ptr, position_ptr, skip_draw_ptr, token_ptr, max_scaled_ptr,
    log_normalizer_ptr, stride_processed, stride_raw, vocab_size, greedy_below,
    SEPARATE_RAW: tl.constexpr, NOISE: tl.constexpr, SKIP_DRAW: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    is_greedy = temperature < greedy_below
    draws = NOISE & ~is_greedy
    if SKIP_DRAW:
        draws = draws & (tl.load(skip_draw_ptr + row) == 0)
    inverse = 1.0 / tl.where(is_greedy, 1.0, temperature)  # one division; x = logit * inverse
    key_a, key_b = row_keys(tl.load(seed_ptr + row), tl.load(position_ptr + row))
    offsets = tl.arange(0, BLOCK)
    processed_max = tl.full((), float("-inf"), tl.float32)
    argmax = tl.full((), 0, tl.int32)
    raw_max = tl.full((), float("-inf"), tl.float32)
    raw_sum = tl.full((), 0.0, tl.float32)
    best_score = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        index = start + offsets
        mask = index < vocab_size
        processed = tl.load(processed_ptr + row * stride_processed + index, mask=mask, other=float("-inf"))
        processed_max, argmax = running_argmax(processed, index, vocab_size, processed_max, argmax)
        if SEPARATE_RAW:
            raw = tl.load(raw_ptr + row * stride_raw + index, mask=mask, other=float("-inf"))
            raw_max, raw_sum = running_sum_exp(raw, raw_max, raw_sum)
        else:
            raw_max, raw_sum = running_sum_exp(processed, raw_max, raw_sum)
        if draws:
            best_score, best_index = running_gumbel_argmax(processed * inverse, mask, index, vocab_size, index,
                                                           key_a, key_b, best_score, best_index, LIBDEVICE)
    token = tl.where(draws, best_index, argmax)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(max_scaled_ptr + row, processed_max * inverse)
    tl.store(log_normalizer_ptr + row, raw_max + tl.log(raw_sum))


def first_pass(
    processed: torch.Tensor, raw: torch.Tensor | None, temperature: torch.Tensor, seed: torch.Tensor,
    position: torch.Tensor, greedy_below: float, noise: bool, skip_draw: torch.Tensor | None = None,
    block: int | None = None, num_warps: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as kernels.sample_ref.first_pass; rows flagged in `skip_draw` (bool [N]) are drawn
    elsewhere (from their top-k candidates) and skip the noise: their token is the argmax. `block`: by default
    8192 entries, 4096 with the noise (whose skipped blocks pay off at the finer grain, while the greedy pass
    is fastest at 8192)."""
    num_rows, vocab_size = processed.shape
    assert processed.dtype == torch.float32 and processed.stride(1) == 1
    assert raw is None or (raw.shape == processed.shape and raw.dtype == torch.float32 and raw.stride(1) == 1)
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=processed.device)
    max_scaled = torch.empty(num_rows, dtype=torch.float32, device=processed.device)
    log_normalizer = torch.empty(num_rows, dtype=torch.float32, device=processed.device)
    if num_rows:
        _first_pass_kernel[(num_rows,)](
            processed, processed if raw is None else raw, temperature, seed, position,
            token_ids if skip_draw is None else skip_draw, token_ids, max_scaled,
            log_normalizer, processed.stride(0), processed.stride(0) if raw is None else raw.stride(0),
            vocab_size, greedy_below, SEPARATE_RAW=raw is not None, NOISE=noise, SKIP_DRAW=skip_draw is not None,
            LIBDEVICE=has_libdevice(),
            BLOCK=min(block or (4096 if noise else 8192), triton.next_power_of_2(vocab_size)), num_warps=num_warps,
        )
    return token_ids, max_scaled, log_normalizer
