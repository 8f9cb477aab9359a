"""Per-request sampling parameters as the scheduler holds them.

Parsed and validated once, at the gRPC edge (`request_validation.py`), from the wire message; immutable after
that, so the scheduler, the stop checks and the plan builder can share one object without copying. Names and
defaults follow vLLM's `SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = -1  # -1 = off
    # Always set once admitted: the scheduler draws one for requests that gave none, so a request samples
    # the same tokens after a preemption as it would have without.
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
