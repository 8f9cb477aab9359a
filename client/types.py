"""What the SDK hands back: plain frozen dataclasses, so callers never touch protobuf messages.

Each type is built from its wire message here, in one place; the sync and async clients share these
conversions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from protos.pagedserve.v1 import generate_pb2

_FINISH_REASONS = {
    generate_pb2.FINISH_REASON_UNSPECIFIED: None,
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class GenerateChunk:
    """One message of a generation stream: the text and token ids produced since the previous chunk.

    Why the usage fields are optional: the server sends the token counts once, on the last chunk, together
    with the finish reason ("stop": EOS, a stop string or a stop token id; "length": max_tokens or the
    model's length; "abort": the server gave up on the request). Every earlier chunk has all three None.
    `text` may be empty while a multi-byte character or a possible stop string is still incomplete.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None

    @classmethod
    def from_response(cls, response: generate_pb2.GenerateResponse) -> GenerateChunk:
        has_usage = response.HasField("usage")
        return cls(
            request_id=response.request_id,
            text=response.text,
            token_ids=tuple(response.token_ids),
            # A reason newer than this SDK still ends the stream; "abort" is the closest honest name for it.
            finish_reason=_FINISH_REASONS.get(response.finish_reason, "abort"),
            prompt_tokens=response.usage.prompt_tokens if has_usage else None,
            completion_tokens=response.usage.completion_tokens if has_usage else None,
        )


@dataclass(frozen=True)
class GenerationResult:
    """A whole generation: the concatenation of a stream's chunks.

    `finish_reason` and the token counts come from the last chunk; they are None only if the server closed
    the stream without a final chunk, which a conforming server never does.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None

    @classmethod
    def from_chunks(cls, chunks: Iterable[GenerateChunk]) -> GenerationResult:
        texts: list[str] = []
        token_ids: list[int] = []
        last: GenerateChunk | None = None
        for chunk in chunks:
            texts.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            last = chunk
        return cls(
            request_id=last.request_id if last else "",
            text="".join(texts),
            token_ids=tuple(token_ids),
            finish_reason=last.finish_reason if last else None,
            prompt_tokens=last.prompt_tokens if last else None,
            completion_tokens=last.completion_tokens if last else None,
        )


@dataclass(frozen=True)
class ModelInfo:
    """What the server serves (mirrors ModelInfoResponse). `has_tokenizer` False: only token-id prompts work;
    `has_chat_template` False: chat messages are refused."""

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    num_swap_blocks: int
    eos_token_ids: tuple[int, ...]
    has_tokenizer: bool
    has_chat_template: bool

    @classmethod
    def from_response(cls, response: generate_pb2.ModelInfoResponse) -> ModelInfo:
        return cls(**{
            field.name: tuple(getattr(response, field.name)) if field.name == "eos_token_ids"
            else getattr(response, field.name)
            for field in dataclasses.fields(cls)
        })


@dataclass(frozen=True)
class ServerStats:
    """Scheduler counters at one moment (mirrors GetStatsResponse): queue lengths, KV and swap blocks,
    preemptions, steps and finished requests since the server started."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_swap_blocks: int
    num_free_swap_blocks: int
    num_steps: int
    num_finished_requests: int
    num_swapped_out_blocks: int

    @classmethod
    def from_response(cls, response: generate_pb2.GetStatsResponse) -> ServerStats:
        return cls(**{field.name: getattr(response, field.name) for field in dataclasses.fields(cls)})
