"""RequestMetrics: when a request was sent, got its first and last token, and ended (vLLM's
`RequestOutput.metrics` names), as seen by the client.

Why measured by the client: these are the latencies a caller experiences (network and queueing included),
and they cost the server nothing. Times are wall-clock seconds since the epoch (`time.time()`), as vLLM's.
The server's own view of the same requests (queue, prefill and decode times) is in its metrics (/metrics).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types.py imports this module
    from client.types import GenerateChunk


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    # None when the request produced no token (refused, aborted at once, or max_tokens reached by the prompt).
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class RequestClock:
    """Stamps a request's events as its stream is read: made when it is sent, `saw(chunk)` for each chunk,
    `metrics()` at the end."""

    def __init__(self) -> None:
        self._arrival = time.time()
        self._first: float | None = None
        self._last: float | None = None

    def saw(self, chunk: GenerateChunk) -> GenerateChunk:
        if chunk.token_ids:
            now = time.time()
            if self._first is None:
                self._first = now
            self._last = now
        return chunk

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(self._arrival, self._first, self._last, time.time())
