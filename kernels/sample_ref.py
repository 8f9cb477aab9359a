"""Torch references of the sampling kernels: the CPU worker runs these, and each Triton kernel is tested
against its function here (kernels/triton_sample.py, triton_kth_largest.py, triton_nucleus.py,
triton_logprob_details.py). Shapes: logits float32 [N, V]; per-row columns [N].

Semantics (vLLM's, with ties kept together): greedy rows (temperature below `greedy_below`) take the argmax
of the processed logits, lowest index on ties. Other rows draw by Gumbel-max (kernels/gumbel_ref.py) over
their kept set: with x = processed logits * (1 / temperature), K = {processed >= the k-th largest processed logit}
∩ {x >= max(x) + log(min_p)}, and the nucleus = the tokens of K whose strictly better tokens (in x) weigh
less than top_p of K's softmax mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gumbel_ref import gumbel_noise


def first_pass(
    processed: torch.Tensor, raw: torch.Tensor | None, temperature: torch.Tensor, seed: torch.Tensor,
    position: torch.Tensor, greedy_below: float, noise: bool, skip_draw: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids int64: the argmax for greedy rows, else the Gumbel-max draw over the whole vocabulary;
    max of processed * (1 / temperature) float32; logsumexp of `raw` (None: of `processed`) float32).
    `skip_draw` (rows drawn from their top-k candidates instead) only saves the kernel work."""
    is_greedy = temperature < greedy_below
    scaled = processed * _inverse_temperature(temperature, greedy_below).unsqueeze(-1)
    token_ids = processed.argmax(dim=-1)
    if noise:
        drawn = (scaled + gumbel_noise(seed, position, processed.shape[-1])).argmax(dim=-1)
        token_ids = torch.where(is_greedy, token_ids, drawn)
    log_normalizer = torch.logsumexp(processed if raw is None else raw, dim=-1)
    return token_ids, scaled.max(dim=-1).values, log_normalizer


@dataclass(frozen=True)
class TopKCandidates:
    """Per row, every value >= its top-k threshold (and a few more), gathered by the kernel that found the
    threshold, so that top-k rows are drawn from these few instead of the whole vocabulary.
    values float32 [N, C] (-inf padded), ids int64 [N, C] (their vocabulary indices), fits bool [N] (False: the
    row's values did not fit, or it has no top-k; draw it from the whole row)."""

    values: torch.Tensor
    ids: torch.Tensor
    fits: torch.Tensor


@dataclass(frozen=True)
class TopK:
    """`kth_largest`'s answer: threshold float32 [N], and the candidates when the kernel gathered them."""

    threshold: torch.Tensor
    candidates: TopKCandidates | None = None


def kth_largest(values: torch.Tensor, k: torch.Tensor, k_max: int | None = None) -> TopK:
    """threshold: the k[i]-th largest of row i (ties counted), or -inf where k <= 0 or k >= V (keep all).
    `k_max` (>= every k) sizes the kernel's buffers; unused here."""
    vocab_size = values.shape[-1]
    k = k.to(torch.int64)
    restricts = (k > 0) & (k < vocab_size)
    ordered = values.sort(dim=-1, descending=True).values
    kth = ordered.gather(-1, (k - 1).clamp(0, vocab_size - 1).unsqueeze(-1)).squeeze(-1)
    return TopK(torch.where(restricts, kth, torch.full_like(kth, float("-inf"))))


def nucleus(
    processed: torch.Tensor, token_ids: torch.Tensor, max_scaled: torch.Tensor, temperature: torch.Tensor,
    seed: torch.Tensor, position: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    top_k_threshold: torch.Tensor, greedy_below: float, candidates: TopKCandidates | None = None,
) -> torch.Tensor:
    """`token_ids` with each restricted non-greedy row's token replaced by the Gumbel-max draw over its kept
    set (the module docstring's K ∩ nucleus). `top_k_threshold`: from `kth_largest`; `candidates` only
    saves the kernel work, the draw is the same."""
    scaled = processed * _inverse_temperature(temperature, greedy_below).unsqueeze(-1)
    min_p_threshold = torch.where(min_p > 0, max_scaled + torch.log(min_p), torch.full_like(min_p, float("-inf")))
    in_k = (processed >= top_k_threshold.unsqueeze(-1)) & (scaled >= min_p_threshold.unsqueeze(-1))
    weight = torch.where(in_k, torch.exp(scaled - max_scaled.unsqueeze(-1)), 0.0).to(torch.float64)
    kept = in_k & ((top_p >= 1).unsqueeze(-1)
                   | (mass_above(scaled, weight) < top_p.to(torch.float64).unsqueeze(-1) * weight.sum(-1, True)))
    drawn = torch.where(kept, scaled + gumbel_noise(seed, position, processed.shape[-1]), float("-inf"))
    restricted = (top_p < 1) | (min_p > 0) | (top_k_threshold > float("-inf"))
    return torch.where((temperature >= greedy_below) & restricted, drawn.argmax(dim=-1), token_ids)


def _inverse_temperature(temperature: torch.Tensor, greedy_below: float) -> torch.Tensor:
    """1 / temperature (1 for greedy rows): logits are scaled by one multiplication, as the kernels do."""
    return 1.0 / torch.where(temperature < greedy_below, torch.ones_like(temperature), temperature)


def mass_above(scaled: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 [N, V]: for each token, the sum of `weight` over the tokens with a strictly larger `scaled`."""
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    cumulative = weight.gather(-1, order).cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    # Ties share the mass before their first member: searchsorted finds it in the ascending -ordered.
    first_of_tie = torch.searchsorted(-ordered, -ordered, side="left")
    return torch.empty_like(before).scatter_(-1, order, before.gather(-1, first_of_tie))


def logprob_details(
    logits: torch.Tensor, token_ids: torch.Tensor, log_normalizer: torch.Tensor, k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rank int64 [N], top ids int64 [N, k], top logprobs float32 [N, k]) of the raw logits: rank = 1 + the
    number of tokens with a strictly higher logit than the sampled one; the k best tokens, best first."""
    chosen = logits.gather(-1, token_ids.unsqueeze(-1))
    ranks = 1 + (logits > chosen).sum(dim=-1)
    top = torch.topk(logits, k=min(k, logits.shape[-1]), dim=-1)
    return ranks, top.indices, top.values - log_normalizer.unsqueeze(-1)
