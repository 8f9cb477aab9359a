"""The gateway's entry point: `python -m gateway` (and `pagedserve gateway`, which delegates here) parses
the gateway's flags into its one config and serves HTTP."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gateway.config import add_gateway_arguments, gateway_config_from_args
from service_runtime.service_process import service_main

DESCRIPTION = "start the OpenAI-compatible HTTP gateway alone"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_gateway_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from gateway.server import run_gateway

    return run_gateway(gateway_config_from_args(args))


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("gateway", DESCRIPTION, add_arguments, run, argv)
