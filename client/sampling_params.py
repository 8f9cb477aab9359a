"""SamplingParams: vLLM's name and fields for how to sample, as one reusable frozen object.

Why a class when the clients take keywords: the offline `LLM.generate(prompts, sampling_params)` applies one
set of parameters to many prompts (or one per prompt), as vLLM's does, so code moving over from vLLM keeps
its shape. Fields left None stay unset on the wire and take the server's defaults (max_tokens 16,
temperature 1.0, top_p 1.0, top_k off, n 1), exactly as with the keyword API. The fields are the rows of
protos/pagedserve/v1/sampling_fields.py (tests/test_sampling_field_table.py checks they stay so).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from client.structured_outputs import StructuredOutputsParams
from protos.pagedserve.v1.sampling_fields import SAMPLING_FIELDS


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    # Generation stops before the first occurrence of any of these (not included in the output).
    stop: str | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool | None = None
    # Parallel sampling: n sequences returned, best of best_of generated.
    n: int | None = None
    best_of: int | None = None
    # Beam search when > 1 (greedy).
    beam_width: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # {token id: bias}; kept as sorted (id, bias) pairs so the object stays hashable.
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    bad_words: tuple[str, ...] | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    # Top alternatives per generated / prompt token (0: the token's own logprob and rank only).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # Constrained decoding: a JSON schema, regex, choice or grammar the output must follow.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Lists are accepted as vLLM's are, and kept as tuples so the object stays hashable and immutable.
        for row in SAMPLING_FIELDS:
            value = getattr(self, row.name)
            if row.repeated and isinstance(value, list):
                object.__setattr__(self, row.name, tuple(value))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted((int(k), v) for k, v in self.logit_bias.items())))

    def keywords(self) -> dict[str, Any]:
        """The SDK's sampling keywords (`Client.generate(..., **params.keywords())`), unset ones left out."""
        return {field.name: (dict(value) if field.name == "logit_bias" else
                             list(value) if isinstance(value, tuple) else value)
                for field in dataclasses.fields(self)
                if (value := getattr(self, field.name)) is not None}
