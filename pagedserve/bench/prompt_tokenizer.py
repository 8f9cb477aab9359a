"""The tokens a benchmark's prompts are built from and counted in: the served model's tokenizer, wherever it
can be found, or only its vocabulary size.

Why three sources: `vllm bench serve` loads the model's tokenizer with transformers, which needs the model's
files on the benchmarking machine. Ours runs against a server from anywhere: `--tokenizer` (or the model name,
if transformers finds it locally) comes first; else the server's own tokenizer over its /tokenize and
/detokenize routes (vLLM's and ours) or our gRPC Tokenize/Detokenize; else, for a model that has no tokenizer
at all (a config.json served with random weights), only its vocab_size: prompts are then random token ids,
sent as ids, and output tokens are counted from the server's usage report.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pagedserve.bench.http_client import JsonHttpClient, JsonHttpError


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class PromptTokens:
    """`tokenizer`: turns text into ids and back (None: the model has none). `vocab_size`: ids to draw random
    prompts from when there is no tokenizer. `source`: where they came from, as printed."""

    tokenizer: TextTokenizer | None
    vocab_size: int | None
    source: str


class TransformersTokenizer:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids))


class HttpServerTokenizer:
    """The server's tokenizer through vLLM's POST /tokenize and /detokenize."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str]) -> None:
        self._http = JsonHttpClient(base_url, headers, timeout=60.0)
        self._model = model

    def encode(self, text: str) -> list[int]:
        answer = self._http.post("/tokenize", {"model": self._model, "prompt": text, "add_special_tokens": False})
        return list(answer["tokens"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._http.post("/detokenize", {"model": self._model, "tokens": list(token_ids)})["prompt"]


class GrpcServerTokenizer:
    """Our server's tokenizer through the Tokenize and Detokenize RPCs."""

    def __init__(self, client) -> None:
        self._client = client

    def encode(self, text: str) -> list[int]:
        return list(self._client.tokenize(text, add_special_tokens=False).token_ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._client.detokenize(list(token_ids))


def local_prompt_tokens(name: str, trust_remote_code: bool, local_files_only: bool) -> PromptTokens | None:
    """transformers' tokenizer of `name` (a directory or a hub id); else, for a directory whose config.json
    names a vocab_size, that size alone; else None."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code,
                                                  local_files_only=local_files_only)
        return PromptTokens(TransformersTokenizer(tokenizer), len(tokenizer), f"transformers: {name}")
    except Exception:  # noqa: BLE001 (no transformers, no such tokenizer, a directory without one: all "not here")
        pass
    config = Path(name) / "config.json"
    if config.is_file():
        vocab_size = json.loads(config.read_text()).get("vocab_size")
        if isinstance(vocab_size, int) and vocab_size > 0:
            return PromptTokens(None, vocab_size, f"{config}: vocab_size {vocab_size} (no tokenizer: token-id prompts)")
    return None


def http_prompt_tokens(base_url: str, model: str, headers: dict[str, str]) -> PromptTokens | None:
    """The server's /tokenize, if it answers for this model."""
    tokenizer = HttpServerTokenizer(base_url, model, headers)
    try:
        tokenizer.encode("Hello")
    except (JsonHttpError, KeyError, ValueError):
        return None
    return PromptTokens(tokenizer, None, f"server: {base_url}/tokenize")


def grpc_prompt_tokens(client, info) -> PromptTokens:
    """Our server's tokenizer over gRPC, or its vocab_size when the model has none."""
    if info.has_tokenizer:
        return PromptTokens(GrpcServerTokenizer(client), info.vocab_size, f"server: gRPC Tokenize ({client.target})")
    return PromptTokens(None, info.vocab_size,
                        f"server: model has no tokenizer, vocab_size {info.vocab_size} (token-id prompts)")
