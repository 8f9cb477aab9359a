"""A wire prompt (text, token ids or a chat with its options) -> the token ids the model reads, or a refusal.

Who uses it: Generate's validator and the Tokenize RPC, so that /tokenize counts exactly the tokens a
generation of the same prompt would read. The chat options are vLLM's (which are transformers'
`apply_chat_template`'s): add_generation_prompt (default true), continue_final_message (the last message, an
assistant's, is left open; refused together with add_generation_prompt, as vLLM), chat_template_kwargs (extra
template variables, e.g. enable_thinking), documents and tools (OpenAI's tool definitions, the template's
`tools`). Messages carry an assistant's tool calls and thought and a tool message's tool_call_id
(chat_messages.py). add_special_tokens defaults to true for a text and false for a chat, whose template writes
its own BOS.
"""

from __future__ import annotations

import json
from typing import Any

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api.chat_messages import template_messages
from scheduler_svc.core.validated_request import InvalidRequestError
from scheduler_svc.text.tokenizer import NAMED_SPECIAL_TOKENS, Tokenizer

# Characters of prompt text above which it is encoded on a worker thread, not on the event loop that relays
# every stream's tokens: a megabyte takes tens of milliseconds, and Tokenizer.encode releases the GIL for such
# a text (through the Rust tokenizer's encode_batch; its plain encode holds the GIL throughout).
OFF_LOOP_PROMPT_CHARS = 16_384

# How many code points Unicode normalization (a tokenizer's NFC, e.g. Qwen2's) may fold into one at most: a
# base letter with three combining marks (Greek 'ᾄ') or decomposed Hangul jamo compose into one character.
MAX_NORMALIZATION_FOLD = 4

# Template variables a request may not override through chat_template_kwargs: those the server sets itself
# (and vLLM's own request fields, which have their own wire fields).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
     "tokenize", "raise_exception", "strftime_now", *NAMED_SPECIAL_TOKENS}
)


def encode_prompt(
    kind: str | None,
    text: str,
    token_ids: list[int],
    chat: generate_pb2.ChatPrompt,
    add_special_tokens: bool | None,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    max_model_len: int | None = None,
) -> list[int]:
    """Token ids of the prompt form `kind` ("text", "token_ids" or "chat"); fields are named as in
    GenerateRequest (prompt.text, prompt.chat.*, add_special_tokens). With `max_model_len`, a text too long
    to fit in it is refused before it is tokenized (`check_prompt_chars`)."""
    if kind is None:
        raise InvalidRequestError("prompt", "one of text, token_ids or chat is required")
    if kind == "token_ids":
        if not token_ids:
            raise InvalidRequestError("prompt.token_ids", "must not be empty")
        if any(i < 0 or i >= vocab_size for i in token_ids):
            raise InvalidRequestError("prompt.token_ids", f"ids must lie in [0, {vocab_size})")
        return list(token_ids)
    if tokenizer is None:
        raise InvalidRequestError(f"prompt.{kind}", "this model has no tokenizer; send prompt.token_ids")
    if kind == "text":
        if not text:
            raise InvalidRequestError("prompt.text", "must not be empty")
        check_prompt_chars("prompt.text", text, tokenizer, max_model_len)
        ids = tokenizer.encode(text, add_special_tokens=True if add_special_tokens is None else add_special_tokens)
    else:
        rendered = render_chat(chat, tokenizer)
        check_prompt_chars("prompt.chat.messages", rendered, tokenizer, max_model_len)
        ids = tokenizer.encode(rendered, add_special_tokens=bool(add_special_tokens))
    if not ids:
        raise InvalidRequestError(f"prompt.{kind}", "encodes to no tokens")
    return ids


def check_prompt_chars(field: str, text: str, tokenizer: Tokenizer, max_model_len: int | None) -> None:
    """Refuses a text that cannot encode to fewer than `max_model_len` tokens, without tokenizing it (a 20 MB
    prompt would take a tokenizer thread seconds). No valid prompt is refused: a token covers at most
    `tokenizer.max_token_chars` characters of the text as normalized, and normalization folds at most
    MAX_NORMALIZATION_FOLD characters into one, so a text over max_model_len * max_token_chars *
    MAX_NORMALIZATION_FOLD characters needs more than max_model_len tokens (SmolLM2: 8,192 * 81 * 4 = 2.65
    million characters)."""
    if max_model_len is None:
        return
    bound = max_model_len * tokenizer.max_token_chars * MAX_NORMALIZATION_FOLD
    if len(text) > bound:
        raise InvalidRequestError(field, f"{len(text):,} characters cannot fit in max_model_len {max_model_len} "
                                         f"tokens (refused above {bound:,} characters, before tokenizing)")


def prompt_chars(text: str, chat: generate_pb2.ChatPrompt) -> int:
    """How much text a prompt has to encode (to decide whether it leaves the event loop)."""
    return (len(text) + len(chat.tools_json)
            + sum(len(message.content) + sum(len(call.arguments) for call in message.tool_calls)
                  for message in chat.messages))


def render_chat(chat: generate_pb2.ChatPrompt, tokenizer: Tokenizer) -> str:
    """The chat's prompt text as the model's template renders it with the request's options."""
    if not tokenizer.has_chat_template:
        raise InvalidRequestError("prompt.chat", "this model has no chat template")
    if not chat.messages:
        raise InvalidRequestError("prompt.chat.messages", "must not be empty")
    messages = template_messages(chat.messages)
    if any(not m["role"] for m in messages):
        raise InvalidRequestError("prompt.chat.messages.role", "must not be empty")
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    if chat.continue_final_message:
        if add_generation_prompt:
            raise InvalidRequestError("prompt.chat.continue_final_message",
                                      "cannot be true together with add_generation_prompt; set it to false")
        if messages[-1]["role"] != "assistant" or messages[-1].get("content") is None:
            raise InvalidRequestError("prompt.chat.continue_final_message", "the last message must be an assistant's")
    template_kwargs = _template_kwargs(chat.chat_template_kwargs_json)
    documents = _json_objects(chat.documents_json, "prompt.chat.documents")
    tools = _json_objects(chat.tools_json, "prompt.chat.tools")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt,
                                             continue_final_message=chat.continue_final_message,
                                             documents=documents, tools=tools, template_kwargs=template_kwargs)
    except Exception as error:  # a template's raise_exception() for e.g. bad role order
        raise InvalidRequestError("prompt.chat.messages", f"the chat template refused them ({type(error).__name__}"
                                  + (f": {error}" if isinstance(error, ValueError) else "") + ")") from None


def _template_kwargs(source: str) -> dict[str, Any]:
    if not source:
        return {}
    value = _json(source, "prompt.chat.chat_template_kwargs")
    if not isinstance(value, dict):
        raise InvalidRequestError("prompt.chat.chat_template_kwargs", "must be a JSON object")
    reserved = sorted(set(value) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequestError("prompt.chat.chat_template_kwargs",
                                  f"reserved names may not be set: {', '.join(reserved)}")
    return value


def _json_objects(source: str, field: str) -> list[dict[str, Any]] | None:
    if not source:
        return None
    value = _json(source, field)
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InvalidRequestError(field, "must be a JSON array of objects")
    return value


def _json(source: str, field: str) -> Any:
    try:
        return json.loads(source)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise InvalidRequestError(field, "not valid JSON (or nested too deeply)") from None
