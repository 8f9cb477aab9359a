"""Per-request output state on the scheduler: detokenization, stop strings, and what was already streamed.

Owned by the engine loop; one `OutputStream` per admitted request. It turns the request's new token ids into
the next `OutputDelta` for the client's gRPC stream, holding back text that could still become a stop string
so the concatenated deltas always equal the final text.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.stop_strings import StopStringMatcher
from scheduler_svc.tokenizer import Tokenizer


@dataclass(frozen=True)
class OutputDelta:
    """What one gRPC stream message carries: new text, new token ids, and on the last one how it ended."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    index: int = 0  # which of the request's n sequences
    cumulative_logprob: float = 0.0  # set on a sequence's last message
    logprobs: tuple[float, ...] = ()  # one per token id, when tracked (request_group.py fills it)


class OutputStream:
    def __init__(self, request: Request, tokenizer: Tokenizer | None):
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids) if tokenizer else None
        stop = request.sampling_params.stop
        self._stop_matcher = StopStringMatcher(stop) if stop else None
        self._num_sent_tokens = 0
        self._num_sent_chars = 0
        self._num_checked_chars = 0  # a prefix of the text known to hold no stop string
        self._text = ""

    @property
    def text(self) -> str:
        """The whole output text so far (stop string cut off)."""
        return self._text

    def advance(self, request: Request) -> tuple[OutputDelta, bool]:
        """Consumes the request's tokens not yet seen. Returns the delta to stream and whether a stop string
        ended the request (the caller must then finish it in the scheduler)."""
        new_ids = request.output_token_ids[self._num_sent_tokens :]
        self._num_sent_tokens = len(request.output_token_ids)
        finished = request.finish_reason is not None
        if self._detokenizer is not None:
            # A stop token (EOS or stop_token_ids) ends the request but is not part of the text.
            text_ids = new_ids[:-1] if finished and request.finish_reason == FinishReason.STOP else new_ids
            self._detokenizer.step(list(text_ids))
            if finished:  # an unfinished multi-byte character at the very end is released now
                self._detokenizer.flush()
            self._text = self._detokenizer.output_text
        stopped_by_string = False
        if self._stop_matcher is not None:
            # Checked even on the step that hit max_tokens: a stop string completed by the last token wins.
            match = self._stop_matcher.check(self._text, self._num_checked_chars)
            if match is not None:
                self._text = self._text[: match.index]
                stopped_by_string = finished = True
            self._num_checked_chars = len(self._text)
        if finished:
            end = len(self._text)
        elif self._stop_matcher is not None:
            end = max(self._num_sent_chars, self._stop_matcher.safe_length(self._text))
        else:
            end = len(self._text)
        delta_text = self._text[self._num_sent_chars : end]
        self._num_sent_chars = end
        reason = FinishReason.STOP if stopped_by_string else request.finish_reason
        delta = OutputDelta(
            text=delta_text,
            token_ids=tuple(new_ids),
            finish_reason=reason,
            prompt_tokens=request.num_prompt_tokens if finished else 0,
            completion_tokens=request.num_output_tokens if finished else 0,
        )
        return delta, stopped_by_string
