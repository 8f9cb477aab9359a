"""Mistral's tool calls (vLLM's `mistral` parser): text, then the [TOOL_CALLS] token and a JSON array of
calls, or (tokenizer v11 and later) the call's name and its arguments after [ARGS]:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

Mistral's templates accept only 9-character alphanumeric call ids, so this format has its own.
"""

from __future__ import annotations

import secrets
import string

from gateway.tool_parsers.partial_json import ScanMemo, skip_whitespace, value_end
from gateway.tool_parsers.tool_calls import ToolCallParser, ParsedOutput, ToolCallDraft, calls_in_array, held_back

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(ToolCallParser):
    # [TOOL_CALLS] is a control token: without it the calls cannot be told from text.
    keeps_special_tokens = True

    @staticmethod
    def new_call_id() -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedOutput:
        memo = ScanMemo() if memo is None else memo
        first = memo.find(text, MARKER, 0)
        if first < 0:
            return ParsedOutput(text if final else text[:len(text) - held_back(text, MARKER)])
        calls: list[ToolCallDraft] = []
        position = first
        while text.startswith(MARKER, position):
            position = skip_whitespace(text, position + len(MARKER))
            if text.startswith("[", position):
                calls += calls_in_array(text, position, final, memo)
                break
            if position >= len(text):
                break
            calls.append(_named_call(text, position, final, memo))
            if not calls[-1].complete:
                break
            position = skip_whitespace(text, memo.find(text, ARGS, position) + len(ARGS))
            position = skip_whitespace(text, value_end(text, position, final, memo))
        return ParsedOutput(text[:first], tuple(calls))


def _named_call(text: str, position: int, final: bool, memo: ScanMemo) -> ToolCallDraft:
    """`name[ARGS]{...}` from `position` on."""
    args_at = memo.find(text, ARGS, position)
    if args_at < 0:
        return ToolCallDraft(None, "", False)
    name = text[position:args_at].strip()
    start = skip_whitespace(text, args_at + len(ARGS))
    end = value_end(text, start, final, memo)
    return ToolCallDraft(name, text[start:len(text) if end is None else end], end is not None)
