"""Per-request rows the worker keeps between steps, and the step inputs built from them.

Owned by the worker process. A row holds a request's known tokens, how many of them are in the KV cache, its
block table and its sampling parameters, in preallocated numpy arrays indexed by row. Each plan only edits
rows (add the new, drop the finished and preempted, append new block ids); the forward pass's inputs are then
gathered from the rows with whole-array operations, never a Python loop over tokens. Sampled tokens are
appended here, on the worker: the scheduler is told them but never sends them back. A constrained row's
grammar matcher (`grammar_matchers.py`) is made with its row and dropped with it, and advanced when the row's
sampled token is written (`fill`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos.pagedserve.v1 import worker_pb2
from worker_svc.grammar_matchers import GrammarMatchers
from worker_svc.row_entries import RowEntries

# A token the previous step samples that has not come back to the host yet: the next step may be built
# before it does (see `begin_step`), and its input is then taken from that step's sampled ids on the device.
PENDING_TOKEN = -1
_UINT64_WRAP = 1 << 64
_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class StepInputs:
    """One step's flattened model inputs (host arrays; the worker moves them to the device at once)."""

    rows: np.ndarray  # [B] scheduled rows, in plan order
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray  # [B] context length after this step
    block_tables: np.ndarray  # [B, max blocks in use]
    # Rows whose computed tokens reach their last known token: they sample (or, beam rows, return candidates).
    sample_rows: np.ndarray  # [S]
    logits_indices: np.ndarray  # [S] index of each such row's last scheduled token in the token axis
    num_decode_seqs: int  # leading rows with exactly one scheduled token
    # Input tokens still pending from the step in flight: their indices in input_ids, and where each sits
    # in that step's sampled ids (its `sampled_rows` order). Empty unless steps overlap.
    pending_input_indices: np.ndarray
    pending_sources: np.ndarray


@dataclass(frozen=True)
class PendingTokens:
    """Where the tokens a launched step samples go once they reach the host (`PersistentBatch.fill`): the
    rows, their owners' generation at launch (a row freed and reused meanwhile is skipped), positions."""

    rows: np.ndarray
    generations: np.ndarray
    positions: np.ndarray


class PersistentBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int,
                 grammars: GrammarMatchers | None = None):
        self.block_size = block_size
        # Constrained decoding (None: the worker has no tokenizer and takes no constrained rows).
        self.grammars = grammars
        max_blocks = self.max_blocks_per_seq(max_model_len, block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_seqs, dtype=np.float32)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.top_k = np.full(max_num_seqs, -1, dtype=np.int64)
        self.seed = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_beam_candidates = np.zeros(max_num_seqs, dtype=np.int64)
        # Bumped when a row is given to a request, so late tokens of its previous owner are not written.
        self.generation = np.zeros(max_num_seqs, dtype=np.int64)
        # For a row whose newest token is PENDING_TOKEN: its index in the in-flight step's sampled ids.
        self.pending_source = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_seqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_seqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_seqs, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(max_num_seqs, -1, dtype=np.int64)
        # Sparse per-row parameters (few rows have them; `has_sparse` says which rows have any). A row's
        # logit_bias (ids, biases) and the ids masked until min_tokens (value -inf) are runs of flat pools, so a
        # step gathers every row's entries at once. Its bad words are tuples of token ids, matched against the
        # row's last tokens one row at a time, on the rows that have any (`has_bad_words`); comparing small
        # tuples of ints is several times cheaper than np.array_equal on small arrays.
        self.logit_bias = RowEntries(max_num_seqs)
        self.min_tokens_masked = RowEntries(max_num_seqs)
        self.bad_words: list[tuple[tuple[int, ...], ...]] = [()] * max_num_seqs
        self.has_bad_words = np.zeros(max_num_seqs, dtype=bool)
        self.has_sparse = np.zeros(max_num_seqs, dtype=bool)
        self._row_of: dict[str, int] = {}
        self._request_of_row: list[str | None] = [None] * max_num_seqs
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    @staticmethod
    def max_blocks_per_seq(max_model_len: int, block_size: int) -> int:
        """A row's block table width: enough blocks for max_model_len tokens."""
        return -(-max_model_len // block_size)

    def __len__(self) -> int:
        return len(self._row_of)

    def row_of(self, request_id: str) -> int:
        return self._row_of[request_id]

    def request_id_of(self, row: int) -> str:
        return self._request_of_row[row]

    def reads_history(self, row: int) -> bool:
        """Whether building this row's sampling inputs reads its earlier tokens on the host (penalties, sparse
        masks). A grammar matcher needs the previous token too, but only for the mask, which the worker builds
        after the step in flight is finished (Worker.complete)."""
        return bool(self.has_sparse[row] or self.presence_penalty[row] or self.frequency_penalty[row]
                    or self.repetition_penalty[row] != 1.0)

    def remove(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._request_of_row[row] = None
            self.logit_bias.clear(row)
            self.min_tokens_masked.clear(row)
            self.bad_words[row] = ()
            self.has_bad_words[row] = self.has_sparse[row] = False
            if self.grammars is not None:
                self.grammars.remove(row)
            self._free_rows.append(row)

    def add(self, new: worker_pb2.NewRequest) -> int:
        if new.request_id in self._row_of:
            raise ValueError(f"request {new.request_id} already has a row")
        if not self._free_rows:
            raise ValueError("more requests than max_num_seqs")
        row = self._free_rows.pop()
        self.generation[row] += 1
        self._row_of[new.request_id] = row
        self._request_of_row[row] = new.request_id
        tokens = np.asarray(new.token_ids, dtype=np.int64)
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = new.num_computed_tokens
        blocks = np.asarray(new.block_ids, dtype=np.int64)
        self.block_table[row, : len(blocks)] = blocks
        self.num_blocks[row] = len(blocks)
        sampling = new.sampling
        self.temperature[row] = sampling.temperature
        self.top_p[row] = sampling.top_p
        self.top_k[row] = sampling.top_k
        seed = sampling.seed
        self.seed[row] = seed - _UINT64_WRAP if seed > _INT64_MAX else seed
        self.num_beam_candidates[row] = sampling.num_beam_candidates
        self.num_prompt_tokens[row] = new.num_prompt_tokens or len(tokens)
        self.min_p[row] = sampling.min_p
        self.presence_penalty[row] = sampling.presence_penalty
        self.frequency_penalty[row] = sampling.frequency_penalty
        self.repetition_penalty[row] = sampling.repetition_penalty or 1.0
        self.min_tokens[row] = sampling.min_tokens
        self.num_logprobs[row] = sampling.num_logprobs
        self.num_prompt_logprobs[row] = sampling.num_prompt_logprobs
        self.logit_bias.set(row, [b.token_id for b in sampling.logit_bias], [b.bias for b in sampling.logit_bias])
        self.min_tokens_masked.set(row, sampling.min_tokens_masked_ids if sampling.min_tokens else [], -np.inf)
        self.bad_words[row] = tuple(tuple(w.token_ids) for w in sampling.bad_words if w.token_ids)
        self.has_bad_words[row] = bool(self.bad_words[row])
        self.has_sparse[row] = bool(self.logit_bias.length[row] or self.min_tokens_masked.length[row]
                                    or self.has_bad_words[row])
        if sampling.structured_grammar:
            after = (sampling.structured_grammar_after_token_id
                     if sampling.HasField("structured_grammar_after_token_id") else None)
            self._add_grammar(row, sampling.structured_grammar, after)
        return row

    def _add_grammar(self, row: int, grammar: str, after_token_id: int | None) -> None:
        if self.grammars is None:
            raise ValueError("a constrained request, but this worker has no grammar matchers (no tokenizer)")
        try:
            self.grammars.add(row, grammar, self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]],
                              after_token_id)
        except Exception:
            self.remove(self._request_of_row[row])  # the row is not half-made
            raise

    def update(self, scheduled: worker_pb2.ScheduledRequest) -> int:
        """Applies a scheduled request's diff to its row: copy-on-write replacements, new blocks, and the
        tokens the scheduler chose for it (beam rows)."""
        row = self._row_of[scheduled.request_id]
        for replaced in scheduled.replaced_blocks:
            self.block_table[row, replaced.index] = replaced.block_id
        # Most steps are decodes that bring no block and no token: they cost a dict lookup, not numpy calls
        # (a few microseconds each, times every row, every step, on the worker's critical path).
        if scheduled.new_block_ids:
            start = self.num_blocks[row]
            blocks = np.asarray(scheduled.new_block_ids, dtype=np.int64)
            self.block_table[row, start : start + len(blocks)] = blocks
            self.num_blocks[row] = start + len(blocks)
        if scheduled.new_token_ids:
            tokens = np.asarray(scheduled.new_token_ids, dtype=np.int64)
            self.token_ids[row, self.num_tokens[row] : self.num_tokens[row] + len(tokens)] = tokens
            self.num_tokens[row] += len(tokens)
        return row

    def build_inputs(self, rows: np.ndarray, num_scheduled: np.ndarray) -> StepInputs:
        """Gathers the inputs of one step: `num_scheduled[i]` tokens of row `rows[i]`, from its first
        uncomputed token on."""
        computed = self.num_computed_tokens[rows]
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        token_row = np.repeat(rows, num_scheduled)
        offset_in_chunk = np.arange(total, dtype=np.int64) - np.repeat(query_start_loc[:-1], num_scheduled)
        positions = np.repeat(computed, num_scheduled) + offset_in_chunk
        input_ids = self.token_ids[token_row, positions]
        block_ids = self.block_table[token_row, positions // self.block_size]
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        seq_lens = computed + num_scheduled
        max_blocks = int(-(-seq_lens.max() // self.block_size)) if len(rows) else 0
        samples = seq_lens == self.num_tokens[rows]
        pending = np.flatnonzero(input_ids == PENDING_TOKEN)
        return StepInputs(
            rows=rows,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=self.block_table[rows, :max_blocks],
            sample_rows=rows[samples],
            logits_indices=query_start_loc[1:][samples] - 1,
            num_decode_seqs=int(np.argmax(num_scheduled != 1)) if (num_scheduled != 1).any() else len(rows),
            pending_input_indices=pending,
            pending_sources=self.pending_source[token_row[pending]],
        )

    def begin_step(self, inputs: StepInputs, sampled_rows: np.ndarray) -> PendingTokens:
        """Marks a launched step's tokens computed and gives each sampled row its next token as PENDING_TOKEN
        (beam rows get theirs from the scheduler instead), so the next step can be built before the sampled
        ids reach the host. `fill` writes them then."""
        self.num_computed_tokens[inputs.rows] = inputs.seq_lens
        positions = self.num_tokens[sampled_rows].copy()
        self.token_ids[sampled_rows, positions] = PENDING_TOKEN
        self.num_tokens[sampled_rows] += 1
        self.pending_source[sampled_rows] = np.arange(len(sampled_rows))
        return PendingTokens(sampled_rows, self.generation[sampled_rows].copy(), positions)

    def fill(self, pending: PendingTokens, sampled_token_ids: np.ndarray) -> list[worker_pb2.FailedRequest]:
        """Writes the sampled tokens of a step begun with `begin_step`, in its rows still held by the same
        requests. Returns the requests whose grammar failed on them (`GrammarMatchers.advance`)."""
        same = self.generation[pending.rows] == pending.generations
        self.token_ids[pending.rows[same], pending.positions[same]] = sampled_token_ids[same]
        if self.grammars is None:
            return []
        return [worker_pb2.FailedRequest(request_id=self.request_id_of(row), reason=reason)
                for row, reason in self.grammars.advance(pending.rows[same], sampled_token_ids[same])]
