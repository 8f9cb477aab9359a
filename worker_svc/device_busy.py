"""How much of the wall time the GPU spends on steps while decode steps follow each other (the target is
"busy at least 95% of wall time in steady decode"), from CUDA events.

Why events around each step: the worker records one timing event before a step's first device work and
another after its result's copy (the event the host waits on anyway). A step launched behind another starts
on the device the moment the previous one ends, so the interval from one step's end event to the next one's
start event is time the device sat idle waiting for the host (the scheduler's plan, the worker's launch);
the interval from start to end is the step's span. Busy = spans / (spans + gaps), counted over pairs of
decode-only steps (steady decode: prefill steps are long enough to hide any gap). What it cannot see: the
device idling inside a step while the host launches its kernels one by one (CUDA graphs keep that small for
decodes; `benchmarks/profile_decode_step.py --overlap` measures kernel time against wall time for that).
On the CPU there are no events and it reports nothing.
"""

from __future__ import annotations

import torch


class DeviceBusyClock:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._previous_end: torch.cuda.Event | None = None
        self._previous_kind = ""
        self._span_ms = 0.0
        self._gap_ms = 0.0
        self._steps = 0

    def step_started(self) -> torch.cuda.Event | None:
        """Records (and returns) the event before a step's first device work; None on the CPU."""
        if not self.enabled:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_ended(self) -> torch.cuda.Event | None:
        """A timing event for the end of a step's device work (record it after the step's last copy)."""
        return torch.cuda.Event(enable_timing=True) if self.enabled else None

    def on_finished(self, kind: str, started: torch.cuda.Event | None, ended: torch.cuda.Event | None) -> None:
        """Counts a finished step (its end event completed): its span and the idle gap before it, when it and
        the step before it were decode-only. Steps finish in launch order."""
        if started is None or ended is None:
            self._previous_end = None
            return
        if kind == "decode" and self._previous_kind == "decode" and self._previous_end is not None:
            self._span_ms += started.elapsed_time(ended)
            self._gap_ms += max(0.0, self._previous_end.elapsed_time(started))
            self._steps += 1
        self._previous_end, self._previous_kind = ended, kind

    def busy_fraction(self) -> float | None:
        total = self._span_ms + self._gap_ms
        return self._span_ms / total if total > 0 else None

    def summary(self) -> str:
        busy = self.busy_fraction()
        if busy is None:
            return "device busy in steady decode: not measured"
        return (f"device busy in steady decode: {100 * busy:.1f}% over {self._steps} steps "
                f"(idle {self._gap_ms / max(self._steps, 1):.3f} ms between steps, span "
                f"{self._span_ms / max(self._steps, 1):.3f} ms)")
