"""Per-request rows the worker keeps between steps, and the step inputs built from them.

Owned by the worker process. A row holds a request's known tokens, how many of them are in the KV cache, its
block table and its sampling parameters, in preallocated numpy arrays indexed by row. Each plan only edits
rows (add the new, drop the finished and preempted, append new block ids); the forward pass's inputs are then
gathered from the rows with whole-array operations, never a Python loop over tokens. Sampled tokens are
appended here, on the worker: the scheduler is told them but never sends them back. A constrained row's
grammar matcher (`grammar_matchers.py`) is made with its row and dropped with it, and advanced when the row's
sampled token is written (`fill`).

Speculative decoding: a scheduled request may bring draft tokens (`update`). They are written after the row's
known tokens without counting them (`num_drafts` remembers how many), computed with its last known token in one
chunk, and sampled at every one of those positions (the step's sampling entries, `StepInputs.sample_offsets`).
`fill` then keeps the drafts that match the tokens sampled before them (`accepted_drafts`) and the token sampled
after the last kept one. A step with drafts is never overlapped (Worker.can_overlap), so its rows hold no
PENDING_TOKEN: their drafts stay in place until verified.

Multi-LoRA: a row keeps the adapter slot its NewRequest names (`lora_slot`, 0 the base model; a preempted
request may come back in another slot), and a step with any adapter row gives each token its row's slot index
(`StepInputs.lora_token_slots`: slot - 1, -1 for base rows).
"""

from __future__ import annotations

import dataclasses
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
    # Sampling entries: such a row once, at offset 0; a row with d drafts 1 + d times in a row, at offsets
    # 0..d (the token after its last known token, after each draft). logits_indices: each entry's token index.
    sample_rows: np.ndarray  # [S]
    sample_offsets: np.ndarray  # [S]
    logits_indices: np.ndarray  # [S]
    num_draft_tokens: int  # in the whole step (0: every sampling row samples once, at offset 0)
    num_decode_seqs: int  # leading rows with exactly one scheduled token
    # Input tokens still pending from the step in flight: their indices in input_ids, and where each sits
    # in that step's sampled ids (its `sampled_rows` order). Empty unless steps overlap.
    pending_input_indices: np.ndarray
    pending_sources: np.ndarray
    # Multi-LoRA: each token's adapter slot (-1: the base model), or None when no scheduled row has an adapter
    # (the step is then the base model's alone: no per-token slots, and its CUDA graphs may run it).
    lora_token_slots: np.ndarray | None = None

    @property
    def is_verification(self) -> bool:
        """Whether every row schedules one token plus its drafts, and some row has drafts."""
        return bool(self.num_draft_tokens) and len(self.input_ids) == len(self.rows) + self.num_draft_tokens

    def as_single_token_decodes(self) -> StepInputs | None:
        """The same step for the forward pass as T one-token decodes, each token a sequence of its own (context:
        its row's tokens up to and including it; its row's block table), where every row schedules one token
        plus its drafts (a verification step); None otherwise.

        Why: such a step would run as a step "with prefill" (its rows have several query tokens), through the
        piecewise graphs with attention launched eagerly per layer, which on an H200 cost 3.5 ms of host time
        per step for the 1.5B shape against 1.9 ms for a whole decode step, and so ate the speculation's gain.
        As decodes it fits the decode CUDA graphs. It is the same attention: each layer writes every token's K/V
        before attending, so a draft's pseudo-sequence sees the row's earlier drafts of this step; and each
        token is attended by the decode kernel over the context a step without speculation would give it. Only
        the forward pass sees this view; the step's bookkeeping (rows, seq_lens) keeps the real rows."""
        if not self.is_verification:
            return None
        counts = np.diff(self.query_start_loc)
        total = len(self.input_ids)
        return dataclasses.replace(
            self, rows=np.repeat(self.rows, counts), query_start_loc=np.arange(total + 1, dtype=np.int64),
            seq_lens=self.positions + 1, block_tables=np.repeat(self.block_tables, counts, axis=0),
            num_decode_seqs=total)


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
        # Draft tokens written after the row's known tokens for the step being built or run (0 once verified).
        self.num_drafts = np.zeros(max_num_seqs, dtype=np.int64)
        # How many rows have drafts: 0 (speculation off, or no drafts this step) skips their work in a step.
        self.num_rows_with_drafts = 0
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_seqs, dtype=np.float32)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.top_k = np.full(max_num_seqs, -1, dtype=np.int64)
        self.seed = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_beam_candidates = np.zeros(max_num_seqs, dtype=np.int64)
        # LoRA adapter slot of each row (0: the base model), and how many rows have one (0: skip the slots).
        self.lora_slot = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_rows_with_lora = 0
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

    def may_take_drafts(self, rows: np.ndarray) -> np.ndarray:
        """Which rows drafts could be planned for (a draft model proposes for these only): sampled from their own
        logits at each position, as `_write_drafts` requires, and without host-side history (penalties, sparse
        masks), as the scheduler requires (step_planner.samples_plainly; it checks the rest)."""
        plain = ((self.num_beam_candidates[rows] == 0) & (self.num_logprobs[rows] < 0) & ~self.has_sparse[rows]
                 & (self.presence_penalty[rows] == 0) & (self.frequency_penalty[rows] == 0)
                 & (self.repetition_penalty[rows] == 1.0))
        if self.grammars is not None:
            plain &= ~(self.grammars.constrained[rows] | self.grammars.waiting[rows])
        return plain

    def remove(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._request_of_row[row] = None
            self.num_rows_with_drafts -= bool(self.num_drafts[row])
            self.num_drafts[row] = 0
            self.num_rows_with_lora -= bool(self.lora_slot[row])
            self.lora_slot[row] = 0
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
        self.lora_slot[row] = new.lora_slot
        self.num_rows_with_lora += bool(new.lora_slot)
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
        """Applies a scheduled request's diff to its row: copy-on-write replacements, new blocks, the tokens the
        scheduler chose for it (beam rows) and its draft tokens (written after its known tokens, not counted)."""
        row = self._row_of[scheduled.request_id]
        if scheduled.draft_token_ids:
            self._write_drafts(row, scheduled)
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

    def _write_drafts(self, row: int, scheduled: worker_pb2.ScheduledRequest) -> None:
        """Drafts are only for rows sampled from the row's own logits at each position (the scheduler's rule):
        a beam row's, a constrained row's (its matcher advances token by token) or a row returning logprobs
        (one result entry per row) would be answered wrongly, so the plan is refused."""
        if (self.num_beam_candidates[row] or self.num_logprobs[row] >= 0
                or (self.grammars is not None and self.grammars.follows_sampled_tokens(np.asarray([row])))):
            raise ValueError(f"request {scheduled.request_id}: draft tokens for a beam, logprobs or constrained row")
        drafts = np.asarray(scheduled.draft_token_ids, dtype=np.int64)
        start = self.num_tokens[row]
        if (scheduled.num_scheduled_tokens != 1 + len(drafts) or self.num_computed_tokens[row] != start - 1
                or start + len(drafts) >= self.token_ids.shape[1]):
            raise ValueError(f"request {scheduled.request_id}: {len(drafts)} drafts, but not on a decode of "
                             f"{1 + len(drafts)} scheduled tokens within max_model_len")
        self.token_ids[row, start : start + len(drafts)] = drafts
        self.num_rows_with_drafts += not self.num_drafts[row]
        self.num_drafts[row] = len(drafts)

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
        if self.num_rows_with_drafts:
            drafts = self.num_drafts[rows]
            num_draft_tokens = int(drafts.sum())
            samples = seq_lens == self.num_tokens[rows] + drafts
        else:
            num_draft_tokens, samples = 0, seq_lens == self.num_tokens[rows]
        sample_rows, sample_offsets = rows[samples], np.zeros(int(samples.sum()), dtype=np.int64)
        logits_indices = query_start_loc[1:][samples] - 1
        if num_draft_tokens:
            sample_rows, sample_offsets, logits_indices = _draft_entries(sample_rows, logits_indices, drafts[samples])
        pending = np.flatnonzero(input_ids == PENDING_TOKEN)
        lora_token_slots = None
        if self.num_rows_with_lora and self.lora_slot[rows].any():
            slots = np.repeat(self.lora_slot[rows], num_scheduled)
            lora_token_slots = slots - 1  # slot s is index s - 1 of the layers' stacks; the base model's 0 is -1
        return StepInputs(
            rows=rows,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=self.block_table[rows, :max_blocks],
            sample_rows=sample_rows,
            sample_offsets=sample_offsets,
            logits_indices=logits_indices,
            num_draft_tokens=num_draft_tokens,
            num_decode_seqs=int(np.argmax(num_scheduled != 1)) if (num_scheduled != 1).any() else len(rows),
            pending_input_indices=pending,
            pending_sources=self.pending_source[token_row[pending]],
            lora_token_slots=lora_token_slots,
        )

    def begin_step(self, inputs: StepInputs, sampled_rows: np.ndarray) -> PendingTokens:
        """Marks a launched step's tokens computed and gives each sampled row its next token as PENDING_TOKEN
        (beam rows get theirs from the scheduler instead), so the next step can be built before the sampled
        ids reach the host. `fill` writes them then. A row with drafts keeps them in place (and its computed
        count includes them) until `fill` verifies them: no step is built meanwhile."""
        self.num_computed_tokens[inputs.rows] = inputs.seq_lens
        positions = self.num_tokens[sampled_rows].copy()
        plain = sampled_rows[self.num_drafts[sampled_rows] == 0] if inputs.num_draft_tokens else sampled_rows
        self.token_ids[plain, self.num_tokens[plain]] = PENDING_TOKEN
        self.num_tokens[plain] += 1
        self.pending_source[sampled_rows] = np.arange(len(sampled_rows))
        return PendingTokens(sampled_rows, self.generation[sampled_rows].copy(), positions)

    def accepted_drafts(self, rows: np.ndarray, offsets: np.ndarray,
                        sampled_token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sample-and-match over a step's sampling entries (`rows`, `offsets`, as in StepInputs; each row's
        entries together, from offset 0): a row keeps its drafts while each equals the token sampled at its
        position. Returns, per row (its offset-0 entry's order), the index of the entry whose token it takes
        (the first that differs from its draft, or the one after the last draft) and its number of kept drafts.
        Whole-array: the entry after a row's last draft has no draft, so every row's run of matches ends.
        Exact for point-mass drafts (n-gram, greedy): it is the rejection rule with q(x) = 1. A draft a draft model
        sampled from q has, at its entry, the rejection rule's token instead of a plain draw
        (sampling/rejection_sampler.py): the draft when kept, another token when not, so the same match applies."""
        first = np.flatnonzero(offsets == 0)
        is_draft = offsets < self.num_drafts[rows]
        # Only the draft entries are read: a plain row's token count already counts its pending token, and
        # may reach max_model_len.
        draft_rows = rows[is_draft]
        matches = np.zeros(len(rows), dtype=bool)
        matches[is_draft] = (self.token_ids[draft_rows, self.num_tokens[draft_rows] + offsets[is_draft]]
                             == sampled_token_ids[is_draft])
        taken = np.minimum.reduceat(np.where(matches, len(rows), np.arange(len(rows))), first)
        return taken, taken - first

    def fill(self, pending: PendingTokens, sampled_token_ids: np.ndarray,
             num_accepted: np.ndarray | None = None) -> list[worker_pb2.FailedRequest]:
        """Writes the sampled tokens of a step begun with `begin_step`, in its rows still held by the same
        requests. Returns the requests whose grammar failed on them (`GrammarMatchers.advance`).
        `num_accepted` (a step with drafts: each row's kept drafts, `accepted_drafts`): a row's known tokens
        become its old ones, its kept drafts (already in place) and its token; its computed ones, all but that
        token (the rejected drafts' K/V is overwritten later). A row that had drafts drops the blocks past its
        computed tokens, as the scheduler frees them (BlockManager.keep_accepted_slots): its next new blocks
        follow the kept ones."""
        same = self.generation[pending.rows] == pending.generations
        rows, positions = pending.rows[same], pending.positions[same]
        if num_accepted is not None:
            positions = positions + num_accepted[same]
            self.num_tokens[rows] = positions + 1
            self.num_computed_tokens[rows] = positions
            had_drafts = rows[self.num_drafts[rows] > 0]
            self.num_blocks[had_drafts] = -(-self.num_computed_tokens[had_drafts] // self.block_size)
            self.num_rows_with_drafts -= len(had_drafts)
            self.num_drafts[rows] = 0
        self.token_ids[rows, positions] = sampled_token_ids[same]
        if self.grammars is None:
            return []
        return [worker_pb2.FailedRequest(request_id=self.request_id_of(row), reason=reason)
                for row, reason in self.grammars.advance(rows, sampled_token_ids[same])]


def _draft_entries(rows: np.ndarray, last_indices: np.ndarray,
                   num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sampling entries of rows that sample (`last_indices`: each one's last scheduled token in the token
    axis; `num_drafts`: its drafts, the last tokens of its chunk): rows, offsets and token indices of 1 + d
    entries per row, at the row's last known token and each draft."""
    counts = 1 + num_drafts
    entry = np.repeat(np.arange(len(rows)), counts)
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - (np.cumsum(counts) - counts)[entry]
    return rows[entry], offsets, last_indices[entry] - num_drafts[entry] + offsets
