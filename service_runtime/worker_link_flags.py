"""The flags both ends of the scheduler <-> worker ZeroMQ link must agree on, defined once for both parsers.

Why here and not in either service: the scheduler binds the address the workers connect to, and each side
times the other out after three of its heartbeat intervals; `pagedserve serve` gives both children the same
values, and `pagedserve scheduler` / `pagedserve worker` started by hand (docker compose) need the same
defaults on both sides.
"""

from __future__ import annotations

import argparse

DEFAULT_WORKER_ADDRESS = "tcp://127.0.0.1:5557"


def add_heartbeat_argument(parser: argparse.ArgumentParser) -> None:
    """--heartbeat-interval, shared by the scheduler, the worker and `pagedserve serve` (which gives both the
    same value)."""
    parser.add_argument("--heartbeat-interval", type=float, default=2.0,
                        help="seconds between heartbeats over ZeroMQ; a peer silent for 3 intervals is dead")
