"""Request fields the gateway knows (OpenAI's or vLLM's) but does not serve: each refused with a 400 naming it.

Why refuse instead of ignoring: a client that asks for a structural tag or a per-request template and
silently gets free text would trust output it did not get. A field is refused only when it
asks for something: absent, null, or its no-op value (tool_choice "none", response_format {"type": "text"},
include_reasoning true, ...) passes. The table is the single list docs/switching_from_vllm.md's "Request fields" follows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from gateway.errors import unsupported
from gateway.protocol import ChatCompletionRequest, ChatMessage

_FUNCTIONS = "OpenAI's deprecated functions API is not supported: use tools and tool_choice"


def _absent(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


# field -> (why it is refused, which values pass as asking for nothing)
REFUSED_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    # The constraints served (response_format, structured_outputs, guided_*) are structured_outputs.py's.
    "structural_tag": ("structural tags are not supported (json, regex, choice and grammar constraints are)",
                       _absent),
    "functions": (_FUNCTIONS, _absent),
    "function_call": (_FUNCTIONS, lambda value: value in (None, "none")),
    "suffix": ("insertion (suffix) is not supported", _absent),
    "truncate_prompt_tokens": ("prompt truncation is not supported", _absent),
    "allowed_token_ids": ("use logit_bias instead", _absent),
    "logits_processors": ("per-request logits processors are not supported", _absent),
    "return_tokens_as_token_ids": ("not supported", _absent),
    "return_token_ids": ("not supported", _absent),
    "cache_salt": ("prefix-cache salting is not supported", _absent),
    "kv_transfer_params": ("disaggregated prefill is not supported", _absent),
    "vllm_xargs": ("not supported", _absent),
    "prompt_embeds": ("prompt embeddings are not supported", _absent),
    "chat_template": ("per-request chat templates are not supported: the model's own template is used", _absent),
    "mm_processor_kwargs": ("multimodal content is not supported", _absent),
    "modalities": ("only text output is supported", lambda value: _absent(value) or value == ["text"]),
    "audio": ("only text output is supported", _absent),
    "prediction": ("predicted outputs are not supported", _absent),
    "web_search_options": ("web search is not supported", _absent),
    "reasoning_effort": ("reasoning effort is not supported; use chat_template_kwargs if the template has one",
                         _absent),
    "verbosity": ("not supported", _absent),
    "store": ("stored completions are not supported", _absent),
    "use_beam_search": ("not supported over HTTP (the gRPC API has beam_width)", _absent),
    "length_penalty": ("applies to beam search only, which is not served over HTTP",
                       lambda value: value is None or value == 1.0),
}
_REFUSED_MESSAGE_FIELDS = {
    "name": "message names are not passed to the chat template",
}


def refuse_unserved(body: BaseModel) -> None:
    """Raises a 400 naming the first field of `body` that asks for something not served."""
    if isinstance(body, ChatCompletionRequest) and body.echo:
        raise unsupported("echo", "echoing the last message is not supported in chat")
    if isinstance(body, ChatCompletionRequest) and body.prompt_logprobs is not None:
        raise unsupported("prompt_logprobs", "prompt logprobs are returned by /v1/completions (and the gRPC API)")
    for name, (reason, asks_nothing) in REFUSED_FIELDS.items():
        if name in type(body).model_fields and not asks_nothing(getattr(body, name)):
            raise unsupported(name, reason)
    for index, message in enumerate(getattr(body, "messages", None) or ()):
        refuse_unserved_message(index, message)


def refuse_unserved_message(index: int, message: ChatMessage) -> None:
    for name, reason in _REFUSED_MESSAGE_FIELDS.items():
        if not _absent(getattr(message, name)):
            raise unsupported(f"messages[{index}].{name}", reason)
