"""Reading JSON that a model is still writing: where a value ends (or that it has not ended yet), and the
members of an object whose closing brace may not have arrived.

Why not parse and re-serialize: a streamed tool call sends its arguments as fragments of text that the client
concatenates, so every fragment must extend what was sent before. Slicing the model's own text keeps that
true by construction (a value's text only ever grows); parsing partial JSON into objects and dumping them again
would not (key order, spacing and escapes could change between two looks).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
# Scans run as regular expressions, in C: the output is re-read after every chunk, so a long string argument
# (a file's content: 12 kB of code as 8,000 four-character chunks is parsed in 0.8 s in all) must not cost a
# Python step per character. A whole string is runs of plain characters and escapes (possessive: an open
# string fails without backtracking); a container scan stops only at quotes and brackets.
_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)
_STRUCTURAL = re.compile(r'["{}\[\]]')
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")


class MalformedJSON(ValueError):
    """The text cannot become JSON whatever follows it."""


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in _WHITESPACE:
        position += 1
    return position


def value_end(text: str, start: int, final: bool) -> int | None:
    """The index just past the JSON value that starts at text[start], or None when the text ends first.
    `final`: no more text will come, so a number running to the end is complete."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in "{[":
        return _container_end(text, start)
    position = start
    while position < len(text) and text[position] in _SCALAR_CHARS:
        position += 1
    if position == start:
        raise MalformedJSON(f"unexpected {first!r} where a JSON value starts")
    return position if position < len(text) or final else None


def _string_end(text: str, start: int) -> int | None:
    whole = _STRING.match(text, start)
    return None if whole is None else whole.end()


def _container_end(text: str, start: int) -> int | None:
    closers = []
    position = start
    while (special := _STRUCTURAL.search(text, position)) is not None:
        char, position = special.group(), special.start()
        if char == '"':
            end = _string_end(text, position)
            if end is None:
                return None
            position = end
            continue
        if char in "{[":
            closers.append("}" if char == "{" else "]")
        elif not closers or closers.pop() != char:
            raise MalformedJSON(f"unbalanced {char!r}")
        elif not closers:
            return position + 1
        position += 1
    return None


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


def read_object(text: str, start: int, final: bool) -> PartialObject:
    """The object whose '{' is at text[start], as far as the text goes; MalformedJSON if it cannot be one."""
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
        key_end = _string_end(text, position)
        if key_end is None:
            return PartialObject(tuple(members), None)
        key = json.loads(text[position:key_end])
        position = skip_whitespace(text, key_end)
        if position >= len(text):
            return PartialObject(tuple(members), None)
        if text[position] != ":":
            raise MalformedJSON("':' follows an object's key")
        value_start = skip_whitespace(text, position + 1)
        end = value_end(text, value_start, final)
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
