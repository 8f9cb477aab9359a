"""The gateway's one configuration, parsed from its command line in one place (frozen).

`pagedserve gateway` parses it directly; `pagedserve serve` starts the gateway as a child process with the
same flags built from its own (--host, --port, --served-model-name, --uvicorn-log-level,
--disable-log-requests; its --tls-cert-file becomes --grpc-root-cert), and docker compose passes them on the
gateway service's command line. The API keys may come from the environment instead (PAGEDSERVE_API_KEY,
VLLM_API_KEY, PAGEDSERVE_GRPC_API_KEY), so that `ps` does not show them: `serve` hands its key over this way.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from gateway.reasoning_parsers import REASONING_PARSERS
from gateway.tool_parsers import TOOL_CALL_PARSERS
from service_runtime.api_key_source import GRPC_API_KEY_ENV, api_key_from, grpc_api_key_from

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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
    # Seconds a stream in flight, or a new request, waits for a lost scheduler to serve again (its supervisor
    # restarts it) before failing; streams then resume where they stopped (client/stream_resume.py). 0: fail.
    resume_timeout: float = 120.0
    # The scheduler's --api-key (sent on every gRPC call) and, when it serves TLS, the PEM file to trust.
    grpc_api_key: str | None = None
    grpc_root_cert: str | None = None
    # uvicorn's own log level (vLLM's --uvicorn-log-level), and whether it logs each request (its access log,
    # the only per-request log line pagedserve writes; vLLM's --disable-log-requests turns it off).
    uvicorn_log_level: str = "info"
    log_requests: bool = True
    # Larger request bodies get a 413 before they are read (body_limit.py).
    max_request_body_bytes: int = 16 * 1024 * 1024
    # vLLM's --enable-auto-tool-choice and --tool-call-parser: tool_choice "auto" (the default with tools)
    # parses the model's tool calls in this format (tool_parsers/); without them "auto" is a 400.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # vLLM's --reasoning-parser: the model's thought goes to reasoning_content (reasoning_parsers/).
    reasoning_parser: str | None = None


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grpc-target", default="127.0.0.1:50051", help="the scheduler's gRPC host:port")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    add_gateway_access_arguments(parser)
    parser.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds on 429 and 503")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="drain time on SIGTERM")
    parser.add_argument("--resume-timeout", type=float, default=120.0,
                        help="seconds streams and new requests wait for a lost scheduler to come back (0: fail)")
    parser.add_argument("--grpc-api-key", default=None,
                        help=f"the scheduler's --api-key, sent on every gRPC call (default: ${GRPC_API_KEY_ENV})")
    parser.add_argument("--grpc-root-cert", default=None, help="the scheduler serves TLS: trust this PEM certificate")


def add_gateway_access_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `pagedserve serve` shares with `pagedserve gateway` (it forwards them to its gateway)."""
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1 requests (empty: no key; default: "
                             "$PAGEDSERVE_API_KEY, else $VLLM_API_KEY); `serve` also requires it on gRPC calls")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name the HTTP API lists and accepts (default: the served model's)")
    parser.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                        help="log level of the HTTP server (uvicorn)")
    parser.add_argument("--disable-log-requests", "--disable-uvicorn-access-log", dest="log_requests",
                        action="store_false", help="write no log line per HTTP request")
    parser.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024,
                        help="larger HTTP request bodies get a 413 (invalid_request_error) before they are read")
    add_output_parsing_arguments(parser)


def add_output_parsing_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's tool-call and reasoning parser flags (shared by `serve` and `gateway`)."""
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="serve tool_choice \"auto\" (needs --tool-call-parser)")
    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help=f"the model's tool-call format: {', '.join(sorted(TOOL_CALL_PARSERS))}")
    parser.add_argument("--reasoning-parser", default=None, metavar="NAME",
                        help=f"put the model's thought in reasoning_content: {', '.join(sorted(REASONING_PARSERS))}")


def output_parsing_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the parser flags (an unknown name, listing the known ones; --enable-auto-tool-choice
    without a parser), or None."""
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_CALL_PARSERS:
        return (f"--tool-call-parser {args.tool_call_parser!r}: unknown; choose one of "
                f"{', '.join(sorted(TOOL_CALL_PARSERS))}")
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        return (f"--reasoning-parser {args.reasoning_parser!r}: unknown; choose one of "
                f"{', '.join(sorted(REASONING_PARSERS))}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return ("--enable-auto-tool-choice needs --tool-call-parser NAME (one of "
                f"{', '.join(sorted(TOOL_CALL_PARSERS))})")
    return None


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    if not 0 <= args.port < 65536:
        raise SystemExit("--port must lie in [0, 65535]")
    if args.retry_after < 0:
        raise SystemExit("--retry-after must be >= 0")
    if args.resume_timeout < 0:
        raise SystemExit("--resume-timeout must be >= 0")
    if args.max_request_body_bytes < 1:
        raise SystemExit("--max-request-body-bytes must be at least 1")
    if (error := output_parsing_error(args)) is not None:
        raise SystemExit(error)
    return GatewayConfig(
        grpc_target=args.grpc_target,
        host=args.host,
        port=args.port,
        api_key=api_key_from(args.api_key, os.environ),
        served_model_name=args.served_model_name or None,
        retry_after_s=args.retry_after,
        shutdown_timeout=args.shutdown_timeout,
        resume_timeout=args.resume_timeout,
        grpc_api_key=grpc_api_key_from(args.grpc_api_key, os.environ),
        grpc_root_cert=args.grpc_root_cert,
        uvicorn_log_level=args.uvicorn_log_level,
        log_requests=args.log_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
