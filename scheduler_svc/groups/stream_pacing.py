"""Pacing of stream messages under load: how often each stream's buffered deltas are handed to its gRPC
handler.

Why: the scheduler's one event loop runs both the engine and every stream's gRPC handler: a delta queued
for a stream wakes its handler, which runs as soon as the engine waits (for a step's result). Each message costs tens of
microseconds of Python and gRPC, so with hundreds of streams getting a token every step the handlers take
longer than a GPU step and the engine (and the GPU behind it) waits. `PacedQueue` therefore holds a
stream's ordinary deltas until the engine flushes it; the engine flushes every stream every step while at
most `max_messages_per_step` streams run (no stream waits for pacing), and beyond that each
stream every k-th step, staggered, where k = ceil(streams / max_messages_per_step). A stream's first delta,
its last one, an error and the end of the stream are never held. The handler then sends what it finds as one
message per sequence run (delta_coalescing.py): under load streams get a few tokens per message, as with
vLLM's stream interval.
"""

from __future__ import annotations

import asyncio
import math

from scheduler_svc.text.output_stream import OutputDelta


class PacedQueue(asyncio.Queue):
    """A stream's queue whose ordinary deltas wait in a buffer until `flush` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._held: list = []
        self._num_put = 0

    def put_nowait(self, item) -> None:
        ordinary = isinstance(item, OutputDelta) and item.finish_reason is None and self._num_put > 0
        self._num_put += 1
        if ordinary:
            self._held.append(item)
            return
        self.flush()
        super().put_nowait(item)

    def flush(self) -> None:
        held, self._held = self._held, []
        for item in held:
            super().put_nowait(item)


def streams_to_flush(num_streams: int, step: int, max_messages_per_step: int) -> tuple[int, int]:
    """(k, r): this step flushes the streams whose index i has i % k == r."""
    k = max(1, math.ceil(num_streams / max_messages_per_step))
    return k, step % k
