"""A byte-level BPE tokenizer from `vocab.json` + `merges.txt`, for checkpoints that ship no `tokenizer.json`
(every facebook/opt-* repository, GPT-2 and its kin), built as transformers 5's GPT2Tokenizer builds it.

Why here and not transformers: the scheduler never imports torch, and transformers' tokenizer classes do. What
we follow (transformers 5, GPT2Tokenizer over the `tokenizers` backend): a BPE with no continuing-subword prefix
or end-of-word suffix and no unknown token; the ByteLevel pre-tokenizer (`add_prefix_space` from
tokenizer_config.json, default false) and decoder; and a post-processor that adds the BOS token before a
sequence when the config's `add_bos_token` is true (OPT: "</s>", id 2) and the EOS after it when
`add_eos_token` is (both default false, as for GPT-2). The named special tokens become special added tokens in
`Tokenizer` (tokenizer.py), as for every directory; those the configs leave out take GPT2Tokenizer's default,
"<|endoftext|>".

Which directories: tokenizer_config.json's `tokenizer_class` must be GPT2Tokenizer(Fast); without one, config.json's
`model_type` must be one transformers' AutoTokenizer maps to GPT2Tokenizer. Other vocab/merges tokenizers
(RoBERTa's, CodeGen's) differ in pre-tokenizer or post-processor and are refused naming the key: their ids
would otherwise be silently wrong.
"""

from __future__ import annotations

import os
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, pre_tokenizers, processors
from tokenizers.models import BPE

VOCAB_FILE, MERGES_FILE = "vocab.json", "merges.txt"
GPT2_TOKENIZER_CLASSES = ("GPT2Tokenizer", "GPT2TokenizerFast")
GPT2_MODEL_TYPES = ("gpt2", "gpt_neo", "gptj", "opt")  # AutoTokenizer's GPT2Tokenizer families
GPT2_SPECIAL_TOKEN_DEFAULTS = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}


def has_vocab_and_merges(directory: str) -> bool:
    return all(os.path.isfile(os.path.join(directory, name)) for name in (VOCAB_FILE, MERGES_FILE))


def check_gpt2_tokenizer(tokenizer_config: dict[str, Any], model_config: dict[str, Any]) -> None:
    """Raise unless the configs name GPT-2's tokenizer (see the module docstring)."""
    named = tokenizer_config.get("tokenizer_class")
    if named is not None and named not in GPT2_TOKENIZER_CLASSES:
        raise ValueError(f"tokenizer_class {named!r} from vocab.json + merges.txt (no tokenizer.json) is not "
                         f"supported; supported: {list(GPT2_TOKENIZER_CLASSES)}")
    if named is None and model_config.get("model_type") not in GPT2_MODEL_TYPES:
        raise ValueError(f"no tokenizer.json, and vocab.json + merges.txt of model_type "
                         f"{model_config.get('model_type')!r} is not supported; supported: {list(GPT2_MODEL_TYPES)} "
                         "(or tokenizer_class GPT2Tokenizer)")


def vocab_merges_backend(directory: str, config: dict[str, Any], special_tokens: dict[str, str]) -> BackendTokenizer:
    """The backend for `directory`'s vocab.json + merges.txt; `config` is its tokenizer_config.json and
    `special_tokens` the named special tokens (bos_token, eos_token, ...) read from it."""
    model = BPE.from_file(
        os.path.join(directory, VOCAB_FILE), os.path.join(directory, MERGES_FILE),
        dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
    )
    backend = BackendTokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space", False)))
    backend.decoder = decoders.ByteLevel()
    bos = _token_and_id(backend, special_tokens.get("bos_token")) if config.get("add_bos_token") else None
    eos = _token_and_id(backend, special_tokens.get("eos_token")) if config.get("add_eos_token") else None
    backend.post_processor = bos_eos_post_processor(bos, eos)
    return backend


def _token_and_id(backend: BackendTokenizer, token: str | None) -> tuple[str, int] | None:
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(f"special token {token!r} is not in {VOCAB_FILE}")
    return token, token_id


def bos_eos_post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.PostProcessor:
    """Add BOS / EOS (token, id) around a sequence, as a tokenizer's add_bos_token / add_eos_token flags say."""
    single = " ".join(([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else []))
    pair = " ".join([single] + ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else []))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t])
