"""A stream that fell behind sends its waiting deltas as one message per sequence run, losing nothing."""

from __future__ import annotations

import asyncio

from scheduler_svc.api.delta_coalescing import coalesce, take_ready
from scheduler_svc.core.request import FinishReason
from scheduler_svc.groups.request_group import StreamEnd
from scheduler_svc.text.output_stream import OutputDelta


def test_runs_of_one_sequence_merge_and_an_end_is_never_merged_forward():
    items = [
        OutputDelta("Hel", (1,), logprobs=(-0.1,)),
        OutputDelta("lo", (2,), logprobs=(-0.2,)),
        OutputDelta("", (3,), index=1),  # another sequence: a run ends here
        OutputDelta("!", (4,), FinishReason.STOP, prompt_tokens=5, completion_tokens=3, logprobs=(-0.3,),
                    cumulative_logprob=-0.6),
        OutputDelta(" x", (5,)),  # after an end: separate
        StreamEnd(),
    ]
    merged = coalesce(items)
    assert [type(item) for item in merged] == [OutputDelta] * 4 + [StreamEnd]
    first = merged[0]
    assert (first.text, first.token_ids, first.logprobs, first.finish_reason) == ("Hello", (1, 2), (-0.1, -0.2), None)
    assert merged[1].index == 1 and merged[2].finish_reason is FinishReason.STOP
    assert (merged[2].completion_tokens, merged[2].cumulative_logprob) == (3, -0.6)


def test_merged_end_keeps_the_later_deltas_counts():
    (merged,) = coalesce([OutputDelta("a", (1,)), OutputDelta("b", (2,), FinishReason.LENGTH, completion_tokens=2)])
    assert (merged.text, merged.token_ids, merged.finish_reason, merged.completion_tokens) == (
        "ab", (1, 2), FinishReason.LENGTH, 2)


def test_take_ready_drains_what_is_waiting_in_order():
    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(4):
            queue.put_nowait(i)
        return take_ready(queue, await queue.get()), queue.empty()

    assert asyncio.run(scenario()) == ([0, 1, 2, 3], True)


def test_a_long_run_merges_into_one_delta_in_order():
    run = [OutputDelta(f"t{i} ", (i,), logprobs=(-i / 100,)) for i in range(60)]
    merged = coalesce([*run, OutputDelta("end", (60,), FinishReason.LENGTH, completion_tokens=61), StreamEnd()])
    assert [type(item) for item in merged] == [OutputDelta, StreamEnd]
    (whole,) = merged[:1]
    assert whole.text == "".join(f"t{i} " for i in range(60)) + "end"
    assert whole.token_ids == tuple(range(61))
    assert whole.logprobs == tuple(-i / 100 for i in range(60))
    assert (whole.finish_reason, whole.completion_tokens) == (FinishReason.LENGTH, 61)
