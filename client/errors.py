"""Typed errors for failed RPCs, so callers catch what they can act on instead of inspecting status codes.

What each means for the caller:
- InvalidRequestError: the request itself is wrong (bad sampling values, a prompt too long, chat without a
  template); retrying it unchanged fails again.
- ServerUnavailableError: no server answered, or it is starting, draining or lost its workers; retry later.
- OverloadedError: the server refused more work for now; back off and retry.
- NotFoundError: the request names something the server does not serve (a LoRA adapter); retrying fails again.
- RequestCancelledError / DeadlineExceededError: the call was cancelled, or ran past its timeout.
Any other status is a plain PagedServeError.
"""

from __future__ import annotations

import grpc


class PagedServeError(Exception):
    """A failed RPC: `code` is the grpc.StatusCode, `details` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details


class InvalidRequestError(PagedServeError):
    """INVALID_ARGUMENT: the server rejected the request as given."""


class NotFoundError(PagedServeError):
    """NOT_FOUND: the request names a LoRA adapter the server does not serve."""


class ServerUnavailableError(PagedServeError):
    """UNAVAILABLE: the server is unreachable or not ready to generate."""


class OverloadedError(PagedServeError):
    """RESOURCE_EXHAUSTED: the server is out of capacity for new requests."""


class RequestCancelledError(PagedServeError):
    """CANCELLED: the call was cancelled before it finished."""


class DeadlineExceededError(PagedServeError):
    """DEADLINE_EXCEEDED: the call ran past its timeout."""


_ERROR_BY_CODE: dict[grpc.StatusCode, type[PagedServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAVAILABLE: ServerUnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


# How gRPC itself words RESOURCE_EXHAUSTED for a message over a receive (or send) limit: a request that can
# never succeed, not an overload, so it is an InvalidRequestError (and never retried).
_MESSAGE_TOO_LARGE = ("message larger than max",)


def from_rpc_error(error: grpc.RpcError) -> PagedServeError:
    """The typed error for a failed call (sync grpc or grpc.aio); raise it `from` the original."""
    code = (error.code() if hasattr(error, "code") else None) or grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or ""
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and any(text in details.lower() for text in _MESSAGE_TOO_LARGE):
        return InvalidRequestError(code, details)
    return _ERROR_BY_CODE.get(code, PagedServeError)(code, details)
