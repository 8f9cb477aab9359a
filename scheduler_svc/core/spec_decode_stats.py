"""Speculative decoding counters over the scheduler's life: vLLM's spec_decode metrics.

Who owns it: the `Scheduler`, which counts each verified draft run when it applies a step's result; the stats
RPC and the gateway's /metrics read it (vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens,
_num_accepted_tokens_per_pos). Mean tokens per verification step = 1 + accepted / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # draft runs verified (one per request per step that carried drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [j]: draft runs whose draft at position j was accepted (grows to the longest run seen).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def count(self, num_drafts: int, num_accepted: int) -> None:
        """One verified run of `num_drafts` drafts, its first `num_accepted` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_drafts:
            self.num_accepted_tokens_per_pos.extend([0] * (num_drafts - len(self.num_accepted_tokens_per_pos)))
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1
