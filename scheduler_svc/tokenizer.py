"""Text <-> token ids for the scheduler, loaded from a Hugging Face directory or a GGUF file.

Why not `transformers.AutoTokenizer`: in transformers 5 it imports torch, and the scheduler service never does.
So this module builds the same fast tokenizer itself, from the `tokenizers` library (Rust), `jinja2` for chat
templates and the `gguf` package for GGUF metadata, and is tested id for id against transformers.

Who owns what: one `Tokenizer` per served model, created once at start-up and shared read-only by the gRPC edge
(prompt encoding, chat templates) and the engine loop (incremental detokenization, stop checks). It holds no
per-request state.

What we follow, from transformers 5:
- A directory's `tokenizer.json` is used as is, post-processor included: transformers 5 drops
  `add_bos_token`/`add_eos_token` from `tokenizer_config.json` whenever `tokenizer.json` exists, so do we.
- Named special tokens from the config (bos, eos, unk, pad, ...) become special added tokens when the backend does
  not already have them, so they are matched whole in text and skipped by `decode(skip_special_tokens=True)`.
- `clean_up_tokenization_spaces` is not applied: it is not prefix-stable, so streamed text could not equal the
  final text (vLLM's fast detokenizer ignores it too). Modern configs set it to false anyway.
The GGUF conversion is in `gguf_tokenizer.py`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

# The template variables transformers passes from its special tokens map (SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything besides the backend that a model's files say about its tokenizer.

    special_tokens: named special tokens by attribute name (`{"bos_token": "<|im_start|>", ...}`), which are also
    the chat template's variables. extra_eos_token_ids: ids that end generation besides the eos token's own (from
    generation_config.json, or a GGUF's end-of-turn ids).
    """

    special_tokens: dict[str, str]
    extra_special_tokens: tuple[str, ...] = ()
    extra_eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None


class Tokenizer:
    """A fast tokenizer plus the model's special tokens and chat template.

    Why a wrapper and not the bare `tokenizers.Tokenizer`: the backend knows nothing of bos/eos ids, chat templates
    or the extra stop ids of generation_config.json; this class is the one place that joins them, with the small
    API the scheduler needs (the same names and results as transformers' tokenizer methods). It takes ownership of
    `backend` (named special tokens missing from it are added).
    """

    def __init__(self, backend: BackendTokenizer, spec: TokenizerSpec) -> None:
        self._backend = backend
        self._special_tokens = dict(spec.special_tokens)
        self._add_missing_special_tokens((*spec.special_tokens.values(), *spec.extra_special_tokens))
        eos_id = self._token_id(spec.special_tokens.get("eos_token"))
        eos_ids = ([eos_id] if eos_id is not None else []) + list(spec.extra_eos_token_ids)
        self._eos_token_ids = tuple(dict.fromkeys(eos_ids))
        self._bos_token_id = self._token_id(spec.special_tokens.get("bos_token"))
        added = backend.get_added_tokens_decoder()
        self._all_special_ids = tuple(sorted(token_id for token_id, token in added.items() if token.special))
        self._chat_template_source = spec.chat_template
        self._chat_template = _compile_chat_template(spec.chat_template) if spec.chat_template else None

    # ---- encoding / decoding ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a leading BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """Vocabulary strings of `ids` (byte-level spelling, e.g. 'Ġworld'); None for an id out of the vocabulary."""
        return [self._backend.id_to_token(token_id) for token_id in ids]

    # ---- chat ----

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered as transformers' `apply_chat_template(tokenize=False)`."""
        if self._chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead of messages")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        # As transformers: keys whose value is None are dropped (OpenAI clients send content=None).
        conversation = [{key: value for key, value in message.items() if value is not None} for message in messages]
        return self._chat_template.render(
            **self._special_tokens,
            messages=conversation,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation; the template writes its own special tokens, so none are added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    # ---- special tokens ----

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the eos token's first, then generation_config.json's (or a GGUF's eot)."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        """Ids of every special added token, i.e. exactly those `decode(skip_special_tokens=True)` drops.

        A superset of transformers' `all_special_ids`, which lists only the named ones (bos, eos, unk, pad, ...).
        """
        return self._all_special_ids

    @property
    def vocab_size(self) -> int:
        """Number of token strings, added tokens included (`len(tokenizer)` in transformers)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _add_missing_special_tokens(self, tokens: tuple[str, ...]) -> None:
        added = {token.content for token in self._backend.get_added_tokens_decoder().values()}
        missing = [token for token in dict.fromkeys(tokens) if token and token not in added]
        if missing:
            self._backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in missing])


def load_tokenizer(model_path: str) -> Tokenizer | None:
    """The tokenizer of a model directory or .gguf file; None for a directory without tokenizer.json."""
    if os.path.isdir(model_path):
        return _load_directory_tokenizer(model_path)
    if model_path.endswith(".gguf") and os.path.isfile(model_path):
        from scheduler_svc.gguf_tokenizer import load_gguf_tokenizer  # here: that module imports TokenizerSpec


        backend, spec = load_gguf_tokenizer(model_path)
        return Tokenizer(backend, spec)
    raise ValueError(f"not a model directory or .gguf file: {model_path!r}")


def read_eos_token_ids(model_path: str) -> tuple[int, ...]:
    """Stop ids of a directory that has no tokenizer: generation_config.json's, else config.json's."""
    for file_name in ("generation_config.json", "config.json"):
        eos_ids = _eos_ids_of(_read_json(os.path.join(model_path, file_name)).get("eos_token_id"))
        if eos_ids:
            return eos_ids
    return ()


def _load_directory_tokenizer(directory: str) -> Tokenizer | None:
    tokenizer_file = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        return None
    backend = BackendTokenizer.from_file(tokenizer_file)
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    # Older repos keep the special tokens in special_tokens_map.json; tokenizer_config.json wins where both say.
    token_map = {**_read_json(os.path.join(directory, "special_tokens_map.json")), **config}
    special_tokens = {name: _token_content(token_map[name]) for name in NAMED_SPECIAL_TOKENS if token_map.get(name)}
    extra = token_map.get("extra_special_tokens") or token_map.get("additional_special_tokens") or ()
    if isinstance(extra, dict):  # transformers 5 may store {name: token}
        extra = list(extra.values())
    generation_config = _read_json(os.path.join(directory, "generation_config.json"))
    spec = TokenizerSpec(
        special_tokens=special_tokens,
        extra_special_tokens=tuple(_token_content(token) for token in extra),
        extra_eos_token_ids=_eos_ids_of(generation_config.get("eos_token_id")),
        chat_template=_directory_chat_template(directory, config),
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


# ---- chat templates ----


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` and render its body unchanged.

    transformers uses this tag to mark assistant tokens for training masks; some templates contain it, and
    they would not even parse without the tag. Serving has no use for the mask.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt; transformers overrides it thus.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders them in.

    Templates come from model repos, so they are untrusted code: a sandbox that cannot mutate its inputs.
    """
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)
