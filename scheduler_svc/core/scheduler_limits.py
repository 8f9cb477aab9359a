"""The scheduler's fixed limits and switches, validated once when the service starts.

Who owns it: the service builds one from its config and hands it to the `Scheduler`; frozen, so every reader
sees the same values for the scheduler's whole life.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int  # requests holding a worker row at once
    max_num_batched_tokens: int  # tokens in one forward pass
    max_model_len: int
    preemption_mode: str = "recompute"  # "recompute" | "swap"
    # Must match the BlockManager's (the scheduler checks): the cache lives there, the switch is read here.
    enable_prefix_caching: bool = True
    # Off: a prompt (the part not found in the prefix cache) is computed in one step or waits; which needs a
    # token budget of at least max_model_len, or a long prompt would wait forever.
    enable_chunked_prefill: bool = True
    # Multi-LoRA: the most distinct adapters among the running requests (so in any step); the base model does not
    # count. A waiting request of another adapter waits, in queue order (step_planner.py).
    max_loras: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len})"
            )
