"""Build a fast tokenizer from a GGUF file's metadata.

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary, merges, token types and special ids as metadata.
We rebuild from them the tokenizer transformers 5 builds for `AutoTokenizer.from_pretrained(dir, gguf_file=...)`
(its `integrations/gguf/gguf_tokenizer_mapping.py`), so that our ids are the reference's ids:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE (GPT-2 style pre-tokenizer and decoder), the split regex
  chosen by `tokenizer.ggml.pre` where transformers knows it (llama3, qwen2, ...), GPT-2's regex otherwise.
- `"llama"`: sentencepiece-style BPE with byte fallback (Metaspace, prepend "first"); merges from the file or,
  as for most such files, recovered from the token scores.
- Tokens typed CONTROL become special added tokens, USER_DEFINED ones plain added tokens, so both are matched
  whole in text.
Other tokenizer types, and the architectures transformers special-cases (gemma, phi3), raise a ValueError that
says to serve the model's Hugging Face directory instead.
"""

from __future__ import annotations

from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from scheduler_svc.text.tokenizer import TokenizerSpec
from scheduler_svc.text.vocab_merges_tokenizer import bos_eos_post_processor

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# tokenizer.ggml.<key> -> the named special token it designates
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
# llama.cpp also ends generation on these (end of turn / end of message) when a file names them.
_END_OF_GENERATION_IDS = ("eot_token_id", "eom_token_id")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex; the same table as transformers 5. Unlisted values keep GPT-2's regex.
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
         "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# Sentencepiece files of these architectures need tokenizers of their own in transformers; we do not rebuild them.
_UNSUPPORTED_SENTENCEPIECE_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "phi3")


def load_gguf_tokenizer(path: str) -> tuple[BackendTokenizer, TokenizerSpec]:
    """The backend tokenizer and the special tokens / chat template / stop ids a GGUF file describes."""
    metadata = _read_tokenizer_metadata(path)
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    tokenizer_type = metadata.get("tokenizer.ggml.model")
    architecture = metadata.get("general.architecture")
    if tokenizer_type == "gpt2":
        backend = _byte_level_bpe(metadata)
    elif tokenizer_type == "llama" and architecture not in _UNSUPPORTED_SENTENCEPIECE_ARCHITECTURES:
        backend = _sentencepiece_bpe(metadata)
    else:
        raise ValueError(
            f"{path}: cannot build a tokenizer for GGUF tokenizer type {tokenizer_type!r} of architecture "
            f"{architecture!r} (supported: 'gpt2', and 'llama' except {_UNSUPPORTED_SENTENCEPIECE_ARCHITECTURES}); "
            "serve the model's Hugging Face directory instead"
        )
    _add_typed_tokens(backend, tokens, metadata.get("tokenizer.ggml.token_type") or (), tokenizer_type == "gpt2")

    special_tokens = {
        name: tokens[metadata[f"tokenizer.ggml.{key}"]]
        for name, key in _SPECIAL_TOKEN_IDS.items()
        if f"tokenizer.ggml.{key}" in metadata
    }
    # Older sentencepiece files carry no flag, and llama.cpp adds BOS unless told otherwise (so does transformers).
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", tokenizer_type == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = bos_eos_post_processor(
        _token_and_id(metadata, "bos_token_id") if add_bos else None,
        _token_and_id(metadata, "eos_token_id") if add_eos else None,
    )
    spec = TokenizerSpec(
        special_tokens=special_tokens,
        extra_eos_token_ids=tuple(
            metadata[f"tokenizer.ggml.{key}"] for key in _END_OF_GENERATION_IDS if f"tokenizer.ggml.{key}" in metadata
        ),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
    return backend, spec


def _read_tokenizer_metadata(path: str) -> dict[str, Any]:
    reader = gguf.GGUFReader(path)
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if name.startswith("tokenizer.") or name == "general.architecture"
    }


def _byte_level_bpe(metadata: dict[str, Any]) -> BackendTokenizer:
    """GPT-2 style byte-level BPE. Tokens spelled outside the byte alphabet are respelled into it."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[byte] for byte in token.encode("utf-8")): index
        for index, token in enumerate(metadata["tokenizer.ggml.tokens"])
    }
    backend = BackendTokenizer(
        BPE(vocab=vocab, merges=_merges(metadata), dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
            fuse_unk=False)
    )
    split = _PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(metadata: dict[str, Any]) -> BackendTokenizer:
    """Llama/Mistral-style sentencepiece BPE: '▁' for spaces, a prefix space on the first word, byte fallback."""
    vocab = {token: index for index, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    backend = BackendTokenizer(BPE(vocab=vocab, merges=_merges(metadata), fuse_unk=True, byte_fallback=True,
                                   dropout=None))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    return backend


def _merges(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    """The file's merges, or the ones its scored vocabulary implies (sentencepiece files list none)."""
    if "tokenizer.ggml.merges" in metadata:
        return [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    tokens = metadata["tokenizer.ggml.tokens"]
    return _merges_from_scores(tokens, metadata["tokenizer.ggml.scores"])


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens is a merge, ranked by the merged token's score.

    The same order as transformers' `generate_merges` (ties: shorter left, then shorter right piece; within a token,
    by the pieces' ids), so that equal-score merges apply in the same order.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    token_scores = dict(zip(tokens, scores))
    ranked: list[tuple[str, str, float]] = []
    for token, score in token_scores.items():
        splits = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        ranked.extend(sorted(splits, key=lambda split: (vocab[split[0]], vocab[split[1]])))
    ranked.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_typed_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int], byte_level: bool) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED ones (e.g. `<think>`) plain added tokens.

    In a byte-level vocabulary a CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel and is
    skipped, as transformers does.
    """
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types)
        if token_type == _CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == _USER_DEFINED and token in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)


def _token_and_id(metadata: dict[str, Any], key: str) -> tuple[str, int] | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else (metadata["tokenizer.ggml.tokens"][token_id], token_id)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet byte-level BPE vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    spelling = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling
