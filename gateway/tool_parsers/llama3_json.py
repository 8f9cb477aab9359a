"""Llama 3.1/3.2/3.3's JSON tool calls (vLLM's `llama3_json` parser): the whole output is one or more
objects, separated by ";" or whitespace, optionally after the <|python_tag|> token:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

An output that does not open with "{" or the tag is plain content, as in vLLM: the model either calls tools
or answers.
"""

from __future__ import annotations

from gateway.tool_parsers.partial_json import ScanMemo, skip_whitespace
from gateway.tool_parsers.tool_calls import ParsedOutput, ToolCallParser, read_calls

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolCallParser):
    # The calls are JSON whether or not the tag is kept: the tag only marks them.
    keeps_special_tokens = False

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedOutput:
        start = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        elif not text.startswith("{", start):
            undecided = not final and PYTHON_TAG.startswith(text[start:])
            return ParsedOutput("" if undecided else text)
        return ParsedOutput("", tuple(read_calls(text, start, final, ";", None, memo)))
