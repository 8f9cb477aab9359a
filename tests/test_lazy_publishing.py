"""Streams published only when their queues are flushed (request_group.py: SingleSequence under stream
pacing) give every client the same tokens, text, stop and order as publishing every step; aborts and
disconnects still end streams at once, with nothing computed before an abort lost.

Drives the real engine loop with an instant stand-in worker (pagedserve/testing/instant_worker_link.py) whose
tokens are a pure function of (request, position), so a paced run and an unpaced run can be compared item by
item.
"""

from __future__ import annotations

import asyncio
import zlib

import pytest

from pagedserve.testing.instant_worker_link import InstantWorkerLink
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request import FinishReason
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_limits import SchedulerLimits
from scheduler_svc.core.validated_request import ValidatedRequest
from scheduler_svc.engine import Engine
from scheduler_svc.groups.request_group import StreamEnd
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model

NUM_STREAMS = 12


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None).path)


@pytest.fixture(scope="module")
def words(tokenizer):
    """Forty ids of ordinary words: their text joins into plain text a stop string can be found in."""
    pool = [i for i in range(300, 20000) if (text := tokenizer.decode([i])).startswith(" ") and text[1:].isalpha()]
    return pool[:40]


def make_engine(tokenizer, words, max_messages_per_step: int) -> tuple[Engine, Scheduler]:
    scheduler = Scheduler(SchedulerLimits(NUM_STREAMS, 256, 128), BlockManager(4, 512, 0), max_steps_in_flight=2)

    def sample(request_id: str, position: int) -> int:
        return words[zlib.crc32(f"{request_id}@{position}".encode()) % len(words)]

    engine = Engine(scheduler, InstantWorkerLink(sample), tokenizer, eos_token_ids=(2,), seed=0,
                    max_messages_per_step=max_messages_per_step)
    return engine, scheduler


async def read_all(queue) -> list:
    items = []
    while not isinstance(item := await queue.get(), StreamEnd):
        items.append(item)
    return items


def run_streams(tokenizer, words, max_messages_per_step: int, params: SamplingParams) -> list[list]:
    async def main():
        engine, scheduler = make_engine(tokenizer, words, max_messages_per_step)
        queues = [engine.submit(f"r{i}", ValidatedRequest([words[i], words[i + 1], 5], params))[0]
                  for i in range(NUM_STREAMS)]
        loop = asyncio.create_task(engine.run())
        items = await asyncio.wait_for(asyncio.gather(*(read_all(queue) for queue in queues)), 60)
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop
        assert not scheduler.has_unfinished_requests()
        return items

    return asyncio.run(main())


def joined(items) -> tuple[str, tuple[int, ...], FinishReason, int, tuple[float, ...]]:
    return ("".join(d.text for d in items), sum((d.token_ids for d in items), ()), items[-1].finish_reason,
            items[-1].completion_tokens, sum((d.logprobs for d in items), ()))


def test_paced_streams_get_what_unpaced_streams_get_in_fewer_messages(tokenizer, words):
    params = SamplingParams(max_tokens=30, seed=1)
    unpaced = run_streams(tokenizer, words, max_messages_per_step=NUM_STREAMS, params=params)
    paced = run_streams(tokenizer, words, max_messages_per_step=3, params=params)  # each stream every 4th step
    assert [joined(items) for items in paced] == [joined(items) for items in unpaced]
    for items in paced:
        text, token_ids, reason, completion_tokens, logprobs = joined(items)
        assert text == tokenizer.decode(list(token_ids)) and reason is FinishReason.LENGTH
        assert completion_tokens == len(token_ids) == len(logprobs) == 30
        assert len(items[0].token_ids) == 1  # the first token is never held back
    assert sum(map(len, paced)) < sum(map(len, unpaced)) // 2


def test_a_stop_string_found_late_ends_the_stream_at_the_same_token(tokenizer, words):
    stop = tokenizer.decode([words[7]]).strip()
    params = SamplingParams(max_tokens=60, seed=1, stop=(stop,))
    unpaced = run_streams(tokenizer, words, max_messages_per_step=NUM_STREAMS, params=params)
    paced = run_streams(tokenizer, words, max_messages_per_step=3, params=params)
    assert [joined(items) for items in paced] == [joined(items) for items in unpaced]
    reasons = [joined(items)[2] for items in paced]
    assert FinishReason.STOP in reasons  # the comparison covers streams that stopped on the string...
    for items in paced:
        text, token_ids, reason, completion_tokens, _ = joined(items)
        assert stop not in text and completion_tokens == len(token_ids)
        if reason is FinishReason.STOP:  # ...which ends at the token completing it, later tokens dropped
            assert tokenizer.decode(list(token_ids)).rstrip().endswith(stop)


def test_an_abort_streams_every_token_computed_before_it_then_ends(tokenizer, words):
    async def main():
        engine, scheduler = make_engine(tokenizer, words, max_messages_per_step=1)
        params = SamplingParams(max_tokens=100, seed=1)
        queues = [engine.submit(f"r{i}", ValidatedRequest([words[i], 5], params))[0] for i in range(NUM_STREAMS)]
        loop = asyncio.create_task(engine.run())
        while scheduler.get_request("r0") is None or scheduler.get_request("r0").num_output_tokens < 20:
            await asyncio.sleep(0)
        request = scheduler.get_request("r0")
        engine.abort("r0", notify=True)
        engine.abort("r1", notify=False)  # its client went away
        items = await asyncio.wait_for(read_all(queues[0]), 10)
        num_computed = request.num_output_tokens
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop
        return items, num_computed, scheduler, engine

    items, num_computed, scheduler, engine = asyncio.run(main())
    assert items[-1].finish_reason is FinishReason.ABORT
    assert len(sum((d.token_ids for d in items), ())) == num_computed >= 20
    assert scheduler.get_request("r0") is None and scheduler.get_request("r1") is None
    assert not engine.is_in_flight("r0") and not engine.is_in_flight("r1")
