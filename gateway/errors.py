"""Failures as OpenAI's JSON error shape (`{"error": {"message", "type", "param", "code"}}`) with the HTTP
status an OpenAI client acts on, so the official SDKs raise their matching exception classes.

The mapping from the scheduler's gRPC status: INVALID_ARGUMENT -> 400 (the request is wrong; the scheduler's
message names the field, which becomes `param`), RESOURCE_EXHAUSTED -> 429 and UNAVAILABLE -> 503 (both with
Retry-After: come back later), DEADLINE_EXCEEDED -> 504, anything else -> 500. The gateway's own refusals:
400 for a body it cannot read or a feature it does not serve, 401 for a missing or wrong key, 404 for a model
it does not serve.
"""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from client.errors import PagedServeError


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, type: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, type="invalid_request_error", param=param)


def unsupported(param: str, what: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {what}", type="invalid_request_error", param=param, code="unsupported_parameter")


def invalid_api_key() -> OpenAIError:
    return OpenAIError(401, "missing or incorrect API key: send `Authorization: Bearer <key>`",
                       type="invalid_request_error", code="invalid_api_key")


def model_not_found(served: str) -> OpenAIError:
    # The requested name is not echoed back: error bodies never repeat the input.
    return OpenAIError(404, f"the requested model does not exist; this server serves {served!r}",
                       type="invalid_request_error", param="model", code="model_not_found")


def from_scheduler_error(error: PagedServeError, retry_after_s: int) -> OpenAIError:
    """The OpenAI error for a failed gRPC call to the scheduler."""
    details = error.details or error.code.name
    # The scheduler's message limit (INVALID_ARGUMENT naming --max-message-bytes), or past twice it gRPC's own
    # (RESOURCE_EXHAUSTED): not load, and a 429 would have OpenAI clients resend the same request forever.
    too_large = (error.code == grpc.StatusCode.INVALID_ARGUMENT and "--max-message-bytes" in details) or (
        error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in details)
    if error.code == grpc.StatusCode.INVALID_ARGUMENT and not too_large:
        return invalid_request(details, _openai_param(details))
    if too_large:
        return OpenAIError(413, f"the request is larger than the model server accepts: {details}",
                           type="invalid_request_error", code="request_too_large")
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OpenAIError(429, f"the server is overloaded: {details}", type="rate_limit_error",
                           code="server_overloaded", retry_after_s=retry_after_s)
    if error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return OpenAIError(503, f"the model server is not available: {details}", type="service_unavailable_error",
                           code="service_unavailable", retry_after_s=retry_after_s)
    if error.code == grpc.StatusCode.FAILED_PRECONDITION:  # runtime LoRA updates without their flag
        return invalid_request(details)
    if error.code == grpc.StatusCode.NOT_FOUND:  # a LoRA adapter gone since the gateway looked (ModelInfo)
        return OpenAIError(404, f"the requested model does not exist: {details}", type="invalid_request_error",
                           param="model", code="model_not_found")
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return OpenAIError(504, f"the request timed out: {details}", type="timeout_error")
    return OpenAIError(500, f"the model server failed: {details}", type="internal_error")


def _openai_param(details: str) -> str | None:
    """The OpenAI field behind the scheduler's "field.path: reason" message (sampling.top_p -> top_p)."""
    field = details.split(":", 1)[0].strip()
    if " " in field or not field:
        return None
    option = field.removeprefix("prompt.chat.")
    if option in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents"):
        return option
    if field.startswith("prompt.chat"):
        return "messages"
    if field == "token_ids":  # Detokenize's, /detokenize's `tokens`
        return "tokens"
    if field.startswith("prompt"):
        return "prompt"
    if field.startswith("sampling."):
        return field.removeprefix("sampling.")
    return field
