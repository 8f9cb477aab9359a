"""What `Client.tokenize` returns: the served model's tokenization of a text or a chat (vLLM's /tokenize)."""

from __future__ import annotations

from dataclasses import dataclass

from protos.pagedserve.v1 import generate_pb2


@dataclass(frozen=True)
class Tokenization:
    """The prompt's token ids, exactly those a generation of it would read (chat rendered by the template),
    the model's context length (to tell how much room is left), and each token's vocabulary string when asked
    for (`return_token_strs`; byte-level spelling such as 'Ġworld')."""

    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] | None = None

    @property
    def count(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_response(cls, response: generate_pb2.TokenizeResponse, with_token_strs: bool) -> Tokenization:
        return cls(list(response.token_ids), response.max_model_len,
                   list(response.token_strs) if with_token_strs else None)
