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
Loading from a model's files is in `tokenizer_loading.py` (the GGUF conversion in `gguf_tokenizer.py`), chat
templates are compiled in `chat_template.py`; both loaders build a `TokenizerSpec`, which this module owns.
"""

from __future__ import annotations

import functools
import json

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from scheduler_svc.text.chat_template import compile_chat_template

# The template variables transformers passes from its special tokens map (SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# Characters above which `encode` releases the GIL (a 16k-character text takes a few milliseconds).
GIL_FREE_ENCODE_CHARS = 16_384


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
        self._chat_template = compile_chat_template(spec.chat_template) if spec.chat_template else None
        # decode([id]) by (id, skip_special_tokens): the incremental detokenizer asks for one token's text about
        # once per streamed token, and it is a pure function of the id (at most two entries per vocabulary id).
        self._single_token_texts: dict[tuple[int, bool], str] = {}
        self._num_token_strings = backend.get_vocab_size(with_added_tokens=True)

    # ---- encoding / decoding ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a leading BOS).

        A long text goes through `encode_batch`, which gives the same ids but releases the GIL while it works
        (`encode` holds it throughout, so a tokenizer thread would still stall the event loop that relays every
        stream's tokens for as long as a long text takes to encode)."""
        if len(text) > GIL_FREE_ENCODE_CHARS:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) == 1 and 0 <= ids[0] < self._num_token_strings:
            key = (int(ids[0]), skip_special_tokens)
            text = self._single_token_texts.get(key)
            if text is None:
                text = self._backend.decode([key[0]], skip_special_tokens=skip_special_tokens)
                self._single_token_texts[key] = text
            return text
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def appended_text(self, token_id: int) -> str | None:
        """The text `token_id` adds to any text ending in a complete character, or None if that depends on its
        neighbours (the incremental detokenizer's shortcut: detokenizer.py).

        Only a byte-level decoder (GPT-2 style: the tokens' bytes joined, then read as UTF-8) has such tokens:
        those not added to the vocabulary whose bytes are complete UTF-8 on their own (most of them). A
        SentencePiece decoder drops the first token's leading space, a byte-fallback one joins byte tokens:
        None for every token there."""
        texts = self._appended_texts
        if texts is None:
            return None
        text = texts.get(token_id)
        if text is None:
            text = False
            if 0 <= token_id < self._num_token_strings and token_id not in self._added_token_ids:
                decoded = self._backend.decode([token_id], skip_special_tokens=False)
                if decoded and "\ufffd" not in decoded:
                    text = decoded
            texts[token_id] = text
        return text or None

    @functools.cached_property
    def _appended_texts(self) -> dict[int, str | bool] | None:
        """appended_text's answers by id (False: none), or None when the decoder is not byte-level."""
        decoder = json.loads(self._backend.to_str()).get("decoder") or {}
        return {} if decoder.get("type") == "ByteLevel" else None

    @functools.cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self._backend.get_added_tokens_decoder())

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary string, added tokens included. A token covers at most this many
        characters of a text: a byte-level token's string has one character per byte it covers (>= one per
        code point), a SentencePiece piece one per character ('▁' for a space), a byte-fallback or special
        token's spelling is at least as long as what it matches."""
        return max(len(token) for token in self._backend.get_vocab(with_added_tokens=True))

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

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        documents: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation, rendered as transformers' `apply_chat_template(tokenize=False)`:
        `template_kwargs` become extra template variables, `documents` and `tools` the template's, and
        `continue_final_message` cuts the rendering right after the last message's content (no end-of-turn),
        so the model continues that message."""
        if self._chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead of messages")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        # As transformers: keys whose value is None are dropped (OpenAI clients send content=None).
        conversation = [{key: value for key, value in message.items() if value is not None} for message in messages]
        # The request's variables cannot replace the ones the server sets (they come last).
        rendered = self._chat_template.render({
            **self._special_tokens,
            **(template_kwargs or {}),
            "messages": conversation,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        })
        if continue_final_message:
            return _cut_after_final_message(rendered, conversation[-1].get("content") or "")
        return rendered

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation; the template writes its own special tokens, so none are added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def to_json(self) -> str:
        """The backend serialized as `tokenizers` JSON, added special tokens included: the workers' grammar
        matchers build their token table from it (WorkerSetup.structured_output_tokenizer)."""
        return self._backend.to_str()

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


def _cut_after_final_message(rendered: str, final_content: str) -> str:
    """transformers' continue_final_message: the rendering up to the end of the last message's content.

    Templates often strip the content; the cut is after the stripped text unless the template kept it whole.
    """
    stripped = final_content.strip()
    if stripped not in rendered:
        raise ValueError("continue_final_message: the final message does not appear in the rendered chat")
    start = rendered.rindex(stripped)
    whole = final_content.lstrip()
    if rendered[start:start + len(whole)] == whole:
        return rendered[:start + len(whole)]
    return rendered[:start + len(stripped)]
