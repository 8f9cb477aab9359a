"""The scheduler service's one configuration, parsed from its command line in one place.

Frozen: every component receives the same immutable object at start-up, so no setting can drift at run time
and no module reads the environment. `pagedserve serve` builds this command line for its child process from
its own flags (see pagedserve/cli.py), and docker compose passes the same flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    model: str | None
    host: str = "127.0.0.1"
    port: int = 50051
    # ZeroMQ address the scheduler binds; workers connect to it.
    worker_address: str = "tcp://127.0.0.1:5557"
    num_workers: int = 1
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # None: the model's own context limit.
    max_model_len: int | None = None
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Append every StepPlan to this file (see plan_log.py); None: no log.
    plan_log: str | None = None
    # How long to wait for every worker to connect and report its KV pool.
    worker_ready_timeout: float = 600.0
    # Seconds in-flight requests get to finish on SIGTERM before they are aborted.
    shutdown_timeout: float = 30.0
    # Plan step N+1 while the worker runs step N (see scheduler.py); off: plan, wait, apply, plan.
    async_scheduling: bool = True
    # Seconds between heartbeats to the workers; a worker silent for 3 of its intervals is dead.
    heartbeat_interval: float = 2.0


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    """Scheduler flags, shared by `pagedserve scheduler` and `pagedserve serve`."""
    parser.add_argument("--model", default=None, help="model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port")
    parser.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64, 128))
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="most tokens in one step")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    parser.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="drain time on SIGTERM")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="do not reuse the KV blocks of earlier requests' common prefixes")
    parser.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                        help="schedule each prompt whole (needs --max-num-batched-tokens >= max model len)")
    parser.add_argument("--plan-log", default=None, help="append every step plan to this file (replay, tests)")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="wait for each step's result before planning the next (default: plan step N+1 "
                             "while the worker runs step N)")
    add_heartbeat_argument(parser)


def add_heartbeat_argument(parser: argparse.ArgumentParser) -> None:
    """--heartbeat-interval, shared by the scheduler, the worker and `pagedserve serve` (which gives both the
    same value)."""
    parser.add_argument("--heartbeat-interval", type=float, default=2.0,
                        help="seconds between heartbeats over ZeroMQ; a peer silent for 3 intervals is dead")


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    for flag in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise SystemExit("--max-model-len must be at least 2")
    if args.heartbeat_interval <= 0:
        raise SystemExit("--heartbeat-interval must be > 0")
    return SchedulerConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        worker_address=args.worker_address,
        num_workers=getattr(args, "num_workers", 1),
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        preemption_mode=args.preemption_mode,
        shutdown_timeout=args.shutdown_timeout,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        plan_log=args.plan_log,
        async_scheduling=args.async_scheduling,
        heartbeat_interval=args.heartbeat_interval,
    )
