"""What earlier scans of a growing output found, so that reading it again scans only its new text.

Why: the gateway reads a streamed output after every chunk as a whole (a parser returns a snapshot of the whole
output so far; tool_calls.py says why), and without memory each reading rescans all of it: a 12 kB argument
streamed in 4-character chunks would be scanned 3,000 times over, work quadratic in the output's length. With
a memo a scan that reached the end of the text unfinished (an open string or object, a marker not found yet)
resumes where it stopped, and one that found its end answers from the memo at once; the snapshots, and so the
deltas sent, are exactly those of a fresh scan.

Who owns it: `ChatOutput` (chat_output.py), one per choice for the thought split and one for the answer, each
used with one text that only grows: every text given to a memo must start with the one given before (a memo
keyed by positions would answer wrongly otherwise), or be that one cut by characters that hold no quote and no
bracket (a Hermes call's body cut at its end tag: no end was found in them, and an open scan stays open). A parser called without one (tests, one-off parses) makes
a fresh one. `scanned` counts the characters the scans examined, for the tests that prove the work per chunk
does not grow with the output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# The inside of a JSON string from a position on: runs of plain characters and escapes (possessive: an open
# string fails without backtracking). It stops at the closing quote, at a backslash that ends the text (its
# escape not complete yet: the scan resumes there), or at the end of the text.
_STRING_BODY = re.compile(r'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)
# A container scan stops only at quotes and brackets.
_STRUCTURAL = re.compile(r'["{}\[\]]')


class MalformedJSON(ValueError):
    """The text cannot become JSON whatever follows it."""


@dataclass
class ScanMemo:
    scanned: int = 0
    # A string or container that starts at the key ends just before the value (index past its last character).
    _ends: dict[int, int] = field(default_factory=dict)
    # One still open at the text's end: where its scan resumes, and (containers) the closers still expected.
    _open: dict[int, tuple[int, tuple[str, ...]]] = field(default_factory=dict)
    # (marker, searched from): where it was found, or where the next search resumes (the text's length then).
    _found: dict[tuple[str, int], int] = field(default_factory=dict)
    _searched: dict[tuple[str, int], int] = field(default_factory=dict)
    # Memos of slices of the text (a Hermes call's body), by a key the caller chooses.
    _parts: dict[object, ScanMemo] = field(default_factory=dict)

    def part(self, key: object) -> ScanMemo:
        """The memo of a slice of the text (a Hermes call's body), by the slice's start."""
        return self._parts.setdefault(key, ScanMemo())

    @property
    def total_scanned(self) -> int:
        """Characters examined by this memo's scans and its parts'."""
        return self.scanned + sum(part.total_scanned for part in self._parts.values())

    def find(self, text: str, marker: str, start: int) -> int:
        """`text.find(marker, start)`, searching only text not searched before (less a marker's length)."""
        key = (marker, start)
        found = self._found.get(key)
        if found is not None:
            return found
        since = max(start, self._searched.get(key, start) - len(marker) + 1)
        index = text.find(marker, since)
        if index >= 0:
            self._found[key] = index
            self._searched.pop(key, None)
            self.scanned += index + len(marker) - since
        else:
            self._searched[key] = len(text)
            self.scanned += max(0, len(text) - since)
        return index

    def string_end(self, text: str, start: int) -> int | None:
        """The index past the JSON string whose quote is text[start], or None while it is open."""
        end = self._ends.get(start)
        if end is not None:
            return end
        resume = min(self._open[start][0] if start in self._open else start + 1, len(text))
        stop = _STRING_BODY.match(text, resume).end()
        self.scanned += stop - resume + 1
        if stop < len(text) and text[stop] == '"':
            self._open.pop(start, None)
            self._ends[start] = stop + 1
            return stop + 1
        self._open[start] = (stop, ())
        return None

    def container_end(self, text: str, start: int) -> int | None:
        """The index past the object or array whose bracket is text[start], or None while it is open."""
        end = self._ends.get(start)
        if end is not None:
            return end
        position, expected = self._open.get(start, (start, ()))
        position = min(position, len(text))
        closers = list(expected)
        while (special := _STRUCTURAL.search(text, position)) is not None:
            self.scanned += special.start() - position + 1
            char, position = special.group(), special.start()
            if char == '"':
                end = self.string_end(text, position)
                if end is None:
                    self._open[start] = (position, tuple(closers))
                    return None
                position = end
                continue
            if char in "{[":
                closers.append("}" if char == "{" else "]")
            elif not closers or closers.pop() != char:
                raise MalformedJSON(f"unbalanced {char!r}")
            elif not closers:
                self._open.pop(start, None)
                self._ends[start] = position + 1
                return position + 1
            position += 1
        self.scanned += max(0, len(text) - position)
        self._open[start] = (len(text), tuple(closers))
        return None
