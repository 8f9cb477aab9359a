"""OpenAI request fields -> the SDK's sampling keywords (vLLM's names), and refusals of what is not served.

What is refused, and why, is refused_fields.py's table; each refusal is a 400 naming the field. The
constraint fields (response_format, structured_outputs, guided_*) are structured_outputs.py's.

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
from gateway.prompt_echo import EchoPlan
from gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields, TokenizeRequest
from gateway.refused_fields import refuse_unserved
from gateway.structured_outputs import structured_outputs_keyword
from gateway.tool_choice import ToolPlan, schema_text


def completion_keywords(body: CompletionRequest) -> dict[str, Any]:
    refuse_unserved(body)
    if body.logprobs is not None and body.best_of is not None and body.best_of > body.n:
        raise unsupported("logprobs", "per-token logprobs are not returned with best_of > n")
    # max_tokens null: until the context is full (vLLM's), so no strict check; else prompt + max_tokens past
    # the model's length is a 400 with vLLM's message (the scheduler's strict_context_length).
    keywords = {**_common_keywords(body), "max_tokens": body.max_tokens, "best_of": body.best_of,
                "logprobs": body.logprobs, "strict_context_length": body.max_tokens is not None}
    if body.prompt_logprobs is not None:
        keywords["prompt_logprobs"] = body.prompt_logprobs
    echo = EchoPlan.of(body.echo, body.logprobs)
    if echo is not None:
        keywords |= echo.keywords(body.logprobs, body.prompt_logprobs)
    return keywords


def chat_keywords(body: ChatCompletionRequest, model: ModelInfo, tools: ToolPlan,
                  reasoning_end: str | None = None) -> dict[str, Any]:
    """`tools`: the request's tool plan (tool_choice.py): a forced choice's constraint, and special tokens kept
    where the parser's markers are special tokens (as vLLM's parsers ask). `reasoning_end`: the reasoning
    parser's end of thought (`</think>`), after which a constraint applies (the thought is not constrained)."""
    refuse_unserved(body)
    if body.top_logprobs and not body.logprobs:
        raise invalid_request("top_logprobs: needs logprobs=true", "top_logprobs")
    if body.logprobs and body.best_of is not None and body.best_of > body.n:
        raise unsupported("logprobs", "per-token logprobs are not returned with best_of > n")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # OpenAI's chat default is "until the context is full" (vLLM's too); the scheduler ends the request at
    # max_model_len with finish_reason "length". A generation config's max_new_tokens is the default instead
    # (vLLM's too): the field then stays unset and the scheduler applies it. A max_tokens given is checked
    # against the context (strict).
    strict = max_tokens is not None
    if max_tokens is None and "max_tokens" not in model.default_sampling:
        max_tokens = model.max_model_len
    keywords = {**_common_keywords(body), "max_tokens": max_tokens, "strict_context_length": strict,
                "best_of": body.best_of, "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
                **chat_options(body)}
    if tools.json_schema is not None:
        if keywords["structured_outputs"] is not None:
            raise invalid_request("tool_choice: a forced tool choice is an output constraint of its own; drop "
                                  "response_format / structured_outputs / guided_* or set tool_choice to auto",
                                  "tool_choice")
        keywords["structured_outputs"] = {"json": schema_text(tools.json_schema)}
    if reasoning_end is not None and keywords["structured_outputs"] is not None:
        keywords["structured_outputs"] = {**keywords["structured_outputs"], "reasoning_end": reasoning_end}
    if tools.parser is not None and tools.parser.keeps_special_tokens and body.skip_special_tokens is None:
        keywords["skip_special_tokens"] = False
    return keywords


def chat_options(body: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """vLLM's chat options, as the SDK's keywords (the scheduler renders the template with them)."""
    if body.continue_final_message and body.add_generation_prompt:
        raise invalid_request("continue_final_message: cannot be true together with add_generation_prompt; "
                              "set add_generation_prompt to false", "continue_final_message")
    return {"add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message,
            "chat_template_kwargs": body.chat_template_kwargs,
            "documents": body.documents,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation for the model's chat template: text content (parts joined by newlines), an assistant's
    tool calls and thought, and a tool message's call id (the SDK's message shape)."""
    conversation = []
    for index, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": _text_content(index, message.content)}
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
            if message.content is None:
                entry["content"] = None
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        conversation.append(entry)
    return conversation


def _text_content(index: int, content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part_index, part in enumerate(content):
        where = f"messages[{index}].content[{part_index}]"
        if part.get("type") != "text":
            raise unsupported(where, "multimodal content is not supported (only text content parts)")
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise invalid_request(f"{where}: a text part is exactly {{\"type\": \"text\", \"text\": <string>}}",
                                  where)
        texts.append(part["text"])
    return "\n".join(texts)


def _common_keywords(body: SamplingFields) -> dict[str, Any]:
    """Ranges are the scheduler's to check (a 400 naming the field comes back from it)."""
    logit_bias = None
    if body.logit_bias:
        try:
            logit_bias = {int(token_id): bias for token_id, bias in body.logit_bias.items()}
        except ValueError:
            raise invalid_request("logit_bias: keys must be token ids", "logit_bias") from None
        if any(not -(2**31) <= token_id < 2**31 for token_id in logit_bias):  # the wire's int32 keys
            raise invalid_request("logit_bias: keys must be token ids", "logit_bias")
    options = body.stream_options
    return {
        # Usage on every chunk needs the prompt's length from the first one (vLLM's continuous_usage_stats).
        "return_prompt": bool(options and options.include_usage and options.continuous_usage_stats),
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
        "add_special_tokens": body.add_special_tokens,
        "structured_outputs": structured_outputs_keyword(body),
    }
