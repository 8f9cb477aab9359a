"""One generation request as the scheduler tracks it.

Who owns it: the scheduler thread only. The engine loop creates a `Request`, hands it to
`Scheduler.add_request`, and from then on only the scheduler mutates it (token counts, status, output ids);
the engine reads it back (the list `update_from_output` returns) to detokenize and stream. No lock guards
it, so nothing outside the scheduler thread may touch it.

Token counts, not phase flags. A request is described by two numbers:

- `num_tokens`: every token known so far (prompt + generated);
- `num_computed_tokens`: how many of them have their K/V in the KV cache.

Each step a running request is given `num_scheduled_tokens = min(num_tokens - num_computed_tokens, budget)`,
and the worker samples a token for it exactly when `num_computed_tokens + num_scheduled_tokens == num_tokens`.
(Counts advance when a step is planned; a token sampled by a step still in flight is counted in
`num_tokens` as a pending token, so the next step can be planned before the result is back.)
That one rule is prefill (computed 0), chunked prefill (the budget cuts the prompt), decode (computed is
num_tokens - 1, the newest token has no K/V yet), recompute after preemption (computed reset to 0, the
generated tokens stay in `output_token_ids` and are prefilled again) and swap-in (computed kept, since the
K/V came back). A prefix-cache hit or a fork is simply a request that starts with computed > 0.

Two kinds of request do not sample (the worker samples a row only when its computed tokens reach its known
tokens, and never a beam row):
- a fan-out root (`prefill_only`, for n > 1 / best_of): computes its prompt but the last token, then the
  engine forks the sampling children from it and releases it;
- a beam row (`num_beam_candidates` > 0): the worker returns that many top candidates for its last token and
  the engine's beam search appends the token it chose (`Scheduler.append_token`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler_svc.core.sampling_params import SamplingParams


class FinishReason(enum.Enum):
    """Why a request left; mirrors the public API's FinishReason."""

    STOP = "stop"  # EOS, a stop token id, or a stop string (found by the engine)
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the client or the server


class RequestStatus(enum.Enum):
    """Which queue a request is in; the FINISHED_* members say it left and why."""

    WAITING = "waiting"  # no KV blocks; never scheduled, or preempted by recompute
    RUNNING = "running"  # holds GPU blocks and a row on the worker
    SWAPPED = "swapped"  # its blocks sit in the swap (CPU) pool; no worker row
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @staticmethod
    def finished_by(reason: FinishReason) -> RequestStatus:
        if reason is FinishReason.STOP:
            return RequestStatus.FINISHED_STOPPED
        if reason is FinishReason.LENGTH:
            return RequestStatus.FINISHED_LENGTH
        return RequestStatus.FINISHED_ABORTED


@dataclass(eq=False)  # identity equality: two requests are never "equal" by value
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    # Lower runs first; FCFS within a priority. Forked children take their parent's.
    priority: int = 0
    # Fan-out root: computed up to num_prompt_tokens - 1 tokens, never samples (see the module docstring).
    prefill_only: bool = False
    # > 0: a beam row; the worker returns this many candidates instead of sampling.
    num_beam_candidates: int = 0
    # Admission order, assigned by `Scheduler.add_request` (a forked child inherits its parent's); with
    # `fork_seq` (0, or the scheduler's fork number for a child) it orders requests of equal priority.
    arrival_seq: int = -1
    fork_seq: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the KV cache (GPU, or the swap pool while SWAPPED), counting those of steps
    # already planned whose results have not come back: the count advances when a step is scheduled.
    num_computed_tokens: int = 0
    # Tokens sampled by planned steps whose results have not come back yet (one per such step): with step N
    # in flight the scheduler plans step N+1 as if its token were known (the worker feeds it from its row).
    num_pending_tokens: int = 0
    # Speculative decoding: the draft tokens of this request's step in flight (planned with its decode, not yet
    # verified); its computed tokens count them. Not planned again, nor preempted, until the result applies
    # the accepted ones (`Scheduler.update_from_output`); () otherwise.
    draft_token_ids: tuple[int, ...] = ()
    # Speculative decoding with a draft model: the tokens the workers' draft model proposed to follow this
    # request's first `proposed_after` tokens (its known tokens when the proposing step's result was applied).
    # The planner takes them as drafts only while the request still has exactly those tokens; a proposal for
    # older tokens is never used.
    proposed_draft_token_ids: tuple[int, ...] = ()
    proposed_after: int = -1
    # Multi-LoRA: the adapter the request runs with (name, directory, generation; None: the base model), part of its
    # prefix-cache keys (block_manager.py); forked children, preemptions and worker recovery keep it. Its GPU
    # slot (lora_slots.py; 0: none) is given by the planner whenever the request gets a worker row: fixed while
    # it runs, possibly another after a preemption.
    lora_name: str | None = None
    lora_path: str = ""
    lora_generation: int = 0  # which load of the name (api/lora_registry.py): a reload is another adapter
    lora_slot: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0

    @property
    def lora_key(self) -> tuple[str, str, int]:
        """The adapter's identity (name, directory, generation) in the GPU slots and the prefix cache."""
        return self.lora_name or "", self.lora_path, self.lora_generation

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) without building the whole token list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def max_kv_tokens(self, max_model_len: int) -> int:
        """The most tokens this request can ever need K/V slots for.

        A request is scheduled only while unfinished, so at most prompt + max_tokens - 1 tokens (the last
        sampled token is never computed), capped at max_model_len - 1 the same way; a prompt of exactly
        max_model_len still needs all its slots to sample its one token. Admission compares this with the pool.
        """
        capped = min(self.num_prompt_tokens + self.sampling_params.max_tokens, max_model_len) - 1
        return max(self.num_prompt_tokens, capped)
