"""The data-parallel front: the public pagedserve.v1.Generation service (and gRPC health), forwarding each call
to one engine's scheduler.

Who owns what: the front holds one channel per engine (EngineLink), the router's in-flight counts
(router.py) and, for the prefix policy, a tokenizer for prompt heads (prefix_key.py); the engines hold every
request's state. Requests and responses pass through as bytes (no deserializer either way): the engine
validates and refuses exactly as it does alone, and the front reads a Generate request only to route it.

- Generate: routed to one engine; its initial metadata (`pagedserve-accepted`), messages and final status
  are relayed as they come. A client that goes away, or whose deadline passes, cancels the front's handler,
  which cancels the engine's call: the engine aborts the request and frees its blocks. The handler holds the
  request's bytes until the stream ends: an engine lost before the first message (engine_link.py says when)
  gets the request sent again to a serving engine it has not tried; lost after it, the client gets UNAVAILABLE
  naming the engine, and the SDK resumes the stream on a serving engine.
- Abort: sent to every serving engine (the front keeps no id -> engine table); aborted when any aborted.
- ModelInfo, Tokenize, Detokenize: the first serving engine (every engine serves the same model and flags).
- GetStats: every serving engine's, summed, and each beside the sums with the router's counts (engine_stats.py).
- Health: NOT_SERVING until every engine has served once (start-up, so that a ready server routes over all of
  them), then SERVING while any engine is; engines are polled every HEALTH_POLL_SECONDS and one that does
  not serve (its scheduler restarting, or lost) gets no new request. On SIGTERM: NOT_SERVING, new calls
  UNAVAILABLE, streams in flight relayed until they end (the engines drain them) or --shutdown-timeout passes.
- One of --api-server-count processes (--api-server-rank set; front_processes.py): the same, except that it binds
  the shared port (SO_REUSEPORT) only once every engine has served, and its router's load bound is its share.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api.grpc_server import SERVICE_NAME
from scheduler_svc.api.prompt_encoding import OFF_LOOP_PROMPT_CHARS, prompt_chars
from scheduler_svc.data_parallel.config import FrontConfig
from scheduler_svc.data_parallel.engine_link import ENGINE_LOST_GRACE_S, FORWARDED_UNARY, EngineLink
from scheduler_svc.data_parallel.engine_stats import front_stats
from scheduler_svc.data_parallel.prefix_key import prefix_key
from scheduler_svc.data_parallel.router import Router
from scheduler_svc.service import public_grpc_server
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model

ABORTED_IDS_KEPT = 4096  # recent Abort ids remembered for requests waiting to be sent again

logger = logging.getLogger(__name__)
HEALTH_POLL_SECONDS = 0.25
RESEND_WAIT_S = ENGINE_LOST_GRACE_S  # how long a request to resend waits for a serving engine it has not tried


class DataParallelFront:
    def __init__(self, engines: list[EngineLink], router: Router, tokenizer: Tokenizer | None,
                 engine_metadata: tuple[tuple[str, str], ...]) -> None:
        self.engines = engines
        self.router = router
        self._tokenizer = tokenizer
        self._metadata = engine_metadata  # the API key the engines require, sent on every forwarded call
        self._block_size: int | None = None  # the engines' KV block size, from ModelInfo once they serve
        self.started = False
        self.draining = False
        # Request ids of recent Abort calls: a request waiting for a resend (its engine lost) must not be sent
        # again after its client aborted it while it waited (no engine held it then to take the abort).
        self._aborted_ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def serving_engines(self) -> list[int]:
        return [index for index, engine in enumerate(self.engines) if engine.serving]

    async def watch_engines(self, health: HealthServicer) -> None:
        """Polls the engines' health for as long as the front runs, and sets the front's own."""
        status = None
        while True:
            await asyncio.gather(*(engine.poll_health() for engine in self.engines))
            if not self.started and all(engine.serving for engine in self.engines):
                with contextlib.suppress(grpc.RpcError):
                    info = generate_pb2.ModelInfoResponse.FromString(
                        await self.engines[0].unary["ModelInfo"](b"", metadata=self._metadata, timeout=5.0))
                    self._block_size, self.started = info.block_size, True
            serving = self.started and not self.draining and bool(self.serving_engines())
            new_status = (health_pb2.HealthCheckResponse.SERVING if serving
                          else health_pb2.HealthCheckResponse.NOT_SERVING)
            if new_status != status:
                status = new_status
                await health.set("", status)
                await health.set(SERVICE_NAME, status)
            await asyncio.sleep(HEALTH_POLL_SECONDS)

    def _refusal(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if not self.started:
            return "the server is starting: the engines are not ready yet"
        if not self.serving_engines():
            return "no engine is serving (their schedulers are restarting)"
        return None

    async def Generate(self, request: bytes, context: grpc.aio.ServicerContext):
        """Relays one engine's stream. An engine lost before the stream's first message (its call ends
        UNAVAILABLE, or the link declares it lost) gets the same request bytes sent again to a serving engine
        it has not tried; lost after it, the client gets UNAVAILABLE naming the engine (the SDK resumes the
        stream from what it received, client/stream_resume.py)."""
        if (refusal := self._refusal()) is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        key = await self._prefix_key(request) if self.router.policy == "prefix" else None
        tried: list[EngineLink] = []
        headers_sent = False
        while True:
            engine = await self._engine_for(key, tried, lambda: self._aborted(request))
            if tried and self._aborted(request):  # aborted while no engine held it (its engine lost)
                if engine is not None:
                    self.router.release(engine.index)
                await context.abort(grpc.StatusCode.CANCELLED, "aborted while its engine was lost")
            if engine is None:
                lost = ", ".join(link.name for link in tried)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"no serving engine took the request ({lost} lost "
                                                                 "before its first output)")
            tried.append(engine)
            engine_call = engine.generate(request, self._metadata, context.time_remaining())
            relayed = 0
            try:
                headers = await engine_call.call.initial_metadata()
                if headers and not headers_sent:
                    await context.send_initial_metadata(tuple(headers))
                    headers_sent = True
                async for message in engine_call.call:
                    relayed += 1
                    yield message
                return
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as error:
                unavailable = isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
                client_gone = isinstance(error, asyncio.CancelledError) and asyncio.current_task().cancelling()
                if client_gone or not (engine_call.lost or unavailable):
                    if isinstance(error, asyncio.CancelledError):  # the client went away (maybe as the engine was lost)
                        raise
                    await context.abort(error.code(), error.details() or "")
                engine.mark_unreachable()
                if relayed:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{engine.name} was lost after this stream's "
                                                                     f"first output ({relayed} messages)")
                logger.warning("%s lost before a request's first output; sending it again", engine.name)
            finally:
                engine.done(engine_call)
                self.router.release(engine.index)

    def _aborted(self, request: bytes) -> bool:
        """Whether an Abort named this request's id (checked before a resend, and again after waiting for one)."""
        with contextlib.suppress(Exception):  # a malformed request was refused by the engine already
            return generate_pb2.GenerateRequest.FromString(request).request_id in self._aborted_ids
        return False

    async def _engine_for(self, key: bytes | None, tried: list[EngineLink],
                          aborted: Callable[[], bool]) -> EngineLink | None:
        """The engine for a request (routed, and counted in flight there): the first try among the serving
        engines (all of them while none is); a resend among the serving ones not tried yet, waiting up to
        RESEND_WAIT_S for one, else None (None at once once `aborted()`)."""
        if not tried:
            candidates = self.serving_engines() or list(range(len(self.engines)))
            return self.engines[self.router.route(key, candidates)]
        deadline = asyncio.get_running_loop().time() + RESEND_WAIT_S
        while not (candidates := [index for index in self.serving_engines() if self.engines[index] not in tried]):
            if asyncio.get_running_loop().time() > deadline or aborted():
                return None
            await asyncio.sleep(HEALTH_POLL_SECONDS / 2)
        return self.engines[self.router.route(key, candidates)]

    async def _prefix_key(self, request: bytes) -> bytes | None:
        try:
            parsed = generate_pb2.GenerateRequest.FromString(request)
        except Exception:  # malformed: the engine refuses it with INVALID_ARGUMENT
            return None
        if prompt_chars(parsed.text, parsed.chat) > OFF_LOOP_PROMPT_CHARS:  # a large chat renders on a thread
            return await asyncio.to_thread(prefix_key, parsed, self._tokenizer, self._block_size or 16)
        return prefix_key(parsed, self._tokenizer, self._block_size or 16)

    async def forward_unary(self, name: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        candidates = self.serving_engines()
        if not candidates:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._refusal() or "no engine is serving")
        try:
            return await self.engines[candidates[0]].unary[name](request, metadata=self._metadata,
                                                                  timeout=context.time_remaining())
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")

    async def Abort(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self._aborted_ids[generate_pb2.AbortRequest.FromString(request).request_id] = None
        while len(self._aborted_ids) > ABORTED_IDS_KEPT:
            self._aborted_ids.popitem(last=False)
        # Every engine, not only those serving now: one briefly NOT_SERVING may hold the request.
        replies = await self._each_serving("Abort", request, context, every_engine=True)
        aborted = any(generate_pb2.AbortResponse.FromString(reply).aborted for reply in replies.values())
        return generate_pb2.AbortResponse(aborted=aborted).SerializeToString()

    async def GetStats(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        replies = await self._each_serving("GetStats", request, context)
        per_engine = {engine: generate_pb2.GetStatsResponse.FromString(reply) for engine, reply in replies.items()}
        router = self.router
        return front_stats(per_engine, router.routed, router.in_flight, router.policy).SerializeToString()

    async def _each_serving(self, name: str, request: bytes, context: grpc.aio.ServicerContext,
                            every_engine: bool = False) -> dict[int, bytes]:
        """The replies of every serving engine (`every_engine`: of every engine) that answered, by engine index;
        UNAVAILABLE when none did, the first engine's error when each refused (a malformed request:
        INVALID_ARGUMENT)."""
        indices = list(range(len(self.engines))) if every_engine else self.serving_engines()
        results = await asyncio.gather(*(self.engines[index].unary[name](request, metadata=self._metadata,
                                                                         timeout=5.0)
                                         for index in indices), return_exceptions=True)
        replies = {index: result for index, result in zip(indices, results) if isinstance(result, bytes)}
        if not replies:
            errors = [result for result in results if isinstance(result, grpc.aio.AioRpcError)]
            if errors and errors[0].code() != grpc.StatusCode.UNAVAILABLE:
                await context.abort(errors[0].code(), errors[0].details() or "")
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._refusal() or "no engine answered")
        return replies


def add_front_service(front: DataParallelFront, server: grpc.aio.Server) -> None:
    """The Generation service's methods, bytes in and bytes out."""
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(front.Generate),
                "Abort": grpc.unary_unary_rpc_method_handler(front.Abort),
                "GetStats": grpc.unary_unary_rpc_method_handler(front.GetStats)}
    for name in FORWARDED_UNARY:
        async def forward(request, context, name=name):
            return await front.forward_unary(name, request, context)
        handlers[name] = grpc.unary_unary_rpc_method_handler(forward)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


async def run_front(config: FrontConfig) -> int:
    tokenizer = None
    if config.router_policy == "prefix" and config.model is not None:
        model_path = resolve_model(config.model).path
        tokenizer = load_tokenizer(model_path if config.tokenizer is None else resolve_model(config.tokenizer).path,
                                   config.chat_template)
    credentials = None
    if config.tls_cert_file:
        with open(config.tls_cert_file, "rb") as cert:
            credentials = grpc.ssl_channel_credentials(root_certificates=cert.read())
    engines = [EngineLink(index, target, credentials) for index, target in enumerate(config.engine_targets)]
    metadata = (("authorization", f"Bearer {config.api_key}"),) if config.api_key else ()
    one_of_many = config.api_server_rank is not None  # one of --api-server-count processes (front_processes.py)
    # Each of N processes sees about 1/N of the requests: its share of the load bound (front_processes.py).
    load_bound = -(-config.router_load_bound // config.api_server_count)
    front = DataParallelFront(engines, Router(config.router_policy, len(engines), load_bound), tokenizer, metadata)
    health = HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    watching = asyncio.ensure_future(front.watch_engines(health))
    server = None
    try:
        # One of several binds only once its engines served (gRPC listens as soon as a port is added): the
        # kernel then never hands a connection to a process still starting.
        while one_of_many and not front.started and not stop.is_set():
            await asyncio.sleep(HEALTH_POLL_SECONDS / 2)
        if stop.is_set():  # stopped before it bound: it never opens the shared port
            return 0
        server, address = public_grpc_server(config, reuse_port=one_of_many)
        add_front_service(front, server)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        await server.start()
        logger.info("gRPC listening on %s%s; routing (%s) over %d engines: %s", address,
                    f" (front process {config.api_server_rank} of {config.api_server_count})" if one_of_many else "",
                    config.router_policy, len(engines), ", ".join(config.engine_targets))
        await stop.wait()
        front.draining = True
        deadline = loop.time() + config.shutdown_timeout + 5.0  # the engines drain for shutdown_timeout
        while sum(front.router.in_flight) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return 0
    finally:
        watching.cancel()
        if server is not None:
            await server.stop(grace=1.0)
        for engine in engines:
            await engine.channel.close()
