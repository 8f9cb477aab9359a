"""Several front processes on one public port (`--api-server-count N`, vLLM's name for its API servers): this
process supervises N front processes (front_service.py, each `--api-server-rank i`), which bind the same
host:port with SO_REUSEPORT, so the kernel hands each new client connection to one of them.

Why: one front is one Python process relaying every stream message of every engine through gRPC's asyncio
stack, and it saturates one core (benchmarks/data_parallel_cpu_limits.py measures CPU per relayed message;
docs/scale_out.md has the figures) before two GPU engines do. N processes relay N times as much. Why processes
on one port rather than a faster single relay: the relay's cost is gRPC's own per-message and per-call work,
which no change in our handler removes.

What each process keeps, and what that costs:
- its own channel to every engine, its own health polling and its own router (router.py). The prefix policy's
  key -> engine choice is rendezvous hashing over the engines that serve, the same function in every process,
  so a conversation's turns reach the same engine whichever process takes them: prefix affinity holds across
  processes. What is per process: the in-flight counts. least-load and the prefix policy's load bound see only
  the process's own share of the traffic, so each process's bound is --router-load-bound / N (rounded up),
  which with connections spread evenly keeps the documented imbalance overall; round-robin alternates per
  process (even overall). GetStats (and /metrics' router counters) come from whichever process answers: the
  engines' figures are whole, the router's counts are that process's. Abort still reaches every engine from
  any process; only the ids of requests waiting for a resend (their engine lost) are per process, and the SDK
  sends its Abort on the stream's own connection, so to the process that holds the request.
- balancing is per connection, not per request: one gRPC channel is one HTTP/2 connection and so one front
  process. Many clients (or a client with several connections: `bench serve --num-client-processes`) spread
  over all N; a single channel, such as the gateway's, uses one of them.

Start-up: the port is checked free first (without SO_REUSEPORT, so an unrelated server already on it is found,
not joined). Each process binds only once every engine has served (a lone front binds at once and answers
NOT_SERVING meanwhile): a connection then never reaches a process that is still starting. Stop: SIGTERM/SIGINT
are passed to every process, each drains its own streams (--shutdown-timeout). One process exiting on its own
(a crash) stops the others and this supervisor exits with its code, as a lone front's exit does: `pagedserve
serve` stops the stack, a restart policy brings it back whole.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from scheduler_svc.data_parallel.config import FrontConfig
from service_runtime.api_key_source import API_KEY_ENV
from service_runtime.config_flags import config_argv

logger = logging.getLogger(__name__)
POLL_S = 0.1


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on (or holds) host:port: a plain bind (no SO_REUSEPORT) fails."""
    for family, kind, proto, _, address in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no holder
            try:
                probe.bind(address)
            except OSError:
                return True
    return False


def front_process_argv(config: FrontConfig, rank: int) -> list[str]:
    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    return [sys.executable, "-m", "scheduler_svc.data_parallel",
            *config_argv(FrontConfig, {**values, "api_server_rank": rank}), "--exit-with-parent"]


def run_front_processes(config: FrontConfig) -> int:
    """Supervises config.api_server_count front processes until a signal stops them or one exits."""
    if port_in_use(config.host, config.port):
        raise SystemExit(f"--grpc-port {config.port}: already in use on {config.host or 'every interface'} (the "
                         f"{config.api_server_count} front processes would share it with that server)")
    environment = dict(os.environ)
    if config.api_key:  # never on a command line (forwarded=False): each process reads it from here
        environment[API_KEY_ENV] = config.api_key
    processes = [subprocess.Popen(front_process_argv(config, rank), env=environment)
                 for rank in range(config.api_server_count)]
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    logger.info("%d front processes on %s:%d: pids %s", len(processes), config.host, config.port,
                ", ".join(str(process.pid) for process in processes))
    while not stopping:
        exited = [process for process in processes if process.poll() is not None]
        if exited:
            logger.error("front process %d exited with code %d: stopping the others", exited[0].pid,
                         exited[0].returncode)
            stop(signal.SIGTERM, None)
            for process in processes:
                process.wait()
            return _exit_status(exited[0].returncode)
        time.sleep(POLL_S)
    codes = [process.wait() for process in processes]
    return next((_exit_status(code) for code in codes if code), 0)


def _exit_status(code: int) -> int:
    """A front process's exit as the supervisor's: a signal's death (-N) as a shell reports it (128 + N), any other
    failure as itself (1 if it said 0 while dying first)."""
    return 128 - code if code < 0 else code or 1
