"""The data-parallel front's entry point: `python -m scheduler_svc.data_parallel` (the launcher starts it for
`pagedserve serve -dp N`, N > 1) parses its flags into its one config and runs it (front_service.py), or with --api-server-count N > 1 runs N of
them on the one port (front_processes.py)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from scheduler_svc.data_parallel.config import add_front_arguments, front_config_from_args
from service_runtime.service_process import service_main

DESCRIPTION = "start the data-parallel front alone: route the gRPC API over several engines' schedulers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_front_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config = front_config_from_args(args)
    if not config.engine_targets:
        raise SystemExit("--engine-targets: give at least one engine's scheduler (host:port)")
    if config.api_server_count > 1 and config.api_server_rank is None:  # the supervisor of N front processes
        from scheduler_svc.data_parallel.front_processes import run_front_processes

        return run_front_processes(config)
    from scheduler_svc.data_parallel.front_service import run_front

    return asyncio.run(run_front(config))


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("front", DESCRIPTION, add_arguments, run, argv)
