"""A fake worker for scheduler tests: applies each `SchedulerOutput` the way worker_svc applies a StepPlan and
checks it, with no model.

It keeps what a real worker keeps: one row per request (known tokens, block table, computed count) and the
contents of every KV block, where a "K/V" is simply the token id written at that slot. It runs a step as a
forward pass does (every scheduled token written before anything is read), then checks that every slot each
scheduled row reads still holds the right token, so a block table that points at the wrong block, a block
reused while still held, a stale prefix-cache hit, or a swap or copy that moved the wrong blocks shows up as a
wrong token. Blocks may be shared between rows (prefix-cache hits, forks), but a row may write into a block
another row holds only the very token that row expects there (a block filled by one request and hit by another
in the same step); anything else means copy-on-write was skipped. Sampling is
a pure function of (seed, position), so a request's output does not depend on batching or preemption and
`expected_output` can predict it; a beam row (num_beam_candidates > 0) samples nothing and returns that many
distinct candidates, also a pure function of (seed, position). A row with draft tokens is verified as the
real worker does it: sampled at each draft position, drafts kept while they equal the samples
(`accepted_drafts`), its row cut back to the kept ones and the token sampled after them, its block table to the
blocks of its computed tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import SchedulerOutput

VOCAB_SIZE = 50
_MASK = (1 << 64) - 1


def token_at(seed: int, position: int) -> int:
    """The token the fake model samples at `position` for a request seeded with `seed` (splitmix64)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) % VOCAB_SIZE


def beam_candidates_at(seed: int, position: int, num_candidates: int) -> list[int]:
    """The distinct candidates the fake model returns for a beam row at `position`, best first."""
    candidates: list[int] = []
    salt = 0
    while len(candidates) < num_candidates:
        token = token_at(seed + salt, position)
        salt += 1
        if token not in candidates:
            candidates.append(token)
    return candidates


def expected_output(request: Request, max_model_len: int) -> list[int]:
    """What the request generates when nothing but a token-level stop ends it."""
    params = request.sampling_params
    output: list[int] = []
    while True:
        token = token_at(params.seed, request.num_prompt_tokens + len(output))
        output.append(token)
        if token in params.stop_token_ids or (not params.ignore_eos and token in request.eos_token_ids):
            return output
        if len(output) >= params.max_tokens or request.num_prompt_tokens + len(output) >= max_model_len:
            return output


@dataclass
class _Row:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    seed: int
    num_beam_candidates: int


class FakeWorker:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 model: Callable[[int, list[int]], int] | None = None) -> None:
        """`model(seed, tokens before the position)`: the token sampled there (default: `token_at`, which
        ignores the tokens; a model that repeats its context makes n-gram drafts come true)."""
        self.block_size = block_size
        self.model = model
        # Speculative decoding: request id -> drafts accepted in the last step (rows that had drafts).
        self.accepted_drafts: dict[str, int] = {}
        self.gpu_blocks: list[list[int | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu_blocks: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.rows: dict[str, _Row] = {}
        # Beam rows of the last step: request id -> candidates, best first (the real worker's beam_candidates).
        self.beam_candidates: dict[str, list[int]] = {}

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """Apply one step in the worker's order and return request id -> sampled token (beam rows' candidates
        go to `beam_candidates`)."""
        for request_id in plan.finished_request_ids:
            self.rows.pop(request_id, None)
        for request_id in plan.preempted_request_ids:
            assert self.rows.pop(request_id, None) is not None, f"preempted {request_id} had no row"
        assert not (plan.swap_out and plan.swap_in), "swap out and swap in in one step"
        for gpu, cpu in plan.swap_out:
            self.cpu_blocks[cpu] = list(self.gpu_blocks[gpu])
        for cpu, gpu in plan.swap_in:
            self.gpu_blocks[gpu] = list(self.cpu_blocks[cpu])
        for src, dst in plan.copy:
            self.gpu_blocks[dst] = list(self.gpu_blocks[src])
        for new in plan.new_requests:
            assert new.request_id not in self.rows, f"new request {new.request_id} already has a row"
            self.rows[new.request_id] = _Row(
                list(new.token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params.seed,
                new.num_beam_candidates,
            )
        for scheduled in plan.scheduled_requests:
            row = self.rows[scheduled.request_id]
            for index, block_id in scheduled.replaced_blocks:
                row.block_ids[index] = block_id
            row.block_ids.extend(scheduled.new_block_ids)
            row.token_ids.extend(scheduled.new_token_ids)
            assert not scheduled.new_token_ids or row.num_beam_candidates, "tokens sent to a sampling row"
            if scheduled.draft_token_ids:
                assert scheduled.num_scheduled_tokens == 1 + len(scheduled.draft_token_ids)
                assert row.num_computed_tokens == len(row.token_ids) - 1, "drafts on a row that is not a decode"
                row.token_ids.extend(scheduled.draft_token_ids)  # computed with the last known token
        drafts = {s.request_id: s.draft_token_ids for s in plan.scheduled_requests if s.draft_token_ids}

        num_scheduled = plan.num_scheduled_tokens()
        assert plan.total_num_scheduled_tokens == sum(num_scheduled.values())
        # One forward: in each layer every scheduled token's K/V is written before any attention reads, so a
        # request may read a block another request fills in the same step (a same-step prefix-cache hit).
        holders: dict[int, list[tuple[_Row, int]]] = {}
        for row in self.rows.values():
            for index, block_id in enumerate(row.block_ids):
                holders.setdefault(block_id, []).append((row, index))
        for request_id, num_tokens in num_scheduled.items():
            self._write(self.rows[request_id], num_tokens, holders)
        sampled = {}
        self.beam_candidates = {}
        self.accepted_drafts = {}
        for request_id, num_tokens in num_scheduled.items():
            row = self.rows[request_id]
            end = row.num_computed_tokens + num_tokens
            self._check_kv(row, end)  # attention reads every token up to the last scheduled one
            row.num_computed_tokens = end
            if request_id in drafts:  # sample at each position; keep drafts while they equal the samples
                num_drafts = len(drafts[request_id])
                first = end - num_drafts  # the first draft's position
                num_accepted = 0
                while num_accepted < num_drafts and (
                    self._sample(row, first + num_accepted) == row.token_ids[first + num_accepted]
                ):
                    num_accepted += 1
                token = self._sample(row, first + num_accepted)
                del row.token_ids[first + num_accepted :]
                row.token_ids.append(token)
                row.num_computed_tokens = first + num_accepted
                # The scheduler frees the blocks held only for rejected drafts: the table covers the computed
                # tokens again, and the next plan's new blocks are appended after them (as the worker does).
                del row.block_ids[-(-row.num_computed_tokens // self.block_size) :]
                sampled[request_id] = token
                self.accepted_drafts[request_id] = num_accepted
                continue
            if end < len(row.token_ids):
                continue
            if row.num_beam_candidates:
                self.beam_candidates[request_id] = beam_candidates_at(row.seed, end, row.num_beam_candidates)
            else:
                token = self._sample(row, end)
                row.token_ids.append(token)
                sampled[request_id] = token
        return sampled

    def _sample(self, row: _Row, position: int) -> int:
        if self.model is None:
            return token_at(row.seed, position)
        return self.model(row.seed, row.token_ids[:position])

    def _write(self, row: _Row, num_tokens: int, holders: dict[int, list[tuple[_Row, int]]]) -> None:
        """Cache write of the row's scheduled tokens. A block another row holds may be written only with the
        very token that row expects there (a same-step hit); anything else means copy-on-write was skipped."""
        start, end = row.num_computed_tokens, row.num_computed_tokens + num_tokens
        assert num_tokens >= 1 and end <= len(row.token_ids), (start, num_tokens, len(row.token_ids))
        assert len(row.block_ids) * self.block_size >= end, "block table too short"
        size = self.block_size
        for position in range(start, end):
            block_id, slot, token = row.block_ids[position // size], position % size, row.token_ids[position]
            for other, index in holders[block_id]:
                if other is not row:
                    other_position = index * size + slot
                    expected = other.token_ids[other_position] if other_position < len(other.token_ids) else None
                    assert expected == token, f"write into block {block_id}, shared with another row"
            self.gpu_blocks[block_id][slot] = token

    def _check_kv(self, row: _Row, end: int) -> None:
        size = self.block_size
        for index in range(-(-end // size)):
            count = min(size, end - index * size)
            stored = self.gpu_blocks[row.block_ids[index]][:count]
            assert stored == row.token_ids[index * size : index * size + count], "KV cache corrupted"
