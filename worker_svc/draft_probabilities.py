"""The distributions q a draft model drew its latest proposals from, kept on the device until the step that
verifies them (speculative decoding's exact rejection sampling: worker_svc/sampling/rejection_sampler.py).

Who owns what: the `DraftModel` makes one `DraftProbabilities` per proposal pass (`DraftModel.propose`) and
keeps the latest; the worker asks it, when it launches a step with drafts, for the q of each draft entry
(`for_entries`). Why keyed and checked, not simply indexed by row: between the proposal and its verification the
scheduler decides which drafts to plan, and may plan none, fewer (a prefix: the token budget, max_tokens), or,
for a request it did not schedule when the proposals came, drafts proposed in an earlier pass; a row may also
have been given to another request. A row's q is used only if it belongs to the same request (the row's
generation), its proposals followed exactly the row's current tokens, and its planned drafts are a prefix of
those proposals; any other row with drafts is verified by sample-and-match, which is lossless for any drafts.

Memory: probs is [rows, k, V] float32 on the device, e.g. 8 rows x 4 x 152k = 19 MB, for the rows of one
proposal pass (at most disable_by_batch_size rows speculate).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.host_to_device import to_device
from worker_svc.persistent_batch import PersistentBatch
from worker_svc.sampling.rejection_sampler import SampledDrafts


@dataclass(frozen=True)
class DraftProbabilities:
    """One proposal pass's sampled rows (host keys) and their q (device).

    - rows, generations int64 [R]: the rows whose proposals were drawn from q (rows that sample), and their
      owners' generation then;
    - starts int64 [R]: each row's token count then (the position of its first proposal);
    - counts int64 [R]: its number of proposals; token_ids int64 [R, P]: them (P: the most of any row);
    - probs float32 [R, P, V]: q of each proposal (rows past their count: unused).
    """

    rows: np.ndarray
    generations: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    token_ids: np.ndarray
    probs: torch.Tensor

    def for_entries(self, batch: PersistentBatch, rows: np.ndarray, offsets: np.ndarray) -> SampledDrafts | None:
        """The q of a step's draft entries (`rows`, `offsets`: its draw's entries, StepInputs.sample_offsets) whose
        row's drafts are this pass's proposals for its current tokens (see the module docstring); None if none."""
        is_draft = offsets < batch.num_drafts[rows]
        lookup = np.full(len(batch.num_tokens), -1, dtype=np.int64)
        lookup[self.rows] = np.arange(len(self.rows))
        index = lookup[rows]
        known = is_draft & (index >= 0)
        if not known.any():
            return None
        held = np.zeros(len(rows), dtype=bool)
        i, row = index[known], rows[known]
        same = ((self.generations[i] == batch.generation[row]) & (self.starts[i] == batch.num_tokens[row])
                & (batch.num_drafts[row] <= self.counts[i]))
        # Every draft of the row equal to the proposal at its offset (the entries of a row cover all its drafts).
        last_column = batch.token_ids.shape[1] - 1
        draft_ids = batch.token_ids[row, np.minimum(batch.num_tokens[row] + offsets[known], last_column)]
        proposal_ids = self.token_ids[i, np.minimum(offsets[known], self.token_ids.shape[1] - 1)]
        held[known] = same & (draft_ids == proposal_ids)
        row_held = np.ones(len(batch.num_tokens), dtype=bool)
        np.logical_and.at(row_held, rows[is_draft], held[is_draft])
        entries = np.flatnonzero(is_draft & row_held[rows])
        if not len(entries):
            return None
        device = self.probs.device
        flat = index[entries] * self.probs.shape[1] + offsets[entries]
        return SampledDrafts(entries=to_device(entries, device, torch.long),
                             token_ids=to_device(self.token_ids[index[entries], offsets[entries]], device, torch.long),
                             probs=self.probs.flatten(0, 1)[to_device(flat, device, torch.long)])
