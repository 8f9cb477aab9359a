"""Which workers are still alive, as far as the scheduler can tell; pure bookkeeping, no sockets, no clock.

Two signs of death, because each misses what the other sees:
- a connection that closes (the link's socket monitor): the process exited or was killed, seen at once on
  this host and on any host whose kernel is still up to close the TCP connection;
- silence (heartbeats): a worker that sends nothing at all for `MISSED_HEARTBEATS` of the intervals it
  announced is dead, which also catches a stopped or hung process and a host that vanished, where no
  connection ever closes. Any message counts as a sign of life, not only a heartbeat.

Why ranks are tracked by the file descriptor of their connection: ZeroMQ's ROUTER reports a disconnect by
descriptor only (ROUTER_NOTIFY is a draft API), and a worker's descriptor is known from its hello frame.
"""

from __future__ import annotations

from dataclasses import dataclass

MISSED_HEARTBEATS = 3


@dataclass
class _Rank:
    connection_fd: int | None
    last_heard: float
    interval: float


class WorkerHealth:
    def __init__(self, default_interval: float):
        self._default_interval = default_interval
        self._ranks: dict[int, _Rank] = {}

    def joined(self, rank: int, connection_fd: int | None, now: float) -> None:
        """A worker said hello; until it announces its own interval it is held to the scheduler's."""
        self._ranks[rank] = _Rank(connection_fd, now, self._default_interval)

    def heard(self, rank: int, now: float, interval: float | None = None) -> None:
        """Any message from `rank`; a heartbeat also announces the interval it keeps."""
        state = self._ranks.get(rank)
        if state is None:
            return
        state.last_heard = now
        if interval:
            state.interval = interval

    def rank_of_connection(self, connection_fd: int) -> int | None:
        """The rank whose connection this was (the monitor saw it close), or None for any other peer."""
        return next((rank for rank, state in self._ranks.items() if state.connection_fd == connection_fd), None)

    def first_silent(self, now: float) -> str | None:
        """Why the first worker that missed its heartbeats counts as dead, or None while all are alive."""
        for rank, state in sorted(self._ranks.items()):
            silent = now - state.last_heard
            if silent > MISSED_HEARTBEATS * state.interval:
                return (f"worker rank {rank} missed {MISSED_HEARTBEATS} heartbeats "
                        f"(nothing for {silent:.1f} s, interval {state.interval:g} s)")
        return None
