"""--speculative-config: vLLM's JSON object, parsed once into a frozen `SpeculativeConfig`.

Who owns it: `SchedulerConfig.speculative_config` (None: speculation off); the service hands it to the step
planner (which proposes drafts) and the engine loop (which stops planning ahead while a small batch
speculates). docs/speculative_decoding.md says what it serves.

Only n-gram proposals (prompt lookup) are served: the proposer runs in the scheduler on the tokens it already
holds, so it needs no second model and no worker support beyond verifying drafts. Names, meanings and
defaults are vLLM's: with neither prompt_lookup bound given both are 5; with one given the other takes its
value. `"[ngram]"` is vLLM's older spelling of the method and is accepted as well.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

NGRAM_METHODS = ("ngram", "[ngram]")
# Methods vLLM serves that need a second model or heads on the worker (refused by name).
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
MAX_SPECULATIVE_TOKENS = 16
# vLLM's defaults of the n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
# Speculation off above this many running requests (vLLM's default is no limit). Why 8 by default: a
# verification step computes 1 + k tokens per row, and it buys latency only while decode is memory-bound,
# which a batch of a few rows is; a larger batch is already compute-efficient, gains little from drafts and
# loses the async overlap of planning ahead, which speculation gives up (docs/speculative_decoding.md).
# To be measured on a GPU (benchmarks); vLLM's users set it themselves.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """What the scheduler proposes: up to `num_speculative_tokens` draft tokens per plain decode, from the
    longest n-gram (n from prompt_lookup_max down to prompt_lookup_min) ending the request's tokens that
    occurred earlier in them; only while at most `disable_by_batch_size` requests run."""

    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    method: str = "ngram"

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"method {self.method!r}: only ngram is served")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must lie in [1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be >= 1 and <= prompt_lookup_max")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")

    def is_on_for(self, num_running: int) -> bool:
        """Whether a step with `num_running` running requests speculates (drafts, and no planning ahead)."""
        return num_running <= self.disable_by_batch_size

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's keys, refusing other methods (first: a draft model's config has its own keys) and unknown
        keys by name (ValueError)."""
        method = options.get("method")
        if method is None:
            raise ValueError("method is required (served: ngram)")
        if method not in NGRAM_METHODS:
            kind = "needs a draft model or heads, not served yet" if method in MODEL_METHODS else "unknown"
            raise ValueError(f"method {method!r}: {kind} (served: ngram)")
        unknown = sorted(set(options) - set(_KEYS))
        if unknown:
            raise ValueError(f"unsupported key(s) {', '.join(unknown)} (served: {', '.join(_KEYS)})")
        if "num_speculative_tokens" not in options:
            raise ValueError("num_speculative_tokens is required")
        for key in _KEYS[1:]:
            value = options.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{key} must be an integer")
        lookup_max, lookup_min = options.get("prompt_lookup_max"), options.get("prompt_lookup_min")
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = DEFAULT_PROMPT_LOOKUP
        lookup_max = lookup_min if lookup_max is None else lookup_max
        lookup_min = lookup_max if lookup_min is None else lookup_min
        disable = options.get("disable_by_batch_size")
        return cls(num_speculative_tokens=options["num_speculative_tokens"], prompt_lookup_max=lookup_max,
                   prompt_lookup_min=lookup_min,
                   disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE if disable is None else disable)

    def to_json(self) -> str:
        """The flag's value that gives this config back (a child's command line)."""
        return json.dumps({key: getattr(self, key) for key in _KEYS})


def speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config's argparse type: the config, or an argparse error naming what is refused."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    try:
        return SpeculativeConfig.from_options(options)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
