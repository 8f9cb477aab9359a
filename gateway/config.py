"""The gateway's one configuration, parsed from its command line in one place (frozen, no environment).

`pagedserve gateway` parses it directly; `pagedserve serve` starts the gateway as a child process with the
same flags built from its own (--http-port, --api-key, --served-model-name; its --api-key also becomes
--grpc-api-key, its --tls-cert-file --grpc-root-cert), and docker compose passes them
on the gateway service's command line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    # The scheduler's gRPC address (host:port).
    grpc_target: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 8000
    # Set: every /v1 request must carry `Authorization: Bearer <api_key>` (/health and /metrics stay open).
    api_key: str | None = None
    # The model name clients send and /v1/models lists; None: the scheduler's own (ModelInfo.model_name).
    served_model_name: str | None = None
    # Seconds a client is told to wait (Retry-After) when the scheduler is overloaded or not ready.
    retry_after_s: int = 1
    # Seconds in-flight HTTP requests get to finish on SIGTERM.
    shutdown_timeout: float = 30.0
    # The scheduler's --api-key (sent on every gRPC call) and, when it serves TLS, the PEM file to trust.
    grpc_api_key: str | None = None
    grpc_root_cert: str | None = None


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grpc-target", default="127.0.0.1:50051", help="the scheduler's gRPC host:port")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    add_gateway_access_arguments(parser)
    parser.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds on 429 and 503")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="drain time on SIGTERM")
    parser.add_argument("--grpc-api-key", default=None, help="the scheduler's --api-key, sent on every gRPC call")
    parser.add_argument("--grpc-root-cert", default=None, help="the scheduler serves TLS: trust this PEM certificate")


def add_gateway_access_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `pagedserve serve` shares with `pagedserve gateway` (it forwards them to its gateway)."""
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1 requests (empty: no key); "
                             "`serve` also requires it on gRPC calls")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name the HTTP API lists and accepts (default: the served model's)")


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    if not 0 <= args.port < 65536:
        raise SystemExit("--port must lie in [0, 65535]")
    if args.retry_after < 0:
        raise SystemExit("--retry-after must be >= 0")
    return GatewayConfig(
        grpc_target=args.grpc_target,
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        served_model_name=args.served_model_name or None,
        retry_after_s=args.retry_after,
        shutdown_timeout=args.shutdown_timeout,
        grpc_api_key=args.grpc_api_key or None,
        grpc_root_cert=args.grpc_root_cert,
    )
