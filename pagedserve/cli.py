"""`pagedserve` command line: `serve` (scheduler + worker + HTTP gateway processes), `scheduler`, `worker`,
`gateway`, `front` (the data-parallel front, docs/scale_out.md), `health` (a readiness probe for container
health checks) and `bench` (benchmarks, pagedserve/bench/).

`serve` reads like `vllm serve`: `pagedserve serve [MODEL]`, `--host`/`--port` the OpenAI HTTP server's
(default 127.0.0.1:8000; vLLM binds every interface, we bind loopback unless told), `--grpc-host`/`--grpc-port`
the gRPC API's (127.0.0.1:50051). The vLLM flags it does not support are refused by name (vllm_flags.py).

`scheduler`, `worker`, `gateway` and `front` are each service's own entry point (`scheduler_svc/main.py`, ...: the
same flags as `python -m scheduler_svc`); `serve` parses the flags of all three (its table: serve_flags.py)
and forwards each child its share (launcher.py), the same command lines docker compose uses.
"""

from __future__ import annotations

import argparse
import sys

from gateway import main as gateway_main
from gateway.config import output_parsing_error
from pagedserve.bench.cli import add_bench_commands, run_bench
from pagedserve.serve_flags import SERVE_HELP, add_serve_arguments
from scheduler_svc import main as scheduler_main
from scheduler_svc.data_parallel import main as front_main
from service_runtime.service_process import add_exit_with_parent_argument, start_service_process
from worker_svc import main as worker_main

SERVICES = {"scheduler": scheduler_main, "worker": worker_main, "gateway": gateway_main, "front": front_main}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="vLLM-style LLM serving over gRPC")
    commands = parser.add_subparsers(dest="command", required=True)

    add_serve_arguments(commands.add_parser("serve", help=SERVE_HELP))

    for name, service in SERVICES.items():
        service_parser = commands.add_parser(name, help=service.DESCRIPTION)
        service.add_arguments(service_parser)
        add_exit_with_parent_argument(service_parser)

    health = commands.add_parser("health", help="exit 0 if a scheduler or gateway is ready, else 1")
    probe = health.add_mutually_exclusive_group(required=True)
    probe.add_argument("--grpc-target", help="a scheduler's host:port: its gRPC health must be SERVING")
    probe.add_argument("--http-url", help="a gateway's /health URL: it must answer 200")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    health.add_argument("--tls-root-cert", default=None, help="--grpc-target serves TLS: trust this PEM certificate")
    add_bench_commands(commands)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: `serve MODEL` and `serve --model MODEL` are one thing (both, if they differ:
    a usage error), and the deprecated --http-port is announced."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
            parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model if args.model is not None else args.model_tag
        if (error := output_parsing_error(args)) is not None:
            parser.error(error)
        given = sys.argv[1:] if argv is None else argv
        if any(arg == "--http-port" or arg.startswith("--http-port=") for arg in given):
            print("pagedserve: --http-port is deprecated and will be removed in the next release: use --port",
                  file=sys.stderr, flush=True)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "health":
        from pagedserve.health_probe import grpc_serving, http_ok

        if args.grpc_target:
            ready = grpc_serving(args.grpc_target, args.timeout, args.tls_root_cert)
        else:
            ready = http_ok(args.http_url, args.timeout)
        return 0 if ready else 1
    if args.command == "bench":
        return run_bench(args)
    if args.command == "serve":
        from pagedserve.launcher import serve

        start_service_process("serve", exit_with_parent=False)
        return serve(args)
    start_service_process(args.command, args.exit_with_parent)
    return SERVICES[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
