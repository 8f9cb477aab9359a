"""The gateway's drain on SIGTERM: requests in flight finish, new ones get a 503 with Retry-After.

Why not uvicorn's own graceful shutdown: it closes the listening socket first, so a client that sends a
request during the drain gets "connection refused", which most HTTP clients report as a hard failure
(and load balancers count as a dead backend) instead of retrying elsewhere. Here the socket stays open while
requests are in flight: every new request gets 503 `service_unavailable` with `Retry-After` (an OpenAI
client retries it, a balancer moves on), /health and /ping say 503 too, and only when the last request in
flight has finished (or `--shutdown-timeout` has passed) does uvicorn stop. A second SIGTERM or SIGINT
stops at once, as uvicorn's does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import OpenAIError

_OPEN_PATHS = ("/metrics",)  # scrapers keep reading the server's state while it drains


@dataclass
class DrainState:
    """Whether the gateway drains, since when it must stop regardless, and how many requests are in flight."""

    draining: bool = False
    deadline: float = 0.0
    in_flight: int = 0

    def start(self, timeout_s: float) -> None:
        self.draining = True
        self.deadline = time.monotonic() + timeout_s

    def done(self) -> bool:
        return self.draining and (self.in_flight == 0 or time.monotonic() >= self.deadline)


class DrainGate:
    """ASGI middleware: counts HTTP requests in flight; while draining, refuses new ones with a 503."""

    def __init__(self, app: ASGIApp, state: DrainState, retry_after_s: int) -> None:
        self._app = app
        self._state = state
        self._retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        state = self._state
        if state.draining and scope["path"] not in _OPEN_PATHS:
            refusal = OpenAIError(503, "the server is shutting down; retry on another replica or later",
                                  type="service_unavailable_error", code="service_unavailable",
                                  retry_after_s=self._retry_after_s)
            await refusal.response()(scope, receive, send)
            return
        state.in_flight += 1
        try:
            await self._app(scope, receive, send)
        finally:
            state.in_flight -= 1
