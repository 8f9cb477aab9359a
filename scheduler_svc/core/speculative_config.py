"""--speculative-config: vLLM's JSON object, parsed once into a frozen `SpeculativeConfig`.

Who owns it: `SchedulerConfig.speculative_config` (None: speculation off); the service hands it to the step
planner (which proposes drafts) and the engine loop (which stops planning ahead while a small batch
speculates). docs/speculative_decoding.md says what it serves.

Four methods are served. `ngram` (prompt lookup): the proposer runs in the scheduler on the tokens it already
holds (ngram_proposer.py). `draft_model`: a smaller model of the target's tokenizer, which the workers load
beside the target (`model`: its directory or hub id; WorkerSetup.draft_model), proposes each row's next tokens
greedily after every step that asks for them, and the scheduler plans them as the next step's drafts. `eagle3`
and `eagle`: the same, with an EAGLE-3 or EAGLE-1 head (`model`) that reads the target's hidden states
(worker_svc/eagle_head.py). Names, meanings and defaults are vLLM's: with neither prompt_lookup bound given both
are 5; with one given the other takes its value. `"[ngram]"` is vLLM's older spelling of the method and is
accepted as well; a config with a `model` and no `method` is a draft model's, as vLLM infers for a model that is
not an EAGLE/MTP head.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from scheduler_svc.core.json_flag import json_object_flag

NGRAM_METHODS = ("ngram", "[ngram]")
DRAFT_MODEL_METHOD = "draft_model"
EAGLE3_METHOD = "eagle3"
EAGLE1_METHOD = "eagle"
# The methods whose proposals the workers make (with the model `model` names), and their served names.
WORKER_METHODS = (DRAFT_MODEL_METHOD, EAGLE3_METHOD, EAGLE1_METHOD)
_SERVED = "ngram, draft_model, eagle3, eagle"
# Methods vLLM serves that need heads or proposers we do not have (refused by name).
HEAD_METHODS = ("medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
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
_DRAFT_MODEL_KEYS = ("method", "num_speculative_tokens", "model", "draft_tensor_parallel_size", "disable_by_batch_size")
_EAGLE_KEYS = ("method", "num_speculative_tokens", "model", "disable_by_batch_size")
_INTEGER_KEYS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
                 "draft_tensor_parallel_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Up to `num_speculative_tokens` draft tokens per plain decode, only while at most `disable_by_batch_size`
    requests run: for `ngram`, from the longest n-gram (n from prompt_lookup_max down to prompt_lookup_min) ending
    the request's tokens that occurred earlier in them; for `draft_model`, what the draft model `model`
    proposed after the request's newest token (the prompt_lookup bounds are unused). `draft_tensor_parallel_size`
    (vLLM's; None: not given) can only be the target's: the draft runs in the target's tensor-parallel group."""

    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    method: str = "ngram"
    model: str | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", *WORKER_METHODS):
            raise ValueError(f"method {self.method!r}: only {_SERVED} are served")
        if self.uses_draft_model != (self.model is not None):
            raise ValueError("a draft model's or head's directory (model) goes with method draft_model, eagle3 "
                             "or eagle, and only with them")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must lie in [1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be >= 1 and <= prompt_lookup_max")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")

    @property
    def uses_draft_model(self) -> bool:
        """Whether the workers' draft model or EAGLE head proposes the drafts (else the scheduler's n-gram
        proposer)."""
        return self.method in WORKER_METHODS

    def tensor_parallel_refusal(self, tensor_parallel_size: int) -> str | None:
        """Why this config cannot go with the target's tensor-parallel size, or None."""
        size = self.draft_tensor_parallel_size
        if size is None or size == tensor_parallel_size:
            return None
        return (f"draft_tensor_parallel_size {size}: the draft model runs in the target's tensor-parallel group "
                f"(--tensor-parallel-size {tensor_parallel_size}); leave it out or give that size")

    def is_on_for(self, num_running: int) -> bool:
        """Whether a step with `num_running` running requests speculates (drafts, and no planning ahead)."""
        return num_running <= self.disable_by_batch_size

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's keys, refusing other methods and unknown keys by name (ValueError)."""
        method = options.get("method")
        if method is None and "model" in options:
            method = DRAFT_MODEL_METHOD  # vLLM's inference for a model that is no EAGLE/MTP head
        if method is None:
            raise ValueError(f"method is required (served: {_SERVED})")
        if method not in (*NGRAM_METHODS, *WORKER_METHODS):
            kind = "needs heads or a proposer not served yet" if method in HEAD_METHODS else "unknown"
            raise ValueError(f"method {method!r}: {kind} (served: {_SERVED})")
        keys = _keys_of(method)
        unknown = sorted(set(options) - set(keys))
        if unknown:
            raise ValueError(f"unsupported key(s) {', '.join(unknown)} for method {method} "
                             f"(served: {', '.join(keys)})")
        if "num_speculative_tokens" not in options:
            raise ValueError("num_speculative_tokens is required")
        for key in _INTEGER_KEYS:
            value = options.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{key} must be an integer")
        disable = options.get("disable_by_batch_size")
        disable = DEFAULT_DISABLE_BY_BATCH_SIZE if disable is None else disable
        if method in WORKER_METHODS:
            model = options.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(f"method {method} needs model: the draft model's or head's directory or hub id")
            return cls(num_speculative_tokens=options["num_speculative_tokens"], disable_by_batch_size=disable,
                       method=method, model=model,
                       draft_tensor_parallel_size=options.get("draft_tensor_parallel_size"))
        lookup_max, lookup_min = options.get("prompt_lookup_max"), options.get("prompt_lookup_min")
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = DEFAULT_PROMPT_LOOKUP
        lookup_max = lookup_min if lookup_max is None else lookup_max
        lookup_min = lookup_max if lookup_min is None else lookup_min
        return cls(num_speculative_tokens=options["num_speculative_tokens"], prompt_lookup_max=lookup_max,
                   prompt_lookup_min=lookup_min, disable_by_batch_size=disable)

    def to_json(self) -> str:
        """The flag's value that gives this config back (a child's command line)."""
        keys = _keys_of(self.method)
        return json.dumps({key: getattr(self, key) for key in keys if getattr(self, key) is not None})


def _keys_of(method: str) -> tuple[str, ...]:
    """The keys a method takes."""
    return {DRAFT_MODEL_METHOD: _DRAFT_MODEL_KEYS, EAGLE3_METHOD: _EAGLE_KEYS, EAGLE1_METHOD: _EAGLE_KEYS}.get(
        method, _KEYS)


def speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config's argparse type: the config, or an argparse error naming what is refused."""
    options = json_object_flag(text)
    try:
        return SpeculativeConfig.from_options(options)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
