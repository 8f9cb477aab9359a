"""How `bench serve` sends its requests: the request function of a target, and the timed sending of a run's
requests under a concurrency limit. Why a module of its own: the measured run's sender is the same in the
`bench serve` process and in each of its client processes (client_processes.py), which import it without the
command's parser and reporting.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from tqdm import tqdm

from client import AsyncClient
from pagedserve.bench.request_funcs import GrpcBackend, OpenAIStreamingBackend
from pagedserve.bench.request_outcome import RequestInput, RequestOutcome


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def make_backend(spec: dict, max_concurrency: int | None, connections: int = 1):
    """The request function of `spec` (backend, base_url, endpoint, api_key: a ServeTarget's, as a client
    process gets it too); call it inside the run's event loop. `connections` > 1: gRPC over that many
    connections of its own (HTTP opens connections as it needs them)."""
    if spec["backend"] == "grpc":
        if connections == 1:
            return GrpcBackend(AsyncClient(spec["base_url"], api_key=spec["api_key"], max_retries=0))
        return GrpcBackend(*(AsyncClient(spec["base_url"], api_key=spec["api_key"], max_retries=0,
                                         own_connection=True) for _ in range(connections)))
    return OpenAIStreamingBackend(spec["base_url"] + spec["endpoint"], spec["backend"] == "openai-chat",
                                  auth_headers(spec["api_key"]), max_concurrency)


async def send_all(backend, inputs, offsets, max_concurrency, disable_tqdm, start: float | None = None):
    """Sends request i at offsets[i] after `start` (perf_counter; default now), waiting for a free slot under
    max_concurrency; returns the outcomes in input order and the wall time from the start to the last outcome."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    progress = tqdm(total=len(inputs), disable=disable_tqdm)

    async def send(request: RequestInput) -> RequestOutcome:
        async with limit:
            outcome = await backend(request)
        progress.update(1)
        return outcome

    start = time.perf_counter() if start is None else start
    tasks = []
    for request, offset in zip(inputs, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(request)))
    outcomes = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    progress.close()
    return list(outcomes), duration
