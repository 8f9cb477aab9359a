"""Turns Python arguments into a GenerateRequest: one prompt form, vLLM-named sampling keywords.

Why keywords left out (or passed as None) stay unset on the wire: the server applies vLLM's defaults to
unset fields (max_tokens 16, temperature 1.0, top_p 1.0, top_k -1), so the SDK never hard-codes them and
never overrides a server-side default by accident.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from protos.pagedserve.v1 import generate_pb2

# Keywords named as vLLM's SamplingParams (each a SamplingParams field), plus the request's own id.
SAMPLING_KEYWORDS = frozenset(
    {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "n",
     "best_of", "beam_width", "length_penalty", "early_stopping", "presence_penalty", "frequency_penalty",
     "repetition_penalty", "logit_bias", "bad_words", "min_tokens", "include_stop_str_in_output", "logprobs",
     "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "request_id", "priority",
     "return_prompt"}
)
_MESSAGE_KEYS = frozenset({"role", "content"})


def build_generate_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
    **sampling: Any,
) -> generate_pb2.GenerateRequest:
    """Builds the request for exactly one of `prompt` (text, or token ids) and `messages` (a chat, rendered
    by the server's chat template).

    Sampling keywords (vLLM's SamplingParams names): max_tokens, temperature, top_p, top_k, min_p, seed, stop
    (a string or a list of them), stop_token_ids, ignore_eos, n, best_of, beam_width, length_penalty,
    early_stopping, presence_penalty, frequency_penalty, repetition_penalty, logit_bias ({token id: bias}),
    bad_words (a list of strings), min_tokens, include_stop_str_in_output, logprobs, prompt_logprobs,
    skip_special_tokens, spaces_between_special_tokens; and the request's own request_id, priority
    (lower first) and return_prompt (the result carries the prompt's text and token ids). Raises TypeError
    for any other keyword or a malformed prompt, ValueError for a malformed chat message.
    """
    unknown = sorted(set(sampling) - SAMPLING_KEYWORDS)
    if unknown:
        raise TypeError(
            f"unknown sampling keyword(s): {', '.join(unknown)}; supported: {', '.join(sorted(SAMPLING_KEYWORDS))}"
        )
    request = generate_pb2.GenerateRequest()
    _set_prompt(request, prompt, messages)
    given = {name: value for name, value in sampling.items() if value is not None}
    if "request_id" in given:
        request.request_id = given.pop("request_id")
    if "priority" in given:
        request.priority = given.pop("priority")
    if "return_prompt" in given:
        request.return_prompt = bool(given.pop("return_prompt"))
    stop = given.pop("stop", [])
    if stop:
        request.sampling.stop.extend([stop] if isinstance(stop, str) else stop)
    stop_token_ids = _token_ids(given.pop("stop_token_ids", []), "stop_token_ids")
    if stop_token_ids:
        request.sampling.stop_token_ids.extend(stop_token_ids)
    logit_bias = given.pop("logit_bias", {})
    if not isinstance(logit_bias, Mapping):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
    for token_id, bias in logit_bias.items():
        request.sampling.logit_bias[int(token_id)] = bias  # OpenAI clients send the ids as strings
    bad_words = given.pop("bad_words", [])
    if bad_words:
        request.sampling.bad_words.extend([bad_words] if isinstance(bad_words, str) else bad_words)
    for name, value in given.items():
        try:
            setattr(request.sampling, name, value)
        except (TypeError, ValueError) as error:  # protobuf's own message does not name the field
            raise type(error)(f"{name}={value!r}: {error}") from error
    return request


def _set_prompt(
    request: generate_pb2.GenerateRequest,
    prompt: str | Sequence[int] | None,
    messages: Sequence[Mapping[str, str]] | None,
) -> None:
    if (prompt is None) == (messages is None):
        raise TypeError("pass exactly one of prompt (text or token ids) and messages (a chat)")
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.SetInParent()  # an empty list is still the token-id form; the server judges it
        request.token_ids.ids.extend(_token_ids(prompt, "prompt"))
    else:
        request.chat.SetInParent()
        for index, message in enumerate(messages):
            request.chat.messages.append(_chat_message(index, message))


def _token_ids(values: Any, what: str) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{what} must be a list of token ids, got {type(values).__name__}")
    if not all(isinstance(value, int) and not isinstance(value, bool) for value in values):
        raise TypeError(f"{what} must contain only int token ids")
    return list(values)


def _chat_message(index: int, message: Mapping[str, str]) -> generate_pb2.ChatMessage:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}")
    missing, extra = _MESSAGE_KEYS - set(message), set(message) - _MESSAGE_KEYS
    if missing or extra:
        raise ValueError(
            f"messages[{index}] must have exactly the keys 'role' and 'content'"
            + (f"; missing {sorted(missing)}" if missing else "")
            + (f"; unsupported {sorted(extra)}" if extra else "")
        )
    if not isinstance(message["role"], str) or not isinstance(message["content"], str):
        raise ValueError(f"messages[{index}]: 'role' and 'content' must be strings")
    return generate_pb2.ChatMessage(role=message["role"], content=message["content"])
