"""Merging the output deltas a stream has queued up into as few gRPC messages as possible.

Why: every gRPC message costs the scheduler's event loop tens of microseconds, and that loop also runs the
engine. With hundreds of streams each getting a token per step, writing one message per token per stream
would take longer than a GPU step, and the engine would wait behind the writes. A stream that finds several
deltas waiting (its handler ran after the engine had applied more than one step: the engine applies results
back to back when they are already there) sends them as one message instead; under heavy load streams get a
few tokens per message, as vLLM's do.
"""

from __future__ import annotations

import asyncio
import dataclasses

from scheduler_svc.text.output_stream import OutputDelta


def take_ready(queue: asyncio.Queue, first) -> list:
    """`first` (just taken from `queue`) and every item already waiting behind it, in order."""
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def coalesce(items: list) -> list:
    """Items in order, with each run of deltas of the same sequence merged into one (a delta that ends its
    sequence is never merged with a later one)."""
    out: list = []
    for item in items:
        previous = out[-1] if out else None
        if (isinstance(item, OutputDelta) and isinstance(previous, OutputDelta) and previous.index == item.index
                and previous.finish_reason is None):
            out[-1] = merge(previous, item)
        else:
            out.append(item)
    return out


def merge(earlier: OutputDelta, later: OutputDelta) -> OutputDelta:
    """One delta with both deltas' text, tokens and logprobs; the later one's end, counts and score."""
    return dataclasses.replace(
        later,
        text=earlier.text + later.text,
        token_ids=earlier.token_ids + later.token_ids,
        logprobs=earlier.logprobs + later.logprobs,
        token_logprobs=earlier.token_logprobs + later.token_logprobs,
        prompt_logprobs=earlier.prompt_logprobs + later.prompt_logprobs,
    )
