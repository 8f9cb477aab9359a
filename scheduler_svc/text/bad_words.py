"""bad_words as token-id sequences, the form the worker masks them in.

Why on the scheduler: it has the tokenizer, the worker never sees text. As vLLM does, each word is tokenized
twice, as given (a word at the very start of the output) and with one leading space (a word in the middle of
text, which byte-level BPE and sentencepiece spell with the space glued to the first token); the spaced form
is kept only when it is a different first token of the same length, i.e. really another spelling.
"""

from __future__ import annotations

from scheduler_svc.text.tokenizer import Tokenizer


def bad_words_token_ids(bad_words: tuple[str, ...], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    sequences: list[tuple[int, ...]] = []
    for word in bad_words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if plain:
            sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return tuple(dict.fromkeys(sequences))
