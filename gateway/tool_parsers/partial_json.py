"""Reading JSON that a model is still writing: where a value ends (or that it has not ended yet), and the
members of an object whose closing brace may not have arrived.

Why not parse and re-serialize: a streamed tool call sends its arguments as fragments of text that the client
concatenates, so every fragment must extend what was sent before. Slicing the model's own text keeps that
true by construction (a value's text only ever grows); parsing partial JSON into objects and dumping them again
would not (key order, spacing and escapes could change between two looks).

The scans themselves (strings, containers) are scan_memo.py's: regular expressions, in C, resumed where an
earlier look at the same growing text stopped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.tool_parsers.scan_memo import MalformedJSON, ScanMemo

__all__ = ["MalformedJSON", "Member", "PartialObject", "ScanMemo", "read_object", "skip_whitespace", "value_end"]

_WHITESPACE = " \t\n\r"
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in _WHITESPACE:
        position += 1
    return position


def value_end(text: str, start: int, final: bool, memo: ScanMemo | None = None) -> int | None:
    """The index just past the JSON value that starts at text[start], or None when the text ends first.
    `final`: no more text will come, so a number running to the end is complete. `memo`: what earlier scans
    of this growing text found (scan_memo.py); strings and containers are scanned past it only."""
    if start >= len(text):
        return None
    memo = ScanMemo() if memo is None else memo
    first = text[start]
    if first == '"':
        return memo.string_end(text, start)
    if first in "{[":
        return memo.container_end(text, start)
    position = start
    while position < len(text) and text[position] in _SCALAR_CHARS:
        position += 1
    if position == start:
        raise MalformedJSON(f"unexpected {first!r} where a JSON value starts")
    return position if position < len(text) or final else None


@dataclass(frozen=True)
class Member:
    """One `"key": value` of an object: where its value's text starts, and ends (None: not yet)."""

    key: str
    value_start: int
    value_end: int | None


@dataclass(frozen=True)
class PartialObject:
    """The members read so far, and the index past the closing brace (None while the object is open)."""

    members: tuple[Member, ...]
    end: int | None

    def member(self, *keys: str) -> Member | None:
        """The first member named by any of `keys` (models write "arguments" or "parameters")."""
        return next((member for member in self.members if member.key in keys), None)


def read_object(text: str, start: int, final: bool, memo: ScanMemo | None = None) -> PartialObject:
    """The object whose '{' is at text[start], as far as the text goes; MalformedJSON if it cannot be one."""
    memo = ScanMemo() if memo is None else memo
    if start >= len(text):
        return PartialObject((), None)
    if text[start] != "{":
        raise MalformedJSON("a JSON object starts with '{'")
    members: list[Member] = []
    position = skip_whitespace(text, start + 1)
    if text.startswith("}", position):
        return PartialObject((), position + 1)
    while True:
        if position >= len(text):
            return PartialObject(tuple(members), None)
        if text[position] != '"':
            raise MalformedJSON("an object's key is a string")
        key_end = memo.string_end(text, position)
        if key_end is None:
            return PartialObject(tuple(members), None)
        key = json.loads(text[position:key_end])
        position = skip_whitespace(text, key_end)
        if position >= len(text):
            return PartialObject(tuple(members), None)
        if text[position] != ":":
            raise MalformedJSON("':' follows an object's key")
        value_start = skip_whitespace(text, position + 1)
        end = value_end(text, value_start, final, memo)
        members.append(Member(key, value_start, end))
        if end is None:
            return PartialObject(tuple(members), None)
        position = skip_whitespace(text, end)
        if position >= len(text):
            return PartialObject(tuple(members), None)
        if text[position] == "}":
            return PartialObject(tuple(members), position + 1)
        if text[position] != ",":
            raise MalformedJSON("',' or '}' follows an object's member")
        position = skip_whitespace(text, position + 1)
