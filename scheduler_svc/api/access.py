"""Who may call the scheduler's gRPC API: an API key checked on every call but health, and TLS.

The key travels as call metadata, `authorization: Bearer KEY` (what the SDK sends, as OpenAI clients do over
HTTP) or `x-api-key: KEY`; it is compared in constant time (hmac.compare_digest) so the answer's timing tells
nothing about how much of a guess was right. A call without it, or with another key, ends with
UNAUTHENTICATED before its handler runs. The health service stays open: load balancers and `pagedserve
health` probe it without credentials, and it reveals nothing but SERVING or not.

TLS: with a certificate chain and its key the port is served over TLS only (no plaintext port beside it).
"""

from __future__ import annotations

import hmac

import grpc

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
_UNAUTHENTICATED = "missing or incorrect API key: send `authorization: Bearer <key>` metadata"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self._expected = api_key.encode()

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        if self._authorized(handler_call_details.invocation_metadata or ()):
            return handler
        return _refusing_handler(handler)

    def _authorized(self, metadata) -> bool:
        presented = b""
        for key, value in metadata:
            if key == "authorization" and value[:7].lower() == "bearer ":  # the scheme is case-insensitive
                presented = value[7:].encode()
            elif key == "x-api-key":
                presented = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(presented, self._expected)


async def _refuse(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)


async def _refuse_stream(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)
    yield  # pragma: no cover - makes this an async generator, the shape a streaming handler has


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED (the request bytes are
    never parsed: no deserializer)."""
    codecs = dict(response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_refuse_stream, **codecs)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_refuse, **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_refuse, **codecs)
    return grpc.stream_stream_rpc_method_handler(_refuse_stream, **codecs)


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    with open(cert_file, "rb") as cert, open(key_file, "rb") as key:
        return grpc.ssl_server_credentials([(key.read(), cert.read())])
