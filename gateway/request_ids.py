"""The request id of an HTTP generation, as vLLM's server picks it, and its echo in the `X-Request-Id` header.

The id is the `X-Request-Id` header if sent, else the body's `request_id` (vLLM's extra field), else a fresh
one; it names the response (`cmpl-<id>`, `chatcmpl-<id>`) and the scheduler's request (so its logs and Abort
match), and comes back in the response's `X-Request-Id` header, errors included, so a client or proxy can
match a response to its request. A client that sends the same id twice concurrently gets a 400 from the
scheduler (ids in flight are unique).
"""

from __future__ import annotations

import uuid

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import invalid_request

REQUEST_ID_HEADER = "x-request-id"
_STATE_KEY = "request_id"


def base_request_id(request: Request, body_request_id: str | None) -> str:
    """The id to use (header, else body, else new), remembered for the response header."""
    if body_request_id is not None and not (body_request_id.isascii() and body_request_id.isprintable()):
        raise invalid_request("request_id: printable ASCII characters only", "request_id")
    request_id = request.headers.get(REQUEST_ID_HEADER) or body_request_id or uuid.uuid4().hex
    setattr(request.state, _STATE_KEY, request_id)
    return request_id


class RequestIdEcho:
    """ASGI middleware: the response carries the request's id (the one a handler chose, else the one sent).

    Pure ASGI rather than Starlette's BaseHTTPMiddleware, which would sit between a streamed response and
    the client's disconnect message that streaming.py listens for."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                chosen = scope.get("state", {}).get(_STATE_KEY)
                sent = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode())
                request_id = chosen.encode() if chosen else sent
                if request_id:
                    message.setdefault("headers", [])
                    message["headers"] = [*message["headers"], (b"x-request-id", request_id)]
            await send(message)

        await self._app(scope, receive, send_with_id)
