"""Assembles and runs the scheduler service: gRPC server, health, worker link, engine; and its lifecycle.

Start-up: the gRPC server answers at once (health NOT_SERVING, Generate UNAVAILABLE) while the workers load;
once every worker reported its KV pool the block manager is sized from it and health turns SERVING.
SIGTERM/SIGINT: stop admitting (Generate UNAVAILABLE, health NOT_SERVING), give in-flight requests
`shutdown_timeout` seconds, abort the rest (finish_reason "abort"), tell the workers to exit, return 0.
A worker failure (its WorkerError, its connection closing, 3 missed heartbeats; see worker_link.py) at any
time, draining included, ends every stream with UNAVAILABLE saying why, turns health NOT_SERVING and
returns 1, so a supervisor (pagedserve serve, docker compose) restarts the stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from protos.pagedserve.v1 import worker_pb2
from scheduler_svc.api.access import ApiKeyInterceptor, server_credentials
from scheduler_svc.api.grpc_server import SERVICE_NAME, GenerationServicer, ServedModel, add_generation_service
from scheduler_svc.api.grpc_server import grpc_receive_limit
from scheduler_svc.api.lora_registry import LoraRegistry
from scheduler_svc.api.request_limits import RequestLimits
from scheduler_svc.api.request_validation import ServingLimits
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.scheduler import Scheduler, SchedulerLimits
from scheduler_svc.engine import Engine
from scheduler_svc.generation_defaults import load_generation_defaults
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.text.tokenizer_loading import load_tokenizer, read_eos_token_ids
from scheduler_svc.worker_io.plan_log import PlanLogWriter
from scheduler_svc.worker_io.worker_link import WorkerFailure, WorkerLink, WorkerPool
from service_runtime.lora_modules import read_projection_shapes
from service_runtime.model_source import resolve_model
from service_runtime.worker_link_auth import WORKER_SECRET_ENV, link_keys_from

logger = logging.getLogger(__name__)
# The SDK pings every 20 s to notice a server that froze (client/channel.py); gRPC's default would answer
# pings more often than every 5 minutes on a quiet stream with GOAWAY.
SERVER_OPTIONS = (("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),)


async def run_scheduler_service(config: SchedulerConfig) -> int:
    model = resolve_model(config.model)
    tokenizer_path = model.path if config.tokenizer is None else resolve_model(config.tokenizer).path
    tokenizer = load_tokenizer(tokenizer_path, config.chat_template)
    eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else read_eos_token_ids(model.path)
    generation_defaults = load_generation_defaults(config.generation_config, model.path,
                                                   config.override_generation_config)

    health = HealthServicer()
    await _set_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer = GenerationServicer(tokenizer)
    server, address = public_grpc_server(config)
    add_generation_service(servicer, server, config.max_message_bytes)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await server.start()
    logger.info("gRPC listening on %s%s%s; waiting for %d worker(s) on %s", address,
                " (TLS)" if config.tls_cert_file else "", " (API key required)" if config.api_key else "",
                config.num_workers, config.worker_address)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    keys = link_keys_from(os.environ)
    if keys is None and config.worker_address.startswith("tcp://") and not _loopback(config.worker_address):
        logger.warning("the worker link on %s is not authenticated: anyone who reaches it can act as a worker; set "
                       "%s in the scheduler's and the workers' environment", config.worker_address, WORKER_SECRET_ENV)
    structured_tokenizer = _structured_output_tokenizer(tokenizer, eos_token_ids)

    def setup_for(hello: worker_pb2.WorkerHello) -> worker_pb2.WorkerSetup:
        """Every worker's setup, the first set's and any replacement's alike."""
        return _worker_setup(config, hello, structured_tokenizer)

    link = WorkerLink(config.worker_address, config.num_workers, config.heartbeat_interval, config.heartbeat_grace,
                      keys)
    try:
        connecting = asyncio.ensure_future(
            link.connect_workers(setup_for,
                                 config.worker_ready_timeout))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([connecting, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():
            connecting.cancel()
            await link.shutdown_workers()
            return 0
        try:
            pool = connecting.result()
        except WorkerFailure as failure:  # a first worker lost while starting (killed while loading): as after a loss
            logger.error("a worker was lost while starting (%s); waiting for its replacement", failure)
            pool = await _replacement_pool(config, link, setup_for, stopping)
        except TimeoutError:
            logger.error("the workers did not come up: not ready in %g s", config.worker_ready_timeout)
            pool = None
        if pool is None:
            await link.shutdown_workers()
            return 0 if stopping.done() else 1
        stopping.cancel()
        max_model_len = _fit_pool(config, _max_model_len(config, pool.max_position_embeddings),
                                  pool.num_kv_blocks * config.block_size)
        limits = ServingLimits(max_model_len, pool.vocab_size, pool.num_kv_blocks * config.block_size,
                               _request_limits(config))
        scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, _token_budget(config, max_model_len), max_model_len, config.preemption_mode,
                            enable_prefix_caching=config.enable_prefix_caching,
                            enable_chunked_prefill=config.enable_chunked_prefill, max_loras=config.max_loras),
            _block_manager(config, pool),
            max_steps_in_flight=config.max_steps_in_flight if config.async_scheduling else 1,
            speculative=config.speculative_config,
        )
        plan_log = PlanLogWriter(config.plan_log) if config.plan_log else None
        engine = Engine(scheduler, link, tokenizer, eos_token_ids, plan_log,
                        max_messages_per_step=config.stream_messages_per_step, seed=config.seed)
        # Everything built so far (tokenizer, model limits, the scheduler's tables) lives as long as the
        # service: keep it out of the cyclic collector's full passes, which would scan it on every one.
        gc.freeze()
        servicer.start_serving(engine, ServedModel(model.name, limits, config.block_size, pool.num_kv_blocks,
                                                   pool.num_swap_blocks, eos_token_ids, config.max_queued_requests,
                                                   generation_defaults, pool.batch_invariant, pool.quantization,
                                                   pool.kv_cache_dtype,
                                                   LoraRegistry(config.enable_lora, config.lora_modules,
                                                                config.max_lora_rank,
                                                                config.allow_runtime_lora_updating,
                                                                read_projection_shapes(model.path))))
        await _set_health(health, health_pb2.HealthCheckResponse.SERVING)
        logger.info("serving %s: %d KV blocks of %d tokens, %d swap blocks, max_model_len %d", model.name,
                    pool.num_kv_blocks, config.block_size, pool.num_swap_blocks, max_model_len)
        return await _serve_until_stopped(config, engine, servicer, health, link, stop, setup_for)
    finally:
        await server.stop(grace=1.0)
        await link.close()


def public_grpc_server(config, reuse_port: bool = False) -> tuple[grpc.aio.Server, str]:
    """The public API's gRPC server, bound (not started) to config.host:config.port with the config's TLS, API
    key and message limit, and that address: the scheduler's, and a data-parallel front's (whose config has the
    same fields). `reuse_port`: one of several front processes sharing the port (front_processes.py)."""
    server = grpc.aio.server(
        interceptors=[ApiKeyInterceptor(config.api_key)] if config.api_key else [],
        # so_reuseport off: a second server started on a port in use fails to bind instead of silently
        # sharing it (the kernel would then hand this server's clients to the other one). On only for the front
        # processes of one --api-server-count, whose supervisor checked the port was free first.
        options=[*SERVER_OPTIONS, ("grpc.max_receive_message_length", grpc_receive_limit(config.max_message_bytes)),
                 ("grpc.so_reuseport", int(reuse_port))],
    )
    address = f"{config.host}:{config.port}"
    if config.tls_cert_file:
        server.add_secure_port(address, server_credentials(config.tls_cert_file, config.tls_key_file))
    else:
        server.add_insecure_port(address)
    return server, address


async def _serve_until_stopped(config, engine: Engine, servicer, health, link: WorkerLink, stop, setup_for) -> int:
    engine_task = asyncio.ensure_future(engine.run())
    stopping = asyncio.ensure_future(stop.wait())
    link_failed = asyncio.ensure_future(link.wait_failed())
    restarts_left = config.max_worker_restarts

    def failed() -> bool:
        return engine_task.done() or link_failed.done()

    try:
        await asyncio.wait([engine_task, stopping, link_failed], return_when=asyncio.FIRST_COMPLETED)
        while link_failed.done() and restarts_left > 0 and not stopping.done():
            restarts_left -= 1
            if not await _replace_workers(config, engine, engine_task, link_failed.result(), restarts_left, health,
                                          link, stopping, setup_for):
                break
            engine_task = asyncio.ensure_future(engine.run())
            link_failed = asyncio.ensure_future(link.wait_failed())
            await asyncio.wait([engine_task, stopping, link_failed], return_when=asyncio.FIRST_COMPLETED)
        if not failed():
            servicer.stop_accepting("the server is shutting down")
            await _set_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
            deadline = loop_time() + config.shutdown_timeout
            while _has_work(engine) and loop_time() < deadline and not failed():
                await asyncio.sleep(0.05)
        if failed():
            return await _fail(engine, engine_task, link_failed, servicer, health, link)
        engine.abort_all()
        await asyncio.sleep(0.05)  # let the handlers flush their final messages
        engine_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await engine_task
        await link.shutdown_workers()
        logger.info(engine.step_timer.summary())
        return 0
    finally:
        stopping.cancel()
        link_failed.cancel()


async def _replacement_pool(config, link: WorkerLink, setup_for, stopping) -> WorkerPool | None:
    """A new set of workers' pool, or None when none came within --worker-ready-timeout or a stop came first. A
    replacement that dies before it reported its pool (killed again while loading) is waited for once more, as
    often as --max-worker-restarts allows: its supervisor starts another."""
    for attempts_left in range(config.max_worker_restarts, -1, -1):
        replacing = asyncio.ensure_future(
            link.replace_workers(setup_for, config.worker_ready_timeout))
        await asyncio.wait([replacing, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not replacing.done():
            replacing.cancel()
            with contextlib.suppress(asyncio.CancelledError, WorkerFailure, TimeoutError):
                await replacing
            logger.error("stopped while waiting for replacement workers")
            return None
        try:
            return replacing.result()
        except WorkerFailure as error:
            if not attempts_left:
                logger.error("no replacement workers: %s", error)
                return None
            logger.error("a replacement worker was lost while starting (%s); waiting for another", error)
        except TimeoutError:
            logger.error("no replacement workers: not ready in %g s", config.worker_ready_timeout)
            return None
    return None


async def _replace_workers(config, engine: Engine, engine_task, failure, restarts_left: int, health, link: WorkerLink,
                           stopping, setup_for) -> bool:
    """Worker crash recovery: health NOT_SERVING, the loop stopped, and once a new set of workers reported its
    pool every request in flight resumes by recompute (streams stay open; new requests queue meanwhile).
    `restarts_left`: how many more losses may be recovered after this one (poison requests: see the engine).
    False when no new workers came within --worker-ready-timeout, or a stop came first (then everything fails
    as without recovery)."""
    logger.error("worker lost (%s); waiting up to %g s for its replacement", failure, config.worker_ready_timeout)
    await _set_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
    engine_task.cancel()
    with contextlib.suppress(asyncio.CancelledError, WorkerFailure):
        await engine_task
    pool = await _replacement_pool(config, link, setup_for, stopping)
    if pool is None:
        return False
    failed = engine.recover_from_worker_loss(_block_manager(config, pool), failure, restarts_left)
    logger.warning("workers replaced (%d KV blocks): requests in flight resume by recompute%s", pool.num_kv_blocks,
                   f"; {failed} failed after repeated losses" if failed else "")
    await _set_health(health, health_pb2.HealthCheckResponse.SERVING)
    return True


async def _fail(engine: Engine, engine_task, link_failed, servicer, health, link: WorkerLink) -> int:
    """A worker failed or went away (or the engine itself raised): new requests are refused and every request
    in flight ends with UNAVAILABLE saying why, health turns NOT_SERVING, and the process exits 1: compose's
    restart policy restarts it; `pagedserve serve` stops the stack (it restarts crashes only: launcher._crashed)."""
    failure = link_failed.result() if link_failed.done() else engine_task.exception()
    servicer.stop_accepting(f"the engine stopped: {failure}")
    if not engine_task.done():  # idle, or waiting for a result that will never come
        engine_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await engine_task
    elif not engine_task.cancelled():
        engine_task.exception()  # taken: it repeats the link's failure (else asyncio logs it with a traceback)
    engine.fail_all(failure)
    await _set_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
    await link.shutdown_workers()  # ranks still alive exit now rather than when our heartbeats stop
    return 1


def _has_work(engine: Engine) -> bool:
    stats = engine.stats()
    return stats.num_running + stats.num_waiting + stats.num_swapped > 0


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def _worker_setup(config: SchedulerConfig, hello: worker_pb2.WorkerHello,
                  structured_tokenizer: worker_pb2.StructuredOutputTokenizer | None) -> worker_pb2.WorkerSetup:
    max_model_len = _max_model_len(config, hello.max_position_embeddings)
    speculative = config.speculative_config
    return worker_pb2.WorkerSetup(
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=_token_budget(config, max_model_len),
        max_model_len=max_model_len,
        structured_output_tokenizer=structured_tokenizer,
        structured_output_limits=config.grammar_limits.to_wire(),
        draft_model=worker_pb2.DraftModelSetup(model=speculative.model,
                                               num_speculative_tokens=speculative.num_speculative_tokens,
                                               method=speculative.method,
                                               max_proposing_rows=min(speculative.disable_by_batch_size,
                                                                      config.max_num_seqs))
        if speculative is not None and speculative.uses_draft_model else None,
        lora_adapters=[worker_pb2.LoraAdapterSetup(name=module.name, path=module.path)
                       for module in config.lora_modules] if config.enable_lora else [],
        max_lora_rank=config.max_lora_rank if config.enable_lora else 0,
        max_loras=config.max_loras if config.enable_lora else 0,
        max_cpu_loras=(config.max_cpu_loras or config.max_loras) if config.enable_lora else 0,
    )


def _structured_output_tokenizer(tokenizer: Tokenizer | None,
                                 eos_token_ids: tuple[int, ...]) -> worker_pb2.StructuredOutputTokenizer | None:
    """What the workers build their grammar matchers' tokenizer from (serialized once, sent at every setup)."""
    if tokenizer is None:
        return None
    return worker_pb2.StructuredOutputTokenizer(tokenizer_json=tokenizer.to_json(), eos_token_ids=eos_token_ids)


def _request_limits(config: SchedulerConfig) -> RequestLimits:
    return RequestLimits(
        max_prompt_tokens=config.max_prompt_tokens,
        max_n=config.max_n,
        max_tokens_limit=config.max_tokens_limit,
        max_stop_strings=config.max_stop_strings,
        max_stop_string_length=config.max_stop_string_length,
        max_logprobs=config.max_logprobs,
        json_without_whitespace=config.structured_outputs_disable_any_whitespace,
        grammar_limits=config.grammar_limits,
    )


def _token_budget(config: SchedulerConfig, max_model_len: int) -> int:
    """Tokens per step. Without chunked prefill a whole prompt must fit one step (as vLLM sizes it)."""
    if config.enable_chunked_prefill:
        return config.max_num_batched_tokens
    return max(config.max_num_batched_tokens, max_model_len)


def _max_model_len(config: SchedulerConfig, model_limit: int) -> int:
    if config.max_model_len is None:
        return model_limit
    if config.max_model_len > model_limit:
        raise SystemExit(f"--max-model-len {config.max_model_len} exceeds the model's limit {model_limit}")
    return config.max_model_len


def _loopback(address: str) -> bool:
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def _block_manager(config: SchedulerConfig, pool: WorkerPool) -> BlockManager:
    """The block tables of the workers' pool (at start-up, and empty again for replacement workers)."""
    return BlockManager(block_size=config.block_size, num_gpu_blocks=pool.num_kv_blocks,
                        num_cpu_blocks=pool.num_swap_blocks, enable_prefix_caching=config.enable_prefix_caching)


def _fit_pool(config: SchedulerConfig, max_model_len: int, pool_tokens: int) -> int:
    """max_model_len, or what the KV pool holds when that is less: an unset --max-model-len is capped to the
    pool (with a warning); an explicit one the pool cannot hold stops the server, as vLLM does, instead of
    refusing every long request later (a chat without max_tokens asks for all of max_model_len)."""
    if pool_tokens >= max_model_len:
        return max_model_len
    if config.max_model_len is not None:
        raise SystemExit(f"--max-model-len {max_model_len} needs {max_model_len} KV slots but the KV pool holds "
                         f"{pool_tokens} ({pool_tokens // config.block_size} blocks of {config.block_size}): raise "
                         "--gpu-memory-utilization, --num-kv-blocks or --cpu-kv-cache-space, or lower --max-model-len")
    logger.warning("max_model_len capped to %d, what the KV pool holds (the model allows %d; raise "
                   "--gpu-memory-utilization, --num-kv-blocks or --cpu-kv-cache-space for more)", pool_tokens,
                   max_model_len)
    return pool_tokens


async def _set_health(health: HealthServicer, status) -> None:
    await health.set("", status)
    await health.set(SERVICE_NAME, status)
