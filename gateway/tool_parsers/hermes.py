"""Hermes' tool-call format, which Qwen2.5, Qwen3 and the Hermes models write (vLLM's `hermes` parser):

    optional text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call><tool_call>...</tool_call>

Text before the first tag is content; each tag holds one JSON object; anything after the last call (usually
whitespace) is dropped.
"""

from __future__ import annotations

from gateway.tool_parsers.partial_json import ScanMemo, read_object, skip_whitespace
from gateway.tool_parsers.tool_calls import ToolCallParser, ParsedOutput, ToolCallDraft, draft_from_object, held_back

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolCallParser):
    # Qwen2.5's <tool_call> is an added token: kept in the text only when special tokens are.
    keeps_special_tokens = True

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedOutput:
        memo = ScanMemo() if memo is None else memo
        first = memo.find(text, START, 0)
        if first < 0:
            return ParsedOutput(text if final else text[:len(text) - held_back(text, START)])
        calls: list[ToolCallDraft] = []
        position = first
        while text.startswith(START, position):
            body_start = position + len(START)
            body_end = memo.find(text, END, body_start)
            body = text[body_start:] if body_end < 0 else text[body_start:body_end]
            # A body is read as a text of its own. When its end tag comes the body is cut shorter (by the part
            # of the tag already there), and the memo stays valid: a tag holds no quote or bracket.
            body_memo = memo.part(body_start)
            call = read_object(body, skip_whitespace(body, 0), final or body_end >= 0, body_memo)
            draft = draft_from_object(body, call)
            calls.append(ToolCallDraft(draft.name, draft.arguments, draft.complete and body_end >= 0))
            if body_end < 0:
                break
            position = skip_whitespace(text, body_end + len(END))
        return ParsedOutput(text[:first], tuple(calls))
