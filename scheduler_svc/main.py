"""The scheduler service's entry point: `python -m scheduler_svc` (and `pagedserve scheduler`, which
delegates here) parses the scheduler's flags into its one config and runs the service."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from scheduler_svc.config import add_scheduler_arguments, scheduler_config_from_args
from service_runtime.service_process import service_main

DESCRIPTION = "start the scheduler service alone"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The standalone scheduler's flags: every flag of its config (scheduler_svc/config.py), its own API key,
    where it listens, the ZeroMQ address to bind and how many worker ranks to wait for among them."""
    add_scheduler_arguments(parser, shared_only=False)


# The exit code of a scheduler that crashed (an exception nothing handled), as of one killed by a signal: its
# supervisor restarts it and the clients resume their streams (client/stream_resume.py). Exit 1 stays the
# scheduler's own decision after losing its workers for good, which `pagedserve serve` does not undo.
CRASH_EXIT_CODE = 70  # EX_SOFTWARE


def run(args: argparse.Namespace) -> int:
    from scheduler_svc.service import run_scheduler_service

    config = scheduler_config_from_args(args)
    refusal = config.lora_refusal(with_speculation=True)
    if refusal is not None:
        raise SystemExit(refusal)
    try:
        return asyncio.run(run_scheduler_service(config))
    except Exception:
        logging.getLogger("scheduler_svc").exception("the scheduler crashed")
        return CRASH_EXIT_CODE


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("scheduler", DESCRIPTION, add_arguments, run, argv)
