"""The request bodies the gateway accepts, as pydantic models (FastAPI validates them on arrival).

Fields are OpenAI's (API reference) and vLLM's extras (vLLM's protocol.py names), nothing else: a field
neither knows is a 400 naming it (extra="forbid"; app.py gives it OpenAI's error shape), because a typo such
as `max_token` silently ignored would serve a request the client did not ask for. Fields declared here but
not served (guided decoding, suffix, ...) are refused in refused_fields.py with a 400 naming them;
fields served are mapped to the SDK in sampling.py. docs/switching_from_vllm.md ("Request fields") lists
each field's fate.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protos.pagedserve.v1.sampling_fields import INTEGER_WIRE_RANGES

# Integers as the gRPC wire carries them (protobuf int32 / uint32 / uint64): a value past its range is a 400
# naming the field here, not a protobuf error naming none later. Which sampling field has which type is the
# table's (protos/pagedserve/v1/sampling_fields.py; tests/test_sampling_field_table.py checks the fields here).
Int32 = Annotated[int, Field(ge=INTEGER_WIRE_RANGES["int32"][0], le=INTEGER_WIRE_RANGES["int32"][1])]
UInt32 = Annotated[int, Field(ge=INTEGER_WIRE_RANGES["uint32"][0], le=INTEGER_WIRE_RANGES["uint32"][1])]
UInt64 = Annotated[int, Field(ge=INTEGER_WIRE_RANGES["uint64"][0], le=INTEGER_WIRE_RANGES["uint64"][1])]
# OpenAI's roles, and Llama 3.1's `ipython` (its chat template's tool-output role).
Role = Literal["system", "developer", "user", "assistant", "tool", "function", "ipython"]


class _Body(BaseModel):
    # strict: JSON types as declared (`max_tokens: true` or `"n": "2"` are 400s, not 1 and 2); a JSON integer
    # still fills a float field.
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        # JSON may escape a lone surrogate ("\ud800"), which no UTF-8 wire (protobuf strings) can carry.
        if _has_lone_surrogate(value):
            raise ValueError("text must be valid Unicode (a lone surrogate such as \\ud800 is not)")
        return value


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(_has_lone_surrogate(item) for item in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(key) or _has_lone_surrogate(item) for key, item in value.items())
    return False


class StreamOptions(_Body):
    # A last chunk with empty choices carries the whole request's usage.
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage on every chunk too


class SamplingFields(_Body):
    """What both generation endpoints share."""

    model: str | None = None  # None: the served model
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=2**32 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: UInt64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: accepted, no effect by definition
    best_of: UInt32 | None = None
    # text, json_object or json_schema (gateway/structured_outputs.py, as the guided_* fields below).
    response_format: dict[str, Any] | None = None
    # vLLM's extra sampling fields.
    use_beam_search: bool = False
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    min_tokens: UInt32 | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int32] | None = None
    # vLLM's extra request fields.
    priority: Int32 = 0
    request_id: str | None = None
    add_special_tokens: bool | None = None
    # vLLM's: per prompt token, its logprob and this many alternatives (completions only; prompt_echo.py).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Declared to be refused by name (refused_fields.py): vLLM fields pagedserve does not serve.
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    structural_tag: Any = None
    # vLLM's constrained decoding (checked in gateway/structured_outputs.py).
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a batch of them; each prompt's choices are n consecutive indices.
    prompt: str | list[str] | list[Int32] | list[list[Int32]]
    max_tokens: Int32 | None = 16
    # How many top alternatives per token; 0 returns the sampled token's own logprob only.
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    prompt_embeds: Any = None  # refused


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A call an assistant message made (OpenAI's shape), sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Role
    # Text parts ({"type": "text", "text": ...}) are joined; any other part (image_url, input_audio, ...) is
    # refused (sampling.py).
    content: str | list[dict[str, Any]] | None = None
    # An assistant's tool calls and thought, and a tool message's answer to a call: the template renders them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # Refused when set (refused_fields.py): the wire's chat messages do not carry it.
    name: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        # As OpenAI: only an assistant message that calls tools may come without content.
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.reasoning_content)):
            raise ValueError(f"content: required in a {self.role} message")
        return self


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    # A JSON Schema of an object (tool_choice.py checks it); None: no parameters.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    """OpenAI's tool: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """tool_choice {"type": "function", "function": {"name": ...}}: the model must call this function."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's chat options (transformers' apply_chat_template's).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    # false: at most one tool call (tool_choice.py says how).
    parallel_tool_calls: bool | None = None
    # OpenAI fields with no effect here: accepted as OpenAI documents them (docs/switching_from_vllm.md,
    # "Request fields").
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Tool calling (tool_choice.py): None with tools means "auto", as OpenAI's.
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Refused unless absent or their no-op value (refused_fields.py).
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: bool | None = None
    include_reasoning: bool = True  # false: no reasoning_content (with --reasoning-parser)
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
    tools: list[ToolDefinition] | None = None  # rendered by the template as a chat request's are
    # Refused when set.
    chat_template: str | None = None
    mm_processor_kwargs: Any = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int32]


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter: serve the PEFT adapter at `lora_path` as the model `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter (`lora_int_id` is vLLM's, accepted and unused: names select adapters)."""

    lora_name: str
    lora_int_id: int | None = None
