"""One step's `SamplingTensors`, gathered from the persistent batch's rows.

Who owns what: the `PersistentBatch` holds every row's sampling parameters (host numpy); this module reads
the rows that sample this step and builds the device tensors the sampler takes, deciding every fast path on
the host (no device read). Each optional part costs nothing unless some row in the step uses it:
- penalties: only the penalized rows' token ids, lengths and penalties go to the device, in one copy
  (`PenaltyTensors.from_host`), and are counted there; the other rows are left out, untouched;
- sparse entries (logit_bias, the min_tokens mask, the bad_words mask): built on the host only for rows that
  have any. The bad_words check compares each banned word's prefix with the row's last tokens, a host loop
  over the rows and words that have them (vLLM's processor does the same), then one scatter on the device;
- top logprobs: computed only when some row asked for them (`num_top_logprobs`).
"""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.host_to_device import to_device
from worker_svc.logits_processors import LogitsAdjustments, PenaltyTensors, SparseLogits
from worker_svc.persistent_batch import PersistentBatch
from worker_svc.sampler import SamplingTensors


def build_sampling_tensors(batch: PersistentBatch, rows: np.ndarray, device: torch.device | str) -> SamplingTensors:
    """`rows`: the rows that sample, in logits order; each row's next token is at position num_tokens."""
    penalties = _penalties(batch, rows, device)
    sparse = _sparse_logits(batch, rows, device)
    adjustments = None if penalties is None and sparse is None else LogitsAdjustments(sparse, penalties)
    num_logprobs = batch.num_logprobs[rows]
    return SamplingTensors.from_host(
        temperature=batch.temperature[rows],
        top_p=batch.top_p[rows],
        top_k=batch.top_k[rows],
        seed=batch.seed[rows],
        position=batch.num_tokens[rows],
        min_p=batch.min_p[rows],
        adjustments=adjustments,
        num_top_logprobs=int(num_logprobs.max()) if len(rows) else -1,
        device=device,
    )


def _penalties(batch: PersistentBatch, rows: np.ndarray, device) -> PenaltyTensors | None:
    presence, frequency = batch.presence_penalty[rows], batch.frequency_penalty[rows]
    repetition = batch.repetition_penalty[rows]
    penalized = np.flatnonzero((presence != 0) | (frequency != 0) | (repetition != 1))
    if not len(penalized):
        return None
    penalized_rows = rows[penalized]
    num_tokens = batch.num_tokens[penalized_rows]
    num_prompt = np.minimum(batch.num_prompt_tokens[penalized_rows], num_tokens)
    return PenaltyTensors.from_host(
        rows=penalized, num_prompt_tokens=num_prompt, num_tokens=num_tokens,
        token_ids=batch.token_ids[penalized_rows, : int(num_tokens.max())], repetition=repetition[penalized],
        frequency=frequency[penalized], presence=presence[penalized], device=torch.device(device))


def _sparse_logits(batch: PersistentBatch, rows: np.ndarray, device) -> SparseLogits | None:
    indices = np.flatnonzero(batch.has_sparse[rows])
    if not len(indices):
        return None
    entry_rows, entry_ids, entry_values = [], [], []

    def add(index: int, ids: np.ndarray, values: np.ndarray | float) -> None:
        entry_rows.append(np.full(len(ids), index, dtype=np.int64))
        entry_ids.append(ids)
        entry_values.append(np.broadcast_to(np.asarray(values, dtype=np.float32), ids.shape))

    for index in indices.tolist():
        row = rows[index]
        bias_ids, biases = batch.logit_bias[row]
        if len(bias_ids):
            add(index, bias_ids, biases)
        num_output = batch.num_tokens[row] - batch.num_prompt_tokens[row]
        if num_output < batch.min_tokens[row]:
            add(index, batch.min_tokens_masked_ids[row], -np.inf)
        banned = _banned_last_tokens(batch, row)
        if len(banned):
            add(index, banned, -np.inf)
    if not entry_rows:
        return None
    return SparseLogits(rows=_to(np.concatenate(entry_rows), torch.int64, device),
                        token_ids=_to(np.concatenate(entry_ids), torch.int64, device),
                        values=_to(np.concatenate(entry_values), torch.float32, device))


def _banned_last_tokens(batch: PersistentBatch, row: int) -> np.ndarray:
    """The last token of each bad word whose other tokens the row's output ends with (always, for one-token
    words). Only output tokens count: a word cannot be completed across the prompt boundary."""
    words = batch.bad_words[row]
    if not words:
        return np.zeros(0, dtype=np.int64)
    end = batch.num_tokens[row]
    num_output = end - batch.num_prompt_tokens[row]
    tokens = batch.token_ids[row]
    banned = [word[-1] for word in words
              if len(word) - 1 <= num_output and np.array_equal(tokens[end - len(word) + 1 : end], word[:-1])]
    return np.asarray(banned, dtype=np.int64)


def _to(array: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
    return to_device(array, torch.device(device), dtype)
