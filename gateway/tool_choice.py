"""A chat request's `tools` and `tool_choice` -> what the template gets, how the output is read, and the
constraint that forces a call (vLLM's rules, checked before the scheduler sees anything).

- `none`: the tools still reach the template (as vLLM renders them by default); the output is text.
- `auto` (the default when tools are given): the model may call tools in its own format, read by the server's
  --tool-call-parser; without --enable-auto-tool-choice it is a 400, as in vLLM.
- `required`: the output must be a JSON array of one or more {"name": one of the tools, "parameters": its
  arguments}; a named function: the output is that function's arguments object. Both are enforced with a JSON
  Schema sent as the request's `structured_outputs.json` (vLLM's schemas, built here), so the arguments always
  parse, and both are read the same for every model (tool_parsers/forced_calls.py).

`parallel_tool_calls: false` (OpenAI's "at most one call"): with `required` the schema's array gets
`maxItems: 1`, so the model cannot write a second call (a small model at temperature 1 otherwise appends calls
until max_tokens); a named function is one call anyway; with `auto` the model's own format cannot be
constrained, so the output is read up to its first call and later calls are not shown (vLLM's
maybe_filter_parallel_tool_calls; the model may still spend tokens writing them).

A forced choice's output cut short by max_tokens is never shown as content (chat_output.py says what is).

Bad input is a 400 naming the field: tool_choice without tools, a named function not among them, a tool whose
parameters are not a JSON Schema of an object, two tools with one name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewayConfig
from gateway.errors import invalid_request
from gateway.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from gateway.tool_parsers import TOOL_CALL_PARSERS
from gateway.tool_parsers.forced_calls import NamedFunctionOutput, RequiredToolsOutput
from gateway.tool_parsers.tool_calls import FirstCallOnly, ToolCallParser

_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What one request's tool choice asks of the scheduler and the output's reader (the tools themselves
    reach the template through the chat options, sampling.py)."""

    parser: ToolCallParser | None  # reads tool calls from the output; None: the output is text
    json_schema: dict[str, Any] | None  # the output's constraint (forced choices)


def plan_tools(body: ChatCompletionRequest, config: GatewayConfig) -> ToolPlan:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise invalid_request("tool_choice: needs tools (no tools were given)", "tool_choice")
        return ToolPlan(None, None)
    _check_tools(body.tools)
    if choice == "none":
        return ToolPlan(None, None)
    if isinstance(choice, NamedToolChoice):
        named = next((tool for tool in body.tools if tool.function.name == choice.function.name), None)
        if named is None:
            raise invalid_request(f"tool_choice: function {choice.function.name!r} is not among the tools "
                                  f"({', '.join(tool.function.name for tool in body.tools)})", "tool_choice")
        return ToolPlan(NamedFunctionOutput(named.function.name), _parameters(named))
    if choice == "required":
        return ToolPlan(RequiredToolsOutput(), required_calls_schema(body.tools, body.parallel_tool_calls))
    if not config.enable_auto_tool_choice:  # "auto", said or by default
        raise invalid_request('tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
                              '--tool-call-parser (or send tool_choice "none", "required" or a named function)',
                              "tool_choice")
    parser = TOOL_CALL_PARSERS[config.tool_call_parser]()
    return ToolPlan(FirstCallOnly(parser) if body.parallel_tool_calls is False else parser, None)


def required_calls_schema(tools: list[ToolDefinition], parallel_tool_calls: bool | None = None) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of one or more calls (exactly one when
    `parallel_tool_calls` is false), each a tool's name and its parameters; the tools' `$defs` are hoisted to
    the top (a `$ref` resolves from the root)."""
    definitions: dict[str, Any] = {}
    calls = []
    for index, tool in enumerate(tools):
        parameters = dict(_parameters(tool))
        for name, definition in parameters.pop("$defs", {}).items():
            if definitions.setdefault(name, definition) != definition:
                raise invalid_request(f"tools[{index}].function.parameters: $defs {name!r} differs from another "
                                      "tool's of that name", f"tools[{index}].function.parameters")
        calls.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _NO_PARAMETERS


def _check_tools(tools: list[ToolDefinition]) -> None:
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise invalid_request(f"tools[{index}].function.parameters: must be a JSON Schema of an object "
                                  f"(\"type\": \"object\"), got type {parameters['type']!r}",
                                  f"tools[{index}].function.parameters")
        if parameters is not None and not isinstance(parameters.get("properties", {}), dict):
            raise invalid_request(f"tools[{index}].function.parameters: properties must be an object",
                                  f"tools[{index}].function.parameters")
        if tool.function.name in seen:
            raise invalid_request(f"tools[{index}].function.name: {tool.function.name!r} names two tools",
                                  f"tools[{index}].function.name")
        seen.add(tool.function.name)
