"""Where a constrained step's host time goes: the mask fills on llguidance's threads, the matchers' advances,
and how long the worker waited for masks it was ready to draw with.

Why apart from the step timer: a fill runs on another thread while the worker's own thread prepares the
next step, so it is no phase of the worker's loop; what decides whether it costs throughput is whether it
ends before the forward pass it hides under (a few milliseconds). Logged at shutdown beside the step timer
(`benchmarks/structured_outputs_gpu.py` reads it). Cheap enough to stay on: two perf_counter calls per fill
or advance.
"""

from __future__ import annotations

import threading


class GrammarTiming:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # fills end on the background thread
        self._totals = {"fill": [0, 0, 0.0, 0.0], "advance": [0, 0, 0.0, 0.0], "wait": [0, 0, 0.0, 0.0]}

    def add(self, what: str, rows: int, seconds: float) -> None:
        """One fill, advance or wait ("fill", "advance", "wait") of `rows` rows that took `seconds`."""
        with self._lock:
            total = self._totals[what]
            total[0] += 1
            total[1] += rows
            total[2] += seconds
            total[3] = max(total[3], seconds)

    def summary(self) -> str:
        """One line for the log; '' when nothing was constrained."""
        parts = [f"{what} x {count} ({rows / count:.0f} rows): mean {1e3 * seconds / count:.3f} ms, "
                 f"max {1e3 * longest:.2f} ms"
                 for what, (count, rows, seconds, longest) in self._totals.items() if count]
        return "grammar masks: " + "; ".join(parts) if parts else ""
