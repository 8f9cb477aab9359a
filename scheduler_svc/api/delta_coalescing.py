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
    sequence is never merged with a later one). One pass: a run of k deltas costs one merge of k, not k - 1
    pairwise merges (under load a stream finds dozens waiting, and pairwise merging was quadratic)."""
    out: list = []
    run: list[OutputDelta] = []
    for item in items:
        if run and not (isinstance(item, OutputDelta) and item.index == run[-1].index
                        and run[-1].finish_reason is None):
            out.append(merge(run))
            run = []
        if isinstance(item, OutputDelta):
            run.append(item)
        else:
            out.append(item)
    if run:
        out.append(merge(run))
    return out


def merge(run: list[OutputDelta]) -> OutputDelta:
    """One delta with the run's text, tokens and logprobs in order; the last one's end, counts and score."""
    if len(run) == 1:
        return run[0]
    return dataclasses.replace(
        run[-1],
        text="".join(delta.text for delta in run),
        token_ids=tuple(token for delta in run for token in delta.token_ids),
        logprobs=tuple(value for delta in run for value in delta.logprobs),
        token_logprobs=tuple(entry for delta in run for entry in delta.token_logprobs),
        prompt_logprobs=tuple(entry for delta in run for entry in delta.prompt_logprobs),
    )
