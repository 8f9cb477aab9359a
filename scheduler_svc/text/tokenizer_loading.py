"""A model's `Tokenizer` from its files: a Hugging Face directory (tokenizer.json and its configs, or vocab.json +
merges.txt: `vocab_merges_tokenizer.py`) or a GGUF file (`gguf_tokenizer.py`), and the stop ids of a directory
that has no tokenizer.

Why apart from tokenizer.py: the loaders depend on the Tokenizer and its `TokenizerSpec`, never the other way,
so the GGUF conversion and the directory reader import tokenizer.py and nothing imports them back.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from scheduler_svc.text.gguf_tokenizer import load_gguf_tokenizer
from scheduler_svc.text.tokenizer import NAMED_SPECIAL_TOKENS, Tokenizer, TokenizerSpec
from scheduler_svc.text.vocab_merges_tokenizer import (
    GPT2_SPECIAL_TOKEN_DEFAULTS,
    check_gpt2_tokenizer,
    has_vocab_and_merges,
    vocab_merges_backend,
)


def load_tokenizer(model_path: str, chat_template: str | None = None) -> Tokenizer | None:
    """The tokenizer of a model directory or .gguf file; None for a directory without tokenizer.json.
    `chat_template`: a template that replaces the files' (--chat-template)."""
    if os.path.isdir(model_path):
        return _load_directory_tokenizer(model_path, chat_template)
    if model_path.endswith(".gguf") and os.path.isfile(model_path):
        backend, spec = load_gguf_tokenizer(model_path)
        if chat_template is not None:
            spec = dataclasses.replace(spec, chat_template=chat_template)
        return Tokenizer(backend, spec)
    raise ValueError(f"not a model directory or .gguf file: {model_path!r}")


def read_eos_token_ids(model_path: str) -> tuple[int, ...]:
    """Stop ids of a directory that has no tokenizer: generation_config.json's, else config.json's."""
    for file_name in ("generation_config.json", "config.json"):
        eos_ids = _eos_ids_of(_read_json(os.path.join(model_path, file_name)).get("eos_token_id"))
        if eos_ids:
            return eos_ids
    return ()


def _load_directory_tokenizer(directory: str, chat_template: str | None) -> Tokenizer | None:
    """tokenizer.json if there is one, else vocab.json + merges.txt (OPT, GPT-2), else None."""
    tokenizer_file = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(tokenizer_file) and not has_vocab_and_merges(directory):
        return None
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    # Older repos keep the special tokens in special_tokens_map.json; tokenizer_config.json wins where both say.
    token_map = {**_read_json(os.path.join(directory, "special_tokens_map.json")), **config}
    from_vocab_merges = not os.path.isfile(tokenizer_file)
    if from_vocab_merges:  # GPT2Tokenizer: its defaults for the named tokens the configs leave out
        check_gpt2_tokenizer(config, _read_json(os.path.join(directory, "config.json")))
        token_map = {**GPT2_SPECIAL_TOKEN_DEFAULTS, **token_map}
    special_tokens = {name: _token_content(token_map[name]) for name in NAMED_SPECIAL_TOKENS if token_map.get(name)}
    if from_vocab_merges:
        backend = vocab_merges_backend(directory, config, special_tokens)
    else:
        backend = BackendTokenizer.from_file(tokenizer_file)
    extra = token_map.get("extra_special_tokens") or token_map.get("additional_special_tokens") or ()
    if isinstance(extra, dict):  # transformers 5 may store {name: token}
        extra = list(extra.values())
    generation_config = _read_json(os.path.join(directory, "generation_config.json"))
    spec = TokenizerSpec(
        special_tokens=special_tokens,
        extra_special_tokens=tuple(_token_content(token) for token in extra),
        extra_eos_token_ids=_eos_ids_of(generation_config.get("eos_token_id")),
        chat_template=chat_template if chat_template is not None else _directory_chat_template(directory, config),
    )
    return Tokenizer(backend, spec)


def _directory_chat_template(directory: str, config: dict[str, Any]) -> str | None:
    """chat_template.jinja if present (it takes priority, as in transformers), else the config's template."""
    template_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as handle:
            return handle.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    return template or None


def _token_content(token: str | dict[str, Any]) -> str:
    """A config's special token: a plain string or a serialized AddedToken ({"content": ..., ...})."""
    return token["content"] if isinstance(token, dict) else token


def _eos_ids_of(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
