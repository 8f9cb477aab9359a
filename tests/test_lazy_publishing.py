"""Streams published only when their queues are flushed (request_group.py: SingleSequence under stream
pacing) give every client the same tokens, text, stop and order as publishing every step; aborts and
disconnects still end streams at once, with nothing computed before an abort lost.

Drives the real engine loop with an instant stand-in worker (pagedserve/testing/instant_worker_link.py) whose
tokens are a pure function of (request, position), so a paced run and an unpaced run can be compared item by
item; subclasses of it fail a request or abort one at a chosen output token.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable

import pytest

from pagedserve.testing.instant_worker_link import InstantWorkerLink
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request import FinishReason
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_limits import SchedulerLimits
from scheduler_svc.core.validated_request import ResumedOutput, ValidatedRequest
from scheduler_svc.engine import Engine, RequestFailedError
from scheduler_svc.groups.request_group import StreamEnd
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from scheduler_svc.worker_io.worker_link import WorkerFailure
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


def sampler(words) -> Callable[[str, int], int]:
    def sample(request_id: str, position: int) -> int:
        return words[zlib.crc32(f"{request_id}@{position}".encode()) % len(words)]

    return sample


def make_engine(tokenizer, words, max_messages_per_step: int, make_link=InstantWorkerLink,
                num_kv_blocks: int = 512) -> tuple[Engine, Scheduler]:
    scheduler = Scheduler(SchedulerLimits(NUM_STREAMS, 256, 128), BlockManager(4, num_kv_blocks, 0),
                          max_steps_in_flight=2)
    link = make_link(sampler(words))
    engine = Engine(scheduler, link, tokenizer, eos_token_ids=(2,), seed=0,
                    max_messages_per_step=max_messages_per_step)
    link.engine = engine  # for the links that abort
    return engine, scheduler


async def read_all(queue) -> list:
    items = []
    while not isinstance(item := await queue.get(), StreamEnd):
        items.append(item)
    return items


def run_streams(tokenizer, words, max_messages_per_step: int, params: SamplingParams, make_link=InstantWorkerLink,
                num_kv_blocks: int = 512, resume: Callable[[int], ResumedOutput | None] = lambda i: None,
                ) -> tuple[list[list], Engine]:
    """Every stream's items (deltas, or an error, up to its StreamEnd) and the engine that ran them."""
    async def main():
        engine, scheduler = make_engine(tokenizer, words, max_messages_per_step, make_link, num_kv_blocks)
        queues = [engine.submit(f"r{i}", ValidatedRequest([words[i], words[i + 1], 5], params, resume(i)))[0]
                  for i in range(NUM_STREAMS)]
        loop = asyncio.create_task(engine.run())
        items = await asyncio.wait_for(asyncio.gather(*(read_all(queue) for queue in queues)), 60)
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop
        assert not scheduler.has_unfinished_requests()
        return items, engine

    return asyncio.run(main())


def joined(items) -> tuple[str, tuple[int, ...], FinishReason, int, tuple[float, ...]]:
    return ("".join(d.text for d in items), sum((d.token_ids for d in items), ()), items[-1].finish_reason,
            items[-1].completion_tokens, sum((d.logprobs for d in items), ()))


def test_paced_streams_get_what_unpaced_streams_get_in_fewer_messages(tokenizer, words):
    params = SamplingParams(max_tokens=30, seed=1)
    unpaced, _ = run_streams(tokenizer, words, max_messages_per_step=NUM_STREAMS, params=params)
    paced, _ = run_streams(tokenizer, words, max_messages_per_step=3, params=params)  # each stream every 4th step
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
    unpaced, _ = run_streams(tokenizer, words, max_messages_per_step=NUM_STREAMS, params=params)
    paced, _ = run_streams(tokenizer, words, max_messages_per_step=3, params=params)
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


class NthOutputLink(InstantWorkerLink):
    """Acts on the result of the step that samples `request_id`'s `num_outputs`-th output token, before the
    engine gets it: `at_output(link, result)`."""

    engine: Engine

    def __init__(self, sample, num_outputs: int, at_output: Callable[[NthOutputLink, object], None],
                 request_id: str = "r0"):
        super().__init__(sample)
        self.request_id = request_id
        self._num_outputs = num_outputs
        self._at_output = at_output
        self._num_sampled = 0

    async def receive_result(self, step_id: int):
        result = await super().receive_result(step_id)
        if self.request_id in result.sampled.request_ids:
            self._num_sampled += 1
            if self._num_sampled == self._num_outputs:
                self._at_output(self, result)
        return result


def fail_request(link: NthOutputLink, result) -> None:
    """The worker reports the request failed (StepResult.failed_requests, as a grammar failure)."""
    result.failed_requests.add(request_id=link.request_id, reason="the grammar refused the token")


def abort_request(link: NthOutputLink, result) -> None:
    """The client aborts the request (notify) as the result comes back: the engine applies the result, then
    takes the abort before publishing it."""
    link.engine.abort(link.request_id, notify=True)


def paced_as_unpaced(tokenizer, words, params: SamplingParams, make_link=InstantWorkerLink,
                     **options) -> tuple[list[list], Engine, Engine]:
    """Runs the streams unpaced and paced (each stream flushed every 4th step), checks that every client got
    the same, and returns the paced streams' items, then the paced and the unpaced engine."""
    unpaced, unpaced_engine = run_streams(tokenizer, words, NUM_STREAMS, params, make_link, **options)
    paced, paced_engine = run_streams(tokenizer, words, 3, params, make_link, **options)
    assert [summary(items) for items in paced] == [summary(items) for items in unpaced]
    return paced, paced_engine, unpaced_engine


def summary(items) -> tuple:
    """What a client gets from one stream: text, token ids, logprobs, and how it ended (a finish reason, or
    the error's type and message)."""
    deltas, last = items[:-1] if isinstance(items[-1], Exception) else items, items[-1]
    ending = (type(last), str(last)) if isinstance(last, Exception) else last.finish_reason
    return ("".join(d.text for d in deltas), sum((d.token_ids for d in deltas), ()),
            sum((d.logprobs for d in deltas), ()), ending)


@pytest.mark.parametrize("num_outputs", [13, 14, 15, 16])
def test_a_failed_request_streams_every_token_before_its_failure_as_unpaced(tokenizer, words, num_outputs):
    """What pacing held back is streamed before the error, and the failing step's token is not."""
    params = SamplingParams(max_tokens=30, seed=1)

    paced, _, _ = paced_as_unpaced(tokenizer, words, params, lambda sample: NthOutputLink(sample, num_outputs,
                                                                                         fail_request))
    text, token_ids, logprobs, ending = summary(paced[0])
    assert ending[0] is RequestFailedError
    assert len(token_ids) == len(logprobs) == num_outputs - 1 and text == tokenizer.decode(list(token_ids))
    assert all(summary(items)[3] is FinishReason.LENGTH for items in paced[1:])


@pytest.mark.parametrize("num_outputs", [13, 14, 15, 16])
def test_an_abort_after_a_step_was_applied_streams_its_tokens_with_their_logprobs(tokenizer, words, num_outputs):
    params = SamplingParams(max_tokens=30, seed=1, logprobs=0)

    paced, _, _ = paced_as_unpaced(tokenizer, words, params, lambda sample: NthOutputLink(sample, num_outputs,
                                                                                         abort_request))
    _, token_ids, logprobs, ending = summary(paced[0])
    assert ending is FinishReason.ABORT and len(token_ids) == len(logprobs) == num_outputs


@pytest.mark.parametrize("stream", range(8))
def test_an_abort_that_finds_a_held_back_stop_string_counts_as_a_stop(tokenizer, words, stream):
    """The stream's stop string completes at its output `stop_at` and the abort comes right after that step:
    a paced stream not flushed in it finds the stop string only when the abort publishes what it held back.
    The request stopped, in its stream and in the metrics, as unpaced. (Streams 0-7: each is flushed in a
    different one of four staggered steps, so some are not flushed when their abort comes.)"""
    request_id, sample = f"r{stream}", sampler(words)
    outputs = [tokenizer.decode([sample(request_id, 3 + i) for i in range(end)]) for end in range(31)]
    stop_at, stop = next((end, word) for end in range(8, 30)
                         if (word := outputs[end][len(outputs[end - 1]):].strip()) not in outputs[end - 1])
    params = SamplingParams(max_tokens=40, seed=1, stop=(stop,))

    paced, paced_engine, unpaced_engine = paced_as_unpaced(
        tokenizer, words, params, lambda sample: NthOutputLink(sample, stop_at, abort_request, request_id))
    assert summary(paced[stream])[3] is FinishReason.STOP and len(summary(paced[stream])[1]) == stop_at
    assert paced_engine.serving_metrics().num_finished == unpaced_engine.serving_metrics().num_finished


def test_resumed_and_preempted_streams_get_what_unpaced_streams_get(tokenizer, words):
    """Streams resumed after a scheduler loss (starting with output they received) on a KV pool small enough
    to preempt and recompute them: pacing changes nothing they get."""
    params = SamplingParams(max_tokens=40, seed=1, logprobs=0)
    received = {i: tuple(words[(i + j) % len(words)] for j in range(i % 4 + 1)) for i in range(0, NUM_STREAMS, 2)}

    def resume(i: int) -> ResumedOutput | None:
        if i not in received:
            return None
        text = tokenizer.decode(list(received[i]))
        return ResumedOutput(received[i], num_sent_chars=len(text) - 1, cumulative_logprob=-float(i))

    paced, paced_engine, unpaced_engine = paced_as_unpaced(tokenizer, words, params, num_kv_blocks=60,
                                                           resume=resume)
    assert paced_engine.stats().num_preemptions > 0 and unpaced_engine.stats().num_preemptions > 0
    for i, items in enumerate(paced):
        text, token_ids, logprobs, ending = summary(items)
        before = received.get(i, ())
        assert ending is FinishReason.LENGTH and len(token_ids) == len(logprobs) == 40 - len(before)
        whole = tokenizer.decode([*before, *token_ids])
        assert text == (whole[len(tokenizer.decode(list(before))) - 1:] if before else whole)


class CrashingWorkerLink(InstantWorkerLink):
    """A worker that dies (WorkerFailure) in every step that would sample r0's `num_outputs`-th output
    token: a poison request, which the engine fails after repeated losses (worker_loss_suspects.py)."""

    def __init__(self, sample, num_outputs: int):
        self._poison_position = 3 + num_outputs - 1  # r0's prompt is 3 tokens

        def sample_or_crash(request_id: str, position: int) -> int:
            if request_id == "r0" and position == self._poison_position:
                self._poisoned = True
            return sample(request_id, position)

        super().__init__(sample_or_crash)
        self._poisoned = False
        self._crashing_steps: set[int] = set()

    async def send_plan(self, message) -> None:
        await super().send_plan(message)
        if self._poisoned:
            self._poisoned = False
            self._crashing_steps.add(message.plan.step_id)

    async def receive_result(self, step_id: int):
        if step_id in self._crashing_steps:
            self._crashing_steps.clear()  # a plan sent to the dead worker is never answered
            raise WorkerFailure("the worker died")
        return await super().receive_result(step_id)


def crashing_streams(tokenizer, words, max_messages_per_step: int, params: SamplingParams, num_outputs: int,
                     read) -> tuple[Engine, Scheduler, asyncio.Future]:
    """An engine over a worker that crashes at r0's `num_outputs`-th token (CrashingWorkerLink), NUM_STREAMS streams
    submitted to it, and their readers (`read` per queue) gathered; call inside the event loop."""
    engine, scheduler = make_engine(tokenizer, words, max_messages_per_step,
                                    lambda sample: CrashingWorkerLink(sample, num_outputs))
    queues = [engine.submit(f"r{i}", ValidatedRequest([words[i], words[i + 1], 5], params))[0]
              for i in range(NUM_STREAMS)]
    return engine, scheduler, asyncio.gather(*(read(queue) for queue in queues))


def run_through_worker_losses(tokenizer, words, max_messages_per_step: int, params: SamplingParams,
                              num_outputs: int) -> list[list]:
    """Runs streams on a worker that crashes at r0's `num_outputs`-th token, recovering (as the service does:
    new workers, requests recomputed) until the engine gives r0 up."""
    async def main():
        engine, scheduler, readers = crashing_streams(tokenizer, words, max_messages_per_step, params, num_outputs,
                                                      read_all)
        for _ in range(10):
            with pytest.raises(WorkerFailure):
                await asyncio.wait_for(engine.run(), 60)
            if engine.recover_from_worker_loss(BlockManager(4, 512, 0), WorkerFailure("the worker died"), 1):
                break
        loop = asyncio.create_task(engine.run())
        items = await asyncio.wait_for(readers, 60)
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop
        assert not scheduler.has_unfinished_requests()
        return items

    return asyncio.run(main())


@pytest.mark.parametrize("num_outputs", [13, 14, 15, 16])
def test_a_request_failed_after_worker_losses_streams_every_token_before_its_failure_as_unpaced(
        tokenizer, words, num_outputs):
    params = SamplingParams(max_tokens=30, seed=1)
    unpaced = run_through_worker_losses(tokenizer, words, NUM_STREAMS, params, num_outputs)
    paced = run_through_worker_losses(tokenizer, words, 3, params, num_outputs)
    assert [summary(items) for items in paced] == [summary(items) for items in unpaced]
    _, token_ids, logprobs, ending = summary(paced[0])
    assert ending[0] is RequestFailedError and len(token_ids) == len(logprobs) == num_outputs - 1


async def read_until_failure(queue) -> list:
    """A stream's items up to the failure that ends it (kept, last), as the service reads them."""
    items = []
    while not isinstance(item := await queue.get(), BaseException):
        items.append(item)
    return [*items, item]


def run_until_the_engine_stops(tokenizer, words, max_messages_per_step: int, params: SamplingParams,
                               num_outputs: int) -> list[list]:
    """Runs streams on a worker that dies at r0's `num_outputs`-th token; the engine then stops for good
    (`fail_all`, as the service does when no restart is left)."""
    async def main():
        engine, _, readers = crashing_streams(tokenizer, words, max_messages_per_step, params, num_outputs,
                                              read_until_failure)
        with pytest.raises(WorkerFailure):
            await asyncio.wait_for(engine.run(), 60)
        engine.fail_all(WorkerFailure("the worker is gone for good"))
        return await asyncio.wait_for(readers, 60)

    return asyncio.run(main())


@pytest.mark.parametrize("num_outputs", [13, 16])
def test_an_engine_that_stops_streams_every_token_before_its_failure_as_unpaced(tokenizer, words, num_outputs):
    params = SamplingParams(max_tokens=30, seed=1)
    unpaced = run_until_the_engine_stops(tokenizer, words, NUM_STREAMS, params, num_outputs)
    paced = run_until_the_engine_stops(tokenizer, words, 3, params, num_outputs)
    assert [summary(items) for items in paced] == [summary(items) for items in unpaced]
    _, token_ids, _, ending = summary(paced[0])
    assert ending[0] is WorkerFailure and len(token_ids) == num_outputs - 1
