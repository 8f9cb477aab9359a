"""The gateway's one configuration (frozen). Each field declares its own flag (service_runtime/config_flags.py).

`pagedserve gateway` parses them all; `pagedserve serve` takes the shared ones and starts the gateway as a
child process with them, forwarded from this declaration, plus the values it sets from its own flags (--host,
--port, --shutdown-timeout; its --tls-cert-file becomes --grpc-root-cert); docker compose passes them on the
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
from service_runtime.config_flags import add_config_arguments, flag, flag_values

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class GatewayConfig:
    # The scheduler's gRPC address (host:port); `serve` gives its own scheduler's.
    grpc_target: str = flag("--grpc-target", default="127.0.0.1:50051", help="the scheduler's gRPC host:port",
                            shared=False)
    # `serve` gives its own --host/--port (help of their own: vLLM's defaults differ).
    host: str = flag("--host", default="127.0.0.1", help="HTTP bind address", shared=False)
    port: int = flag("--port", default=8000, help="HTTP port", shared=False)
    # Set: every /v1 request must carry `Authorization: Bearer <api_key>` (/health and /metrics stay open).
    # `serve` takes the flag too, and hands the key to the gateway in its environment, never its argv.
    api_key: str | None = flag("--api-key", default=None, forwarded=False,
                               help="require `Authorization: Bearer KEY` on /v1 requests (empty: no key; default: "
                                    "$PAGEDSERVE_API_KEY, else $VLLM_API_KEY); `serve` also requires it on gRPC calls")
    # The model name clients send and /v1/models lists; None: the scheduler's own (ModelInfo.model_name).
    served_model_name: str | None = flag("--served-model-name", default=None,
                                         help="the model name the HTTP API lists and accepts (default: the served "
                                              "model's)")
    # uvicorn's own log level (vLLM's --uvicorn-log-level), and whether it logs each request (its access log,
    # the only per-request log line pagedserve writes; vLLM's --disable-log-requests turns it off).
    uvicorn_log_level: str = flag("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                                  help="log level of the HTTP server (uvicorn)")
    log_requests: bool = flag("--disable-log-requests", "--disable-uvicorn-access-log", default=True, switch="off",
                              help="write no log line per HTTP request")
    # Larger request bodies get a 413 before they are read (body_limit.py).
    max_request_body_bytes: int = flag("--max-request-body-bytes", default=16 * 1024 * 1024,
                                       help="larger HTTP request bodies get a 413 (invalid_request_error) before "
                                            "they are read")
    # vLLM's --enable-auto-tool-choice and --tool-call-parser: tool_choice "auto" (the default with tools)
    # parses the model's tool calls in this format (tool_parsers/); without them "auto" is a 400.
    enable_auto_tool_choice: bool = flag("--enable-auto-tool-choice", default=False, switch="on",
                                         help="serve tool_choice \"auto\" (needs --tool-call-parser)")
    tool_call_parser: str | None = flag("--tool-call-parser", default=None, metavar="NAME",
                                        help=f"the model's tool-call format: {', '.join(sorted(TOOL_CALL_PARSERS))}")
    # vLLM's --reasoning-parser: the model's thought goes to reasoning_content (reasoning_parsers/).
    reasoning_parser: str | None = flag("--reasoning-parser", default=None, metavar="NAME",
                                        help="put the model's thought in reasoning_content: "
                                             f"{', '.join(sorted(REASONING_PARSERS))}")
    # Seconds a client is told to wait (Retry-After) when the scheduler is overloaded or not ready.
    retry_after_s: int = flag("--retry-after", default=1, metavar="RETRY_AFTER",
                              help="Retry-After seconds on 429 and 503", shared=False)
    # Seconds in-flight HTTP requests get to finish on SIGTERM (`serve` gives its scheduler's).
    shutdown_timeout: float = flag("--shutdown-timeout", default=30.0, help="drain time on SIGTERM", shared=False)
    # Seconds a stream in flight, or a new request, waits for a lost scheduler to serve again (its supervisor
    # restarts it) before failing; streams then resume where they stopped (client/stream_resume.py). 0: fail.
    resume_timeout: float = flag("--resume-timeout", default=120.0, shared=False,
                                 help="seconds streams and new requests wait for a lost scheduler to come back "
                                      "(0: fail)")
    # The scheduler's --api-key (sent on every gRPC call; `serve` hands it over in the environment) and, when
    # it serves TLS, the PEM file to trust (`serve` gives its --tls-cert-file).
    grpc_api_key: str | None = flag("--grpc-api-key", default=None, shared=False, forwarded=False,
                                    help=f"the scheduler's --api-key, sent on every gRPC call (default: "
                                         f"${GRPC_API_KEY_ENV})")
    grpc_root_cert: str | None = flag("--grpc-root-cert", default=None, shared=False,
                                      help="the scheduler serves TLS: trust this PEM certificate")

    def __post_init__(self) -> None:
        """The checks that span fields, as usage errors naming the flags."""
        if not 0 <= self.port < 65536:
            raise SystemExit("--port must lie in [0, 65535]")
        if self.retry_after_s < 0:
            raise SystemExit("--retry-after must be >= 0")
        if self.resume_timeout < 0:
            raise SystemExit("--resume-timeout must be >= 0")
        if self.max_request_body_bytes < 1:
            raise SystemExit("--max-request-body-bytes must be at least 1")
        if (error := output_parsing_error(self)) is not None:
            raise SystemExit(error)


def add_gateway_arguments(parser: argparse.ArgumentParser, *, shared_only: bool = False) -> None:
    """Gateway flags: all of them (`pagedserve gateway`, the default), or those `pagedserve serve` shares (it
    forwards them to its gateway): the API key, the served name, uvicorn's logging, the body limit and
    vLLM's tool-call and reasoning parsers."""
    add_config_arguments(parser, GatewayConfig, shared_only=shared_only)


def output_parsing_error(args: argparse.Namespace | GatewayConfig) -> str | None:
    """What is wrong with the parser flags (an unknown name, listing the known ones; --enable-auto-tool-choice
    without a parser), or None. `serve` asks too, with its parsed flags, before any child starts."""
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
    """The config of parsed gateway flags, the API keys resolved (flag, else the environment)."""
    values = flag_values(GatewayConfig, args)
    values["api_key"] = api_key_from(values["api_key"], os.environ)
    values["grpc_api_key"] = grpc_api_key_from(values["grpc_api_key"], os.environ)
    values["served_model_name"] = values["served_model_name"] or None
    return GatewayConfig(**values)
