"""Logprobs the worker reported for one token, as the scheduler passes them on to the client's stream.

Who owns what: built by `plan_codec.decode_step_result` from the wire StepResult, carried on `StepOutcome`
and `OutputDelta` (immutable), turned into the public TokenLogprobs message by the gRPC edge, which also
adds each token's decoded text (the worker never sees text).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """A token (sampled, or a prompt token), its logprob and rank (1 = best) under log_softmax of the raw
    logits, and the top alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobChunk:
    """The prompt tokens scored in one step: `tokens[i]` is prompt token `first_position + i`."""

    first_position: int
    tokens: tuple[TokenLogprob, ...]


class PromptLogprobs:
    """A request's prompt logprobs as the chunks arrive (prompt tokens 1 .. P - 1, in order). A recompute
    after preemption scores positions again: only positions not yet held are taken."""

    def __init__(self) -> None:
        self._tokens: list[TokenLogprob] = []

    def add(self, chunk: PromptLogprobChunk | None) -> None:
        if chunk is None:
            return
        skip = 1 + len(self._tokens) - chunk.first_position  # first_position 1 is prompt token 1
        if skip >= 0:
            self._tokens.extend(chunk.tokens[skip:])

    @property
    def tokens(self) -> tuple[TokenLogprob, ...]:
        return tuple(self._tokens)
