"""What one `Scheduler.schedule()` call decided: the plan of one step, before it becomes a protobuf StepPlan.

Who owns it: built by the scheduler, then read (never changed: every type here is frozen) by the engine
loop, which converts it to the wire StepPlan for the workers and later passes it back to
`Scheduler.update_from_output` with the sampled tokens.

Plans are diffs (DESIGN.md "Processes"): a request's tokens, sampling parameters and whole block table
travel once, as `NewRequestData`, when the worker holds no row for it; after that only `ScheduledRequestData`
(new block ids, a token count, and the rare copy-on-write replacement or engine-chosen beam token). The worker
applies a step in this order: drop `finished_request_ids` and `preempted_request_ids` rows, run `swap_out`,
`swap_in`, `copy`, add `new_requests` rows, apply `scheduled_requests` diffs to their rows, run one forward
over every scheduled token, and sample one token for each request whose computed tokens reach the end of its
known tokens (for a beam row, return its top candidates instead); a row with draft tokens samples at each of
their positions too and reports how many drafts it accepted before its token.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.lora_slots import LoraLoadData
from scheduler_svc.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the worker holds no row for: scheduled for the first time, or resumed after a preemption.

    After a recompute preemption `num_computed_tokens` is 0 and the generated tokens are prefilled again with
    the prompt; after a swap-in it counts the tokens whose K/V came back in `block_ids`.
    """

    request_id: str
    token_ids: tuple[int, ...]  # every known token: prompt, then any tokens generated before a preemption
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]  # the whole GPU block table (a prefix-cache hit or a fork shares some)
    num_computed_tokens: int  # > 0 after a prefix-cache hit, a fork or a swap-in
    num_scheduled_tokens: int
    num_beam_candidates: int = 0  # > 0: a beam row (return this many candidates, do not sample)
    num_prompt_tokens: int = 0  # the first num_prompt_tokens of token_ids are the prompt
    eos_token_ids: tuple[int, ...] = ()  # masked (with the stop ids) until min_tokens are generated
    lora_slot: int = 0  # the LoRA adapter's GPU slot (0: the base model); may change when resumed after preemption


@dataclass(frozen=True)
class ScheduledRequestData:
    """A request already running on the worker; its row already holds every token it was told or sampled."""

    request_id: str
    new_block_ids: tuple[int, ...]  # appended to the row's block table
    num_scheduled_tokens: int
    # Beam rows: tokens the engine appended (`Scheduler.append_token`) since the worker last saw the row,
    # appended to the row's tokens before the forward. Empty for rows that sample their own tokens.
    new_token_ids: tuple[int, ...] = ()
    # Copy-on-write: (index in the row's block table, new block id), applied before `new_block_ids` are
    # appended; the copy itself is in `SchedulerOutput.copy`.
    replaced_blocks: tuple[tuple[int, int], ...] = ()
    # Speculative decoding: tokens proposed to follow the row's last known token, computed with it in this step
    # (num_scheduled_tokens is 1 + their count); the worker keeps those its own sampling agrees with.
    draft_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. Block moves are (src, dst) pairs."""

    step_id: int
    new_requests: tuple[NewRequestData, ...]
    scheduled_requests: tuple[ScheduledRequestData, ...]
    # Every request that left since the previous output (finished or aborted), whichever queue it was in:
    # the worker drops the rows it has and ignores ids it holds no row for.
    finished_request_ids: tuple[str, ...]
    # Requests preempted in this step that the worker holds a row for (a forked child preempted before it ever
    # reached the worker is not listed); the worker drops their rows. Disjoint from the scheduled ones.
    preempted_request_ids: tuple[str, ...]
    swap_out: tuple[tuple[int, int], ...]  # (gpu_block, cpu_block)
    swap_in: tuple[tuple[int, int], ...]  # (cpu_block, gpu_block); never in the same step as a swap_out
    # (src gpu_block, dst gpu_block) copy-on-write copies, run after swap_in and before the forward; a src
    # may be written by its remaining holder in the same step's forward, never before the copy.
    copy: tuple[tuple[int, int], ...]
    total_num_scheduled_tokens: int
    # Requests whose computed tokens reach their end in this step, in plan order: those that sample (a token
    # comes back for each) and the fan-out roots and beam rows reported to the engine. Scheduler-side only.
    completing_request_ids: tuple[str, ...] = ()
    # Speculative decoding with a draft model: > 0 asks the workers to propose this many draft tokens after the
    # step for each row that samples in it (the scheduler plans them as the next step's drafts).
    propose_draft_tokens: int = 0
    # Multi-LoRA: adapters the workers load into GPU slots before this step's forward (lora_slots.py).
    lora_loads: tuple[LoraLoadData, ...] = ()

    def num_scheduled_tokens(self) -> dict[str, int]:
        """Request id -> tokens scheduled in this step, over new and already-running requests."""
        counts = {data.request_id: data.num_scheduled_tokens for data in self.new_requests}
        counts.update((data.request_id, data.num_scheduled_tokens) for data in self.scheduled_requests)
        return counts
