"""An abort while the steps that schedule a request are already planned (async scheduling, issue 22 item 4):
the scheduler offers the worker to drop that request's rows from those steps, evicting the prefix-cache keys
of the blocks they would have written, and takes a result without the dropped rows' tokens; it does not
offer it while another request reads those blocks. Pure Python, on the checking fake worker."""

from __future__ import annotations

import dataclasses

from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import SchedulerOutput
from tests.test_scheduler import EOS, make_scheduler, prompt_token

PROMPT = [prompt_token("long", i) for i in range(40)]


def _request(request_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, seed=7), (EOS,))


def _without(output: SchedulerOutput, request_ids: set[str]) -> SchedulerOutput:
    """The plan as a worker runs it after dropping these requests' rows (worker_svc/cancelled_requests.py)."""
    new = tuple(data for data in output.new_requests if data.request_id not in request_ids)
    scheduled = tuple(data for data in output.scheduled_requests if data.request_id not in request_ids)
    total = sum(data.num_scheduled_tokens for data in (*new, *scheduled))
    return dataclasses.replace(output, new_requests=new, scheduled_requests=scheduled, total_num_scheduled_tokens=total)


def test_aborted_prompt_chunks_in_flight_are_offered_to_the_worker_and_their_cache_keys_evicted():
    scheduler, worker = make_scheduler(max_num_batched_tokens=8, max_steps_in_flight=3)
    scheduler.add_request(_request("long", PROMPT))
    planned = [scheduler.schedule() for _ in range(3)]  # chunks [0, 8), [8, 16), [16, 24)
    assert [dict(output.num_scheduled_tokens()) for output in planned] == [{"long": 8}] * 3
    scheduler.update_from_output(planned[0], worker.execute(planned[0]))  # the first chunk is done

    assert scheduler.abort_request("long")
    assert scheduler.take_worker_cancels() == ["long"] and scheduler.take_worker_cancels() == []
    for output in planned[1:]:
        assert scheduler.update_from_output(output, worker.execute(_without(output, {"long"}))) == []
    assert scheduler.block_manager.num_free_gpu_blocks == 64

    # The same prompt again: only the chunk that ran (2 blocks of 4) is a cache hit; the fake worker checks
    # every token it reads, so a hit on a block the dropped chunks never wrote would fail here.
    scheduler.add_request(_request("again", PROMPT, max_tokens=2))
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update_from_output(output, worker.execute(output))
    assert scheduler.prefix_cache_hit_tokens == 8


def test_a_final_chunk_dropped_by_the_worker_owes_no_token():
    """The last chunk samples: the worker that dropped it sends no token, and the result is still accepted."""
    scheduler, worker = make_scheduler(max_num_batched_tokens=8, max_steps_in_flight=2)
    scheduler.add_request(_request("short", PROMPT[:16]))
    first, last = scheduler.schedule(), scheduler.schedule()
    assert last.completing_request_ids == ("short",)
    first_tokens = worker.execute(first)
    scheduler.abort_request("short")
    assert scheduler.take_worker_cancels() == ["short"]
    assert worker.execute(_without(last, {"short"})) == {}
    scheduler.update_from_output(first, first_tokens)
    assert scheduler.update_from_output(last, {}) == []


def test_no_offer_while_another_request_reads_the_blocks_the_chunks_write():
    """A request admitted behind the chunks hits their blocks in the prefix cache before they are written:
    dropping them would leave it reading K/V nobody wrote, so the worker runs them (and the reader is right)."""
    scheduler, worker = make_scheduler(max_num_batched_tokens=12, max_steps_in_flight=3)
    scheduler.add_request(_request("writer", PROMPT[:16]))
    planned = [scheduler.schedule(), scheduler.schedule()]  # [0, 12), [12, 16): blocks 0-3 registered
    scheduler.add_request(_request("reader", PROMPT[:16] + [prompt_token("reader", 0)] * 4))
    planned.append(scheduler.schedule())
    assert planned[2].new_requests[0].num_computed_tokens == 16  # the reader hit all 4 of the writer's blocks
    sampled = [worker.execute(planned[0])]

    scheduler.abort_request("writer")
    assert scheduler.take_worker_cancels() == []
    sampled += [worker.execute(output) for output in planned[1:]]  # the worker keeps the writer's rows
    for output, tokens in zip(planned, sampled):
        scheduler.update_from_output(output, tokens)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update_from_output(output, worker.execute(output))
    assert scheduler.block_manager.num_free_gpu_blocks == 64


def test_no_offer_for_an_abort_with_nothing_in_flight():
    scheduler, worker = make_scheduler(max_num_batched_tokens=8, max_steps_in_flight=3)
    scheduler.add_request(_request("idle", PROMPT[:8]))
    output = scheduler.schedule()
    scheduler.update_from_output(output, worker.execute(output))
    scheduler.abort_request("idle")
    assert scheduler.take_worker_cancels() == []
