"""Tool-call parsers by vLLM's --tool-call-parser names: each turns a model family's tool-call text into
OpenAI tool calls (tool_calls.py says how streaming uses them)."""

from __future__ import annotations

from gateway.tool_parsers.hermes import HermesToolParser
from gateway.tool_parsers.llama3_json import Llama3JsonToolParser
from gateway.tool_parsers.mistral import MistralToolParser
from gateway.tool_parsers.tool_calls import ToolCallParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
