"""A 413 for a request body larger than the gateway accepts, before anything reads it.

Why here and not in the scheduler: a body is parsed as JSON (and a prompt validated) before it becomes a gRPC
request, so a 50 MB body used to cost the gateway its parse and then reach the scheduler as a message over
gRPC's size limit, whose RESOURCE_EXHAUSTED became a 429 `rate_limit_error`; OpenAI clients retry those,
forever, with the same body. 413 with `invalid_request_error` is final: clients do not retry it. The check
reads the Content-Length header when there is one; a chunked body is read here, up to the limit.
Pure ASGI, like request_ids.py, so streamed responses and their disconnect messages pass untouched.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import OpenAIError


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than this server accepts ({limit} bytes; "
                            "see --max-request-body-bytes)", type="invalid_request_error", code="request_too_large")


class RequestBodyLimit:
    """ASGI middleware: requests whose body exceeds `limit` bytes get a 413 in OpenAI's error shape.

    A body without Content-Length (chunked) is read here up to the limit and then handed on as one message:
    every route parses a JSON body whole anyway, and FastAPI turns any failure while it reads one into a 400.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self._app = app
        self._limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self._limit:
                await body_too_large(self._limit).response()(scope, receive, send)
            else:
                await self._app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._limit:
                await body_too_large(self._limit).response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        whole: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return whole.pop() if whole else await receive()

        await self._app(scope, replay, send)
