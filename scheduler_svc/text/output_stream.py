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

    def advance(self, request: Request) -> tuple[OutputDelta, bool]:
        """Consumes the request's tokens not yet seen. Returns the delta to stream and whether a stop string
        ended the request (the caller must then finish it in the scheduler)."""
        new_ids = request.output_token_ids[self._num_sent_tokens :]
        self._num_sent_tokens = len(request.output_token_ids)
        finished = request.finish_reason is not None
        if self._detokenizer is not None:
            # A stop token (EOS or stop_token_ids) ends the request but is not part of the text, unless
            # include_stop_str_in_output (as vLLM: a special one still decodes to "" when skipped).
            stopped_by_token = finished and request.finish_reason == FinishReason.STOP
            text_ids = new_ids[:-1] if stopped_by_token and not self._include_stop_str else new_ids
            self._detokenizer.step(list(text_ids))
            if finished:  # an unfinished multi-byte character at the very end is released now
                self._detokenizer.flush()
            self._text = self._detokenizer.output_text
        stopped_by_string = False
        # Stop strings count from min_tokens on (text before that is marked checked, as vLLM does).
        if self._stop_matcher is not None and request.num_output_tokens >= self._min_tokens:
            # Checked even on the step that hit max_tokens: a stop string completed by the last token wins.
            match = self._stop_matcher.check(self._text, self._num_checked_chars)
            if match is not None:
                self._text = self._text[: match.index + (len(match.stop) if self._include_stop_str else 0)]
                stopped_by_string = finished = True
        if self._stop_matcher is not None:
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
