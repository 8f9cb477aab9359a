"""POST /v1/completions: one gRPC Generate stream per prompt, relayed as OpenAI text completions.

A batch of prompts runs concurrently (the scheduler batches them like any other requests); prompt p's n
sequences are choices p*n .. p*n+n-1, as in OpenAI's API. The gRPC request ids are the completion id plus
the prompt index, so scheduler logs and Abort calls can be matched to the HTTP response. With `echo`, each
choice opens with its prompt's text (streamed: in its first chunk), as vLLM does; with `logprobs` and
`max_tokens: 0` too (prompt_echo.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from client.types import GenerateChunk
from gateway.backend import Backend, lora_name_of
from gateway.choices import ChoiceLog, TokenSpan, completion_logprobs, usage
from gateway.errors import invalid_request
from gateway.prompt_echo import EchoPlan, prompt_token_span, vllm_prompt_logprobs
from gateway.protocol import CompletionRequest
from gateway.request_ids import base_request_id
from gateway.sampling import completion_keywords
from gateway.streaming import StreamAcceptance, collect_streams, event_stream, start_streams


async def create_completion(body: CompletionRequest, request: Request, backend: Backend) -> Response:
    model_name, info = await backend.model_for(body.model)
    keywords = {**completion_keywords(body), "lora_name": lora_name_of(model_name, info)}
    prompts = _prompts(body.prompt)
    completion_id = f"cmpl-{base_request_id(request, body.request_id)}"
    acceptance = StreamAcceptance(len(prompts))
    try:
        streams = [backend.client.generate_stream(prompt, request_id=f"{completion_id}-{index}",
                                                  on_accepted=acceptance.callback(index), **keywords)
                   for index, prompt in enumerate(prompts)]
    except (TypeError, ValueError) as error:  # a value the wire cannot carry (e.g. a seed past 2**64)
        raise invalid_request(str(error)) from error
    echoes = [await _prompt_text(prompt, backend) for prompt in prompts] if body.echo else None
    relay = _CompletionRelay(completion_id, model_name, body, echoes, backend.client.detokenize)
    if body.stream:
        chunks = await start_streams(request, streams, acceptance)
        return event_stream(relay.events(chunks), backend.to_openai_error)
    for prompt_index, chunk in await collect_streams(request, streams):
        await relay.record(prompt_index, chunk)
    return JSONResponse(relay.response())


class _CompletionRelay:
    """The choices of one completion as its chunks arrive, and the OpenAI objects made from them."""

    def __init__(self, completion_id: str, model_name: str, body: CompletionRequest,
                 echoes: list[str] | None, detokenize: Callable[[list[int]], Awaitable[str]]) -> None:
        self._id = completion_id
        self._echoes = echoes  # echo: each prompt's text, which opens each of its choices
        self._echo = EchoPlan.of(body.echo, body.logprobs)
        self._detokenize = detokenize
        self._first_token_texts: dict[int, str] = {}  # echo with logprobs: per prompt, its first token's text
        self._with_prompt_logprobs = body.prompt_logprobs is not None
        self._prompt_logprobs: dict[int, list] = {}  # per choice, vLLM's prompt_logprobs
        self._model = model_name
        self._created = int(time.time())
        self._n = body.n
        self._with_logprobs = body.logprobs is not None
        self._with_usage = bool(body.stream_options and body.stream_options.include_usage)
        # vLLM's continuous_usage_stats (with include_usage): every chunk also carries the usage so far.
        self._usage_every_chunk = self._with_usage and body.stream_options.continuous_usage_stats
        self._choices: dict[int, ChoiceLog] = {}
        self._prompt_tokens: dict[int, int] = {}

    async def record(self, prompt_index: int, chunk: GenerateChunk) -> dict | None:
        """Adds a chunk; returns its choice's streamed form, or None when it carries nothing to send."""
        index = prompt_index * self._n + chunk.index
        opening = index not in self._choices
        choice = self._choices.setdefault(index, ChoiceLog(index))
        first = len(choice.token_texts)
        echoed = ""
        if self._echo is not None:
            if opening:
                echoed = self._echoes[prompt_index]
                choice.add_prompt(echoed, await self._echoed_tokens(prompt_index, chunk))
        choice.add(chunk)
        span = choice.span_from(first)
        prompt_logprobs = None
        if opening and self._with_prompt_logprobs:
            prompt_logprobs = self._prompt_logprobs[index] = vllm_prompt_logprobs(chunk.prompt_logprobs)
        if chunk.prompt_tokens is not None:
            self._prompt_tokens[prompt_index] = chunk.prompt_tokens
        elif chunk.prompt_token_ids is not None:  # asked for by continuous_usage_stats
            self._prompt_tokens[prompt_index] = len(chunk.prompt_token_ids)
        if not (echoed or prompt_logprobs or chunk.text or chunk.token_ids or chunk.finish_reason):
            return None
        streamed = {"index": index, "text": echoed + chunk.text,
                    "logprobs": completion_logprobs(span) if self._with_logprobs else None,
                    "finish_reason": chunk.finish_reason}
        if prompt_logprobs is not None:  # on the choice's first chunk only
            streamed["prompt_logprobs"] = prompt_logprobs
        return streamed

    async def _echoed_tokens(self, prompt_index: int, chunk: GenerateChunk) -> TokenSpan | None:
        """Echo with logprobs: the prompt's tokens (from the sequence's first chunk), else None."""
        if not self._echo.with_prompt_logprobs or not chunk.prompt_token_ids:
            return None
        if prompt_index not in self._first_token_texts:
            self._first_token_texts[prompt_index] = await self._detokenize([chunk.prompt_token_ids[0]])
        return prompt_token_span(self._first_token_texts[prompt_index], chunk.prompt_logprobs)

    async def events(self, chunks: AsyncIterator[tuple[int, GenerateChunk]]) -> AsyncIterator[dict]:
        async for prompt_index, chunk in chunks:
            choice = await self.record(prompt_index, chunk)
            if choice is not None:
                yield self._object(choices=[choice], **self._running_usage())
        if self._with_usage:
            yield self._object(choices=[], usage=self._usage())

    def response(self) -> dict:
        choices = [
            {"index": choice.index, "text": choice.text,
             "logprobs": completion_logprobs(choice.whole()) if self._with_logprobs else None,
             "finish_reason": choice.finish_reason,
             **({"prompt_logprobs": self._prompt_logprobs.get(choice.index)} if self._with_prompt_logprobs else {})}
            for choice in sorted(self._choices.values(), key=lambda c: c.index)
        ]
        return self._object(choices=choices, usage=self._usage())

    def _object(self, **fields) -> dict:
        return {"id": self._id, "object": "text_completion", "created": self._created, "model": self._model, **fields}

    def _running_usage(self) -> dict:
        return {"usage": self._usage()} if self._usage_every_chunk else {}

    def _usage(self) -> dict:
        return usage(sum(self._prompt_tokens.values()), list(self._choices.values()))


async def _prompt_text(prompt: str | list[int], backend: Backend) -> str:
    """What echo prepends: a text prompt as sent, token ids as the model's tokenizer decodes them."""
    return prompt if isinstance(prompt, str) else await backend.client.detokenize(prompt)


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of prompts: text, token ids, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid_request("prompt: must not be empty", "prompt")
    if all(isinstance(item, int) for item in prompt):
        return [prompt]
    return list(prompt)
