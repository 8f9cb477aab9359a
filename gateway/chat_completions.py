"""POST /v1/chat/completions: the conversation goes to the scheduler as a gRPC ChatPrompt, rendered there by
the model's own chat template (with vLLM's chat options: add_generation_prompt, continue_final_message,
chat_template_kwargs, documents, tools), and the answer comes back as OpenAI chat completion objects, or
chunks when streamed.

Streamed, each choice opens with a chunk carrying the assistant role (OpenAI's shape), then deltas; the chunk
that ends a choice carries its finish_reason. With tools (tool_choice.py) or a --reasoning-parser, each
choice's text is read by chat_output.py: deltas carry reasoning_content, content and tool_calls, and an
output that is tool calls finishes with "tool_calls".
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from client.types import GenerateChunk
from gateway.backend import Backend, lora_name_of
from gateway.chat_output import ChatOutput
from gateway.choices import ChoiceLog, chat_logprobs, usage
from gateway.config import GatewayConfig
from gateway.errors import invalid_request
from gateway.protocol import ChatCompletionRequest
from gateway.reasoning_parsers import REASONING_PARSERS
from gateway.request_ids import base_request_id
from gateway.sampling import chat_keywords, chat_messages
from gateway.streaming import StreamAcceptance, collect_streams, event_stream, start_streams
from gateway.tool_choice import ToolPlan, plan_tools


async def create_chat_completion(body: ChatCompletionRequest, request: Request, backend: Backend,
                                 config: GatewayConfig) -> Response:
    model_name, info = await backend.model_for(body.model)
    tools = plan_tools(body, config)
    reasoning = REASONING_PARSERS.get(config.reasoning_parser) if config.reasoning_parser else None
    keywords = chat_keywords(body, info, tools, reasoning.end_marker if reasoning is not None else None)
    keywords["lora_name"] = lora_name_of(model_name, info)
    messages = chat_messages(body.messages)
    completion_id = f"chatcmpl-{base_request_id(request, body.request_id)}"
    acceptance = StreamAcceptance(1)
    try:
        stream = backend.client.generate_stream(messages=messages, request_id=completion_id,
                                                on_accepted=acceptance.callback(0), **keywords)
    except (TypeError, ValueError) as error:  # a value the wire cannot carry (e.g. a seed past 2**64)
        raise invalid_request(str(error)) from error
    relay = _ChatRelay(completion_id, model_name, body, tools, config)
    if body.stream:
        chunks = await start_streams(request, [stream], acceptance)
        return event_stream(relay.events(chunks), backend.to_openai_error)
    for _, chunk in await collect_streams(request, [stream]):
        relay.record(chunk)
    return JSONResponse(relay.response())


class _ChatRelay:
    """The choices of one chat completion as its chunks arrive, and the OpenAI objects made from them."""

    def __init__(self, completion_id: str, model_name: str, body: ChatCompletionRequest, tools: ToolPlan,
                 config: GatewayConfig) -> None:
        self._id = completion_id
        self._model = model_name
        self._created = int(time.time())
        self._with_logprobs = body.logprobs
        self._with_usage = bool(body.stream_options and body.stream_options.include_usage)
        # vLLM's continuous_usage_stats (with include_usage): every chunk also carries the usage so far.
        self._usage_every_chunk = self._with_usage and body.stream_options.continuous_usage_stats
        self._choices: dict[int, ChoiceLog] = {}
        self._prompt_tokens = 0
        self._tool_plan = tools
        # A constraint (a forced tool choice's too) holds after the thought (chat_keywords' reasoning_end), so
        # every output is split; see docs/openai_api.md, "Reasoning outputs".
        self._reasoning = REASONING_PARSERS[config.reasoning_parser] if config.reasoning_parser else None
        self._include_reasoning = body.include_reasoning
        self._outputs: dict[int, ChatOutput] = {}

    def record(self, chunk: GenerateChunk) -> list[dict]:
        """Adds a chunk; returns the streamed choice deltas it makes (none when it carries nothing)."""
        opening = chunk.index not in self._choices
        choice = self._choices.setdefault(chunk.index, ChoiceLog(chunk.index))
        span = choice.add(chunk)
        if chunk.prompt_tokens is not None:
            self._prompt_tokens = chunk.prompt_tokens
        elif chunk.prompt_token_ids is not None:  # asked for by continuous_usage_stats
            self._prompt_tokens = len(chunk.prompt_token_ids)
        deltas = []
        if opening:
            deltas.append({"index": chunk.index, "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None})
        delta, finish_reason = self._delta(chunk)
        if delta or chunk.token_ids or chunk.finish_reason:
            deltas.append({"index": chunk.index, "delta": delta,
                           "logprobs": chat_logprobs(span) if self._with_logprobs else None,
                           "finish_reason": finish_reason})
        return deltas

    async def events(self, chunks: AsyncIterator[tuple[int, GenerateChunk]]) -> AsyncIterator[dict]:
        async for _, chunk in chunks:
            for delta in self.record(chunk):
                yield self._object("chat.completion.chunk", choices=[delta], **self._running_usage())
        if self._with_usage:
            yield self._object("chat.completion.chunk", choices=[], usage=self._usage())

    def response(self) -> dict:
        choices = []
        for choice in sorted(self._choices.values(), key=lambda c: c.index):
            message, finish_reason = {"role": "assistant", "content": choice.text}, choice.finish_reason
            output = self._outputs.get(choice.index)
            if output is not None:
                message = self._visible(output.message())
                finish_reason = output.finish_reason(finish_reason)
            choices.append({"index": choice.index, "message": message,
                            "logprobs": chat_logprobs(choice.whole()) if self._with_logprobs else None,
                            "finish_reason": finish_reason})
        return self._object("chat.completion", choices=choices, usage=self._usage())

    def _delta(self, chunk: GenerateChunk) -> tuple[dict, str | None]:
        """The chunk's delta fields and finish reason: its text as content, or as its parsed output adds."""
        if self._tool_plan.parser is None and self._reasoning is None:
            return ({"content": chunk.text} if chunk.text else {}), chunk.finish_reason
        output = self._outputs.setdefault(chunk.index, ChatOutput(self._reasoning, self._tool_plan.parser))
        delta = output.add(chunk.text)
        if chunk.finish_reason is None:
            return self._visible(delta), None
        delta = _merged(delta, output.finish())
        return self._visible(delta), output.finish_reason(chunk.finish_reason)

    def _visible(self, fields: dict) -> dict:
        """include_reasoning false: the thought is left out (vLLM's)."""
        if self._include_reasoning:
            return fields
        return {key: value for key, value in fields.items() if key != "reasoning_content"}

    def _object(self, kind: str, **fields) -> dict:
        return {"id": self._id, "object": kind, "created": self._created, "model": self._model, **fields}

    def _running_usage(self) -> dict:
        return {"usage": self._usage()} if self._usage_every_chunk else {}

    def _usage(self) -> dict:
        return usage(self._prompt_tokens, list(self._choices.values()))


def _merged(first: dict, second: dict) -> dict:
    """Two deltas as one (text fields joined, call fragments listed in order)."""
    merged = dict(first)
    for key, value in second.items():
        merged[key] = merged[key] + value if key in merged else value
    return merged
