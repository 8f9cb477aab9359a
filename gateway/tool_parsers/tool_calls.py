"""What a tool-call parser makes of a model's output so far: the content to show, and the tool calls begun.

Why a parser returns a snapshot of the whole output, not deltas: streaming then needs no parser state. The
gateway parses the text so far after every chunk and sends what the snapshot adds to the one before
(chat_output.py), so a chunk boundary can fall anywhere (inside a tag, a key, an escape) without a parser
seeing it. What makes that cheap is the `ScanMemo` the gateway passes with each choice's text (scan_memo.py):
every scan resumes where the last look stopped, so a chunk costs its own length, not the output's. Parsers keep snapshots growing: content and each call's arguments only ever extend, and text that
may still turn out to open a tool call (a partial `<tool_call>` tag) is held back until it is decided.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from gateway.tool_parsers.partial_json import MalformedJSON, PartialObject, ScanMemo, read_object, skip_whitespace

# Where a model names a call's arguments: Hermes, Qwen and Mistral say "arguments", Llama 3 "parameters".
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolCallDraft:
    """A tool call as far as the model has written it."""

    name: str | None  # None until the name's string is complete
    arguments: str  # the arguments' JSON text so far (the model's own text)
    complete: bool  # the call's JSON (and its closing tag, where the format has one) has ended

    def is_valid(self) -> bool:
        """Complete, named, and its arguments a JSON object."""
        if not (self.complete and self.name):
            return False
        try:
            return isinstance(json.loads(self.arguments), dict)
        except ValueError:
            return False


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    tool_calls: tuple[ToolCallDraft, ...] = ()


class ToolCallParser:
    """One tool-call format (a model family's, or a forced tool choice's)."""

    # Whether the format's markers are special tokens the detokenizer must keep (skip_special_tokens false).
    keeps_special_tokens = False
    # Whether a constraint makes the whole output tool calls (a forced tool choice): then no text of it is ever
    # content, and a call the output's end cut short is dropped (chat_output.py).
    calls_only = False

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedOutput:
        """The output so far (`final`: all of it); raises MalformedJSON when it cannot be tool calls. `memo`:
        the scans of this text's shorter versions (scan_memo.py); None: a fresh one."""
        raise NotImplementedError

    @staticmethod
    def new_call_id() -> str:
        """A fresh id for a call (OpenAI's shape: call_ and 24 characters)."""
        return f"call_{secrets.token_hex(12)}"


class FirstCallOnly(ToolCallParser):
    """parallel_tool_calls false with a model's own format (vLLM's maybe_filter_parallel_tool_calls): the
    output's first call and content; any later call is not shown (the model may still write it)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self.keeps_special_tokens = parser.keeps_special_tokens
        self.calls_only = parser.calls_only

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> ParsedOutput:
        parsed = self._parser.parse(text, final, memo)
        return ParsedOutput(parsed.content, parsed.tool_calls[:1])

    def new_call_id(self) -> str:
        """The wrapped format's ids (Mistral's templates accept only their own 9-character ones)."""
        return self._parser.new_call_id()


def draft_from_object(text: str, call: PartialObject, name: str | None = None) -> ToolCallDraft:
    """The call an object {"name": ..., "arguments": {...}} in `text` describes so far; `name` overrides."""
    if name is None:
        named = call.member("name")
        if named is not None and named.value_end is not None:
            value = json.loads(text[named.value_start:named.value_end])
            name = value if isinstance(value, str) else None
    arguments = call.member(*ARGUMENT_KEYS)
    if arguments is None:
        # No arguments member: none yet, or none at all ({} once the object has closed).
        return ToolCallDraft(name, "{}" if call.end is not None else "", call.end is not None)
    end = arguments.value_end if arguments.value_end is not None else len(text)
    return ToolCallDraft(name, text[arguments.value_start:end], call.end is not None)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (so are not yet content)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def read_calls(text: str, position: int, final: bool, separator: str, closer: str | None,
               memo: ScanMemo | None = None) -> list[ToolCallDraft]:
    """The call objects from text[position] on, as far as the text goes: each followed by `separator` or
    whitespace, up to `closer` (a JSON array's ']', whose '[' is before `position`), or, with no closer, to the
    end of the text, where only another call may follow one (Llama 3's ';'-separated calls)."""
    memo = ScanMemo() if memo is None else memo
    calls: list[ToolCallDraft] = []
    while position < len(text) and text[position] != closer:
        call = read_object(text, position, final, memo)
        calls.append(draft_from_object(text, call))
        if call.end is None:
            break
        position = skip_whitespace(text, call.end)
        if text.startswith(separator, position):
            position = skip_whitespace(text, position + 1)
        elif closer is not None and position < len(text) and text[position] != closer:
            raise MalformedJSON(f"'{separator}' or '{closer}' follows a call in a list of calls")
        if closer is None and position < len(text) and text[position] != "{":
            raise MalformedJSON("only tool calls may follow a tool call")
    return calls


def calls_in_array(text: str, position: int, final: bool, memo: ScanMemo | None = None) -> list[ToolCallDraft]:
    """The calls of a JSON array of call objects whose '[' is at text[position], as far as the text goes."""
    return read_calls(text, skip_whitespace(text, position + 1), final, ",", "]", memo)
