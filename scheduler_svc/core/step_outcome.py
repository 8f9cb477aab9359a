"""What the worker reported for one step, as the scheduler's core and its request groups read it.

Who owns what: built by `worker_io.plan_codec.decode_step_result` from the wire StepResult, read by the engine
and the request groups (immutable). It lives in the core, not beside the codec, so that the groups and the
scheduler's tests know the outcome of a step without knowing its wire form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.core.token_logprobs import PromptLogprobChunk, TokenLogprob


@dataclass(frozen=True)
class StepOutcome:
    """What the worker reported for one step, keyed by scheduler request id."""

    sampled: dict[str, int]
    logprobs: dict[str, float]
    # Beam rows: (token id, logprob) candidates, best first.
    beam_candidates: dict[str, list[tuple[int, float]]]
    # Rows that asked for logprobs: the sampled token's rank and top alternatives.
    token_logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # Rows that asked for prompt logprobs and computed prompt tokens this step.
    prompt_logprobs: dict[str, PromptLogprobChunk] = field(default_factory=dict)
    # Requests the worker could not go on with (their grammar failed), with a short reason: each ends with an
    # error, the others go on (StepResult.failed_requests).
    failed: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: request id -> draft tokens kept before its `sampled` token (absent: none).
    accepted_drafts: dict[str, int] = field(default_factory=dict)
    # Their logprobs, in order (as `logprobs` for the sampled token): one logprob per token of the step.
    accepted_draft_logprobs: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # Speculative decoding with a draft model: request id -> the draft tokens proposed after this step (absent:
    # none proposed).
    proposed_drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)
