"""The backends `bench serve` drives, vLLM's names: `openai` (/v1/completions), `openai-chat`
(/v1/chat/completions), both streamed over HTTP with aiohttp as in vLLM's `bench serve`, and `grpc` (our SDK's
AsyncClient.generate_stream).

Each is `async (RequestInput) -> RequestOutcome` and never raises for a failed request: the failure is the
outcome's error (request_outcome.py says which chunks count as output and when a request has failed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

import aiohttp

from pagedserve.bench.request_outcome import RequestInput, RequestOutcome

BACKENDS = ("openai", "openai-chat", "grpc")
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}

RequestFunc = Callable[[RequestInput], Awaitable[RequestOutcome]]


class OpenAIStreamingBackend:
    """Streams completions or chat completions from `api_url`; one connection pool for the whole run."""

    def __init__(self, api_url: str, chat: bool, headers: dict[str, str], max_connections: int | None) -> None:
        """Call it inside the run's event loop (the session belongs to it). `max_connections` None: no limit."""
        self._api_url = api_url
        self._chat = chat
        # aiohttp's `connect` timeout would include waiting for a free connection of the pool: sock_connect is
        # the TCP connect alone; total bounds the whole request, as long as a benchmark may run.
        timeout = aiohttp.ClientTimeout(total=6 * 60 * 60, sock_connect=60.0)
        connector = aiohttp.TCPConnector(limit=max_connections or 0)
        self._http = aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout)

    async def close(self) -> None:
        await self._http.close()

    def payload(self, request: RequestInput) -> dict:
        body = {"model": request.model, "max_tokens": request.output_len, "stream": True,
                "stream_options": {"include_usage": True}, **request.sampling}
        if self._chat:
            if not isinstance(request.prompt, str):
                raise ValueError("openai-chat sends text prompts: this model has no tokenizer (use --backend openai)")
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if request.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def __call__(self, request: RequestInput) -> RequestOutcome:
        outcome = RequestOutcome(prompt_len=request.prompt_len)
        try:
            body = self.payload(request)
            outcome.start_time = time.perf_counter()
            async with self._http.post(self._api_url, json=body) as response:
                if response.status != 200:
                    text = (await response.read()).decode(errors="replace")
                    return outcome.fail(f"HTTP {response.status}: {text[:500]}")
                return await self._read_events(response, outcome)
        except Exception as error:  # noqa: BLE001 (a failed request is an outcome, whatever the cause)
            return outcome.fail(f"{type(error).__name__}: {error}")

    async def _read_events(self, response, outcome: RequestOutcome) -> RequestOutcome:
        """Reads the SSE stream in network reads: every event of one read arrived at that read's time. Reads
        on to the body's end after [DONE], so the connection goes back to the pool."""
        stream = _SseStream(outcome, self._chat)
        pending = b""
        async for data in response.content.iter_any():
            now = time.perf_counter()
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                stream.feed(line.rstrip(b"\r"), now)
        return stream.finish()


class _SseStream:
    """One response's server-sent events as they are read: fills the outcome until [DONE] or an error event,
    and ignores what follows."""

    def __init__(self, outcome: RequestOutcome, chat: bool) -> None:
        self._outcome = outcome
        self._chat = chat
        self._pieces: list[str] = []
        self._last_output: float | None = None
        self._last_chunk: float | None = None
        self._done = False
        self._error = ""

    def feed(self, line: bytes, now: float) -> None:
        if self._done or self._error or not line.startswith(b"data:"):
            return
        data = line[len(b"data:"):].strip()
        if data == b"[DONE]":
            self._done = True
            return
        event = json.loads(data)
        if "error" in event:
            self._error = f"error event: {json.dumps(event['error'])[:500]}"
            return
        outcome = self._outcome
        if event.get("usage"):
            outcome.prompt_len = event["usage"].get("prompt_tokens") or outcome.prompt_len
            outcome.output_tokens = event["usage"].get("completion_tokens")
        choices = event.get("choices")
        if not choices:
            return
        self._last_chunk = now
        text = self._text(choices[0])
        # Completions: a chunk with no text and no finish_reason still carries tokens (held back text, or a
        # model without tokenizer). Chat: the first chunk only names the role, so the text decides.
        if text or (not self._chat and choices[0].get("finish_reason") is None):
            self._last_output = outcome.saw_output(now, self._last_output)
            self._pieces.append(text)

    def finish(self) -> RequestOutcome:
        outcome = self._outcome
        outcome.generated_text = "".join(self._pieces)
        if self._error:
            return outcome.fail(self._error)
        if not self._done:
            return outcome.fail("the stream ended before data: [DONE]")
        if self._last_output is None:
            return outcome.fail("the stream ended without any output")
        outcome.latency = self._last_chunk - outcome.start_time
        outcome.success = True
        return outcome

    def _text(self, choice: dict) -> str:
        if self._chat:
            delta = choice.get("delta") or {}
            return delta.get("content") or delta.get("reasoning_content") or ""
        return choice.get("text") or ""


class GrpcBackend:
    """Our server over gRPC: a chunk with token ids is output; the last chunk's usage counts the tokens. With
    several clients (each its own connection), requests take them in turn."""

    def __init__(self, *clients) -> None:
        self._clients = clients
        self._turn = 0

    async def close(self) -> None:
        for client in self._clients:
            await client.close()

    async def __call__(self, request: RequestInput) -> RequestOutcome:
        outcome = RequestOutcome(prompt_len=request.prompt_len)
        sampling = {"max_tokens": request.output_len, "ignore_eos": request.ignore_eos or None, **request.sampling}
        pieces = []
        last_output = None
        finish_reason = None
        client = self._clients[self._turn]
        self._turn = (self._turn + 1) % len(self._clients)
        outcome.start_time = time.perf_counter()
        try:
            stream = client.generate_stream(request.prompt, **sampling)
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.token_ids:
                    last_output = outcome.saw_output(now, last_output)
                    pieces.append(chunk.text)
                if chunk.finish_reason is not None:
                    outcome.latency = now - outcome.start_time
                    outcome.output_tokens = chunk.completion_tokens
                    outcome.prompt_len = chunk.prompt_tokens or outcome.prompt_len
                    finish_reason = chunk.finish_reason
        except Exception as error:  # noqa: BLE001 (a failed request is an outcome, whatever the cause)
            return outcome.fail(f"{type(error).__name__}: {error}")
        outcome.generated_text = "".join(pieces)
        if finish_reason is None:
            return outcome.fail("the stream ended without a finish reason")
        if finish_reason == "abort":
            return outcome.fail("the server aborted the request (finish_reason abort)")
        if last_output is None:
            return outcome.fail("the stream ended without any output")
        outcome.success = True
        return outcome
