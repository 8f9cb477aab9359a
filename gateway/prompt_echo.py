"""`echo` on /v1/completions: each choice opens with its prompt; with `logprobs`, also with the prompt's tokens
and their logprobs; with `max_tokens: 0`, with nothing else. And vLLM's `prompt_logprobs` field: each choice
carries the prompt's logprobs in vLLM's shape. vLLM's behaviour, and what lm-evaluation-harness's
`local-completions` model scores log-likelihoods from (it sums `token_logprobs` past the context).

`max_tokens: 0` goes to the scheduler as is: it computes the prompt for its logprobs and samples nothing
(scheduler_svc/groups/prompt_only.py), so the choice holds the prompt alone, `completion_tokens` is 0 and the
finish reason is "length", as vLLM's.

Where the numbers come from: the scheduler's prompt_logprobs (one entry per prompt token from the second on:
the token's logprob under log_softmax of the raw logits, its rank and the top alternatives, each decoded
alone). The first prompt token has no logprob: its token_logprobs and top_logprobs entries are None (vLLM's),
and its text is the model's tokenizer's decoding of it alone (a Detokenize call, special tokens kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from client.types import TokenLogprobs
from gateway.choices import TokenSpan

# JSON has no -Infinity: a logprob of a token the model rules out is sent as this (vLLM's floor).
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class EchoPlan:
    """What a completion request's echo needs from the scheduler and drops from its output."""

    # The prompt's tokens and logprobs open each choice (echo with logprobs).
    with_prompt_logprobs: bool

    @classmethod
    def of(cls, echo: bool, logprobs: int | None) -> EchoPlan | None:
        if not echo:
            return None
        return cls(with_prompt_logprobs=logprobs is not None)

    def keywords(self, logprobs: int | None, prompt_logprobs: int | None) -> dict[str, Any]:
        """The SDK keywords this echo changes: prompt logprobs (and the prompt's ids, whose first has none)."""
        if not self.with_prompt_logprobs:
            return {}
        return {"prompt_logprobs": max(logprobs, prompt_logprobs or 0), "return_prompt": True}


def prompt_token_span(first_token_text: str, prompt_logprobs: tuple[TokenLogprobs, ...]) -> TokenSpan:
    """The prompt's tokens as a choice's logprobs list them: the first (no logprob), then one per entry."""
    texts = (first_token_text, *(entry.token.decoded_token for entry in prompt_logprobs))
    logprobs = (None, *(max(entry.token.logprob, LOGPROB_FLOOR) for entry in prompt_logprobs))
    alternatives = ((), *(tuple((top.decoded_token, max(top.logprob, LOGPROB_FLOOR)) for top in entry.top)
                          for entry in prompt_logprobs))
    offsets, offset = [], 0
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return TokenSpan(texts, logprobs, tuple(offsets), alternatives)


def vllm_prompt_logprobs(prompt_logprobs: tuple[TokenLogprobs, ...]) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs` of a choice: None for the first token, then per token {token id: {logprob,
    rank, decoded_token}} for the token itself and its alternatives."""
    return [None] + [
        {str(logprob.token_id): {"logprob": max(logprob.logprob, LOGPROB_FLOOR), "rank": logprob.rank,
                                 "decoded_token": logprob.decoded_token}
         for logprob in (entry.token, *entry.top)}
        for entry in prompt_logprobs
    ]
