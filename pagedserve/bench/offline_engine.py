"""The engine under `pagedserve bench throughput|latency`: the offline `LLM`, started from `serve`'s flags.

Why the `LLM` and not an engine object in this process: pagedserve's engine is the scheduler and worker
processes (the scheduler never imports torch, the worker owns the device), so "offline, in-process" as vLLM
means it is, here, the `LLM` class and the private `pagedserve serve` it starts on a loopback port: exactly
the code that serves online, with no HTTP gateway. Every engine flag is `serve`'s (the same parser
functions), so a flag means the same in `serve` and in `bench`, and the bench commands take whatever
`serve` takes. The LLM gets only the flags whose values differ from their defaults, which leaves the
server's own defaults (and its checks of the values) in one place.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedserve.llm import LLM
from pagedserve.vllm_flags import add_refused_vllm_flags
from scheduler_svc.config import add_scheduler_arguments
from worker_svc.config import add_worker_arguments


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagedserve serve`'s engine flags (model, scheduler, worker, -tp; not where it listens) and its
    refusals of the vLLM flags it does not support."""
    _add_engine_flags(parser)
    add_refused_vllm_flags(parser)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags of `args` that differ from their defaults, as `LLM` keywords (--model aside)."""
    defaults = _engine_defaults()
    return {name: getattr(args, name) for name, default in defaults.items()
            if name not in ("model", "ready_timeout") and getattr(args, name) != default}


def start_engine(args: argparse.Namespace) -> LLM:
    """The offline engine for `args`, ready; if it fails to start, SystemExit with the server's log (a
    command's error, not a traceback)."""
    try:
        return LLM(args.model, ready_timeout=args.ready_timeout, **engine_options(args))
    except RuntimeError as error:
        raise SystemExit(f"pagedserve bench: the engine did not start: {error}") from None


def refuse_below(command: str, args: argparse.Namespace, minimum: int, *names: str) -> None:
    """SystemExit naming the first workload flag of `names` below `minimum`, before any engine starts."""
    for name in names:
        if getattr(args, name) < minimum:
            raise SystemExit(f"pagedserve bench {command}: --{name.replace('_', '-')} must be at least {minimum}, "
                             f"not {getattr(args, name)}")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_scheduler_arguments(parser)
    add_worker_arguments(parser)
    parser.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=1,
                        help="worker processes (one per GPU) the model is split over")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait for the engine to load the model and be ready")


def _engine_defaults() -> dict[str, Any]:
    """{dest: default} of every engine flag but the refused ones (a refused flag that parses holds an
    accepted value, which is what pagedserve does anyway), read from a parser of the engine flags alone."""
    parser = argparse.ArgumentParser(add_help=False)
    _add_engine_flags(parser)
    return {action.dest: action.default for action in parser._actions}
