"""When and how the SDK retries a failed call.

Only UNAVAILABLE (no server, or it is starting, draining or lost its workers) and RESOURCE_EXHAUSTED (the
server refused more work for now) are retried: both say "not now", and retrying them is safe. Anything else
(a bad request, a deadline, a cancellation, an internal error) fails at once. A stream is retried only until
its first chunk arrived: after that a retry would generate the text again and the caller would see output
twice, so the error goes to the caller instead.

Backoff is exponential with full jitter (a uniform draw in [0, min(max_backoff, initial_backoff * 2^n)]), so
clients that failed together do not all come back together. Retries stay within the call's `timeout`: every
attempt gets what is left of it, and no retry starts after it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from client.errors import OverloadedError, PagedServeError, ServerUnavailableError

RETRYABLE_ERRORS = (ServerUnavailableError, OverloadedError)


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3
    initial_backoff: float = 0.1  # seconds
    max_backoff: float = 2.0  # seconds

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.initial_backoff < 0 or self.max_backoff < 0:
            raise ValueError(f"retry settings must be >= 0: {self}")

    def backoff(self, retry: int, draw=random.random) -> float:
        """The pause before retry number `retry` (0 for the first)."""
        return draw() * min(self.max_backoff, self.initial_backoff * 2**retry)


class RetryBudget:
    """The retries of one call: how many are left and how much of its timeout (None: no deadline)."""

    def __init__(self, policy: RetryPolicy, timeout: float | None) -> None:
        self._policy = policy
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._retries = 0

    @property
    def deadline(self) -> float | None:
        """When the call's timeout runs out (time.monotonic), or None."""
        return self._deadline

    def attempt_timeout(self) -> float | None:
        """The deadline of the next attempt: what is left of the call's timeout."""
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def next_pause(self, error: PagedServeError) -> float | None:
        """Seconds to wait before retrying after `error`, or None: give up and raise it."""
        if not isinstance(error, RETRYABLE_ERRORS) or self._retries >= self._policy.max_retries:
            return None
        pause = self._policy.backoff(self._retries)
        if self._deadline is not None and time.monotonic() + pause >= self._deadline:
            return None
        self._retries += 1
        return pause
