"""What every service process does first, and the standalone entry point each service's `__main__` runs.

Why one place: the scheduler, the worker and the gateway each run as their own process (`python -m
scheduler_svc`, started by `pagedserve serve` or by docker compose); each must name itself in its log lines
and, when a launcher started it, die with that launcher so no orphan outlives a killed `pagedserve serve`.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

_PR_SET_PDEATHSIG = 1


def service_main(
    name: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
) -> int:
    """Parses the service's own flags, sets the process up, runs it; returns its exit code."""
    parser = argparse.ArgumentParser(prog=f"pagedserve {name}", description=description)
    add_arguments(parser)
    add_exit_with_parent_argument(parser)
    args = parser.parse_args(argv)
    start_service_process(name, args.exit_with_parent)
    return run(args)


def add_exit_with_parent_argument(parser: argparse.ArgumentParser) -> None:
    """Hidden: set by a launcher for the children it starts."""
    parser.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)


def start_service_process(name: str, exit_with_parent: bool) -> None:
    """Log lines carry the service's name; with `exit_with_parent`, the process dies with its launcher."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    if exit_with_parent:
        _exit_with_parent()


def _exit_with_parent() -> None:
    """Asks Linux to send this process SIGTERM when its parent exits (a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent already died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
