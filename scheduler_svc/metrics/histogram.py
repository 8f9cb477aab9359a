"""A fixed-bucket histogram the scheduler accumulates in place, and vLLM's bucket boundaries.

Why fixed buckets kept on the scheduler rather than per-request samples sent to the gateway: GetStats stays
one small message however many requests ran (a few dozen counters per histogram), and Prometheus needs
only the bucket counts. The bounds are vLLM's (vllm/v1/metrics/loggers.py), so a dashboard built for vLLM
reads the same quantiles from ours.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Seconds.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM uses these for e2e latency and for the queue / prefill / decode / inference phases alike.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Counts.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets, up to max_model_len)."""
    bounds: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class HistogramSnapshot:
    """Counts per bucket (not cumulative); the last count, one past `upper_bounds`, is the +Inf bucket."""

    upper_bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int


class Histogram:
    """Fixed buckets with Prometheus' `le` rule: a value equal to a bound falls in that bound's bucket."""

    def __init__(self, upper_bounds: tuple[float, ...]) -> None:
        if not upper_bounds or list(upper_bounds) != sorted(set(upper_bounds)):
            raise ValueError("bucket bounds must be non-empty and strictly increasing")
        self._upper_bounds = tuple(float(bound) for bound in upper_bounds)
        self._counts = [0] * (len(upper_bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._upper_bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self._upper_bounds, tuple(self._counts), self._sum, sum(self._counts))
