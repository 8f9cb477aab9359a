"""The gateway's FastAPI application: routes, the API-key check, and every failure in OpenAI's error shape.

Routes: GET /v1/models and /v1/models/{id}, POST /v1/completions, /v1/chat/completions, vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter (404 without --allow-runtime-lora-updating, as vLLM, which
registers them only with VLLM_ALLOW_RUNTIME_LORA_UPDATING: `_runtime_lora_update`), /tokenize and /detokenize
(all behind `--api-key` when set), GET /health and
/ping (200 once the scheduler is SERVING, else 503: the readiness probe), GET /version and GET /metrics
(Prometheus; open, as probes and scrapers carry no key). Every response echoes the request id in `X-Request-Id`
(request_ids.py). Everything the app uses hangs off the one Backend made here, so two apps in one process (tests)
share nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable
from contextlib import asynccontextmanager

import grpc

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.errors import PagedServeError
from gateway.backend import Backend
from gateway.body_limit import RequestBodyLimit
from gateway.chat_completions import create_chat_completion
from gateway.completions import create_completion
from gateway.config import GatewayConfig
from gateway.draining import DrainGate, DrainState
from gateway.errors import OpenAIError, invalid_api_key, invalid_request
from gateway.metrics import CONTENT_TYPE, render_metrics
from gateway.model_card import model_card, model_cards
from gateway.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
                              TokenizeRequest, UnloadLoRAAdapterRequest)
from gateway.request_ids import RequestIdEcho
from gateway.streaming import ClientDisconnected
from gateway.tokenization import detokenize, tokenize
from gateway.vllm_metrics import ServedModel
from service_runtime.package_version import pagedserve_version

# Not an HTTP status a client ever reads (it has gone): nginx's "client closed request", for the access log.
_CLIENT_CLOSED_REQUEST = 499


def build_app(config: GatewayConfig, drain: DrainState | None = None) -> FastAPI:
    """The app; with `drain`, it counts requests in flight and refuses new ones while draining (draining.py)."""
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
        return {"object": "list", "data": model_cards(*await backend.served_model())}

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        served_name, info = await backend.served_model()
        name, _ = await backend.model_for(model_id)
        return model_card(name, info, served_name if name != served_name else None)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, backend)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, backend, config)

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        await _runtime_lora_update(backend.client.load_lora_adapter(body.lora_name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        await _runtime_lora_update(backend.client.unload_lora_adapter(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    app.include_router(v1)
    # vLLM serves these at the root, not under /v1; they need the key as /v1 does.
    tokenizer_routes = APIRouter(dependencies=[Depends(_api_key_check(config.api_key))])

    @tokenizer_routes.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict:
        return await tokenize(body, backend)

    @tokenizer_routes.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict:
        return await detokenize(body, backend)

    app.include_router(tokenizer_routes)

    async def health() -> Response:
        if await backend.is_ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": str(config.retry_after_s)})

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's (SageMaker's) name for the same probe

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedserve_version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await backend.client.stats()
            served = ServedModel(*await backend.served_model())
        except PagedServeError:
            stats = served = None
        return Response(render_metrics(stats, served), media_type=CONTENT_TYPE)

    _install_error_handlers(app, backend)
    app.add_middleware(RequestIdEcho)
    app.add_middleware(RequestBodyLimit, limit=config.max_request_body_bytes)
    if drain is not None:
        app.add_middleware(DrainGate, state=drain, retry_after_s=config.retry_after_s)  # outermost
    return app


async def _runtime_lora_update(call: Awaitable[None]) -> None:
    """Awaits a LoadLoraAdapter / UnloadLoraAdapter call. Why a 404 when the scheduler answers FAILED_PRECONDITION
    (runtime updating off, or no --enable-lora): vLLM does not register these two routes without
    VLLM_ALLOW_RUNTIME_LORA_UPDATING, so its clients see an unknown path; this answers as this app does for one
    (gRPC callers keep FAILED_PRECONDITION, which says why)."""
    try:
        await call
    except PagedServeError as error:
        if error.code == grpc.StatusCode.FAILED_PRECONDITION:
            raise StarletteHTTPException(404, "Not Found") from error
        raise


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
    unknown = [location for location, problem in zip(locations, problems) if problem.get("type") == "extra_forbidden"]
    if unknown:  # named in full (messages.0.images), as vLLM's "extra fields not permitted"
        names = [".".join(location) for location in unknown]
        return invalid_request(f"unknown field(s): {', '.join(names[:5])} (not an OpenAI or vLLM request field)",
                               names[0])
    param = locations[0][0] if locations[0] else None
    described = [f"{'.'.join(location) or 'body'}: {problem.get('msg', 'invalid')}"
                 for location, problem in zip(locations, problems)]
    return invalid_request("; ".join(described[:3]), param)
