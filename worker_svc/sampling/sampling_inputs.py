"""One step's `SamplingTensors`, gathered from the persistent batch's rows.

Who owns what: the `PersistentBatch` holds every row's sampling parameters (host numpy); this module reads
the rows that sample this step and builds the device tensors the sampler takes, deciding every fast path on
the host (no device read). Each optional part costs nothing unless some row in the step uses it:
- penalties: only the penalized rows' token ids, lengths and penalties go to the device, in one copy
  (`PenaltyTensors.from_host`), and are counted there; the other rows are left out, untouched;
- sparse entries (logit_bias, the min_tokens mask, the bad_words mask): built on the host only for rows that
  have any, with whole-array operations (the rows' logit_bias and masked ids are runs of flat pools,
  `RowEntries`), and sent in one copy (`SparseLogits.from_host`), then one scatter on the device. Only the
  bad_words check loops: it compares each banned word's prefix with the row's last tokens, over the rows
  and words that have them (vLLM's processor does the same);
- top logprobs: computed only when some row asked for them (`num_top_logprobs`).

Speculative decoding samples a row at several positions in one step (its sampling entries: the row repeated,
`offsets` 0..d after its last known token). Each entry is sampled as if the row's tokens ended just before it,
with the drafts before it as its last tokens (they are in the row's token_ids, after its known ones): its
seeded position, and what reads the row's history (penalties, the min_tokens mask, bad words), are taken at
num_tokens + offset. So an entry whose drafts before it are all kept samples exactly the token that decoding
one token at a time would have sampled there.
"""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.persistent_batch import PersistentBatch
from worker_svc.sampling.logits_processors import LogitsAdjustments, PenaltyTensors, SparseLogits
from worker_svc.sampling.sampler import SamplingTensors


def build_sampling_tensors(batch: PersistentBatch, rows: np.ndarray, device: torch.device | str,
                           offsets: np.ndarray | None = None) -> SamplingTensors:
    """`rows`: the rows that sample, in logits order; each row's next token is at position num_tokens, plus
    `offsets` where given (sampling entries after drafts)."""
    num_tokens = batch.num_tokens[rows] if offsets is None else batch.num_tokens[rows] + offsets
    penalties = _penalties(batch, rows, num_tokens, device)
    sparse = _sparse_logits(batch, rows, num_tokens, device)
    adjustments = None if penalties is None and sparse is None else LogitsAdjustments(sparse, penalties)
    num_logprobs = batch.num_logprobs[rows]
    return SamplingTensors.from_host(
        temperature=batch.temperature[rows],
        top_p=batch.top_p[rows],
        top_k=batch.top_k[rows],
        seed=batch.seed[rows],
        position=num_tokens,
        min_p=batch.min_p[rows],
        adjustments=adjustments,
        num_top_logprobs=int(num_logprobs.max()) if len(rows) else -1,
        device=device,
    )


def _penalties(batch: PersistentBatch, rows: np.ndarray, row_num_tokens: np.ndarray,
               device) -> PenaltyTensors | None:
    presence, frequency = batch.presence_penalty[rows], batch.frequency_penalty[rows]
    repetition = batch.repetition_penalty[rows]
    penalized = np.flatnonzero((presence != 0) | (frequency != 0) | (repetition != 1))
    if not len(penalized):
        return None
    penalized_rows = rows[penalized]
    num_tokens = row_num_tokens[penalized]
    num_prompt = np.minimum(batch.num_prompt_tokens[penalized_rows], num_tokens)
    return PenaltyTensors.from_host(
        rows=penalized, num_prompt_tokens=num_prompt, num_tokens=num_tokens,
        token_ids=batch.token_ids[penalized_rows, : int(num_tokens.max())], repetition=repetition[penalized],
        frequency=frequency[penalized], presence=presence[penalized], device=torch.device(device))


def _sparse_logits(batch: PersistentBatch, rows: np.ndarray, row_num_tokens: np.ndarray,
                   device) -> SparseLogits | None:
    """Every sparse entry of the step, row after row (in a row: its logit_bias, then its min_tokens mask, then
    its banned words), gathered with whole-array operations; only the rows with bad words are visited one by
    one."""
    indices = np.flatnonzero(batch.has_sparse[rows])
    if not len(indices):
        return None
    sparse_rows = rows[indices]
    bias_lengths = batch.logit_bias.length[sparse_rows]
    bias_ids, biases = batch.logit_bias.take(sparse_rows, bias_lengths)
    num_output = row_num_tokens[indices] - batch.num_prompt_tokens[sparse_rows]
    mask_lengths = np.where(num_output < batch.min_tokens[sparse_rows], batch.min_tokens_masked.length[sparse_rows], 0)
    masked_ids, mask_values = batch.min_tokens_masked.take(sparse_rows, mask_lengths)
    banned_indices, banned_ids = _banned_last_tokens(batch, rows, row_num_tokens)
    entry_rows = np.concatenate([np.repeat(indices, bias_lengths), np.repeat(indices, mask_lengths), banned_indices])
    if not len(entry_rows):
        return None
    order = np.argsort(entry_rows, kind="stable")
    token_ids = np.concatenate([bias_ids, masked_ids, banned_ids])
    values = np.concatenate([biases, mask_values, np.full(len(banned_ids), -np.inf, dtype=np.float32)])
    return SparseLogits.from_host(rows=entry_rows[order], token_ids=token_ids[order], values=values[order],
                                  device=torch.device(device))


def _banned_last_tokens(batch: PersistentBatch, rows: np.ndarray,
                        row_num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index in `rows`, token id) of the last token of each bad word whose other tokens the row's output ends
    with (always, for one-token words). Only output tokens count: a word cannot be completed across the prompt
    boundary. A loop over the rows that have bad words, and their words."""
    indices, banned = [], []
    for index in np.flatnonzero(batch.has_bad_words[rows]).tolist():
        row = rows[index]
        end = int(row_num_tokens[index])
        num_output = end - int(batch.num_prompt_tokens[row])
        tokens = batch.token_ids[row]
        for word in batch.bad_words[row]:
            prefix_length = len(word) - 1
            if not prefix_length or (prefix_length <= num_output
                                     and tuple(tokens[end - prefix_length : end].tolist()) == word[:-1]):
                indices.append(index)
                banned.append(word[-1])
    return np.asarray(indices, dtype=np.int64), np.asarray(banned, dtype=np.int64)
