"""`pagedserve bench SUBCOMMAND`: registers each benchmark's parser and dispatches to its `run(args)`.

Each benchmark module owns its flags (`add_arguments(parser)`) and its entry point (`run(args) -> int`); this
file only names them, so adding a benchmark is two lines here.
"""

from __future__ import annotations

import argparse

from pagedserve.bench import serve


def add_bench_commands(subparsers: argparse._SubParsersAction) -> None:
    """Adds `bench` to the `pagedserve` command's subparsers, with one subcommand per benchmark."""
    bench = subparsers.add_parser("bench", help="benchmarks: serve (online, against a running server)")
    benchmarks = bench.add_subparsers(dest="bench_command", required=True)
    serve_parser = benchmarks.add_parser("serve", help="online serving benchmark against a running server "
                                                       "(vllm bench serve's flags and summary)")
    serve.add_arguments(serve_parser)
    serve_parser.set_defaults(bench_run=serve.run)


def run_bench(args: argparse.Namespace) -> int:
    return args.bench_run(args)
