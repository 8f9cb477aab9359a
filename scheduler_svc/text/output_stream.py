"""Per-request output state on the scheduler: detokenization, stop strings, and what was already streamed.

Owned by the engine loop; one `OutputStream` per admitted request. It turns the request's new token ids into
the next `OutputDelta` for the client's gRPC stream, holding back text that could still become a stop string
so the concatenated deltas always equal the final text.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.request import FinishReason, Request
from scheduler_svc.core.token_logprobs import TokenLogprob
from scheduler_svc.text.detokenizer import IncrementalDetokenizer
from scheduler_svc.text.stop_strings import StopStringMatcher
from scheduler_svc.text.tokenizer import Tokenizer


@dataclass(slots=True)
class OutputDelta:
    """What one gRPC stream message carries: new text, new token ids, and on the last one how it ended.

    Its owner fills it in (request_group.py adds the step's logprobs) and then hands it to the stream's queue,
    after which nobody changes it. Not frozen, and slotted: one is made per sequence per step, and a frozen
    dataclass's __init__ and `dataclasses.replace` per token cost the scheduler's loop a large share of its CPU
    at hundreds of streams, time it then lacks for planning the next step.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    index: int = 0  # which of the request's n sequences
    cumulative_logprob: float = 0.0  # set on a sequence's last message
    logprobs: tuple[float, ...] = ()  # one per token id, when tracked (request_group.py fills it)
    # sampling.logprobs: rank and alternatives, one per token id; prompt_logprobs: on a sequence's first delta.
    token_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


class OutputStream:
    def __init__(self, request: Request, tokenizer: Tokenizer | None):
        params = request.sampling_params
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
        ) if tokenizer else None
        self._min_tokens = params.min_tokens
        self._include_stop_str = params.include_stop_str_in_output
        stop = params.stop
        self._stop_matcher = StopStringMatcher(stop) if stop else None
        self._num_sent_tokens = 0
        self._num_sent_chars = 0
        self._num_checked_chars = 0  # a prefix of the text known to hold no stop string
        self._stop_end = 0  # where the stop string found ended, in the text before it was cut there
        self._text = ""

    @property
    def text(self) -> str:
        """The whole output text so far (stop string cut off)."""
        return self._text

    def skip_sent(self, request: Request, num_sent_chars: int) -> None:
        """Takes the request's output tokens so far as already streamed, with the first `num_sent_chars`
        characters of their text (a stream resumed after a scheduler loss). The state is then what it was
        after the last delta the client received: the detokenizer's text is the same for any chunking, and
        everything up to the text's end was checked for stop strings, as `advance` leaves it; text held back
        then (a possible stop string, an incomplete character) is sent by the next `advance`."""
        self._num_sent_tokens = len(request.output_token_ids)
        if self._detokenizer is not None:
            self._detokenizer.step(list(request.output_token_ids))
            self._text = self._detokenizer.output_text
        self._num_sent_chars = min(num_sent_chars, len(self._text))
        if self._stop_matcher is not None:
            self._num_checked_chars = len(self._text)

    @property
    def num_sent_tokens(self) -> int:
        """Output tokens consumed (streamed, or dropped after a stop string: those are never consumed)."""
        return self._num_sent_tokens

    def advance(self, request: Request, num_output_tokens: int | None = None) -> tuple[OutputDelta, bool]:
        """Consumes the request's tokens not yet seen, of one step or of several (a stream published only
        when its queue is flushed: request_group.py), up to its first `num_output_tokens` outputs if given
        (those whose steps' outcomes its owner has heard of; the request's finish reason then counts only if
        they are all of its tokens). Returns the delta to stream and whether a stop string ended the request
        (the caller must then finish it in the scheduler, and drop the output tokens after the delta's: the
        tokens after the one that completed the stop string are not part of the output).

        With stop strings, the tokens are checked as if each came in its own step (a request with stop strings
        gets no draft tokens, so each step gave it one token): the stop string completed first in the new text
        is the one a check after each token finds first, and the token whose text reaches its end ends the
        request, however many steps the stream was published late."""
        output_token_ids = request.output_token_ids
        first = self._num_sent_tokens
        finish_reason = request.finish_reason
        if num_output_tokens is not None and num_output_tokens < len(output_token_ids):
            new_ids = output_token_ids[first:num_output_tokens]
            finish_reason = None  # the token that ended it is not among them
        else:
            new_ids = output_token_ids[first:]
        stopped_by_string = False
        matcher = self._stop_matcher
        if matcher is None:
            self._detokenize(new_ids, finish_reason)
        elif first + 1 < self._min_tokens and len(new_ids) > 1:  # the check starts inside these: one at a time
            for index in range(len(new_ids)):
                self._detokenize(new_ids[index : index + 1], finish_reason if index == len(new_ids) - 1 else None)
                stopped_by_string = self._check_stop(first + index + 1, None)
                if stopped_by_string:
                    del new_ids[index + 1 :]
                    break
        else:
            text_ends: list[int] = []
            self._detokenize(new_ids, finish_reason, text_ends)
            stopped_by_string = self._check_stop(first + len(new_ids), text_ends)
            if stopped_by_string:
                del new_ids[_first_reaching(text_ends, self._stop_end, len(new_ids)) + 1 :]
        self._num_sent_tokens = first + len(new_ids)
        finished = finish_reason is not None or stopped_by_string
        if finished or matcher is None:
            end = len(self._text)
        else:
            end = max(self._num_sent_chars, matcher.safe_length(self._text))
        delta_text = self._text[self._num_sent_chars : end]
        self._num_sent_chars = end
        delta = OutputDelta(
            text=delta_text,
            token_ids=tuple(new_ids),
            finish_reason=FinishReason.STOP if stopped_by_string else finish_reason,
            prompt_tokens=request.num_prompt_tokens if finished else 0,
            completion_tokens=self._num_sent_tokens if finished else 0,
        )
        return delta, stopped_by_string

    def _check_stop(self, num_output_tokens: int, text_ends: list[int] | None) -> bool:
        """Looks for a stop string in the text not checked yet; on a match cuts the text there (and notes in
        `_stop_end` where the stop string ended in the text before the cut)."""
        matched = False
        # Stop strings count from min_tokens on (text before that is marked checked, as vLLM does).
        # Checked even on the step that hit max_tokens: a stop string completed by the last token wins.
        if num_output_tokens >= self._min_tokens:
            match = self._stop_matcher.check(self._text, self._num_checked_chars)
            if match is not None:
                self._stop_end = match.index + len(match.stop)
                self._text = self._text[: match.index + (len(match.stop) if self._include_stop_str else 0)]
                matched = True
        self._num_checked_chars = len(self._text)
        return matched

    def _detokenize(self, token_ids: list[int], finish_reason: FinishReason | None,
                    text_ends: list[int] | None = None) -> None:
        """Adds tokens' text; `finish_reason`: the request's, when the last of them is its last token."""
        if self._detokenizer is None:
            return
        # A stop token (EOS or stop_token_ids) ends the request but is not part of the text, unless
        # include_stop_str_in_output (as vLLM: a special one still decodes to "" when skipped).
        if finish_reason == FinishReason.STOP and not self._include_stop_str:
            token_ids = token_ids[:-1]
        if token_ids:
            self._detokenizer.step(token_ids, text_ends)
        if finish_reason is not None:  # an unfinished multi-byte character at the very end is released now
            self._detokenizer.flush()
        self._text = self._detokenizer.output_text


def _first_reaching(text_ends: list[int], position: int, num_tokens: int) -> int:
    """The first of `num_tokens` tokens whose text reaches `position` (the last if none does: the text held
    back until the request finished did, or its stop token, which adds no text)."""
    for index, end in enumerate(text_ends):
        if end >= position:
            return index
    return num_tokens - 1
