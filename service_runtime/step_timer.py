"""Cumulative wall time per phase of the per-step loop, for the question "where does a step's time go".

Owned by one loop (the engine's or a worker's); never shared. Cheap enough to stay on: one perf_counter
call per phase boundary. `summary()` is logged at shutdown and read by benchmarks from the service log.
"""

from __future__ import annotations

import time


class StepTimer:
    """Also per kind of step when the owner says which (`kind`): the worker's decode-only steps and steps with
    prefill cost very different host time, and a mean over both says little about either."""

    def __init__(self, name: str, clock=time.perf_counter):
        """`clock`: wall time; a benchmark on a busy machine may pass time.thread_time (the loop's CPU time)."""
        self.name = name
        self._clock = clock
        self._totals: dict[str, float] = {}
        self._steps = 0
        self._last = 0.0
        self._kind: str | None = None
        self._before_kind: dict[str, float] = {}  # the current step's phases before its kind was known
        self._by_kind: dict[str, dict[str, float]] = {}
        self._steps_by_kind: dict[str, int] = {}

    def start_step(self) -> None:
        self._steps += 1
        self._kind = None
        self._before_kind = {}
        self._last = self._clock()

    def resume(self, kind: str | None = None) -> None:
        """Restarts the clock without counting a new step (a step's phases split across the loop); `kind`:
        the step's, whose phases follow."""
        self._kind = kind
        self._last = self._clock()

    def set_kind(self, kind: str) -> None:
        """The current step's kind, once known: its phases so far and from now on count under it too."""
        self._kind = kind
        self._steps_by_kind[kind] = self._steps_by_kind.get(kind, 0) + 1
        totals = self._by_kind.setdefault(kind, {})
        for phase, seconds in self._before_kind.items():
            totals[phase] = totals.get(phase, 0.0) + seconds
        self._before_kind = {}

    def mark(self, phase: str) -> None:
        """Charges the time since the previous mark (or the step's start) to `phase`."""
        now = self._clock()
        elapsed = now - self._last
        self._totals[phase] = self._totals.get(phase, 0.0) + elapsed
        totals = self._before_kind if self._kind is None else self._by_kind.setdefault(self._kind, {})
        totals[phase] = totals.get(phase, 0.0) + elapsed
        self._last = now

    def add(self, phase: str, seconds: float) -> None:
        """Charges `seconds` measured elsewhere to `phase` (a part of another phase: the clock is not moved)."""
        self._totals[phase] = self._totals.get(phase, 0.0) + seconds

    def totals(self) -> tuple[int, dict[str, float]]:
        """(steps so far, seconds per phase so far): a benchmark diffs two of these to time a window of steps."""
        return self._steps, dict(self._totals)

    def summary(self) -> str:
        steps = max(self._steps, 1)
        phases = " ".join(f"{phase}={1e3 * total / steps:.3f}ms" for phase, total in self._totals.items())
        kinds = "".join(
            f"; {kind} x {self._steps_by_kind[kind]}: "
            + " ".join(f"{phase}={1e3 * total / self._steps_by_kind[kind]:.3f}ms" for phase, total in totals.items())
            for kind, totals in self._by_kind.items() if self._steps_by_kind.get(kind))
        return f"{self.name} step time over {self._steps} steps (mean per step): {phases}{kinds}"


class BackToBackClock:
    """Device time per step, by kind, from the intervals between steps finishing back to back.

    Why: the worker launches step N+1 before it waits for step N, so while plans keep coming the device runs
    steps back to back and the interval between two finishes is the later step's device time (no events in
    the kernels' way). Intervals of steps launched with nothing in flight include idle time and are skipped.
    """

    def __init__(self) -> None:
        self._last: float | None = None
        self._totals: dict[str, list[float]] = {}

    def on_finished(self, kind: str, back_to_back: bool) -> None:
        now = time.perf_counter()
        if back_to_back and self._last is not None:
            total = self._totals.setdefault(kind, [0.0, 0])
            total[0] += now - self._last
            total[1] += 1
        self._last = now

    def summary(self) -> str:
        parts = [f"{kind} {1e3 * total / count:.2f} ms x {count}" for kind, (total, count) in self._totals.items()]
        return "device time per back-to-back step: " + (", ".join(parts) or "none")
