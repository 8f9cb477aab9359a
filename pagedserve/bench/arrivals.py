"""When each request is sent: vLLM's arrival process for --request-rate and --burstiness.

Gaps between sends are gamma-distributed with shape `burstiness` and mean 1 / rate (burstiness 1: a
Poisson process; below 1 burstier, above 1 more even; inf: evenly spaced). The cumulative offsets are then
scaled so the last send falls at num_requests / rate, as vLLM does, so runs with different seeds take the
same time. Rate inf: every request at once.
"""

from __future__ import annotations

import math

import numpy as np


def send_offsets(num_requests: int, request_rate: float, burstiness: float,
                 rng: np.random.Generator) -> list[float]:
    """Seconds after the start at which each request is sent."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive (inf: all at once), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    offsets *= (num_requests / request_rate) / offsets[-1]
    return [float(t) for t in offsets]
