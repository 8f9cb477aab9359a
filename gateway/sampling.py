"""OpenAI request fields -> the SDK's sampling keywords (vLLM's names), and refusals of what is not served.

Why refuse instead of ignoring: a client that asks for tools, echo or a suffix and silently gets none would
trust output it did not get. Each refusal is a 400 naming the field.

Logprobs: completions' `logprobs=k` and chat's `logprobs=true, top_logprobs=k` both become the scheduler's
`logprobs=k` (the sampled token's logprob and rank plus k alternatives per token).

Ranges (temperature >= 0, top_p in (0, 1], n <= 64, prompt length, ...) are the scheduler's to check: it
refuses with INVALID_ARGUMENT naming the field, which the gateway relays as a 400 (errors.py), so the rules
live in one place for every client.
"""

from __future__ import annotations

from typing import Any

from client.types import ModelInfo
from gateway.errors import invalid_request, unsupported
from gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields

def completion_keywords(body: CompletionRequest) -> dict[str, Any]:
    if body.echo:
        raise unsupported("echo", "echoing the prompt is not supported")
    if body.suffix:
        raise unsupported("suffix", "insertion (suffix) is not supported")
    if body.logprobs is not None and body.best_of is not None and body.best_of > body.n:
        raise unsupported("logprobs", "per-token logprobs are not returned with best_of > n")
    return {**_common_keywords(body), "max_tokens": body.max_tokens, "best_of": body.best_of,
            "logprobs": body.logprobs}


def chat_keywords(body: ChatCompletionRequest, model: ModelInfo) -> dict[str, Any]:
    if body.tools:
        raise unsupported("tools", "tool calling is not supported")
    if body.tool_choice not in (None, "none"):
        raise unsupported("tool_choice", "tool calling is not supported")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise unsupported("response_format", "only text responses are supported")
    if body.top_logprobs and not body.logprobs:
        raise invalid_request("top_logprobs: needs logprobs=true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # OpenAI's chat default is "until the context is full" (vLLM's too); the scheduler ends the request at
    # max_model_len with finish_reason "length". A generation config's max_new_tokens is the default instead
    # (vLLM's too): the field then stays unset and the scheduler applies it.
    if max_tokens is None and "max_tokens" not in model.default_sampling:
        max_tokens = model.max_model_len
    return {**_common_keywords(body), "max_tokens": max_tokens,
            "logprobs": (body.top_logprobs or 0) if body.logprobs else None}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The conversation for the model's chat template: text content only (parts joined by newlines)."""
    rendered = []
    for index, message in enumerate(messages):
        content = message.content
        if content is None:
            content = ""
        elif not isinstance(content, str):
            texts = [getattr(part, "text", None) for part in content]
            if any(text is None for text in texts):
                raise unsupported(f"messages[{index}].content", "only text content parts are supported")
            content = "\n".join(texts)
        rendered.append({"role": message.role, "content": content})
    return rendered


def _common_keywords(body: SamplingFields) -> dict[str, Any]:
    """Ranges are the scheduler's to check (a 400 naming the field comes back from it)."""
    logit_bias = None
    if body.logit_bias:
        try:
            logit_bias = {int(token_id): bias for token_id, bias in body.logit_bias.items()}
        except ValueError:
            raise invalid_request("logit_bias: keys must be token ids", "logit_bias") from None
    return {
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "min_p": body.min_p,
        "logit_bias": logit_bias,
        "min_tokens": body.min_tokens,
        "bad_words": body.bad_words,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos or None,
        "n": body.n,
        "priority": body.priority or None,
    }
