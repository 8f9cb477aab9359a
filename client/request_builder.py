"""Turns Python arguments into a GenerateRequest: one prompt form, vLLM-named sampling keywords.

Why keywords left out (or passed as None) stay unset on the wire: the server applies vLLM's defaults to
unset fields (max_tokens 16, temperature 1.0, top_p 1.0, top_k -1), so the SDK never hard-codes them and
never overrides a server-side default by accident.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from client.structured_outputs import StructuredOutputsParams
from protos.pagedserve.v1 import generate_pb2
from protos.pagedserve.v1.sampling_fields import SAMPLING_FIELDS

# The GenerateRequest's own fields, taken as keywords beside the sampling ones.
REQUEST_KEYWORDS = frozenset({"request_id", "priority", "return_prompt", "add_special_tokens",
                              "strict_context_length", "lora_name"})
# Keywords named as vLLM's SamplingParams (each a row of the table of sampling fields), plus the request's own.
SAMPLING_KEYWORDS = frozenset(row.name for row in SAMPLING_FIELDS) | REQUEST_KEYWORDS
# vLLM's chat request options (transformers' apply_chat_template's), only with `messages`.
CHAT_KEYWORDS = frozenset({"add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents",
                           "tools"})
# A message has a role and content; an assistant's may call tools (content None then), a tool's answers a call.
_MESSAGE_KEYS = frozenset({"role", "content"})
_OPTIONAL_MESSAGE_KEYS = frozenset({"tool_calls", "tool_call_id", "reasoning_content"})


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
    skip_special_tokens, spaces_between_special_tokens, structured_outputs (a StructuredOutputsParams or a dict
    of its fields: json, regex, choice, grammar, json_object, disable_any_whitespace); and the request's own
    request_id, priority (lower first), return_prompt (the result carries the prompt's text and token ids),
    add_special_tokens (default: true for a text, false for a chat) and strict_context_length (prompt +
    max_tokens past the model's length is refused rather than cut short), lora_name (a LoRA adapter the server
    serves: ModelInfo.lora_adapters; unknown: NotFoundError). With `messages` only, vLLM's chat options:
    add_generation_prompt (default true), continue_final_message, chat_template_kwargs (a dict of template
    variables), documents (a list of dicts) and tools (OpenAI's tool definitions, for the template). A message
    is {"role", "content"}; an assistant's may add "tool_calls" (OpenAI's shape; content None) and
    "reasoning_content", a tool's "tool_call_id". Raises TypeError for any other keyword or a malformed prompt,
    ValueError for a malformed chat message.
    """
    chat_options = {name: sampling.pop(name) for name in CHAT_KEYWORDS & set(sampling)}
    unknown = sorted(set(sampling) - SAMPLING_KEYWORDS)
    if unknown:
        raise TypeError(
            f"unknown sampling keyword(s): {', '.join(unknown)}; supported: {', '.join(sorted(SAMPLING_KEYWORDS))}"
        )
    request = generate_pb2.GenerateRequest()
    _set_prompt(request, prompt, messages)
    if messages is not None:
        set_chat_options(request.chat, **chat_options)
    elif any(value is not None for value in chat_options.values()):
        raise TypeError(f"{', '.join(sorted(chat_options))}: chat options apply to messages only")
    given = {name: value for name, value in sampling.items() if value is not None}
    for name in ("add_special_tokens", "strict_context_length"):
        if name in given:
            setattr(request, name, bool(given.pop(name)))
    if "request_id" in given:
        request.request_id = given.pop("request_id")
    if "priority" in given:
        request.priority = given.pop("priority")
    if "lora_name" in given:
        request.lora_name = given.pop("lora_name")
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
    structured_outputs = given.pop("structured_outputs", None)
    if structured_outputs is not None:
        request.sampling.structured_outputs.CopyFrom(StructuredOutputsParams.of(structured_outputs).to_wire())
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


def _chat_message(index: int, message: Mapping[str, Any]) -> generate_pb2.ChatMessage:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}")
    missing, extra = _MESSAGE_KEYS - set(message), set(message) - _MESSAGE_KEYS - _OPTIONAL_MESSAGE_KEYS
    if missing or extra:
        raise ValueError(
            f"messages[{index}] must have the keys 'role' and 'content' (and optionally 'tool_calls', "
            "'tool_call_id', 'reasoning_content')"
            + (f"; missing {sorted(missing)}" if missing else "")
            + (f"; unsupported {sorted(extra)}" if extra else "")
        )
    content = message["content"]
    if not isinstance(message["role"], str) or not (isinstance(content, str) or content is None):
        raise ValueError(f"messages[{index}]: 'role' must be a string and 'content' a string or None")
    wire = generate_pb2.ChatMessage(role=message["role"], content=content,
                                    tool_call_id=message.get("tool_call_id") or "",
                                    reasoning_content=message.get("reasoning_content"))
    for call_index, call in enumerate(message.get("tool_calls") or ()):
        wire.tool_calls.append(_tool_call(f"messages[{index}].tool_calls[{call_index}]", call))
    return wire


def _tool_call(where: str, call: Any) -> generate_pb2.ToolCall:
    """OpenAI's {"id", "type": "function", "function": {"name", "arguments"}} as the wire's ToolCall."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}: must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):  # a dict, as some clients send: the wire carries JSON text
        arguments = json.dumps(arguments)
    return generate_pb2.ToolCall(id=str(call.get("id") or ""), name=function["name"], arguments=arguments)


def build_tokenize_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
    add_special_tokens: bool | None = None,
    return_token_strs: bool = False,
    **chat_options: Any,
) -> generate_pb2.TokenizeRequest:
    """The Tokenize request of a text or a chat (with the chat options of `build_generate_request`)."""
    unknown = sorted(set(chat_options) - CHAT_KEYWORDS)
    if unknown:
        raise TypeError(f"unknown keyword(s): {', '.join(unknown)}; chat options: {', '.join(sorted(CHAT_KEYWORDS))}")
    if (prompt is None) == (messages is None) or not (prompt is None or isinstance(prompt, str)):
        raise TypeError("pass exactly one of prompt (a text) and messages (a chat)")
    request = generate_pb2.TokenizeRequest(return_token_strs=return_token_strs)
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    if prompt is not None:
        if any(value is not None for value in chat_options.values()):
            raise TypeError(f"{', '.join(sorted(chat_options))}: chat options apply to messages only")
        request.text = prompt
        return request
    request.chat.SetInParent()
    for index, message in enumerate(messages):
        request.chat.messages.append(_chat_message(index, message))
    set_chat_options(request.chat, **chat_options)
    return request


def set_chat_options(
    chat: generate_pb2.ChatPrompt,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> None:
    if add_generation_prompt is not None:
        chat.add_generation_prompt = bool(add_generation_prompt)
    chat.continue_final_message = bool(continue_final_message)
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, Mapping):
            raise TypeError("chat_template_kwargs must be a dict of template variables")
        chat.chat_template_kwargs_json = json.dumps(dict(chat_template_kwargs))
    if documents is not None:
        if isinstance(documents, (str, bytes, Mapping)) or not all(isinstance(d, Mapping) for d in documents):
            raise TypeError("documents must be a list of dicts")
        chat.documents_json = json.dumps([dict(document) for document in documents])
    if tools is not None:
        if isinstance(tools, (str, bytes, Mapping)) or not all(isinstance(tool, Mapping) for tool in tools):
            raise TypeError("tools must be a list of dicts (OpenAI's tool definitions)")
        chat.tools_json = json.dumps([dict(tool) for tool in tools])
