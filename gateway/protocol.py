"""The OpenAI request bodies the gateway accepts, as pydantic models (FastAPI validates them on arrival).

Fields follow OpenAI's API reference; vLLM's extra sampling fields are accepted too (top_k, min_p,
repetition_penalty, min_tokens, bad_words, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, spaces_between_special_tokens, priority) because users of vLLM's server send them.
Unknown fields are ignored, as OpenAI's own server ignores fields it does not know. Fields accepted here but
not served (tools, echo, suffix, ...) are refused in sampling.py with a 400 naming them, never silently
dropped.
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
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a batch of them; each prompt's choices are n consecutive indices.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None
    # How many top alternatives per token; 0 returns the sampled token's own logprob only.
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
