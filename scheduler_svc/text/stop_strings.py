"""Stop strings: where a request's output text must end, and how much of it is safe to stream yet.

Why the scheduler holds text back: with stop=("###",), after "Hi #" the "#" may be the start of "###", which is
not returned. Streaming it and then stopping would send text the final answer does not contain. So the caller
streams only `text[:safe_length(text)]`, and once `check` finds a stop string, the final text is
`text[:match.index]` -- the stop string and anything after it are dropped. The streamed deltas then always
concatenate to exactly the final text, whatever the chunking of the output.

Which occurrence: the one that is complete first while reading the text left to right (the earliest end; on a
tie, the earliest start, i.e. the longer string). That is where a generator emitting one character at a time
would stop, so the answer is the same however many characters each step adds. (Earliest *start* would not be:
with stops "bcd" and "abcdef", text arriving as "abcd" then "ef" stops at "a", but all at once would give "".)

Typical use, once per engine step for a request with stop strings:

    match = matcher.check(text, checked_length)        # checked_length: len(text) at the previous check
    if match: final = text[:match.index]; stream final[streamed:]; finish the request
    else:     stream text[streamed:matcher.safe_length(text)]; at the end of the request stream the rest

Pure functions of their arguments; one matcher per request, immutable.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in the output. index: where the output is cut (the stop string's start)."""

    stop: str
    index: int


class StopStringMatcher:
    """Finds a request's stop strings in its output text. Empty stop strings are rejected (they would match
    before any output)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        if any(not stop_string for stop_string in stop):
            raise ValueError(f"stop strings must be non-empty, got {stop!r}")
        self._stops = tuple(dict.fromkeys(stop))
        self._longest = max((len(stop_string) for stop_string in self._stops), default=0)

    @property
    def stops(self) -> tuple[str, ...]:
        return self._stops

    def check(self, text: str, checked_length: int = 0) -> StopMatch | None:
        """The first stop string completed in `text`, or None.

        `checked_length`: a prefix of `text` already checked and known to hold no stop string; only occurrences
        ending after it are searched for, so checking a growing output each step costs O(new text), not O(text).
        """
        search_from = max(0, checked_length - self._longest + 1)
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop_string in self._stops:
            start = text.find(stop_string, search_from)
            if start < 0:
                continue
            candidate = (start + len(stop_string), start, stop_string)
            if best is None or candidate < best:
                best = candidate
        return None if best is None else StopMatch(stop=best[2], index=best[1])

    def safe_length(self, text: str) -> int:
        """How much of `text` may be streamed now: all of it but the longest suffix that begins a stop string.

        Assumes `check(text)` found no stop string. Never decreases as the text grows.

        Only the places in the tail where a stop string's first character occurs are tried (`find`), longest
        tail first: ordinary text rarely holds one, so this costs a few C calls per stop string, not one
        `endswith` per prefix length (which was a quarter of the scheduler's publishing time at 256 streams).
        """
        held = 0
        length = len(text)
        for stop_string in self._stops:
            longest = min(len(stop_string) - 1, length)
            if longest <= held:
                continue
            first = stop_string[0]
            start = text.find(first, length - longest)
            while start >= 0 and length - start > held:
                if stop_string.startswith(text[start:]):  # the tail from here is a proper prefix of it
                    held = length - start
                    break
                start = text.find(first, start + 1)
        return length - held
