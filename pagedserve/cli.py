"""`pagedserve` command line: `serve` (scheduler + worker + HTTP gateway processes), `scheduler`, `worker`,
`gateway`, and `health` (a readiness probe for container health checks).

Each subcommand parses its flags into its service's one frozen config; `serve` forwards the same flags to
the children it starts (the same command lines docker compose uses).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from gateway.config import add_gateway_access_arguments, add_gateway_arguments, gateway_config_from_args
from scheduler_svc.config import (
    add_api_key_argument,
    add_heartbeat_argument,
    add_scheduler_arguments,
    scheduler_config_from_args,
)
from worker_svc.config import add_worker_arguments, worker_config_from_args

DEFAULT_WORKER_ADDRESS = "tcp://127.0.0.1:5557"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="vLLM-style LLM serving over gRPC")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start the scheduler, its worker and the HTTP gateway as processes")
    add_scheduler_arguments(serve)
    add_worker_arguments(serve)
    serve.add_argument("--worker-address", default=None,
                       help="ZeroMQ address between scheduler and worker (default: a private ipc socket)")
    serve.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    serve.add_argument("--http-port", type=int, default=8000, help="port of the OpenAI-compatible HTTP gateway")
    serve.add_argument("--no-http", dest="enable_http", action="store_false", help="start no HTTP gateway")
    add_gateway_access_arguments(serve)

    scheduler = commands.add_parser("scheduler", help="start the scheduler service alone")
    add_scheduler_arguments(scheduler)
    add_api_key_argument(scheduler)
    scheduler.add_argument("--worker-address", default=DEFAULT_WORKER_ADDRESS, help="ZeroMQ address to bind")
    scheduler.add_argument("--num-workers", type=int, default=1, help="worker ranks to wait for")
    scheduler.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)

    worker = commands.add_parser("worker", help="start one worker process alone")
    worker.add_argument("--model", default=None, help="model directory, .gguf file or hub id")
    worker.add_argument("--scheduler-address", default=DEFAULT_WORKER_ADDRESS, help="ZeroMQ address to connect")
    add_worker_arguments(worker)
    worker.add_argument("--rank", type=int, default=0)
    worker.add_argument("--world-size", type=int, default=1)
    add_heartbeat_argument(worker)
    worker.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)

    gateway = commands.add_parser("gateway", help="start the OpenAI-compatible HTTP gateway alone")
    add_gateway_arguments(gateway)
    gateway.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)

    health = commands.add_parser("health", help="exit 0 if a scheduler or gateway is ready, else 1")
    probe = health.add_mutually_exclusive_group(required=True)
    probe.add_argument("--grpc-target", help="a scheduler's host:port: its gRPC health must be SERVING")
    probe.add_argument("--http-url", help="a gateway's /health URL: it must answer 200")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    health.add_argument("--tls-root-cert", default=None, help="--grpc-target serves TLS: trust this PEM certificate")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "health":
        from pagedserve.health_probe import grpc_serving, http_ok

        if args.grpc_target:
            ready = grpc_serving(args.grpc_target, args.timeout, args.tls_root_cert)
        else:
            ready = http_ok(args.http_url, args.timeout)
        return 0 if ready else 1
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.command} %(levelname)s %(message)s")
    if getattr(args, "exit_with_parent", False):
        from pagedserve.process_guard import exit_with_parent

        exit_with_parent()
    if args.command == "serve":
        from pagedserve.launcher import serve

        return serve(args)
    if args.command == "scheduler":
        from scheduler_svc.service import run_scheduler_service

        return asyncio.run(run_scheduler_service(scheduler_config_from_args(args)))
    if args.command == "gateway":
        from gateway.server import run_gateway

        return run_gateway(gateway_config_from_args(args))
    if args.world_size != 1:
        raise SystemExit("--world-size > 1 (tensor parallel) is not supported yet")
    from worker_svc.worker import run_worker

    return run_worker(worker_config_from_args(args))


if __name__ == "__main__":
    sys.exit(main())
