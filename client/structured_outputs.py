"""StructuredOutputsParams: vLLM's `vllm.sampling_params.StructuredOutputsParams`, one constraint on the output.

Why a class: it is what vLLM code passes as `SamplingParams(structured_outputs=...)`, so offline code and SDK
calls move over unchanged. Exactly one of json (a JSON schema, as a dict or JSON text), regex, choice, grammar
(Lark or GBNF) or json_object; disable_any_whitespace applies to the JSON kinds; reasoning_end starts the
constraint after a reasoning model's thought. The server builds and checks
the grammar and refuses a bad one with INVALID_ARGUMENT naming the field (sampling.structured_outputs.<kind>).
"""

from __future__ import annotations

import json as json_text
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protos.pagedserve.v1 import generate_pb2

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # A reasoning model's end-of-thought token text (`</think>`): the constraint applies after it (not vLLM's
    # per-request field: vLLM's engine takes it from its --reasoning-parser; here the gateway sends its own).
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        # Kept as JSON text and a tuple, so the object (and a SamplingParams holding it) stays hashable.
        if isinstance(self.json, Mapping):
            object.__setattr__(self, "json", json_text.dumps(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"structured_outputs: give one constraint, not {' and '.join(given)}")

    @classmethod
    def of(cls, value: StructuredOutputsParams | Mapping[str, Any]) -> StructuredOutputsParams:
        """A keyword's value: the class itself, or a dict of its fields (as an OpenAI extra body carries it)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError("structured_outputs must be a StructuredOutputsParams or a dict, "
                            f"got {type(value).__name__}")
        unknown = sorted(set(value) - {*KINDS, "disable_any_whitespace", "reasoning_end"})
        if unknown:
            raise TypeError(f"structured_outputs: unknown field(s) {', '.join(unknown)}")
        return cls(**value)

    def to_wire(self) -> generate_pb2.StructuredOutputs:
        wire = generate_pb2.StructuredOutputs(disable_any_whitespace=self.disable_any_whitespace,
                                              reasoning_end=self.reasoning_end or "")
        if self.json is not None:
            wire.json = self.json
        elif self.regex is not None:
            wire.regex = self.regex
        elif self.choice is not None:
            wire.choice.SetInParent()  # an empty list is still a choice; the server refuses it by name
            wire.choice.choices.extend(self.choice)
        elif self.grammar is not None:
            wire.grammar = self.grammar
        elif self.json_object:
            wire.json_object = True
        return wire
