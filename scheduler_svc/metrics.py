"""Serving metrics the scheduler keeps for GetStats: token totals and latency histograms.

Why on the scheduler and not in the gateway: admission and every generated token happen here, so the
latencies mean the same whatever front end a request came through (gRPC SDK, OpenAI gateway, offline LLM)
and include the queueing the front ends cannot see. The gateway only renders them (gateway/metrics.py).

Ownership: the Engine owns one `ServingMetrics` and feeds it from its loop (a request admitted, a step's
sampled tokens, a request's end); GetStats reads a `ServingMetricsSnapshot`. Everything runs on the
scheduler's one asyncio loop, so nothing here locks. Per client request (not per sequence: n sequences or
beams of one request are one observation):
- time to first token: admission -> the first step that sampled a token for any of its sequences
  (observed then, so requests aborted later count too);
- time per output token: the mean gap between its later token steps (first token -> last token, divided
  by token steps - 1); observed when it finishes with at least two token steps;
- end-to-end latency: admission -> finished. Aborted requests are not observed in either of the last two.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from protos.pagedserve.v1 import generate_pb2

# Bucket upper bounds in seconds; vLLM's, so dashboards built for it read these the same way.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class HistogramSnapshot:
    """Counts per bucket (not cumulative); the last count, one past `upper_bounds`, is the +Inf bucket."""

    upper_bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int


class LatencyHistogram:
    """Fixed buckets with Prometheus' `le` rule: a value equal to a bound falls in that bound's bucket."""

    def __init__(self, upper_bounds: tuple[float, ...]) -> None:
        if list(upper_bounds) != sorted(set(upper_bounds)):
            raise ValueError("bucket bounds must be strictly increasing")
        self._upper_bounds = upper_bounds
        self._counts = [0] * (len(upper_bounds) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._upper_bounds, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self._upper_bounds, tuple(self._counts), self._sum, sum(self._counts))


@dataclass(frozen=True)
class ServingMetricsSnapshot:
    num_prompt_tokens: int
    num_generation_tokens: int
    time_to_first_token: HistogramSnapshot
    time_per_output_token: HistogramSnapshot
    e2e_request_latency: HistogramSnapshot


class _HasRequestId(Protocol):
    request_id: str


@dataclass
class _RequestTimes:
    admitted: float
    first_token: float | None = None
    last_token: float | None = None
    num_token_steps: int = 0


class ServingMetrics:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._in_flight: dict[str, _RequestTimes] = {}  # client request id -> its times
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._time_to_first_token = LatencyHistogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        self._time_per_output_token = LatencyHistogram(TIME_PER_OUTPUT_TOKEN_BUCKETS)
        self._e2e_request_latency = LatencyHistogram(E2E_REQUEST_LATENCY_BUCKETS)

    def on_admitted(self, request_id: str, num_prompt_tokens: int) -> None:
        self._in_flight[request_id] = _RequestTimes(admitted=self._clock())
        self._num_prompt_tokens += num_prompt_tokens

    def on_step(self, member_ids: Iterable[str], owners: Mapping[str, _HasRequestId]) -> None:
        """One step's outcome: `member_ids` are the scheduler requests that got a token (sampled, or beam
        candidates); `owners` maps each to the client request (group) it belongs to."""
        now = self._clock()
        groups: set[str] = set()
        for member_id in member_ids:
            self._num_generation_tokens += 1
            owner = owners.get(member_id)
            if owner is not None:
                groups.add(owner.request_id)
        for request_id in groups:
            times = self._in_flight.get(request_id)
            if times is None:
                continue
            if times.first_token is None:
                times.first_token = now
                self._time_to_first_token.observe(now - times.admitted)
            times.last_token = now
            times.num_token_steps += 1

    def on_request_end(self, request_id: str, completed: bool) -> None:
        """A client request left the engine: finished (`completed`), or aborted / refused."""
        times = self._in_flight.pop(request_id, None)
        if times is None or not completed:
            return
        self._e2e_request_latency.observe(self._clock() - times.admitted)
        if times.num_token_steps >= 2:
            self._time_per_output_token.observe((times.last_token - times.first_token) / (times.num_token_steps - 1))

    def snapshot(self) -> ServingMetricsSnapshot:
        return ServingMetricsSnapshot(
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            time_to_first_token=self._time_to_first_token.snapshot(),
            time_per_output_token=self._time_per_output_token.snapshot(),
            e2e_request_latency=self._e2e_request_latency.snapshot(),
        )


def fill_stats_response(response: generate_pb2.GetStatsResponse, snapshot: ServingMetricsSnapshot) -> None:
    """Copies the snapshot into GetStatsResponse's metric fields (15 and up)."""
    response.num_prompt_tokens = snapshot.num_prompt_tokens
    response.num_generation_tokens = snapshot.num_generation_tokens
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        histogram: HistogramSnapshot = getattr(snapshot, name)
        wire = getattr(response, name)
        wire.upper_bounds.extend(histogram.upper_bounds)
        wire.counts.extend(histogram.counts)
        wire.sum = histogram.sum
        wire.count = histogram.count
