"""The outputs of a forced tool choice, whose shape the request's JSON-schema constraint fixes (vLLM's):

- a named function (`tool_choice: {"type": "function", "function": {"name": ...}}`): the whole output is the
  function's arguments object;
- `tool_choice: "required"`: the output is a JSON array of one or more {"name": ..., "parameters": {...}}.

Any model family's output reads the same here, so these need no --tool-call-parser. The output is calls and
nothing else (`calls_only`): cut short by max_tokens, its complete calls are kept and the rest dropped, never
shown as content (chat_output.py).
"""

from __future__ import annotations

from gateway.tool_parsers.partial_json import MalformedJSON, ScanMemo, skip_whitespace, value_end
from gateway.tool_parsers.tool_calls import ToolCallParser, ParsedOutput, ToolCallDraft, calls_in_array


class NamedFunctionOutput(ToolCallParser):
    calls_only = True

    def __init__(self, name: str) -> None:
        self._name = name

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedOutput:
        start = skip_whitespace(text, 0)
        if start >= len(text):
            return ParsedOutput("", (ToolCallDraft(self._name, "", False),))
        end = value_end(text, start, final, memo)
        arguments = text[start:] if end is None else text[start:end]
        return ParsedOutput("", (ToolCallDraft(self._name, arguments, end is not None),))


class RequiredToolsOutput(ToolCallParser):
    calls_only = True

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedOutput:
        position = skip_whitespace(text, 0)
        if position >= len(text):
            return ParsedOutput("")
        if text[position] != "[":
            raise MalformedJSON("tool_choice required: the output is a JSON array of calls")
        return ParsedOutput("", tuple(calls_in_array(text, position, final, memo)))
