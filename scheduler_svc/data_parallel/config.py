"""The data-parallel front's one configuration (frozen); each field declares its own flag
(service_runtime/config_flags.py). `pagedserve serve -dp N` takes the router's flags (shared) and sets the rest
from its own: the public --grpc-host/--grpc-port, the engines' internal addresses, the model and its text
options (the front renders and encodes prompt heads as the scheduler does), TLS and the API key (in the
environment, never on the command line).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from scheduler_svc.data_parallel.router import DEFAULT_LOAD_BOUND, POLICIES
from scheduler_svc.text.chat_template_source import chat_template_text
from service_runtime.api_key_source import api_key_from
from service_runtime.config_flags import add_config_arguments, flag, flag_values


@dataclass(frozen=True)
class FrontConfig:
    # Each engine's scheduler, host:port, in engine order (engine i is the `engine` label "i").
    engine_targets: tuple[str, ...] = flag("--engine-targets", default=(), nargs="+", parse=str, shared=False,
                                           help="the engines' schedulers (host:port), in order")
    router_policy: str = flag("--router-policy", default="prefix", choices=POLICIES,
                              help="how the data-parallel front picks an engine per request: prefix (the engine "
                                   "whose prefix cache holds the prompt's first block, within the load bound), "
                                   "least-load or round-robin (docs/scale_out.md)")
    router_load_bound: int = flag("--router-load-bound", default=DEFAULT_LOAD_BOUND,
                                  help="prefix policy: a request goes to the least loaded engine instead when its "
                                       "prefix's engine has more than this many in-flight requests above it")
    # Front processes on the one public port (front_processes.py says how they share it and what each keeps).
    api_server_count: int = flag("--api-server-count", default=1,
                                 help="data-parallel front processes serving the public gRPC port together "
                                      "(SO_REUSEPORT: the kernel spreads client connections over them), as "
                                      "vLLM's API servers; more relay more streams a second (docs/scale_out.md)")
    # Set by the front's supervisor for each of its processes: which one this is (None: started by a launcher).
    api_server_rank: int | None = flag("--api-server-rank", default=None, hidden=True, shared=False,
                                       help="this front process's index among --api-server-count")
    host: str = flag("--grpc-host", default="127.0.0.1", help="gRPC bind address", shared=False)
    port: int = flag("--grpc-port", default=50051, help="gRPC port", shared=False)
    model: str | None = flag("--model", default=None, shared=False, help="the served model (its tokenizer)")
    tokenizer: str | None = flag("--tokenizer", default=None, shared=False, help="tokenizer directory")
    chat_template: str | None = flag("--chat-template", default=None, shared=False,
                                     help="chat template (file or text), as the scheduler's")
    api_key: str | None = flag("--api-key", default=None, shared=False, forwarded=False,
                               help="require `authorization: Bearer KEY` (default: $PAGEDSERVE_API_KEY, else "
                                    "$VLLM_API_KEY); sent on to the engines")
    tls_cert_file: str | None = flag("--tls-cert-file", default=None, shared=False,
                                     help="serve TLS with this PEM certificate; the engines serve it too, and are "
                                          "trusted with it")
    tls_key_file: str | None = flag("--tls-key-file", default=None, shared=False, help="its PEM private key")
    max_message_bytes: int = flag("--max-message-bytes", default=4 * 1024 * 1024, shared=False,
                                  help="the engines' request limit (the front lets up to twice it through, so "
                                       "the engine names the limit in its refusal)")
    shutdown_timeout: float = flag("--shutdown-timeout", default=30.0, shared=False,
                                   help="seconds in-flight streams get to finish on SIGTERM")

    def __post_init__(self) -> None:
        if self.router_load_bound < 0:
            raise SystemExit("--router-load-bound must be >= 0")
        if self.api_server_count < 1:
            raise SystemExit(f"--api-server-count must be >= 1, not {self.api_server_count}")
        if self.api_server_count > 1 and self.port == 0:  # each process would bind a port of its own
            raise SystemExit("--api-server-count > 1 needs a fixed --grpc-port (0 picks one per front process, "
                             "so they would not share it)")
        if self.api_server_rank is not None and not 0 <= self.api_server_rank < self.api_server_count:
            raise SystemExit(f"--api-server-rank {self.api_server_rank}: must lie in [0, --api-server-count "
                             f"{self.api_server_count})")


def add_front_arguments(parser: argparse.ArgumentParser, *, shared_only: bool = False) -> None:
    add_config_arguments(parser, FrontConfig, shared_only=shared_only)


def front_config_from_args(args: argparse.Namespace) -> FrontConfig:
    values = flag_values(FrontConfig, args)
    values["engine_targets"] = tuple(values["engine_targets"] or ())
    values["api_key"] = api_key_from(values["api_key"], os.environ)
    try:
        if values["chat_template"] is not None:
            values["chat_template"] = chat_template_text(values["chat_template"])
    except ValueError as error:
        raise SystemExit(str(error)) from None
    return FrontConfig(**values)
