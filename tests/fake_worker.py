"""A fake worker for scheduler tests: applies each `SchedulerOutput` the way worker_svc applies a StepPlan and
checks it, with no model.

It keeps what a real worker keeps: one row per request (known tokens, block table, computed count) and the
contents of every KV block, where a "K/V" is simply the token id written at that slot. Before computing a
request's tokens it checks that every slot of its computed prefix still holds the right token, so a block
table that points at the wrong block, a block reused while still held, or a swap that copied the wrong
blocks shows up as a wrong token. Sampling is a pure function of (seed, position), so a request's output
does not depend on batching or preemption and `expected_output` can predict it.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.request import Request
from scheduler_svc.scheduler import SchedulerOutput

VOCAB_SIZE = 50
_MASK = (1 << 64) - 1


def token_at(seed: int, position: int) -> int:
    """The token the fake model samples at `position` for a request seeded with `seed` (splitmix64)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) % VOCAB_SIZE


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


class FakeWorker:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.block_size = block_size
        self.gpu_blocks: list[list[int | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu_blocks: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.rows: dict[str, _Row] = {}

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """Apply one step in the worker's order and return request id -> sampled token."""
        for request_id in plan.finished_request_ids:
            self.rows.pop(request_id, None)
        for request_id in plan.preempted_request_ids:
            assert self.rows.pop(request_id, None) is not None, f"preempted {request_id} had no row"
        assert not (plan.swap_out and plan.swap_in), "swap out and swap in in one step"
        for gpu, cpu in plan.swap_out:
            self.cpu_blocks[cpu] = list(self.gpu_blocks[gpu])
        for cpu, gpu in plan.swap_in:
            self.gpu_blocks[gpu] = list(self.cpu_blocks[cpu])
        for new in plan.new_requests:
            assert new.request_id not in self.rows, f"new request {new.request_id} already has a row"
            self.rows[new.request_id] = _Row(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens, new.sampling_params.seed
            )
        for scheduled in plan.scheduled_requests:
            self.rows[scheduled.request_id].block_ids.extend(scheduled.new_block_ids)
        self._check_blocks_not_shared()

        num_scheduled = plan.num_scheduled_tokens()
        assert plan.total_num_scheduled_tokens == sum(num_scheduled.values())
        sampled = {}
        for request_id, num_tokens in num_scheduled.items():
            row = self.rows[request_id]
            token = self._forward(row, num_tokens)
            if token is not None:
                sampled[request_id] = token
        return sampled

    def _forward(self, row: _Row, num_tokens: int) -> int | None:
        start, end = row.num_computed_tokens, row.num_computed_tokens + num_tokens
        assert num_tokens >= 1 and end <= len(row.token_ids), (start, num_tokens, len(row.token_ids))
        assert len(row.block_ids) * self.block_size >= end, "block table too short"
        size = self.block_size
        for index in range(-(-start // size)):  # attention reads the computed prefix
            count = min(size, start - index * size)
            stored = self.gpu_blocks[row.block_ids[index]][:count]
            assert stored == row.token_ids[index * size : index * size + count], "KV cache corrupted"
        for position in range(start, end):  # cache write of the new tokens
            self.gpu_blocks[row.block_ids[position // size]][position % size] = row.token_ids[position]
        row.num_computed_tokens = end
        if end < len(row.token_ids):
            return None
        token = token_at(row.seed, end)
        row.token_ids.append(token)
        return token

    def _check_blocks_not_shared(self) -> None:
        held = [block for row in self.rows.values() for block in row.block_ids]
        assert len(held) == len(set(held)), "two rows hold one block"
