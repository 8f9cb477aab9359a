"""Relaying gRPC streams over HTTP: Server-Sent Events, and cancelling the scheduler's work the moment the
HTTP client goes away.

Why the gateway listens for the disconnect itself: a server that notices a vanished client only when its
next write fails keeps a request computing (holding KV blocks) for as long as the next token takes, which
may be long for a request still waiting in the queue, or forever for a non-streamed one. Here every
generation runs next to a listener on the ASGI `http.disconnect` message; when it fires, the generation's
task is cancelled, which closes the SDK's stream, which cancels the gRPC call, which aborts the request on
the scheduler and frees its blocks.

Why a streamed response starts only once the scheduler has accepted its requests: the scheduler refuses a
bad request (and an overloaded or unready one) on the first read of its stream, and that must reach the
client as an HTTP status (400, 429, 503), which can no longer change once a streamed 200 has begun. Why not
later than that: a request may wait in the scheduler's queue for a long time before its first chunk, and a
client that sees not even headers meanwhile gives up (its read timeout). So the 200 and the SSE headers go
out when every stream is accepted (the scheduler's `pagedserve-accepted` initial metadata, after validation:
StreamAcceptance) or has sent its first chunk (an older scheduler), whichever comes first. Failures after
that are sent as an OpenAI error event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from client.errors import PagedServeError
from client.types import GenerateChunk
from gateway.errors import OpenAIError

T = TypeVar("T")
DONE_EVENT = "data: [DONE]\n\n"
_END = object()


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready; its generation was cancelled."""


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that stops its body (and so the generation) when the client leaves,
    whatever ASGI version the server speaks (Starlette itself only notices at the next failed write)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait([streaming, listening], return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel(streaming, listening)
        failure = None if streaming.cancelled() else streaming.exception()
        if failure is not None and not isinstance(failure, OSError):  # OSError: a write to a vanished client
            raise failure  # a failure while streaming: the server logs it


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`; if the client disconnects first, cancels it and raises ClientDisconnected."""
    task = asyncio.ensure_future(work)
    listening = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([task, listening], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (server shutdown)
        await _cancel(task, listening)
        raise
    if not task.done():
        await _cancel(task, listening)
        raise ClientDisconnected()
    await _cancel(listening)
    return task.result()


async def _cancel(*tasks: asyncio.Future) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merge_streams(streams: list[AsyncIterator[GenerateChunk]]) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """Interleaves several prompts' streams as (prompt index, chunk) in arrival order; the first failure
    ends the merge. Closing the merge (or cancelling its consumer) cancels every stream still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[GenerateChunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, _END))
        except PagedServeError as error:
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, PagedServeError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_streams(request: Request, streams: list[AsyncIterator[GenerateChunk]]) -> list[tuple[int, GenerateChunk]]:
    """Every (prompt index, chunk) of `streams`, unless the client leaves first (ClientDisconnected)."""

    async def collect() -> list[tuple[int, GenerateChunk]]:
        return [item async for item in merge_streams(streams)]

    return await unless_disconnected(request, collect())


class StreamAcceptance:
    """Which of one response's gRPC streams the scheduler has accepted (validated and queued): each stream's
    `on_accepted` is `callback(its index)`."""

    def __init__(self, num_streams: int) -> None:
        self._accepted = [asyncio.Event() for _ in range(num_streams)]

    def callback(self, index: int) -> Callable[[], None]:
        return self._accepted[index].set

    async def all_accepted(self) -> None:
        for accepted in self._accepted:
            await accepted.wait()


async def start_streams(request: Request, streams: list[AsyncIterator[GenerateChunk]],
                        acceptance: StreamAcceptance) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """The merged `streams`, once every one is accepted or the first chunk has come (see the module doc):
    raises the scheduler's refusal, or ClientDisconnected, now instead of after a 200 has been sent."""
    stream = merge_streams(streams)

    async def next_item():
        try:
            return await anext(stream)
        except StopAsyncIteration:
            return _END

    first = asyncio.ensure_future(next_item())
    accepted = asyncio.ensure_future(acceptance.all_accepted())
    try:
        await unless_disconnected(request, asyncio.wait([first, accepted], return_when=asyncio.FIRST_COMPLETED))
    except BaseException:
        await _cancel(first)
        raise
    finally:
        await _cancel(accepted)
    if first.done():
        first.result()  # a refusal: raised here, before the 200

    async def resumed() -> AsyncIterator[T]:
        item = await first  # cancelling the response's task cancels this wait, and so the streams
        if item is _END:
            return
        yield item
        async for item in stream:
            yield item

    return resumed()


def event_stream(events: AsyncIterator[dict], to_openai_error: Callable[[PagedServeError], OpenAIError]) -> EventStreamResponse:
    """SSE of `events`, a failure as one OpenAI error event, and always `data: [DONE]` last."""

    async def body() -> AsyncIterator[str]:
        try:
            async for payload in events:
                yield sse_event(payload)
        except PagedServeError as error:
            yield sse_event(to_openai_error(error).body())
        finally:
            await events.aclose()
        yield DONE_EVENT

    return EventStreamResponse(body(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
