"""Turns a wire GenerateRequest into a prompt and SamplingParams the scheduler can trust, or refuses it.

All checks happen here, at the gRPC edge, before the request touches the engine: a bad request costs nobody
else anything. Every refusal names the offending field and the allowed range, and never echoes the input.
Unset fields take the defaults, and set ones are held to the ranges (with the refusals' texts), of the table of
sampling fields (protos/pagedserve/v1/sampling_fields.py); what ties fields together is written here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from protos.pagedserve.v1 import generate_pb2
from protos.pagedserve.v1.sampling_fields import SAMPLING_FIELDS_BY_NAME
from scheduler_svc.api.grammar_limits import GrammarLimits
from scheduler_svc.api.prompt_encoding import encode_prompt
from scheduler_svc.api.request_limits import RequestLimits, check_prompt_tokens, check_wire_limits
from scheduler_svc.api.resume_validation import resumed_output
from scheduler_svc.api.structured_outputs import check_resumed_output, grammar_start_token_id, structured_grammar
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.validated_request import InvalidRequestError, ValidatedRequest
from scheduler_svc.text.bad_words import bad_words_token_ids
from scheduler_svc.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServingLimits:
    """What the validator checks against; known once the workers reported their KV pools."""

    max_model_len: int
    vocab_size: int
    # Tokens the whole KV pool holds: a request that cannot fit even alone is refused, not left waiting.
    kv_capacity_tokens: int
    # Size limits (request_limits.py), checked before the range checks below.
    request_limits: RequestLimits = RequestLimits()


def validate_request(
    request: generate_pb2.GenerateRequest, tokenizer: Tokenizer | None, limits: ServingLimits
) -> ValidatedRequest:
    check_wire_limits(request, limits.request_limits)
    prompt_token_ids = _prompt_token_ids(request, tokenizer, limits)
    sampling = _sampling_params(request.sampling, tokenizer, limits)
    if sampling.structured_grammar and tokenizer is not None:
        start = grammar_start_token_id(request.sampling.structured_outputs, tokenizer, prompt_token_ids)
        sampling = dataclasses.replace(sampling, structured_grammar_after_token_id=start)
    prompt_len = len(prompt_token_ids)
    check_prompt_tokens(prompt_len, limits.request_limits)
    if request.strict_context_length and prompt_len + sampling.max_tokens > limits.max_model_len:
        # Named max_tokens, or prompt when the prompt alone leaves no room.
        raise context_length_error(limits.max_model_len, prompt_len, sampling.max_tokens)
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
    resume = resumed_output(request, sampling, limits.vocab_size)
    if resume is not None and sampling.structured_grammar and tokenizer is not None:
        check_resumed_output(sampling.structured_grammar, sampling.structured_grammar_after_token_id,
                             resume.token_ids, tokenizer, limits.request_limits.grammar_limits)
    return ValidatedRequest(prompt_token_ids, sampling, resume)


def _prompt_token_ids(
    request: generate_pb2.GenerateRequest, tokenizer: Tokenizer | None, limits: ServingLimits
) -> list[int]:
    add_special_tokens = request.add_special_tokens if request.HasField("add_special_tokens") else None
    return encode_prompt(request.WhichOneof("prompt"), request.text, list(request.token_ids.ids), request.chat,
                         add_special_tokens, tokenizer, limits.vocab_size, limits.max_model_len)


def context_length_error(max_model_len: int, prompt_len: int, max_tokens: int) -> InvalidRequestError:
    """vLLM's OpenAI server's refusal of a prompt + max_tokens past the model's context, word for word."""
    return InvalidRequestError(
        "sampling.max_tokens" if prompt_len < max_model_len else "prompt",
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
        "Please reduce the length of the messages or completion.",
    )


def _sampling_params(
    wire: generate_pb2.SamplingParams, tokenizer: Tokenizer | None, limits: ServingLimits
) -> SamplingParams:
    max_tokens = _checked(wire, "max_tokens")  # 0: the prompt alone, with its prompt logprobs (groups/prompt_only.py)
    temperature = _checked(wire, "temperature")
    top_p = _checked(wire, "top_p")
    top_k = _checked(wire, "top_k")
    stop = tuple(wire.stop)
    if stop and tokenizer is None:
        raise InvalidRequestError("sampling.stop", "stop strings need a tokenizer; use stop_token_ids")
    if any(not s for s in stop):
        raise InvalidRequestError("sampling.stop", "stop strings must not be empty")
    stop_token_ids = tuple(wire.stop_token_ids)
    if any(i < 0 or i >= limits.vocab_size for i in stop_token_ids):
        raise InvalidRequestError("sampling.stop_token_ids", f"ids must lie in [0, {limits.vocab_size})")
    max_n = {"--max-n": limits.request_limits.max_n}
    n = _checked(wire, "n", max_n)
    best_of = _checked(wire, "best_of", {**max_n, "n": n})
    beam_width = _checked(wire, "beam_width", max_n)
    length_penalty = _checked(wire, "length_penalty")
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
    extra = _penalties_and_masks(wire, tokenizer, limits, max_tokens, beam_width)
    grammar = _structured_grammar(wire, tokenizer, beam_width, limits.request_limits.json_without_whitespace,
                                  limits.request_limits.grammar_limits)
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
        seed=_given(wire, "seed"),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=wire.ignore_eos,
        include_stop_str_in_output=wire.include_stop_str_in_output,
        skip_special_tokens=_given(wire, "skip_special_tokens"),
        spaces_between_special_tokens=_given(wire, "spaces_between_special_tokens"),
        structured_grammar=grammar,
        **extra,
    )


def _structured_grammar(wire: generate_pb2.SamplingParams, tokenizer: Tokenizer | None, beam_width: int,
                        json_without_whitespace: bool = False,
                        grammar_limits: GrammarLimits = GrammarLimits()) -> str:
    """The llguidance grammar of the request's structured_outputs ("" for none); see structured_outputs.py.
    `json_without_whitespace`: the server's default for JSON kinds (--structured-outputs-config)."""
    if not wire.HasField("structured_outputs"):
        return ""
    constrained = wire.structured_outputs.WhichOneof("kind") is not None
    if constrained and tokenizer is None:
        raise InvalidRequestError("sampling.structured_outputs", "constraints need the model's tokenizer; "
                                  "the server has none")
    if constrained and beam_width > 1:
        raise InvalidRequestError("sampling.structured_outputs", "not supported with beam search")
    # Masks that could remove the grammar's only continuation (EOS once it is complete, a banned word's last
    # token) would leave a row with no token to sample.
    if constrained and wire.min_tokens:
        raise InvalidRequestError("sampling.min_tokens", "not supported with structured_outputs (it masks EOS, "
                                  "which may be the grammar's only continuation)")
    if constrained and len(wire.bad_words):
        raise InvalidRequestError("sampling.bad_words", "not supported with structured_outputs (a banned token "
                                  "may be the grammar's only continuation)")
    constraint = wire.structured_outputs
    if json_without_whitespace and constraint.WhichOneof("kind") in ("json", "json_object"):
        constraint = generate_pb2.StructuredOutputs()
        constraint.CopyFrom(wire.structured_outputs)
        constraint.disable_any_whitespace = True
    return structured_grammar(constraint, tokenizer, grammar_limits)


def _penalties_and_masks(
    wire: generate_pb2.SamplingParams, tokenizer: Tokenizer | None, limits: ServingLimits, max_tokens: int,
    beam_width: int,
) -> dict:
    """The SamplingParams fields of min_p, the penalties, logit_bias, bad_words, min_tokens and logprobs."""
    min_p = _checked(wire, "min_p")
    presence = _checked(wire, "presence_penalty")
    frequency = _checked(wire, "frequency_penalty")
    repetition = _checked(wire, "repetition_penalty")
    logit_bias = tuple(sorted(wire.logit_bias.items()))
    if any(not 0 <= token_id < limits.vocab_size for token_id, _ in logit_bias):
        raise InvalidRequestError("sampling.logit_bias", f"token ids must lie in [0, {limits.vocab_size})")
    logit_bias_row = SAMPLING_FIELDS_BY_NAME["logit_bias"]  # its range is each bias's
    if any(not logit_bias_row.bounds.contains(bias) for _, bias in logit_bias):
        raise InvalidRequestError("sampling.logit_bias", f"biases {logit_bias_row.requirement()}")
    bad_words = tuple(wire.bad_words)
    if bad_words and tokenizer is None:
        raise InvalidRequestError("sampling.bad_words", "bad words need a tokenizer; use logit_bias with -100")
    if any(not word.strip() for word in bad_words):
        raise InvalidRequestError("sampling.bad_words", "words must not be empty")
    min_tokens = _checked(wire, "min_tokens", {"max_tokens": max_tokens})
    max_logprobs = {"--max-logprobs": limits.request_limits.max_logprobs}
    logprobs = _checked(wire, "logprobs", max_logprobs)
    prompt_logprobs = _checked(wire, "prompt_logprobs", max_logprobs)
    if beam_width > 1:
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None:
                raise InvalidRequestError(f"sampling.{name}", "not supported with beam search")
        if presence or frequency or repetition != 1.0 or logit_bias or bad_words or min_p or min_tokens:
            raise InvalidRequestError("sampling.beam_width", "beam search takes no penalties, logit_bias, "
                                      "bad_words, min_p or min_tokens (its candidates are the raw logprobs)")
    return dict(
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logit_bias=logit_bias,
        bad_words=bad_words,
        bad_words_token_ids=bad_words_token_ids(bad_words, tokenizer) if bad_words else (),
        min_tokens=min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _given(wire: generate_pb2.SamplingParams, name: str):
    """The request's value of a singular field, or the table's default (vLLM's) where the field is unset."""
    return getattr(wire, name) if wire.HasField(name) else SAMPLING_FIELDS_BY_NAME[name].default


def _checked(wire: generate_pb2.SamplingParams, name: str, bounds: Mapping[str, float] = MappingProxyType({})):
    """`_given`, refused naming the field and the range where it lies outside the table's range of the field
    (None, unset, is never refused); `bounds`: the values of the server limits and other fields the range names."""
    value, row = _given(wire, name), SAMPLING_FIELDS_BY_NAME[name]
    if value is not None and not row.bounds.contains(value, bounds):
        raise InvalidRequestError(f"sampling.{name}", row.requirement(bounds))
    return value
