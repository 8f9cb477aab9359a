"""The worker service's entry point: `python -m worker_svc` (and `pagedserve worker`, which delegates here)
parses one rank's flags into the worker's one config and runs it."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import NoReturn

from service_runtime.load_refusal import LOAD_REFUSED_EXIT_CODE, LoadRefused
from service_runtime.quiet_exit import exit_after_flush
from service_runtime.service_process import service_main
from worker_svc.config import add_worker_arguments, worker_config_from_args
from worker_svc.stop_signal import leave_with_the_scheduler_on_sigterm

DESCRIPTION = "start one worker process alone"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The standalone worker's flags: every flag of its config (worker_svc/config.py), the model, the
    scheduler's ZeroMQ address and this process's place in its tensor-parallel group among them."""
    add_worker_arguments(parser, shared_only=False)


def run(args: argparse.Namespace) -> NoReturn:
    """Serves until told to stop, then exits without the interpreter's teardown (service_runtime/quiet_exit.py
    says why). A model refused while loading (service_runtime/load_refusal.py) exits with one line and
    LOAD_REFUSED_EXIT_CODE; any other failure before serving still raises with its traceback."""
    from worker_svc.serving_loop import run_worker

    if not getattr(args, "exit_with_parent", False):
        leave_with_the_scheduler_on_sigterm()
    try:
        code = run_worker(worker_config_from_args(args))
    except LoadRefused as refusal:
        logging.getLogger(__name__).error("rank %d: cannot serve %s: %s", args.rank,
                                          args.model or "the default model", refusal)
        code = LOAD_REFUSED_EXIT_CODE
    exit_after_flush(code)


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("worker", DESCRIPTION, add_arguments, run, argv)
