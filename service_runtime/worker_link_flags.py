"""The flags both ends of the scheduler <-> worker ZeroMQ link must agree on, defined once for both configs.

Why here and not in either service: the scheduler binds the address the workers connect to, and each side
times the other out after three of its heartbeat intervals; `pagedserve serve` gives both children the same
values, and `pagedserve scheduler` / `pagedserve worker` started by hand (docker compose) need the same
defaults on both sides.
"""

from __future__ import annotations

from service_runtime.config_flags import Flag

DEFAULT_WORKER_ADDRESS = "tcp://127.0.0.1:5557"
DEFAULT_HEARTBEAT_INTERVAL = 2.0

# --heartbeat-interval, a field of the scheduler's config and the worker's (config_flags.shared_flag_field):
# `pagedserve serve` takes it once and gives both children the same value.
HEARTBEAT_INTERVAL = Flag(("--heartbeat-interval",),
                          help="seconds between heartbeats over ZeroMQ; a peer silent for 3 intervals is dead")
