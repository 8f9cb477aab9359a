"""The gateway's one connection to the scheduler: an AsyncClient, and what the served model is called.

Ownership: the app's lifespan opens it inside uvicorn's event loop (a grpc.aio channel belongs to the loop
that made it) and closes it on shutdown; request handlers only borrow it. ModelInfo is asked for on every
request that needs it rather than cached: one loopback RPC is cheap next to a generation, and a scheduler
restarted with another model or limits is then never misdescribed.
"""

from __future__ import annotations

from client.async_client import AsyncClient
from client.errors import PagedServeError
from client.types import ModelInfo
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError, from_scheduler_error, model_not_found

_HEALTH_CHECK_TIMEOUT_S = 0.5


class Backend:
    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._client: AsyncClient | None = None

    async def open(self) -> None:
        # No SDK retries: the gateway answers 503/429 at once and OpenAI clients retry those themselves
        # (retrying here too would multiply the attempts). But a scheduler lost after it answered is waited
        # for (bounded), and the streams in flight resume on its successor (client/stream_resume.py).
        config = self._config
        self._client = AsyncClient(config.grpc_target, max_retries=0, resume_timeout=config.resume_timeout,
                                   api_key=config.grpc_api_key, root_certificates=config.grpc_root_cert)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    @property
    def client(self) -> AsyncClient:
        assert self._client is not None, "the gateway's lifespan opens the backend before serving"
        return self._client

    async def served_model(self) -> tuple[str, ModelInfo]:
        """The name clients use for the served model, and its ModelInfo."""
        info = await self.client.model_info()
        return self._config.served_model_name or info.model_name, info

    async def model_for(self, requested: str | None) -> tuple[str, ModelInfo]:
        """The served model's name and info if `requested` names it (None: whatever is served), or a LoRA adapter
        the server serves (its name then: `lora_name_of`), else a 404."""
        name, info = await self.served_model()
        if requested is not None and requested not in (name, info.model_name):
            if lora_name_of(requested, info) is None:
                raise model_not_found(name)
            return requested, info
        return name, info

    async def is_ready(self) -> bool:
        """Whether the scheduler's health service says SERVING (its workers are loaded)."""
        try:
            await self.client.wait_ready(timeout=_HEALTH_CHECK_TIMEOUT_S)
        except TimeoutError:
            return False
        return True

    def to_openai_error(self, error: PagedServeError) -> OpenAIError:
        return from_scheduler_error(error, self._config.retry_after_s)


def lora_name_of(model_name: str, info: ModelInfo) -> str | None:
    """The LoRA adapter a request's resolved `model` selects (vLLM: the adapter's name is a model id), None for the
    base model."""
    return model_name if any(adapter.name == model_name for adapter in info.lora_adapters) else None
