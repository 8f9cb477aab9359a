"""The worker's steady-decode busy figure (worker_svc/device_busy.py): spans and idle gaps from step events,
counted only between decode-only steps. Fake events stand in for CUDA's (their times are known)."""

from __future__ import annotations

from worker_svc.device_busy import DeviceBusyClock


class FakeEvent:
    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, later: "FakeEvent") -> float:
        return later.ms - self.ms


def finish(clock: DeviceBusyClock, kind: str, start_ms: float, end_ms: float) -> None:
    clock.on_finished(kind, FakeEvent(start_ms), FakeEvent(end_ms))


def test_busy_is_spans_over_spans_and_gaps_between_decode_steps():
    clock = DeviceBusyClock(enabled=True)
    finish(clock, "with prefill", 0.0, 50.0)
    finish(clock, "decode", 50.0, 53.0)  # after a prefill: not counted (its gap is the prefill's business)
    finish(clock, "decode", 53.0, 56.0)  # back to back: no gap
    finish(clock, "decode", 57.0, 60.0)  # 1 ms idle before it
    assert clock.busy_fraction() == 6.0 / 7.0
    assert "85.7% over 2 steps" in clock.summary()


def test_a_step_without_events_breaks_the_run():
    clock = DeviceBusyClock(enabled=True)
    finish(clock, "decode", 0.0, 3.0)
    clock.on_finished("decode", None, None)  # sampled nothing: no end event
    finish(clock, "decode", 100.0, 103.0)  # its gap to 3.0 is not idle time we can attribute
    assert clock.busy_fraction() is None
    finish(clock, "decode", 103.5, 106.5)
    assert clock.busy_fraction() == 3.0 / 3.5


def test_disabled_on_the_cpu():
    clock = DeviceBusyClock(enabled=False)
    assert clock.step_started() is None and clock.step_ended() is None
    assert clock.summary() == "device busy in steady decode: not measured"
