"""pagedserve's Python SDK: `Client` (blocking) and `AsyncClient` (asyncio) over the public gRPC API.

    from client import Client
    with Client("127.0.0.1:50051") as client:
        client.wait_ready()
        print(client.generate("The capital of France is", max_tokens=8, temperature=0).text)

`python -m client "prompt"` is the same from a shell. Offline batch inference (`LLM`, which starts its own
server) lives a floor up, in `pagedserve` (`from pagedserve import LLM, SamplingParams`): it launches the
services, and the SDK must not depend on the launcher.
"""

from client.async_client import AsyncClient
from client.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    PagedServeError,
    RequestCancelledError,
    ServerUnavailableError,
)
from client.sampling_params import SamplingParams
from client.structured_outputs import StructuredOutputsParams
from client.sync_client import Client
from client.types import (
    CompletionOutput,
    GenerateChunk,
    GenerationResult,
    LatencyHistogram,
    Logprob,
    ModelInfo,
    ServerStats,
    TokenLogprobs,
)

__all__ = [
    "AsyncClient",
    "Client",
    "CompletionOutput",
    "DeadlineExceededError",
    "GenerateChunk",
    "GenerationResult",
    "InvalidRequestError",
    "LatencyHistogram",
    "Logprob",
    "ModelInfo",
    "OverloadedError",
    "PagedServeError",
    "RequestCancelledError",
    "SamplingParams",
    "ServerStats",
    "ServerUnavailableError",
    "StructuredOutputsParams",
    "TokenLogprobs",
]
