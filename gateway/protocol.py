"""The OpenAI request bodies the gateway accepts, as pydantic models (FastAPI validates them on arrival).

Fields follow OpenAI's API reference; a few of vLLM's extra fields are accepted too (top_k, ignore_eos,
stop_token_ids, priority) because users of vLLM's server send them. Unknown fields are ignored, as OpenAI's
own server ignores fields it does not know. Fields accepted here but not served (penalties, tools, logit
bias, ...) are refused in sampling.py with a 400 naming them, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    # A last chunk with empty choices carries the whole request's usage.
    include_usage: bool = False


class SamplingFields(_Body):
    """What both endpoints share."""

    model: str | None = None  # None: the served model
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra fields.
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a batch of them; each prompt's choices are n consecutive indices.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None
    # How many top alternatives per token; 0 returns the sampled token's own logprob (see sampling.py).
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextContentPart | dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
