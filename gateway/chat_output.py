"""One chat choice's output, parsed into reasoning, content and tool calls as it grows: the streamed deltas
(OpenAI's chat.completion.chunk `delta`) and, at the end, the message.

Who does what: the reasoning parser splits the thought from the answer, the tool-call parser reads the answer
(both parse the whole text so far; tool_parsers/tool_calls.py says why, and each is given a ScanMemo of its
text, so that a chunk costs its own length: tool_parsers/scan_memo.py), and this class sends what each new
snapshot adds to what was sent: content text, a call's opening (index, id, type, name) once its name is
complete, then its arguments' new text. The `openai` package's stream helpers reassemble exactly that.

At the end, the calls count only if every one is complete, named and has a JSON object for arguments; else
the answer is content as written (vLLM's fallback), and the streamed deltas have already carried what they
carried. A forced tool choice's output (the parser's `calls_only`) is the exception: it is a grammar's JSON,
never content, so an output cut short (finish_reason "length") keeps its leading complete calls, drops the
cut one, and keeps finish_reason "length" (vLLM says "tool_calls" for a forced choice only when it stopped).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile

from gateway.reasoning_parsers.think_tags import ThinkTagReasoningParser
from gateway.tool_parsers.partial_json import MalformedJSON, ScanMemo
from gateway.tool_parsers.tool_calls import ParsedOutput, ToolCallDraft, ToolCallParser


@dataclass
class _SentCall:
    id: str
    arguments: str = ""


class ChatOutput:
    def __init__(self, reasoning_parser: ThinkTagReasoningParser | None, tool_parser: ToolCallParser | None) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.text = ""  # the choice's whole output so far
        self._reasoning = ""  # what was sent of each part
        self._content = ""
        self._calls: list[_SentCall] = []
        self._final: ParsedOutput | None = None  # the parse of the whole output, once finished
        self._text_memo = ScanMemo()  # the reasoning parser's scans of `text`
        self._answer_memo = ScanMemo()  # the tool parser's scans of the answer (which only grows too)
        self._answer_length = 0

    def add(self, text: str) -> dict:
        """Records the choice's next text; returns the delta fields it makes (empty when none)."""
        self.text += text
        return self._advance(final=False)

    def finish(self) -> dict:
        """The delta fields the end of the output releases (held-back text, the last call's tail)."""
        return self._advance(final=True)

    @property
    def chars_scanned(self) -> int:
        """Characters the parsers' scans have examined so far (the tests' measure of the work per chunk)."""
        return self._text_memo.total_scanned + self._answer_memo.total_scanned

    @property
    def calls_tools(self) -> bool:
        """The finished output is tool calls."""
        return bool(self._final and self._final.tool_calls)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The choice's finish_reason, given the scheduler's: "tool_calls" when the output is calls that ended
        (a forced choice's output cut by max_tokens keeps "length": see the module doc)."""
        cut = finish_reason == "length" and self.tool_parser is not None and self.tool_parser.calls_only
        return "tool_calls" if self.calls_tools and finish_reason in ("stop", "length") and not cut else finish_reason

    def message(self) -> dict:
        """The assistant message of the finished output (after `finish`)."""
        reasoning, answer = self._split(final=True)
        parsed = self._final
        parsing = parsed.tool_calls or self.reasoning_parser is not None
        message: dict = {"role": "assistant", "content": (parsed.content or None) if parsing else parsed.content}
        if self.reasoning_parser is not None:
            message["reasoning_content"] = reasoning or None
        if parsed.tool_calls:  # all valid, so all named: finish() opened each of them
            message["tool_calls"] = [
                {"id": sent.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for sent, call in zip(self._calls, parsed.tool_calls)
            ]
        return message

    def _split(self, final: bool) -> tuple[str, str | None]:
        if self.reasoning_parser is None:
            return "", self.text
        split = self.reasoning_parser.split(self.text, final, self._text_memo)
        return split.reasoning, split.content

    def _parse(self, answer: str, final: bool) -> ParsedOutput:
        if self.tool_parser is None:
            return ParsedOutput(answer)
        if len(answer) < self._answer_length:  # never, as the parsers work: the memo needs a growing text
            self._answer_memo = ScanMemo()
        self._answer_length = len(answer)
        try:
            parsed = self.tool_parser.parse(answer, final, self._answer_memo)
        except MalformedJSON:
            return ParsedOutput(answer)
        if final and not all(call.is_valid() for call in parsed.tool_calls):
            if self.tool_parser.calls_only:  # cut short: the complete calls before the cut one
                valid = takewhile(ToolCallDraft.is_valid, parsed.tool_calls)
                return ParsedOutput(parsed.content, tuple(valid))
            return ParsedOutput(answer)
        return parsed

    def _advance(self, final: bool) -> dict:
        reasoning, answer = self._split(final)
        parsed = self._parse(answer or "", final)
        if final:
            self._final = parsed
        delta: dict = {}
        if reasoning.startswith(self._reasoning) and len(reasoning) > len(self._reasoning):
            delta["reasoning_content"] = reasoning[len(self._reasoning):]
            self._reasoning = reasoning
        if parsed.content.startswith(self._content) and len(parsed.content) > len(self._content):
            delta["content"] = parsed.content[len(self._content):]
            self._content = parsed.content
        calls = self._call_deltas(parsed)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _call_deltas(self, parsed: ParsedOutput) -> list[dict]:
        deltas = []
        for index, call in enumerate(parsed.tool_calls):
            if index == len(self._calls):
                if call.name is None:
                    break  # opened once its name is known (calls open in order)
                self._calls.append(_SentCall(self.tool_parser.new_call_id()))
                deltas.append({"index": index, "id": self._calls[index].id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self._calls[index]
            if call.arguments.startswith(sent.arguments) and len(call.arguments) > len(sent.arguments):
                fragment = call.arguments[len(sent.arguments):]
                sent.arguments = call.arguments
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += fragment
                else:
                    deltas.append({"index": index, "function": {"arguments": fragment}})
        return deltas
