"""What one OpenAI choice (one returned sequence) has produced, built from the SDK's stream chunks, and its
logprobs in the two OpenAI shapes.

Why token strings come from the chunks: the gateway has no tokenizer (it is only a gRPC client). The
scheduler samples one token per sequence per step and streams each step's new text with it, so a chunk with
one token carries exactly the text that token added (possibly "" while a multi-byte character or a possible
stop string is incomplete; the held text is then attributed to the token that releases it). The token
strings therefore always concatenate to the choice's text, and `text_offset` is exact. A chunk with several
tokens (a best_of > n result, sent whole) gives all its text to its first token. Alternatives (top
logprobs) are named by the text the scheduler decoded for each token alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from client.types import GenerateChunk

# A token's alternatives: (text, logprob), best first.
Alternatives = tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class TokenSpan:
    """A run of a choice's tokens: their strings, logprobs (None where the server sent none) and where
    each starts in the choice's text."""

    texts: tuple[str, ...]
    logprobs: tuple[float | None, ...]
    text_offsets: tuple[int, ...]
    alternatives: tuple[Alternatives, ...]


@dataclass
class ChoiceLog:
    index: int
    text: str = ""
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    alternatives: list[Alternatives] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0

    def add(self, chunk: GenerateChunk) -> TokenSpan:
        """Records a chunk of this choice; returns the tokens it added."""
        first = len(self.token_texts)
        count = len(chunk.token_ids)
        if count:
            texts = [chunk.text] + [""] * (count - 1)
            logprobs = list(chunk.logprobs) if len(chunk.logprobs) == count else [None] * count
            ranked = chunk.token_logprobs if len(chunk.token_logprobs) == count else [None] * count
            offset = len(self.text)
            for text, logprob, entry in zip(texts, logprobs, ranked):
                self.alternatives.append(() if entry is None else
                                         tuple((top.decoded_token, top.logprob) for top in entry.top))
                self.token_texts.append(text)
                self.logprobs.append(logprob)
                self.text_offsets.append(offset)
                offset += len(text)
        elif chunk.text and self.token_texts:  # text released without a token: it belongs to the last one
            self.token_texts[-1] += chunk.text
        self.text += chunk.text
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.completion_tokens = chunk.completion_tokens or 0
        return self._span(first)

    def add_prompt(self, text: str, tokens: TokenSpan | None) -> None:
        """Opens the choice with its prompt (echo): the prompt's text, and its tokens with their logprobs
        when the client asked for logprobs (the first token's logprob and alternatives are None)."""
        self.text += text
        if tokens is None:
            return
        self.token_texts += tokens.texts
        self.logprobs += tokens.logprobs
        self.alternatives += tokens.alternatives
        self.text_offsets += tokens.text_offsets

    def whole(self) -> TokenSpan:
        return self._span(0)

    def span_from(self, first: int) -> TokenSpan:
        """The tokens from the `first`-th on (what a streamed chunk adds)."""
        return self._span(first)

    def _span(self, first: int) -> TokenSpan:
        return TokenSpan(tuple(self.token_texts[first:]), tuple(self.logprobs[first:]),
                         tuple(self.text_offsets[first:]), tuple(self.alternatives[first:]))


def completion_logprobs(span: TokenSpan) -> dict:
    """The legacy completions shape: each top_logprobs entry holds the sampled token and its alternatives
    (as vLLM's does; with logprobs=0, the sampled token only)."""
    return {
        "tokens": list(span.texts),
        "token_logprobs": list(span.logprobs),
        # A prompt's first token (echo) has no logprob: None for its top_logprobs too, as vLLM's.
        "top_logprobs": [None if logprob is None else {text: logprob, **dict(alternatives)}
                         for text, logprob, alternatives in zip(span.texts, span.logprobs, span.alternatives)],
        "text_offset": list(span.text_offsets),
    }


def chat_logprobs(span: TokenSpan) -> dict:
    """The chat shape: one entry per token with its UTF-8 bytes and its top_logprobs alternatives."""
    return {"content": [
        {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
         "top_logprobs": [{"token": alt, "logprob": alt_logprob, "bytes": list(alt.encode("utf-8"))}
                          for alt, alt_logprob in alternatives]}
        for text, logprob, alternatives in zip(span.texts, span.logprobs, span.alternatives)
    ]}


def usage(prompt_tokens: int, choices: list[ChoiceLog]) -> dict:
    completion_tokens = sum(choice.completion_tokens for choice in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
