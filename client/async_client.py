"""AsyncClient: the asyncio Python SDK (grpc.aio), with the surface of the blocking Client.

A grpc.aio channel belongs to the event loop it was created in, so an AsyncClient must be created inside a
running loop and used only there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from client.channel import CHANNEL_OPTIONS, HEALTH_CHECK_REQUEST, SERVING, ReadinessPoll
from client.channel import call_metadata, channel_credentials
from client.channel import describe_rpc_failure, describe_status
from client.errors import PagedServeError, from_rpc_error
from client.request_builder import build_generate_request, build_tokenize_request
from client.request_metrics import RequestClock
from client.retry import RetryBudget, RetryPolicy
from client.stream_resume import ResumePolicy, StreamProgress
from client.tokenization import Tokenization
from client.types import GenerateChunk, GenerationResult, ModelInfo, ServerStats
from protos.pagedserve.v1 import generate_pb2, generate_pb2_grpc

# The scheduler's initial metadata once it has validated and queued a Generate request (its grpc_server.py).
_ACCEPTED_KEY = "pagedserve-accepted"


class AsyncClient:
    """Asyncio client. `timeout` (seconds) is the deadline of every call, a whole stream and its retries
    included. Retries as the blocking Client (`max_retries`, client/retry.py), and rides out a scheduler
    restart as it does (`resume_timeout`, client/stream_resume.py).

        async with AsyncClient("127.0.0.1:50051") as client:
            await client.wait_ready()
            async for chunk in client.generate_stream("Hello", max_tokens=32):
                print(chunk.text, end="", flush=True)
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        timeout: float | None = None,
        max_retries: int = 3,
        resume_timeout: float = 120.0,
        api_key: str | None = None,
        root_certificates: bytes | str | None = None,
        own_connection: bool = False,
    ) -> None:
        """`own_connection`: a TCP connection of this client's own; by default gRPC shares one between every
        channel to the same target in a process. Several clients each with its own connection spread over the
        processes of a server that shares its port (a data-parallel front's --api-server-count)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("create an AsyncClient inside a running event loop (in an async function)") from None
        self.target = target
        self._timeout = timeout
        self._retry = RetryPolicy(max_retries=max_retries)
        self._resume = ResumePolicy(resume_timeout)
        self._reached_server = False  # any answer yet: an UNAVAILABLE after one is a lost scheduler (stream_resume.py)
        self._metadata = call_metadata(api_key)
        credentials = channel_credentials(root_certificates)
        options = (*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)) if own_connection else CHANNEL_OPTIONS
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        self._generation = generate_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate_stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        on_accepted: Callable[[], None] | None = None,
        **sampling: Any,
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Streams the generation as it happens. Arguments as `build_generate_request` (checked now; the RPC
        starts at the first `__anext__`). Cancelling the consuming task cancels the request on the server;
        so does `aclose()` on the iterator, or dropping it after an early break. `on_accepted`: called (during
        the first `__anext__`) once the server has validated and queued the request, which may be long
        before its first chunk (an HTTP gateway starts its response then)."""
        request = build_generate_request(prompt, messages=messages, **sampling)
        return self._stream(request, on_accepted)

    async def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        **sampling: Any,
    ) -> GenerationResult:
        """The whole generation at once: the concatenated stream, with the client's RequestMetrics."""
        clock = RequestClock()
        stream = self.generate_stream(prompt, messages=messages, **sampling)
        try:
            return GenerationResult.from_chunks([clock.saw(chunk) async for chunk in stream], clock.metrics())
        finally:
            await stream.aclose()

    async def model_info(self) -> ModelInfo:
        response = await self._call(self._generation.ModelInfo, generate_pb2.ModelInfoRequest())
        return ModelInfo.from_response(response)

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        add_special_tokens: bool | None = None,
        return_token_strs: bool = False,
        **chat_options: Any,
    ) -> Tokenization:
        """The token ids the model would read for `prompt` (a text) or `messages` (a chat, with the chat options
        of `generate`: add_generation_prompt, continue_final_message, chat_template_kwargs, documents)."""
        request = build_tokenize_request(prompt, messages=messages, add_special_tokens=add_special_tokens,
                                         return_token_strs=return_token_strs, **chat_options)
        return Tokenization.from_response(await self._call(self._generation.Tokenize, request), return_token_strs)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens included."""
        request = generate_pb2.DetokenizeRequest(token_ids=list(token_ids))
        return (await self._call(self._generation.Detokenize, request)).text

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serves the PEFT adapter at `lora_path` (as the server sees it) as `lora_name` from now on (a server
        started with --allow-runtime-lora-updating). InvalidRequestError: refused (its config, a name served)."""
        await self._call(self._generation.LoadLoraAdapter,
                         generate_pb2.LoadLoraAdapterRequest(lora_name=lora_name, lora_path=lora_path))

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Stops serving `lora_name` (its requests in flight finish). NotFoundError: not served."""
        await self._call(self._generation.UnloadLoraAdapter, generate_pb2.UnloadLoraAdapterRequest(lora_name=lora_name))

    async def stats(self) -> ServerStats:
        return ServerStats.from_response(await self._call(self._generation.GetStats, generate_pb2.GetStatsRequest()))

    async def abort(self, request_id: str) -> bool:
        """Ends a request in flight (its stream ends with finish_reason "abort"); False if none had that id."""
        response = await self._call(self._generation.Abort, generate_pb2.AbortRequest(request_id=request_id))
        return response.aborted

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Polls the server's health service until it reports SERVING; raises TimeoutError naming the target
        if that does not happen within `timeout` seconds."""
        poll = ReadinessPoll(self.target, timeout)
        while True:
            try:
                response = await self._health.Check(HEALTH_CHECK_REQUEST, timeout=poll.check_timeout())
            except grpc.RpcError as error:
                answer = describe_rpc_failure(error)
            else:
                if response.status == SERVING:
                    self._reached_server = True
                    return
                answer = describe_status(response.status)
            await asyncio.sleep(poll.next_pause(answer))

    async def close(self) -> None:
        """Closes the channel, cancelling any call still in flight."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _stream(self, request: generate_pb2.GenerateRequest,
                      on_accepted: Callable[[], None] | None = None) -> AsyncGenerator[GenerateChunk, None]:
        budget = RetryBudget(self._retry, self._timeout)
        progress = StreamProgress(request)
        while True:
            call = self._generation.Generate(progress.next_request(), timeout=budget.attempt_timeout(),
                                             metadata=self._metadata)
            try:
                if on_accepted is not None and _ACCEPTED_KEY in await call.initial_metadata():
                    self._reached_server = True  # a loss from now on is waited out (stream_resume.py)
                    on_accepted()  # a refusal (or an older server) sends no such metadata
                async for response in call:
                    self._reached_server = True
                    progress.saw(response)
                    yield GenerateChunk.from_response(response)
                return
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
                if progress.complete:
                    return
                wait_until = self._resume.wait_deadline(error, self._reached_server, budget.deadline)
                pause = None if progress.num_messages or wait_until is not None else budget.next_pause(error)
                if wait_until is None and pause is None:
                    raise error from rpc_error
                if wait_until is not None:
                    progress.check_resumable(error)
            finally:
                call.cancel()  # a no-op once the stream has ended; otherwise the caller stopped early
            if wait_until is not None:
                await self._wait_serving(wait_until, error)
            else:
                await asyncio.sleep(pause)

    async def _call(self, method: grpc.aio.UnaryUnaryMultiCallable, request):
        budget = RetryBudget(self._retry, self._timeout)
        while True:
            try:
                response = await method(request, timeout=budget.attempt_timeout(), metadata=self._metadata)
                self._reached_server = True
                return response
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
                wait_until = self._resume.wait_deadline(error, self._reached_server, budget.deadline)
                pause = None if wait_until is not None else budget.next_pause(error)
                if wait_until is None and pause is None:
                    raise error from rpc_error
            if wait_until is not None:
                await self._wait_serving(wait_until, error)
            else:
                await asyncio.sleep(pause)

    async def _wait_serving(self, deadline: float, error: PagedServeError) -> None:
        """Until the (restarted) scheduler serves again, then a jittered pause (up to the retry policy's first
        backoff: the streams resumed together do not all come back at once, and a server that says SERVING but
        refuses cannot spin a client); raises ServerUnavailableError past `deadline`."""
        try:
            await self.wait_ready(timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise self._resume.lost_error(error) from error
        await asyncio.sleep(self._retry.backoff(0))
