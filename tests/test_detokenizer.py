"""Streamed deltas concatenate to the decoded output, however the tokens arrive, and never show half a character."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.text.detokenizer import IncrementalDetokenizer
from scheduler_svc.text.tokenizer import Tokenizer, TokenizerSpec
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model

REAL_TEXTS = [
    "The capital of France is Paris.",
    "你好，世界！这是一个关于流式解码的测试。",
    "Emoji: 😀👍🏽👨‍👩‍👧 and flags 🇫🇷🇯🇵, then text.",
    "café naïve Ångström façade — “quotes” and ½ ≠ ∞",
    "mixed 中文 and English, with émojis 🎉 and code `x = {'a': 1}`\n\tdef f():\n\t\treturn 'ü'",
    "   spaces   everywhere   \n\n  ",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, 한국어, 日本語のテキスト",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model(None).path)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": "Write something."}])


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    deltas, position, sizes = [], 0, iter(chunk_sizes)
    while position < len(ids):
        size = next(sizes, 1)
        deltas.append(detokenizer.step(ids[position : position + size]))
        position += size
    deltas.append(detokenizer.flush())
    return deltas


@pytest.mark.parametrize("text", REAL_TEXTS)
def test_one_token_at_a_time_equals_decode_and_never_emits_replacement(tokenizer, prompt_ids, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = stream(detokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == detokenizer.output_text == tokenizer.decode(ids) == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert deltas[-1] == ""  # real text ends on a whole character: nothing left to flush


@pytest.mark.parametrize("text", REAL_TEXTS)
def test_random_chunks_equal_decode(tokenizer, prompt_ids, text):
    ids = tokenizer.encode(text, add_special_tokens=False) + [2]  # ends with <|im_end|>, skipped
    rng = random.Random(text)
    for _ in range(5):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        deltas = stream(detokenizer, ids, [rng.randint(1, 6) for _ in ids])
        assert "".join(deltas) == tokenizer.decode(ids) == text


def test_split_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE spells this emoji over several tokens
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Look: "))
    assert [detokenizer.step([token_id]) for token_id in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_special_tokens_kept_when_not_skipped(tokenizer, prompt_ids):
    ids = tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False,
                                         spaces_between_special_tokens=False)
    assert "".join(stream(detokenizer, ids, [1] * len(ids))) == "hi<|im_end|>"


@pytest.mark.parametrize("chunk", [1, 2, 7])
def test_spaces_between_special_tokens_joins_kept_special_tokens_with_spaces(tokenizer, prompt_ids, chunk):
    ids = tokenizer.encode("hi<|im_end|>there<|im_end|><|im_end|>", add_special_tokens=False)
    spaced = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False)
    assert "".join(stream(spaced, ids, [chunk] * len(ids))) == "hi <|im_end|> there <|im_end|> <|im_end|>"
    skipped = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    assert "".join(stream(skipped, ids, [chunk] * len(ids))) == "hithere"


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    skip_special_tokens=st.booleans(),
)
def test_random_ids_any_chunking_equal_decode(tokenizer, data, skip_special_tokens):
    """Random ids split characters anywhere, leave invalid bytes and special tokens mid-character."""
    # Ids 0-16 are special; 100-400 are single bytes and short pieces, including UTF-8 lead/continuation bytes.
    token_id = st.one_of(st.integers(0, 16), st.integers(100, 400), st.integers(0, tokenizer.vocab_size - 1))
    ids = data.draw(st.lists(token_id, max_size=40))
    prompt = data.draw(st.lists(st.integers(17, tokenizer.vocab_size - 1), max_size=8))
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=40))
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(tokenizer.decode(prompt)), skip_special_tokens,
                                         spaces_between_special_tokens=False)
    deltas = stream(detokenizer, ids, chunks)
    assert "".join(deltas) == detokenizer.output_text == tokenizer.decode(ids, skip_special_tokens)


# ---- sentencepiece-style decoding (leading spaces) ----


@pytest.fixture(scope="module")
def sentencepiece_tokenizer() -> Tokenizer:
    """A small trained '▁'-style BPE whose decoder drops the leading space of the first token it sees."""
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer(add_prefix_space=True)
    corpus = ["The quick brown fox jumps over the lazy dog, then naps. Hello world!"] * 20
    trainer.train_from_iterator(corpus, vocab_size=120, min_frequency=2, show_progress=False)
    return Tokenizer(trainer._tokenizer, TokenizerSpec(special_tokens={}))


def test_sentencepiece_spaces_between_words_survive_streaming(sentencepiece_tokenizer):
    tokenizer = sentencepiece_tokenizer
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    assert [tokenizer.decode([token_id]) for token_id in ids][1:3] != [" quick", " brown"]  # per token: spaces lost
    deltas = stream(IncrementalDetokenizer(tokenizer, []), ids, [1] * len(ids))
    assert "".join(deltas) == tokenizer.decode(ids) == "The quick brown fox jumps over the lazy dog"


def test_sentencepiece_output_continues_the_prompt_with_its_leading_space(sentencepiece_tokenizer):
    tokenizer = sentencepiece_tokenizer
    prompt = tokenizer.encode("The quick brown")
    full = tokenizer.encode("The quick brown fox jumps")
    assert full[: len(prompt)] == prompt
    output = full[len(prompt) :]
    for chunk in (1, 2, 3):
        deltas = stream(IncrementalDetokenizer(tokenizer, prompt), output, [chunk] * len(output))
        assert "".join(deltas) == " fox jumps" == tokenizer.decode(full)[len(tokenizer.decode(prompt)) :]


@settings(max_examples=100, deadline=None)
@given(
    words=st.lists(st.sampled_from(["The", "quick", "brown", "fox", "naps", "dog", ",", "!", "  ", "\n", "x"]),
                   max_size=12),
    chunks=st.lists(st.integers(1, 4), max_size=30),
)
def test_sentencepiece_random_texts_any_chunking_equal_decode(sentencepiece_tokenizer, words, chunks):
    ids = sentencepiece_tokenizer.encode(" ".join(words))
    deltas = stream(IncrementalDetokenizer(sentencepiece_tokenizer, []), ids, chunks)
    assert "".join(deltas) == sentencepiece_tokenizer.decode(ids)


# ---- the byte-level shortcut (tokenizer.py: appended_text) ----


class _WithoutShortcut:
    """The tokenizer with `appended_text` answering None: the detokenizer decodes every window."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.all_special_ids = tokenizer.all_special_ids

    def decode(self, ids, skip_special_tokens=True):
        return self._tokenizer.decode(ids, skip_special_tokens)

    def appended_text(self, token_id):
        return None


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_the_byte_level_shortcut_gives_the_deltas_of_decoding_every_window(tokenizer, data, skip_special_tokens):
    token_id = st.one_of(st.integers(0, 16), st.integers(100, 400), st.integers(0, tokenizer.vocab_size - 1))
    ids = data.draw(st.lists(token_id, max_size=40))
    prompt = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=8))  # may end mid-character
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=40))
    with_shortcut = stream(IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens), ids, chunks)
    without = stream(IncrementalDetokenizer(_WithoutShortcut(tokenizer), prompt, skip_special_tokens), ids, chunks)
    assert with_shortcut == without


def test_ordinary_tokens_stream_without_decoding_windows(tokenizer, sentencepiece_tokenizer):
    ids = tokenizer.encode(" The capital of France is Paris, of course.")
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Question:"))
    decoded = []
    original = tokenizer.decode
    tokenizer.decode = lambda window, skip=True: decoded.append(list(window)) or original(window, skip)
    try:
        deltas = [detokenizer.step([token_id]) for token_id in ids]
    finally:
        del tokenizer.decode
    assert "".join(deltas) == tokenizer.decode(ids) and not decoded
    assert tokenizer.appended_text(ids[0]) == tokenizer.decode([ids[0]])
    assert tokenizer.appended_text(tokenizer.eos_token_ids[0]) is None  # an added token: its text may differ
    assert all(sentencepiece_tokenizer.appended_text(i) is None for i in range(20))  # not byte-level
