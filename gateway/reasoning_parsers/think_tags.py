"""A thought between <think> and </think> at the start of the output, as Qwen3 and DeepSeek-R1 write it.

Like the tool-call parsers, `split` reads the whole output so far and keeps its answer growing: a partial tag
at the end is held back until the next text decides it. A thought never closed (the output hit max_tokens
while thinking) stays reasoning, and the content is empty, as vLLM's deepseek_r1 parser returns it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.tool_parsers.scan_memo import ScanMemo
from gateway.tool_parsers.tool_calls import held_back

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str  # the thought so far
    content: str | None  # the answer so far; None while the output is still (or may still be) thought


@dataclass(frozen=True)
class ThinkTagReasoningParser:
    # True (qwen3): only an output that opens with <think> has a thought. False (deepseek_r1): the prompt
    # opened it, so the output is thought until </think>, with or without its own <think>.
    opening_required: bool

    @property
    def end_marker(self) -> str:
        """The text that ends the thought: a structured-output constraint applies after it."""
        return CLOSE

    def split(self, text: str, final: bool, memo: ScanMemo | None = None) -> ReasoningSplit:
        """`memo`: the searches of this text's shorter versions (a long thought is searched for its end once)."""
        start = 0
        while start < len(text) and text[start].isspace():  # str.lstrip's whitespace, without copying the text
            start += 1
        opened = text.startswith(OPEN, start)
        if not opened:
            if not final and OPEN.startswith(text[start:]):
                return ReasoningSplit("", None)  # "", or a partial <think>: undecided
            if self.opening_required:
                return ReasoningSplit("", text)
        thought_start = start + len(OPEN) if opened else 0
        close = (ScanMemo() if memo is None else memo).find(text, CLOSE, thought_start)
        if close < 0:
            end = len(text) if final else len(text) - held_back(text, CLOSE)
            return ReasoningSplit(text[thought_start:max(end, thought_start)], None)
        return ReasoningSplit(text[thought_start:close], text[close + len(CLOSE):])
