"""Which engine (data-parallel replica) serves a request: the routing policies and the front's own in-flight
counts. Pure Python: the front (front_service.py) calls `route` when a request arrives and `release` when its
stream ends, whatever the ending.

Policies (--router-policy):
- prefix (default): rendezvous hashing (highest random weight) of the request's prefix key (its first KV
  block's key, prefix_key.py) over the engines that serve: every request whose prompt starts with the same
  block goes to the same engine, whose prefix cache then holds the shared prefix (a multi-turn chat's turns).
  Why rendezvous rather than a hash ring: with a handful of engines it is a loop of N digests, needs no virtual
  nodes to balance, and an engine that stops serving moves only its own keys. Load bound: when the chosen
  engine has more than `load_bound` in-flight requests above the least loaded engine, the request goes to the
  least loaded one instead (a hot prefix spills rather than queueing on one engine while others idle). A
  request with no key (a prompt the front cannot read) is routed as least-load.
- least-load: the engine with the fewest in-flight requests; ties go round-robin, so an idle burst alternates.
- round-robin: the engines in turn.

Ownership: the counts are this front's own requests (not the engines' queues, which other clients may also
fill), rebuilt empty at every start; `routed` counts requests per engine since start (the metrics' router
counters). Candidates are passed per call: the front knows which engines serve now.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

POLICIES = ("prefix", "least-load", "round-robin")
DEFAULT_LOAD_BOUND = 16


class Router:
    def __init__(self, policy: str, num_engines: int, load_bound: int = DEFAULT_LOAD_BOUND) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self.load_bound = load_bound
        self.in_flight = [0] * num_engines
        self.routed = [0] * num_engines
        self._cursor = 0  # round-robin's next engine, and least-load's tie-breaker

    def route(self, prefix_key: bytes | None, candidates: Sequence[int]) -> int:
        """The engine for a new request among `candidates` (non-empty); counts it in flight there."""
        if self.policy == "round-robin":
            engine = self._next_in_turn(candidates)
        elif self.policy == "prefix" and prefix_key is not None:
            engine = max(candidates, key=lambda candidate: _score(prefix_key, candidate))
            if self.in_flight[engine] > min(self.in_flight[c] for c in candidates) + self.load_bound:
                engine = self._least_loaded(candidates)
        else:
            engine = self._least_loaded(candidates)
        self.in_flight[engine] += 1
        self.routed[engine] += 1
        return engine

    def release(self, engine: int) -> None:
        """A request routed to `engine` ended (finished, failed or cancelled)."""
        self.in_flight[engine] -= 1

    def _least_loaded(self, candidates: Sequence[int]) -> int:
        fewest = min(self.in_flight[c] for c in candidates)
        return self._next_in_turn([c for c in candidates if self.in_flight[c] == fewest])

    def _next_in_turn(self, candidates: Sequence[int]) -> int:
        """The first candidate at or after the cursor (cyclically), and the cursor moves past it."""
        num_engines = len(self.in_flight)
        engine = min(candidates, key=lambda c: (c - self._cursor) % num_engines)
        self._cursor = (engine + 1) % num_engines
        return engine


def _score(prefix_key: bytes, engine: int) -> bytes:
    """Rendezvous hashing's weight of `engine` for `prefix_key`: a digest of both, compared as bytes."""
    return hashlib.blake2b(prefix_key + engine.to_bytes(4, "little"), digest_size=8).digest()
