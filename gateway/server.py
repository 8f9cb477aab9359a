"""`pagedserve gateway`: the HTTP gateway in one process, served by uvicorn.

uvicorn owns the event loop and the signals: on SIGTERM/SIGINT it stops accepting connections, gives
in-flight requests `shutdown_timeout` seconds (streams run on while the scheduler drains too, as `pagedserve
serve` signals both at once), then cancels the rest, whose gRPC calls cancel with them. uvicorn re-raises
the signal to the handler it found when it is done; that handler is a no-op here, so a graceful stop exits
0 like the scheduler's (a supervisor then tells a stop from a crash).
"""

from __future__ import annotations

import logging
import signal

import uvicorn

from gateway.app import build_app
from gateway.config import GatewayConfig

logger = logging.getLogger(__name__)


def run_gateway(config: GatewayConfig) -> int:
    server = uvicorn.Server(uvicorn.Config(
        build_app(config),
        host=config.host,
        port=config.port,
        timeout_graceful_shutdown=config.shutdown_timeout,
        log_level=config.uvicorn_log_level,
        access_log=config.log_requests,
        log_config=None,  # the process's own logging setup (service_runtime/service_process.py), not uvicorn's
    ))
    logger.info("OpenAI-compatible API on http://%s:%d/v1 for the scheduler at %s%s", config.host, config.port,
                config.grpc_target, " (API key required)" if config.api_key else "")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)  # what uvicorn re-raises to after its graceful shutdown
    server.run()
    return 0 if server.started else 1
