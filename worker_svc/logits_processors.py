"""Logits processors that run before temperature: repetition / frequency / presence penalties, logit_bias,
and the min_tokens and bad_words masks.

Who owns what: `sampling_inputs.py` builds a `LogitsAdjustments` for one step from the persistent batch's
rows (host work over whole arrays, paid only when some row uses a processor); `sampler.sample` applies it to
the step's logits. Nothing is kept between steps: the token counts are rebuilt from the rows' tokens each
step, so a row added after a preemption, a fork or a beam step needs no bookkeeping, and a plan log replays.

Why rebuild the counts each step instead of a persistent [max_rows, vocab] count tensor updated by
scatter_add: the persistent tensor costs 155 MB at 256 rows x 152k vocab whether penalties are used or not,
and must be rebuilt for rows that arrive with tokens anyway; the rebuild is one H2D copy of the penalized
rows' token ids and one scatter_add, a small part of a step (benchmarks/sampler_bench.py measures it).

Order (vLLM V1's `Sampler.forward`): the sparse entries (bad_words and min_tokens masks, logit_bias) first,
then the penalties, then the sampler's temperature, min_p, top-k, top-p. Definitions:
- repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor): for every token in the prompt or the
  output, a logit > 0 is divided by the penalty, otherwise multiplied by it;
- frequency / presence penalty (OpenAI): logit -= frequency * count + presence * (count > 0), over the
  output tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PenaltyTensors:
    """Rows: the step's sampling rows. counts int32 [N, V]: occurrences of each token in the row's output;
    in_prompt bool [N, V]: the token occurs in the row's prompt. Penalties float32 [N]."""

    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    counts: torch.Tensor
    in_prompt: torch.Tensor


@dataclass(frozen=True)
class SparseLogits:
    """Entries added to the logits: logits[rows[i], token_ids[i]] += values[i] (a bias, or -inf to mask)."""

    rows: torch.Tensor  # int64 [M]
    token_ids: torch.Tensor  # int64 [M]
    values: torch.Tensor  # float32 [M]


@dataclass(frozen=True)
class LogitsAdjustments:
    """What to apply to one step's logits before sampling; either part None when no row needs it."""

    sparse: SparseLogits | None = None
    penalties: PenaltyTensors | None = None


def apply_adjustments(logits: torch.Tensor, adjustments: LogitsAdjustments | None) -> torch.Tensor:
    """The processed logits (a new tensor when anything applies; `logits` itself, untouched, otherwise)."""
    if adjustments is None or (adjustments.sparse is None and adjustments.penalties is None):
        return logits
    processed = logits.clone()
    if adjustments.sparse is not None:
        sparse = adjustments.sparse
        processed.index_put_((sparse.rows, sparse.token_ids), sparse.values, accumulate=True)
    if adjustments.penalties is not None:
        processed = apply_penalties(processed, adjustments.penalties)
    return processed


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    repetition = penalties.repetition.unsqueeze(-1)
    seen = penalties.in_prompt | (penalties.counts > 0)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    counts = penalties.counts.to(logits.dtype)
    return logits - penalties.frequency.unsqueeze(-1) * counts - penalties.presence.unsqueeze(-1) * (counts > 0)


def token_counts(
    token_ids: torch.Tensor, num_prompt_tokens: torch.Tensor, num_tokens: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output counts int32 [N, V], prompt presence bool [N, V]) from padded rows of token ids [N, L]: row i
    holds its prompt in [0, num_prompt_tokens[i]) and its output in [num_prompt_tokens[i], num_tokens[i])."""
    num_rows, length = token_ids.shape
    positions = torch.arange(length, device=token_ids.device).unsqueeze(0)
    in_prompt = positions < num_prompt_tokens.unsqueeze(-1)
    in_output = ~in_prompt & (positions < num_tokens.unsqueeze(-1))
    # Positions outside a part scatter into an extra column, dropped after.
    overflow = torch.full_like(token_ids, vocab_size)
    ones = torch.ones_like(token_ids, dtype=torch.int32)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, torch.where(in_output, token_ids, overflow), ones)
    prompt = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=token_ids.device)
    prompt.scatter_(1, torch.where(in_prompt, token_ids, overflow), True)
    return counts[:, :vocab_size], prompt[:, :vocab_size]
