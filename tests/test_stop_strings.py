"""Stop strings cut the output before their first completion, and streaming never sends text that is later cut."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.text.stop_strings import StopMatch, StopStringMatcher


def stream_with_stops(matcher: StopStringMatcher, chunks: list[str]) -> tuple[list[str], str]:
    """What the engine loop does each step: check the new text, then stream what is safe. Returns (deltas, final)."""
    text, streamed, checked, deltas = "", 0, 0, []
    for chunk in chunks:
        text += chunk
        match = matcher.check(text, checked)
        if match is not None:
            final = text[: match.index]
            deltas.append(final[streamed:])
            return deltas, final
        checked = len(text)
        safe = matcher.safe_length(text)
        assert safe >= streamed  # held-back text never shrinks below what was already sent
        deltas.append(text[streamed:safe])
        streamed = safe
    deltas.append(text[streamed:])  # the request ended without a stop string: release what was held
    return deltas, text


def first_stop_cut(text: str, stops: tuple[str, ...]) -> str:
    """Reference: read character by character; stop at the first position where some stop string is complete."""
    for end in range(1, len(text) + 1):
        completed = [stop for stop in stops if text[:end].endswith(stop)]
        if completed:
            return text[: end - max(len(stop) for stop in completed)]
    return text


def test_cut_before_the_stop_string():
    matcher = StopStringMatcher(("###",))
    assert matcher.check("Answer: 42### more") == StopMatch(stop="###", index=10)
    assert matcher.check("Answer: 42##") is None


def test_first_completed_wins_not_first_started():
    matcher = StopStringMatcher(("abcdef", "bcd"))
    assert matcher.check("xabcdef") == StopMatch(stop="bcd", index=2)


def test_tie_on_end_prefers_the_longer_string():
    matcher = StopStringMatcher(("c", "bc"))
    assert matcher.check("abc") == StopMatch(stop="bc", index=1)


def test_safe_length_holds_back_a_possible_stop_prefix():
    matcher = StopStringMatcher(("###", "END"))
    assert matcher.safe_length("Hi #") == 3
    assert matcher.safe_length("Hi ##") == 3
    assert matcher.safe_length("Hi EN") == 3
    assert matcher.safe_length("Hi E#") == 4
    assert matcher.safe_length("Hi") == 2


def test_checked_length_skips_old_text_but_finds_a_stop_spanning_the_boundary():
    matcher = StopStringMatcher(("<stop>",))
    assert matcher.check("aaa<st", 0) is None
    assert matcher.check("aaa<stop>", 6) == StopMatch(stop="<stop>", index=3)


def test_no_stops_streams_everything():
    matcher = StopStringMatcher(())
    assert matcher.check("anything") is None
    assert matcher.safe_length("anything") == 8


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(("ok", ""))


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab#\n😀", max_size=40),
    stops=st.lists(st.text(alphabet="ab#\n😀", min_size=1, max_size=4), max_size=3).map(tuple),
    data=st.data(),
)
def test_streamed_text_equals_final_text_whatever_the_chunking(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    chunks = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]
    deltas, final = stream_with_stops(StopStringMatcher(stops), chunks)
    assert "".join(deltas) == final == first_stop_cut(text, stops)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab#\n😀", max_size=20),
    stops=st.lists(st.text(alphabet="ab#\n😀", min_size=1, max_size=5), min_size=1, max_size=3).map(tuple),
)
def test_safe_length_holds_back_exactly_the_longest_suffix_that_begins_a_stop_string(text, stops):
    longest_held = max((length for stop in stops for length in range(1, min(len(stop) - 1, len(text)) + 1)
                        if text.endswith(stop[:length])), default=0)
    assert StopStringMatcher(stops).safe_length(text) == len(text) - longest_held
