"""The request the engine accepts, and the error for one it refuses.

Who owns what: the gRPC edge (`api/request_validation.py`) builds a `ValidatedRequest` from the wire message,
the tokenizer and the serving limits; the engine takes it as is. Both live in the core so that the engine and
the core's tests need neither the wire schema nor the validator to make or refuse a request.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """A request the server refuses; str() is safe to send back to the client."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class ResumedOutput:
    """The output a client already received before its scheduler was lost (GenerateRequest.resume): the
    resumed request starts with these tokens as its output and streams only what follows them."""

    token_ids: tuple[int, ...]
    num_sent_chars: int
    cumulative_logprob: float = 0.0


@dataclass(frozen=True)
class ValidatedRequest:
    """A prompt as token ids and its checked sampling parameters: every range and size limit already holds."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    resume: ResumedOutput | None = None  # None: a new request
    # The LoRA adapter it runs with (GenerateRequest.lora_name, checked against the adapters served) and its
    # directory and load generation (api/lora_registry.py); None and "": the base model.
    lora_name: str | None = None
    lora_path: str = ""
    lora_generation: int = 0
