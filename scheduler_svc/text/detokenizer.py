"""Streaming detokenization: the text each new batch of sampled tokens adds to a request's output.

Why not `decode([token])` per token: a token's text depends on its neighbours. Byte-level BPE splits one character
(Chinese, emoji, accents) over several tokens, whose bytes alone decode to U+FFFD; sentencepiece decoders drop the
leading space of the first token they see. Why not `decode(all output ids)` each step: quadratic in the output.

So, as vLLM does: decode a short window of recent tokens with and without the unread ones, and emit the
difference. Tokens `prefix_offset..read_offset` were already emitted and are decoded only as context (a leading
space, the rest of a character); tokens `read_offset..` are not emitted yet. Text ending in U+FFFD is held back:
it may be an incomplete UTF-8 sequence that the next token completes. The window starts on the prompt's last
few tokens, so the first output token keeps its leading space (" Paris" after "The capital of France is"), as in
vLLM.

Invariant (tested): the concatenation of the deltas of `step()` and `flush()` equals
`tokenizer.decode(output ids)`, for any chunking, except that a sentencepiece decoder's strip of the very first
space is not applied when there is a prompt (the output continues the prompt's text). One known exception, shared
with vLLM: a byte-fallback decoder (Llama-2 style `<0xE4>` tokens) turns a run of byte tokens that is not valid
UTF-8 into one U+FFFD per byte, ASCII bytes included, so a byte already streamed as "P" may later decode as U+FFFD.
Only invalid output (never real text) is affected, and only in which replacement characters appear.

`spaces_between_special_tokens` (vLLM's parameter, True by default) acts when special tokens are kept
(`skip_special_tokens=False`): as transformers' slow tokenizers and vLLM's slow detokenizer do, the text is
decoded in segments split at special tokens and joined with single spaces ("Hi <|im_end|> there"); False
joins them with nothing, which is what the plain fast decode gives. (vLLM's fast detokenizer ignores the
parameter; we honour its documented meaning.) The join is prefix-stable, so the streaming invariant holds.

Owned by one request in the scheduler's engine loop; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.text.tokenizer import Tokenizer

_PROMPT_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
_REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's sampled token ids into text deltas, holding back incomplete characters.

    The window is trimmed as text is emitted, so prefix_offset is always 0: `_window[:_read_offset]` are the
    tokens of the last emitted delta (context), `_window[_read_offset:]` the tokens not emitted yet.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._space_special_ids = (
            frozenset(tokenizer.all_special_ids) if spaces_between_special_tokens and not skip_special_tokens
            else frozenset()
        )
        self._window: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)  # decode(_window[:_read_offset])
        self._output_text = ""

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenation of every delta returned)."""
        return self._output_text

    def step(self, new_token_ids: Sequence[int], text_ends: list[int] | None = None) -> str:
        """Append sampled tokens; return the text they complete (may be "" while a character is incomplete).
        `text_ends`: appended with the length of `output_text` after each token (which token completed what)."""
        deltas = []
        num_chars = len(self._output_text)
        # `_emit` inlined, names bound once: this loop runs for every token of every stream (the scheduler's
        # publishing at hundreds of streams is mostly this loop).
        decode, window, prefix_text = self._decode, self._window, self._prefix_text
        appended_text = None if self._space_special_ids else self._tokenizer.appended_text
        for token_id in new_token_ids:  # one at a time, so a complete character is never held behind a partial one
            if (appended_text is not None and self._read_offset == len(window)
                    and not prefix_text.endswith(_REPLACEMENT_CHARACTER)
                    and (delta := appended_text(token_id)) is not None):
                # Nothing unread, and the text ends in a complete character: the token's text is what decoding
                # the window with it adds (tokenizer.py: appended_text), and its own decode the next context.
                window.clear()
                window.append(token_id)
                self._read_offset = 1
                prefix_text = delta
                deltas.append(delta)
                num_chars += len(delta)
                if text_ends is not None:
                    text_ends.append(num_chars)
                continue
            window.append(token_id)
            text = decode(window)
            # Nothing new (e.g. a skipped special token), or possibly half a character: wait for more tokens.
            if len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT_CHARACTER):
                delta = text[len(prefix_text) :]
                deltas.append(delta)
                num_chars += len(delta)
                del window[: self._read_offset]
                self._read_offset = len(window)
                prefix_text = decode(window)
            if text_ends is not None:
                text_ends.append(num_chars)
        self._prefix_text = prefix_text
        delta = "".join(deltas)
        self._output_text += delta
        return delta

    def flush(self) -> str:
        """Return the text held back, once the request has finished: an incomplete character becomes U+FFFD.

        Call it when the output is final (length / eos / stop token), so that the streamed text equals
        `decode(output ids)` even when the last token left a character unfinished. Returns "" when nothing is held.
        """
        if self._read_offset == len(self._window):
            return ""
        text = self._decode(self._window)
        delta = self._emit(text) if len(text) > len(self._prefix_text) else ""
        self._output_text += delta
        return delta

    def _emit(self, text: str) -> str:
        """Return the new part of `text` (the window's decode); its tokens become the next window's context."""
        delta = text[len(self._prefix_text) :]
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not self._space_special_ids or self._space_special_ids.isdisjoint(ids):
            return self._tokenizer.decode(ids, self._skip_special_tokens)
        segments: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in self._space_special_ids:
                if run:
                    segments.append(self._tokenizer.decode(run, skip_special_tokens=False))
                    run = []
                segments.append(self._tokenizer.decode([token_id], skip_special_tokens=False))
            else:
                run.append(token_id)
        if run:
            segments.append(self._tokenizer.decode(run, skip_special_tokens=False))
        return " ".join(segments)
