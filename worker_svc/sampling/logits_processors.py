"""Logits processors that run before temperature: repetition / frequency / presence penalties, logit_bias,
and the min_tokens and bad_words masks.

Who owns what: `sampling_inputs.py` builds a `LogitsAdjustments` for one step from the persistent batch's
rows (host work over whole arrays, paid only when some row uses a processor); `sampler.sample` applies it to
the step's logits. Nothing is kept between steps: each step's penalties are computed from the rows' tokens,
so a row added after a preemption, a fork or a beam step needs no bookkeeping, and a plan log replays.

Why sparse: a row's penalties change only the logits of the tokens it has seen, so the work is over the
penalized rows' token ids [n, L] (L: the longest such row's prompt + output), never over [N, V]. A token's
count in a row's output is two binary searches in the row's sorted output ids; every entry (prompt and
output) gathers its logit, computes the penalized value and scatters it back. All the entries of one token
compute the same value, so a plain scatter's duplicate writes are harmless and the result is deterministic.
The dense way (a [N, V] count tensor and prompt mask rebuilt each step, then several [N, V] passes) costs
more than twice as much per step at a few hundred rows and a large vocabulary (docs/benchmarks.md, "Kernel
tuning"); a persistent [max_rows, V] count tensor would cost a large, fixed amount of memory, used or not, and
still dense passes.

Order (vLLM V1's `Sampler.forward`): the sparse entries (bad_words and min_tokens masks, logit_bias) first,
then the penalties, then the sampler's temperature, min_p, top-k, top-p. Definitions:
- repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor): for every token in the prompt or the
  output, a logit > 0 is divided by the penalty, otherwise multiplied by it;
- frequency / presence penalty (OpenAI): logit -= frequency * count + presence * (count > 0), over the
  output tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.host_to_device import host_buffer, to_device

_NUM_ROW_FIELDS = 6  # rows, num_prompt_tokens, num_tokens, repetition, frequency, presence


@dataclass(frozen=True)
class PenaltyTensors:
    """The step's penalized rows only, n of them (the other rows are left untouched). Int32: rows [n], each
    one's index in the step's logits; num_prompt_tokens and num_tokens [n]; token_ids [n, L], a row's prompt
    in [0, num_prompt_tokens), its output in [num_prompt_tokens, num_tokens), anything after. Float32 [n]: the
    penalties. All views of one device buffer, filled by one H2D copy (`from_host`)."""

    rows: torch.Tensor
    num_prompt_tokens: torch.Tensor
    num_tokens: torch.Tensor
    token_ids: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor

    @classmethod
    def from_host(cls, rows: np.ndarray, num_prompt_tokens: np.ndarray, num_tokens: np.ndarray,
                  token_ids: np.ndarray, repetition: np.ndarray, frequency: np.ndarray, presence: np.ndarray,
                  device: torch.device) -> PenaltyTensors:
        """Packs the host arrays into one int32 buffer (the penalties as their float32 bits), copies it."""
        num_rows, length = token_ids.shape
        host = host_buffer((_NUM_ROW_FIELDS + length) * num_rows, torch.int32, device)
        packed = host.numpy()
        fields = packed[: _NUM_ROW_FIELDS * num_rows].reshape(_NUM_ROW_FIELDS, num_rows)
        fields[:3] = rows, num_prompt_tokens, num_tokens
        fields[3:].view(np.float32)[:] = repetition, frequency, presence
        packed[_NUM_ROW_FIELDS * num_rows :].reshape(num_rows, length)[:] = token_ids
        on_device = to_device(host, device)
        fields = on_device[: _NUM_ROW_FIELDS * num_rows].view(_NUM_ROW_FIELDS, num_rows)
        penalties = fields[3:].view(torch.float32)
        return cls(rows=fields[0], num_prompt_tokens=fields[1], num_tokens=fields[2],
                   token_ids=on_device[_NUM_ROW_FIELDS * num_rows :].view(num_rows, length),
                   repetition=penalties[0], frequency=penalties[1], presence=penalties[2])


@dataclass(frozen=True)
class SparseLogits:
    """Entries added to the logits: logits[rows[i], token_ids[i]] += values[i] (a bias, or -inf to mask).
    Accumulated: a row's logit_bias and masks may name the same token. Built by `from_host`, all three are
    views of one device buffer, filled by one H2D copy."""

    rows: torch.Tensor  # int64 [M]
    token_ids: torch.Tensor  # int64 [M]
    values: torch.Tensor  # float32 [M]

    @classmethod
    def from_host(cls, rows: np.ndarray, token_ids: np.ndarray, values: np.ndarray,
                  device: torch.device) -> SparseLogits:
        """Packs rows and token ids and the values' float32 bits (two to an int64) into one int64 buffer,
        copies it."""
        num_entries = len(rows)
        host = host_buffer(2 * num_entries + (num_entries + 1) // 2, torch.int64, device)
        packed = host.numpy()
        packed[:num_entries], packed[num_entries : 2 * num_entries] = rows, token_ids
        packed[2 * num_entries :].view(np.float32)[:num_entries] = values
        on_device = to_device(host, device)
        return cls(rows=on_device[:num_entries], token_ids=on_device[num_entries : 2 * num_entries],
                   values=on_device[2 * num_entries :].view(torch.float32)[:num_entries])


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
        _penalize(processed, adjustments.penalties)
    return processed


def _penalize(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Penalizes `logits` in place, at the penalized rows' prompt and output tokens only."""
    positions = torch.arange(penalties.token_ids.shape[1], device=logits.device)
    num_tokens = penalties.num_tokens.unsqueeze(-1)
    # Entries past a row's tokens repeat its first token: they compute that token's value again.
    token_ids = torch.where(positions < num_tokens, penalties.token_ids, penalties.token_ids[:, :1])
    is_output = (positions >= penalties.num_prompt_tokens.unsqueeze(-1)) & (positions < num_tokens)
    # The count of each entry's token in its row's output: right minus left insertion point in the row's
    # sorted output ids (the row's other entries sort as -1, never a token id).
    sorted_output = torch.where(is_output, token_ids, -1).sort(dim=-1).values
    counts = torch.searchsorted(sorted_output, token_ids, right=True) - torch.searchsorted(sorted_output, token_ids)
    counts = counts.to(logits.dtype)
    index = (penalties.rows.long().unsqueeze(-1), token_ids.long())
    seen = logits[index]
    repetition = penalties.repetition.unsqueeze(-1)
    penalized = torch.where(seen > 0, seen / repetition, seen * repetition)
    frequency, presence = penalties.frequency.unsqueeze(-1), penalties.presence.unsqueeze(-1)
    logits.index_put_(index, penalized - frequency * counts - presence * (counts > 0))
