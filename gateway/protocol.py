"""The request bodies the gateway accepts, as pydantic models (FastAPI validates them on arrival).

Fields are OpenAI's (API reference) and vLLM's extras (vLLM's protocol.py names), nothing else: a field
neither knows is a 400 naming it (extra="forbid"; app.py gives it OpenAI's error shape), because a typo such
as `max_token` silently ignored would serve a request the client did not ask for. Fields declared here but
not served (guided decoding, tools, suffix, ...) are refused in refused_fields.py with a 400 naming them;
fields served are mapped to the SDK in sampling.py. README "Switching from vLLM" > "Request fields" lists
each field's fate.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    # A last chunk with empty choices carries the whole request's usage.
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage on every chunk too


class SamplingFields(_Body):
    """What both generation endpoints share."""

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
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: accepted, no effect by definition
    best_of: int | None = None
    response_format: dict[str, Any] | None = None  # {"type": "text"} only
    # vLLM's extra sampling fields.
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # vLLM's extra request fields.
    priority: int = 0
    request_id: str | None = None
    add_special_tokens: bool | None = None
    # Declared to be refused by name (refused_fields.py): vLLM fields pagedserve does not serve.
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a batch of them; each prompt's choices are n consecutive indices.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    # How many top alternatives per token; 0 returns the sampled token's own logprob only.
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    prompt_embeds: Any = None  # refused


class ChatMessage(_Body):
    role: str
    # Text parts ({"type": "text", "text": ...}) are joined; any other part (image_url, input_audio, ...) is
    # refused (sampling.py).
    content: str | list[dict[str, Any]] | None = None
    # Refused when set (refused_fields.py): the wire's chat messages carry role and content only.
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's chat options (transformers' apply_chat_template's).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    # OpenAI fields with no effect here: accepted as OpenAI documents them (see README).
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Refused unless absent or their no-op value (refused_fields.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: bool | None = None
    include_reasoning: bool | None = None
    echo: bool = False
    chat_template: str | None = None
    mm_processor_kwargs: Any = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a text (`prompt`) or a chat (`messages` and the chat options)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False
    # Refused when set.
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    mm_processor_kwargs: Any = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
