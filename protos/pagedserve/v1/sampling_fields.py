"""The sampling fields of the public API, declared once: name, wire type, default, range, OpenAI names, and
where each is applied.

Why a table: one sampling field crosses five schemas (the gateway's request model, the SDK's keywords and
SamplingParams, the CLI's flags, the wire's SamplingParams in generate.proto, the scheduler's validation and
its SamplingParams). Written out by hand in each, they drift: a default changed in one, a range checked with
another message in a second, a keyword forgotten in a third. Here each field is one row; the places that can
read it derive from it (the scheduler's range checks and their messages, the SDK's keyword set, the CLI's
plain numeric flags), and tests/test_sampling_field_table.py checks the places that are written by hand (the
proto, the gateway's pydantic models, the SDK's and the scheduler's SamplingParams dataclasses) against it.

Why here, beside generate.proto: the gateway, the SDK and the scheduler all import protos/ and nothing of each
other, so this is the one place all three can read. Stdlib only, like the rest of the wire schema's Python.

What stays in code: what a field means beyond its range. Stop strings, logit_bias's token ids, bad words,
structured outputs, beam search's rules and the checks that tie two fields together are written where they
are applied; `applied_in` says where.

`name` is at once the wire field's, the SDK keyword's and vLLM's name (vLLM's SamplingParams, or its
BeamSearchParams for the beam-search fields): generate.proto promises vLLM's vocabulary, so there is one name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

# What a wire integer type can carry: a value past it is refused before it reaches protobuf.
INTEGER_WIRE_RANGES: Mapping[str, tuple[int, int]] = MappingProxyType({
    "int32": (-(2**31), 2**31 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
})
_PYTHON_TYPES: Mapping[str, type] = MappingProxyType(
    {"int32": int, "uint32": int, "uint64": int, "float": float, "bool": bool, "string": str})

Bound = float | str | None


@dataclass(frozen=True)
class ValueRange:
    """The values a field accepts (each element's, for a list or a map's values), as the scheduler checks them.

    A bound is a number, or a name: "--flag" is a server limit (its value comes from the server's
    configuration), any other name is another field of the same request. The refusal shows a flag's value
    and a field's name, and says what each name stood for: "must lie in [n, 64] (n = 3; --max-n)"."""

    low: Bound = None
    high: Bound = None
    low_open: bool = False  # the low bound itself is refused
    high_open: bool = False
    # Replaces the derived requirement text where the bounds alone would not say what the values mean.
    text: str = ""

    def names(self) -> tuple[str, ...]:
        """The server limits and request fields the bounds name, which `contains` and `requirement` need."""
        return tuple(bound for bound in (self.low, self.high) if isinstance(bound, str))

    def contains(self, value: float, resolved: Mapping[str, float] = MappingProxyType({})) -> bool:
        """Whether `value` lies in the range; NaN and infinities never do."""
        if isinstance(value, float) and not math.isfinite(value):
            return False
        low, high = (_resolve(bound, resolved) for bound in (self.low, self.high))
        if low is not None and (value < low or (self.low_open and value == low)):
            return False
        return high is None or (value < high or (not self.high_open and value == high))

    def requirement(self, is_integer: bool, resolved: Mapping[str, float] = MappingProxyType({})) -> str:
        """The refusal's text: "must lie in (0, 2]", "must be at least 0", "must be a finite number >= 0"."""
        if self.text:
            return self.text
        if self.low is None and self.high is None:
            return "must be a finite number"
        if self.high is None:
            low = _shown(self.low, resolved)
            return f"must be at least {low}" if is_integer else f"must be a finite number >= {low}"
        low = "-inf" if self.low is None else _shown(self.low, resolved)
        interval = (f"{'(' if self.low_open else '['}{low}, {_shown(self.high, resolved)}"
                    f"{')' if self.high_open else ']'}")
        notes = [f"{name} = {_number(resolved[name])}" if not name.startswith("--") else name
                 for name in self.names()]
        return f"must lie in {interval}" + (f" ({'; '.join(notes)})" if notes else "")


def _resolve(bound: Bound, resolved: Mapping[str, float]) -> float | None:
    return resolved[bound] if isinstance(bound, str) else bound


def _shown(bound: float | str, resolved: Mapping[str, float]) -> str:
    if isinstance(bound, str) and bound.startswith("--"):
        return _number(resolved[bound])
    return bound if isinstance(bound, str) else _number(bound)


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class SamplingField:
    """One field of generate.proto's SamplingParams, and what every schema that carries it must agree on."""

    name: str
    # The proto type: "int32", "uint32", "uint64", "float", "bool", "string", "map<int32, float>", or a
    # message's name ("StructuredOutputs").
    wire_type: str
    # What an unset field means on the server (vLLM's defaults): None is "none" (no seed, best_of = n, no
    # logprobs), () an empty list or map.
    default: object
    # Checked by the scheduler at the gRPC edge (request_validation.py); None: any value of the wire type.
    bounds: ValueRange | None
    # Where the value takes effect, in a few words.
    applied_in: str
    # One line of meaning: the CLI's --help, docs/develop/request_fields.md.
    help: str
    repeated: bool = False
    # The gateway's request body fields (OpenAI's, or vLLM's extras to them) that set it; (): gRPC and SDK only.
    openai_names: tuple[str, ...] = ()
    # `python -m client` derives a plain `--flag VALUE` from the row when this is set (the flag's metavar);
    # lists, switches and constraints have flags written in client/cli.py, or none.
    cli_metavar: str = ""

    @property
    def python_type(self) -> type | None:
        """The Python type of a value (of each element, for a list): None for a map or a message."""
        return _PYTHON_TYPES.get(self.wire_type)

    @property
    def cli_flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def requirement(self, resolved: Mapping[str, float] = MappingProxyType({})) -> str:
        assert self.bounds is not None, f"{self.name} has no range"
        return self.bounds.requirement(self.python_type is int, resolved)


_PENALTY = ValueRange(-2.0, 2.0)  # OpenAI's range
_TOP_LOGPROBS = ValueRange(0, "--max-logprobs")
_SAMPLER = "worker sampler"
_STOP_CHECKER = "scheduler stop checker"
_DETOKENIZER = "scheduler detokenizer"
_BEAM_SEARCH = "scheduler beam search"

SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField("max_tokens", "int32", 16, ValueRange(0), "scheduler (ends the request: length)",
                  "tokens generated at most", openai_names=("max_tokens", "max_completion_tokens"),
                  cli_metavar="N"),
    SamplingField("temperature", "float", 1.0, ValueRange(0.0), _SAMPLER, "0 = greedy",
                  openai_names=("temperature",), cli_metavar="T"),
    SamplingField("top_p", "float", 1.0, ValueRange(0.0, 1.0, low_open=True), _SAMPLER,
                  "sample from the smallest set of tokens whose probability reaches P (1 = off)",
                  openai_names=("top_p",), cli_metavar="P"),
    SamplingField("top_k", "int32", -1, ValueRange(-1, text="must be -1 (off), 0 (off) or a positive count"),
                  _SAMPLER, "sample from the K most likely tokens (-1 or 0 = off)", openai_names=("top_k",),
                  cli_metavar="K"),
    SamplingField("seed", "uint64", None, None, _SAMPLER, "same seed, same prompt: same tokens",
                  openai_names=("seed",), cli_metavar="S"),
    SamplingField("stop", "string", (), None, _STOP_CHECKER, "stop strings (not returned)", repeated=True,
                  openai_names=("stop",)),
    SamplingField("stop_token_ids", "int32", (), None, _STOP_CHECKER, "token ids that end the output",
                  repeated=True, openai_names=("stop_token_ids",)),
    SamplingField("ignore_eos", "bool", False, None, _STOP_CHECKER, "EOS does not end the output",
                  openai_names=("ignore_eos",)),
    SamplingField("n", "uint32", 1, ValueRange(1, "--max-n"), "scheduler sequence group",
                  "sequences returned", openai_names=("n",)),
    SamplingField("best_of", "uint32", None, ValueRange("n", "--max-n"), "scheduler sequence group",
                  "sequences generated, the n best returned (None: n)", openai_names=("best_of",)),
    SamplingField("beam_width", "uint32", 1, ValueRange(1, "--max-n"), _BEAM_SEARCH,
                  "beam search when > 1 (greedy)"),
    SamplingField("length_penalty", "float", 1.0, ValueRange(), _BEAM_SEARCH,
                  "beam score = sum of logprobs / length ** length_penalty"),
    SamplingField("early_stopping", "bool", False, None, _BEAM_SEARCH,
                  "beam search ends once beam_width beams finished"),
    SamplingField("min_p", "float", 0.0, ValueRange(0.0, 1.0), _SAMPLER,
                  "drop tokens below P x the best one's probability", openai_names=("min_p",), cli_metavar="P"),
    SamplingField("presence_penalty", "float", 0.0, _PENALTY, _SAMPLER,
                  "logit -= X for each token already generated", openai_names=("presence_penalty",),
                  cli_metavar="X"),
    SamplingField("frequency_penalty", "float", 0.0, _PENALTY, _SAMPLER,
                  "logit -= X x times the token was generated", openai_names=("frequency_penalty",),
                  cli_metavar="X"),
    SamplingField("repetition_penalty", "float", 1.0, ValueRange(0.0, 2.0, low_open=True), _SAMPLER,
                  "1 = off (transformers' definition)", openai_names=("repetition_penalty",), cli_metavar="X"),
    # The range is each bias's; the token ids are checked against the vocabulary in request_validation.py.
    SamplingField("logit_bias", "map<int32, float>", (), ValueRange(-100.0, 100.0), _SAMPLER,
                  "added to these token ids' logits", openai_names=("logit_bias",)),
    SamplingField("bad_words", "string", (), None, "worker sampler (masks)", "words never generated",
                  repeated=True, openai_names=("bad_words",)),
    SamplingField("min_tokens", "uint32", 0, ValueRange(0, "max_tokens"),
                  f"worker sampler (masks EOS) and {_STOP_CHECKER}", "no EOS or stop before N tokens",
                  openai_names=("min_tokens",), cli_metavar="N"),
    SamplingField("include_stop_str_in_output", "bool", False, None, _STOP_CHECKER,
                  "the stop string that ended the output is kept", openai_names=("include_stop_str_in_output",)),
    SamplingField("logprobs", "uint32", None, _TOP_LOGPROBS, "worker sampler (logprobs)",
                  "each token's logprob, rank and top K alternatives", openai_names=("logprobs", "top_logprobs"),
                  cli_metavar="K"),
    SamplingField("prompt_logprobs", "uint32", None, _TOP_LOGPROBS, "worker model runner (prompt logprobs)",
                  "each prompt token's logprob, rank and top K alternatives", openai_names=("prompt_logprobs",),
                  cli_metavar="K"),
    SamplingField("skip_special_tokens", "bool", True, None, _DETOKENIZER, "special tokens left out of the text",
                  openai_names=("skip_special_tokens",)),
    SamplingField("spaces_between_special_tokens", "bool", True, None, _DETOKENIZER,
                  "kept special tokens are joined to the text with spaces",
                  openai_names=("spaces_between_special_tokens",)),
    SamplingField("structured_outputs", "StructuredOutputs", None, None,
                  "scheduler validation (grammar) and worker grammar matcher",
                  "the output follows a JSON schema, regex, choice or grammar",
                  openai_names=("structured_outputs", "response_format", "guided_json", "guided_regex",
                                "guided_choice", "guided_grammar")),
)

SAMPLING_FIELDS_BY_NAME: Mapping[str, SamplingField] = MappingProxyType({row.name: row for row in SAMPLING_FIELDS})
