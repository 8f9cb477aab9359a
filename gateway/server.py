"""`pagedserve gateway`: the HTTP gateway in one process, served by uvicorn.

uvicorn owns the event loop and the signals. The first SIGTERM/SIGINT starts the drain (draining.py): the
socket stays open, requests in flight run on (streams too, while the scheduler drains, as `pagedserve serve`
signals both at once), new requests get a 503 with Retry-After; once none is in flight, or after
`shutdown_timeout` seconds, uvicorn stops, cancelling what is left (their gRPC calls cancel with them). A
second signal stops at once. uvicorn re-raises the signal to the handler it found when it is done; that
handler is a no-op here, so a graceful stop exits 0 like the scheduler's (a supervisor then tells a stop from
a crash).
"""

from __future__ import annotations

import logging
import signal

import uvicorn

from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.draining import DrainState

logger = logging.getLogger(__name__)
_AFTER_DRAIN_S = 2.0


class _DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT starts the drain (draining.py) instead of the stop; the
    stop follows once the drain is done, or at a second signal."""

    def __init__(self, config: uvicorn.Config, drain: DrainState, timeout_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_timeout_s = timeout_s

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain.draining or not self.started:
            super().handle_exit(sig, frame)
            return
        captured = getattr(self, "_captured_signals", None)
        if captured is not None:
            captured.append(sig)  # re-raised after the shutdown, as uvicorn does with the signals it handled
        logger.info("draining: %d requests in flight, new ones get 503", self._drain.in_flight)
        self._drain.start(self._drain_timeout_s)

    async def on_tick(self, counter: int) -> bool:
        if self._drain.done():
            self.should_exit = True
        return await super().on_tick(counter)


def run_gateway(config: GatewayConfig) -> int:
    drain = DrainState()
    server = _DrainingServer(uvicorn.Config(
        build_app(config, drain),
        host=config.host,
        port=config.port,
        timeout_graceful_shutdown=_AFTER_DRAIN_S,  # the drain has had shutdown_timeout already
        log_level=config.uvicorn_log_level,
        access_log=config.log_requests,
        log_config=None,  # the process's own logging setup (service_runtime/service_process.py), not uvicorn's
    ), drain, config.shutdown_timeout)
    logger.info("OpenAI-compatible API on http://%s:%d/v1 for the scheduler at %s%s", config.host, config.port,
                config.grpc_target, " (API key required)" if config.api_key else "")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)  # what uvicorn re-raises to after its graceful shutdown
    server.run()
    return 0 if server.started else 1
