"""Turns a wire GenerateRequest into a prompt and SamplingParams the scheduler can trust, or refuses it.

All checks happen here, at the gRPC edge, before the request touches the engine: a bad request costs nobody
else anything. Every refusal names the offending field and the allowed range, and never echoes the input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.request_limits import RequestLimits, check_prompt_tokens, check_wire_limits
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.tokenizer import Tokenizer


# Most sequences one request may fan out to (n, best_of, beam_width).
MAX_SEQUENCES = 64


class InvalidRequestError(ValueError):
    """A request the server refuses; str() is safe to send back to the client."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class ServingLimits:
    """What the validator checks against; known once the workers reported their KV pools."""

    max_model_len: int
    vocab_size: int
    # Tokens the whole KV pool holds: a request that cannot fit even alone is refused, not left waiting.
    kv_capacity_tokens: int
    # Size limits (request_limits.py), checked before the range checks below.
    request_limits: RequestLimits = RequestLimits()


@dataclass(frozen=True)
class ValidatedRequest:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


def validate_request(
    request: generate_pb2.GenerateRequest, tokenizer: Tokenizer | None, limits: ServingLimits
) -> ValidatedRequest:
    check_wire_limits(request, limits.request_limits)
    prompt_token_ids = _prompt_token_ids(request, tokenizer, limits)
    sampling = _sampling_params(request.sampling, tokenizer, limits)
    prompt_len = len(prompt_token_ids)
    check_prompt_tokens(prompt_len, limits.request_limits)
    if prompt_len >= limits.max_model_len:
        raise InvalidRequestError(
            "prompt", f"{prompt_len} tokens leave no room to generate within max_model_len {limits.max_model_len}"
        )
    needed = min(prompt_len + sampling.max_tokens, limits.max_model_len)
    if needed > limits.kv_capacity_tokens:
        raise InvalidRequestError(
            "max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) needs {needed} tokens of KV cache, "
            f"the whole pool holds {limits.kv_capacity_tokens}",
        )
    return ValidatedRequest(prompt_token_ids, sampling)


def _prompt_token_ids(
    request: generate_pb2.GenerateRequest, tokenizer: Tokenizer | None, limits: ServingLimits
) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt", "one of text, token_ids or chat is required")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequestError("prompt.token_ids", "must not be empty")
        bad = next((i for i in ids if i < 0 or i >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("prompt.token_ids", f"ids must lie in [0, {limits.vocab_size})")
        return ids
    if tokenizer is None:
        raise InvalidRequestError(f"prompt.{kind}", "this model has no tokenizer; send prompt.token_ids")
    if kind == "text":
        if not request.text:
            raise InvalidRequestError("prompt.text", "must not be empty")
        ids = tokenizer.encode(request.text)
    else:
        if not tokenizer.has_chat_template:
            raise InvalidRequestError("prompt.chat", "this model has no chat template")
        if not request.chat.messages:
            raise InvalidRequestError("prompt.chat.messages", "must not be empty")
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if any(not m["role"] for m in messages):
            raise InvalidRequestError("prompt.chat.messages.role", "must not be empty")
        try:
            ids = tokenizer.encode_chat(messages)
        except Exception as error:  # a template's raise_exception() for e.g. bad role order
            raise InvalidRequestError("prompt.chat.messages", f"the chat template refused them ({type(error).__name__})")
    if not ids:
        raise InvalidRequestError(f"prompt.{kind}", "encodes to no tokens")
    return ids


def _sampling_params(
    wire: generate_pb2.SamplingParams, tokenizer: Tokenizer | None, limits: ServingLimits
) -> SamplingParams:
    defaults = SamplingParams()
    max_tokens = wire.max_tokens if wire.HasField("max_tokens") else defaults.max_tokens
    temperature = wire.temperature if wire.HasField("temperature") else defaults.temperature
    top_p = wire.top_p if wire.HasField("top_p") else defaults.top_p
    top_k = wire.top_k if wire.HasField("top_k") else defaults.top_k
    if max_tokens < 1:
        raise InvalidRequestError("sampling.max_tokens", "must be at least 1")
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequestError("sampling.temperature", "must be a finite number >= 0")
    if not (0.0 < top_p <= 1.0):
        raise InvalidRequestError("sampling.top_p", "must lie in (0, 1]")
    if top_k < -1:
        raise InvalidRequestError("sampling.top_k", "must be -1 (off), 0 (off) or a positive count")
    stop = tuple(wire.stop)
    if stop and tokenizer is None:
        raise InvalidRequestError("sampling.stop", "stop strings need a tokenizer; use stop_token_ids")
    if any(not s for s in stop):
        raise InvalidRequestError("sampling.stop", "stop strings must not be empty")
    stop_token_ids = tuple(wire.stop_token_ids)
    if any(i < 0 or i >= limits.vocab_size for i in stop_token_ids):
        raise InvalidRequestError("sampling.stop_token_ids", f"ids must lie in [0, {limits.vocab_size})")
    n = wire.n if wire.HasField("n") else 1
    best_of = wire.best_of if wire.HasField("best_of") else None
    beam_width = wire.beam_width if wire.HasField("beam_width") else 1
    length_penalty = wire.length_penalty if wire.HasField("length_penalty") else 1.0
    if not 1 <= n <= MAX_SEQUENCES:
        raise InvalidRequestError("sampling.n", f"must lie in [1, {MAX_SEQUENCES}]")
    if best_of is not None and not n <= best_of <= MAX_SEQUENCES:
        raise InvalidRequestError("sampling.best_of", f"must lie in [n, {MAX_SEQUENCES}] (n = {n})")
    if not 1 <= beam_width <= MAX_SEQUENCES:
        raise InvalidRequestError("sampling.beam_width", f"must lie in [1, {MAX_SEQUENCES}]")
    if not math.isfinite(length_penalty):
        raise InvalidRequestError("sampling.length_penalty", "must be a finite number")
    if beam_width > 1:
        if wire.HasField("temperature") and temperature != 0.0:
            raise InvalidRequestError("sampling.temperature", "beam search is greedy: temperature must be 0")
        if n > beam_width:
            raise InvalidRequestError("sampling.n", f"beam search returns at most beam_width ({beam_width}) sequences")
        if best_of is not None:
            raise InvalidRequestError("sampling.best_of", "does not apply to beam search")
        if stop:
            raise InvalidRequestError("sampling.stop", "stop strings are not supported with beam search")
        temperature, top_p, top_k = 0.0, 1.0, -1
    return SamplingParams(
        n=n,
        best_of=best_of,
        beam_width=beam_width,
        length_penalty=length_penalty,
        early_stopping=wire.early_stopping,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=-1 if top_k == 0 else top_k,
        seed=wire.seed if wire.HasField("seed") else None,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=wire.ignore_eos,
    )
