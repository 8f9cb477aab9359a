"""`pagedserve bench SUBCOMMAND`: the subcommands' parsers, registered on `pagedserve`'s, and their dispatch.

Each subcommand's module owns its help (`HELP`), its flags (`add_arguments(parser)`) and its run
(`run(args) -> exit code`); this file only names them, so that adding one is one line here.
"""

from __future__ import annotations

import argparse

from pagedserve.bench import latency, serve, throughput

SUBCOMMANDS = (("serve", serve), ("throughput", throughput), ("latency", latency))


def add_bench_commands(subparsers: argparse._SubParsersAction) -> None:
    """Adds `bench` and its subcommands to `pagedserve`'s subcommands."""
    bench = subparsers.add_parser("bench", help="benchmarks, as vLLM's `vllm bench` (serve, throughput, latency)")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    for name, module in SUBCOMMANDS:
        parser = commands.add_parser(name, help=module.HELP, description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(parser)
        parser.set_defaults(bench_run=module.run)


def run_bench(args: argparse.Namespace) -> int:
    """Runs the subcommand `args` were parsed for; its exit code."""
    return args.bench_run(args)
