"""Which workers are still alive, as far as the scheduler can tell; pure bookkeeping, no sockets, no clock.

Two signs of death, because each misses what the other sees:
- a connection that closes (the link's socket monitor): the process exited or was killed, seen at once on
  this host and on any host whose kernel is still up to close the TCP connection;
- silence (heartbeats): a worker that sends nothing at all for `MISSED_HEARTBEATS` of the intervals it
  announced is unresponsive, and dead once its silence also outlasts the grace (--heartbeat-grace), which
  catches a stopped or hung process and a host that vanished, where no connection ever closes. Any message
  counts as a sign of life, not only a heartbeat.

Why a grace beyond the missed heartbeats: a worker can be slow without being dead (a long compile holding its
process, a swap storm, a debugger's or an operator's SIGSTOP), and declaring it dead ends every request in
flight. Silence past the heartbeats is only reported (`newly_unresponsive`); a worker heard again within the
grace carries on as if nothing happened.

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
    reported_unresponsive: bool = False


class WorkerHealth:
    def __init__(self, default_interval: float, grace: float = 0.0):
        self._default_interval = default_interval
        self._grace = grace
        self._ranks: dict[int, _Rank] = {}

    def joined(self, rank: int, connection_fd: int | None, now: float) -> None:
        """A worker said hello; until it announces its own interval it is held to the scheduler's."""
        self._ranks[rank] = _Rank(connection_fd, now, self._default_interval)

    def heard(self, rank: int, now: float, interval: float | None = None) -> float | None:
        """Any message from `rank`; a heartbeat also announces the interval it keeps. Returns how long it had
        been silent when it had been reported unresponsive (it is back), else None."""
        state = self._ranks.get(rank)
        if state is None:
            return None
        back_after = now - state.last_heard if state.reported_unresponsive else None
        state.last_heard, state.reported_unresponsive = now, False
        if interval:
            state.interval = interval
        return back_after

    def rank_of_connection(self, connection_fd: int) -> int | None:
        """The rank whose connection this was (the monitor saw it close), or None for any other peer."""
        return next((rank for rank, state in self._ranks.items() if state.connection_fd == connection_fd), None)

    def first_silent(self, now: float) -> str | None:
        """Why the first worker silent past its heartbeats and the grace counts as dead, or None while all
        are alive."""
        for rank, state in sorted(self._ranks.items()):
            silent = now - state.last_heard
            if silent > max(MISSED_HEARTBEATS * state.interval, self._grace):
                missed = max(MISSED_HEARTBEATS, int(silent / state.interval))
                return (f"worker rank {rank} missed {missed} heartbeats (nothing for {silent:.1f} s, interval "
                        f"{state.interval:g} s, grace {self._grace:g} s)")
        return None

    def newly_unresponsive(self, now: float) -> list[tuple[int, float]]:
        """(rank, seconds silent) of each worker that just missed its heartbeats but is within the grace;
        each silence is reported once."""
        found = []
        for rank, state in sorted(self._ranks.items()):
            silent = now - state.last_heard
            if not state.reported_unresponsive and silent > MISSED_HEARTBEATS * state.interval:
                state.reported_unresponsive = True
                found.append((rank, silent))
        return found
