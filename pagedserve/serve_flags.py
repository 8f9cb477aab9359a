"""`pagedserve serve`'s flag table: the scheduler's, the workers' and the gateway's shared flags (each declared
once, on its service's config: service_runtime/config_flags.py), serve's own (where it listens, how many ranks,
how it supervises them) and its refusals of the vLLM flags it cannot honour (vllm_flags.py).

Why a module of its own: the CLI (cli.py) builds `pagedserve serve` from it, and the offline LLM's private
server (private_server.py) checks its keywords against it; with the table in cli.py, private_server imported
the CLI, which imports the bench commands, which import the LLM: an import circle
(tests/test_import_layers.py checks there is none).
"""

from __future__ import annotations

import argparse

from gateway.config import add_gateway_arguments
from pagedserve.vllm_flags import add_refused_vllm_flags
from scheduler_svc.data_parallel.config import add_front_arguments
from scheduler_svc.config import add_scheduler_arguments
from worker_svc.config import add_worker_arguments

SERVE_HELP = "start the scheduler, its worker and the HTTP gateway as processes"


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """Every flag of `pagedserve serve` (and its MODEL positional)."""
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="model directory, .gguf file or hub id, as --model (default: SmolLM2-135M-Instruct)")
    add_scheduler_arguments(serve)
    add_worker_arguments(serve)
    serve.add_argument("--worker-address", default=None,
                       help="ZeroMQ address between scheduler and worker (default: a private ipc socket)")
    serve.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=1,
                       help="worker processes (one per GPU) the model is split over; must divide its attention heads")
    serve.add_argument("--data-parallel-size", "-dp", dest="data_parallel_size", type=int, default=1,
                       help="engines (each a scheduler with its own -tp ranks) behind one front that routes each "
                            "request to one of them (docs/scale_out.md)")
    add_front_arguments(serve, shared_only=True)
    serve.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default="mp",
                       help="how the ranks are started: mp, local processes (ray: not supported yet)")
    serve.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    serve.add_argument("--max-scheduler-restarts", type=int, default=3,
                       help="times a dead scheduler is restarted (with fresh workers) before the stack stops; "
                            "streams in flight resume on the new one")
    serve.add_argument("--host", default="127.0.0.1",
                       help="bind address of the OpenAI-compatible HTTP server (vLLM's default is every "
                            "interface; ours is loopback: pass 0.0.0.0 to serve the network)")
    serve.add_argument("--port", "--http-port", dest="port", type=int, default=8000,
                       help="port of the OpenAI-compatible HTTP server (--http-port: deprecated, the same)")
    serve.add_argument("--grpc-host", default="127.0.0.1", help="bind address of the gRPC API")
    serve.add_argument("--grpc-port", type=int, default=50051, help="port of the gRPC API")
    serve.add_argument("--no-http", dest="enable_http", action="store_false", help="start no HTTP gateway")
    add_gateway_arguments(serve, shared_only=True)
    add_refused_vllm_flags(serve)


def serve_parser() -> argparse.ArgumentParser:
    """A parser of `pagedserve serve`'s flags alone (the offline LLM's keywords are checked against it)."""
    parser = argparse.ArgumentParser(prog="pagedserve serve", description=SERVE_HELP)
    add_serve_arguments(parser)
    return parser
