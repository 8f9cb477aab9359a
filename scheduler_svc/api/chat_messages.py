"""Wire chat messages -> the dicts a chat template reads, shaped as transformers' `apply_chat_template` and
vLLM's OpenAI server hand them over.

Why arguments become objects: OpenAI clients send a tool call's arguments as JSON text, while tool-calling
templates (Llama 3.1, Qwen2.5, Hermes, Mistral) write them with `tojson`, which would quote the text a second
time; vLLM parses them into objects before rendering, and so does this. Arguments that are not a JSON object
stay text. A message without content has no `content` key (OpenAI's null), as transformers drops None values.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from protos.pagedserve.v1 import generate_pb2


def template_messages(messages: Iterable[generate_pb2.ChatMessage]) -> list[dict[str, Any]]:
    return [_template_message(message) for message in messages]


def _template_message(message: generate_pb2.ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role}
    if message.HasField("content"):
        rendered["content"] = message.content
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": _arguments(call.arguments)}}
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    if message.HasField("reasoning_content"):
        rendered["reasoning_content"] = message.reasoning_content
    return rendered


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text
