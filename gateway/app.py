"""The gateway's FastAPI application: routes, the API-key check, and every failure in OpenAI's error shape.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (all behind `--api-key` when set),
GET /health (200 once the scheduler is SERVING, else 503: the readiness probe) and GET /metrics (Prometheus;
both open, as probes and scrapers carry no key). Everything the app uses hangs off the one Backend made
here, so two apps in one process (tests) share nothing.
"""

from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.errors import PagedServeError
from gateway.backend import Backend
from gateway.chat_completions import create_chat_completion
from gateway.completions import create_completion
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError, invalid_api_key, invalid_request
from gateway.metrics import CONTENT_TYPE, render_metrics
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.streaming import ClientDisconnected

# Not an HTTP status a client ever reads (it has gone): nginx's "client closed request", for the access log.
_CLIENT_CLOSED_REQUEST = 499


def build_app(config: GatewayConfig) -> FastAPI:
    backend = Backend(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.open()  # inside uvicorn's loop: the gRPC channel belongs to it
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="pagedserve OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(config.api_key))])

    @v1.get("/models")
    async def list_models() -> dict:
        name, info = await backend.served_model()
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
            "root": info.model_name, "max_model_len": info.max_model_len,
            # Not in vLLM's card (issue 18 asks for them): what unset sampling fields take, and from where.
            "default_sampling": info.default_sampling, "generation_config": info.generation_config,
            "version": info.version,
        }]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, backend)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, backend)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if await backend.is_ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": str(config.retry_after_s)})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await backend.client.stats()
        except PagedServeError:
            stats = None
        return Response(render_metrics(stats), media_type=CONTENT_TYPE)

    _install_error_handlers(app, backend)
    return app


def _api_key_check(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):  # constant time: the key is not guessable by timing
            raise invalid_api_key()

    return check


def _install_error_handlers(app: FastAPI, backend: Backend) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> Response:
        return error.response()

    @app.exception_handler(PagedServeError)
    async def scheduler_error(request: Request, error: PagedServeError) -> Response:
        return backend.to_openai_error(error).response()

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, error: ClientDisconnected) -> Response:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, error: RequestValidationError) -> Response:
        return _body_error(error.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return OpenAIError(error.status_code, str(error.detail), type=kind).response()


def _body_error(problems: list[dict]) -> OpenAIError:
    """A 400 for a body that failed validation: `param` is the top-level field; the message lists the first
    few problems (a field of several accepted types fails once per type)."""
    if not problems or problems[0].get("type") == "json_invalid":
        return invalid_request("the request body is not valid JSON")
    locations = [[str(part) for part in problem.get("loc", ()) if part != "body"] for problem in problems]
    param = locations[0][0] if locations[0] else None
    described = [f"{'.'.join(location) or 'body'}: {problem.get('msg', 'invalid')}"
                 for location, problem in zip(locations, problems)]
    return invalid_request("; ".join(described[:3]), param)
