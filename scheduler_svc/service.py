"""Assembles and runs the scheduler service: gRPC server, health, worker link, engine; and its lifecycle.

Start-up: the gRPC server answers at once (health NOT_SERVING, Generate UNAVAILABLE) while the workers load;
once every worker reported its KV pool the block manager is sized from it and health turns SERVING.
SIGTERM/SIGINT: stop admitting, give in-flight requests `shutdown_timeout` seconds, abort the rest, tell the
workers to exit, return 0. A worker failure ends every stream with UNAVAILABLE and returns 1, so a
supervisor (pagedserve serve, docker compose) restarts the stack.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from pagedserve.model_source import resolve_model
from protos.pagedserve.v1 import worker_pb2
from scheduler_svc.access import ApiKeyInterceptor, server_credentials
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.plan_log import PlanLogWriter
from scheduler_svc.grpc_server import SERVICE_NAME, GenerationServicer, ServedModel, add_generation_service
from scheduler_svc.request_limits import RequestLimits
from scheduler_svc.request_validation import ServingLimits
from scheduler_svc.scheduler import Scheduler, SchedulerLimits
from scheduler_svc.tokenizer import load_tokenizer, read_eos_token_ids
from scheduler_svc.worker_link import WorkerLink

logger = logging.getLogger(__name__)


async def run_scheduler_service(config: SchedulerConfig) -> int:
    model = resolve_model(config.model)
    tokenizer = load_tokenizer(model.path)
    eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else read_eos_token_ids(model.path)

    health = HealthServicer()
    await _set_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer = GenerationServicer(tokenizer)
    server = grpc.aio.server(
        interceptors=[ApiKeyInterceptor(config.api_key)] if config.api_key else [],
        # so_reuseport off: a second server started on a port in use fails to bind instead of silently
        # sharing it (the kernel would then hand this server's clients to the other one).
        options=[("grpc.max_receive_message_length", config.max_message_bytes), ("grpc.so_reuseport", 0)],
    )
    add_generation_service(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{config.host}:{config.port}"
    if config.tls_cert_file:
        server.add_secure_port(address, server_credentials(config.tls_cert_file, config.tls_key_file))
    else:
        server.add_insecure_port(address)
    await server.start()
    logger.info("gRPC listening on %s%s%s; waiting for %d worker(s) on %s", address,
                " (TLS)" if config.tls_cert_file else "", " (API key required)" if config.api_key else "",
                config.num_workers, config.worker_address)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    link = WorkerLink(config.worker_address, config.num_workers)
    try:
        connecting = asyncio.ensure_future(
            link.connect_workers(lambda hello: _worker_setup(config, hello), config.worker_ready_timeout))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([connecting, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():
            connecting.cancel()
            return 0
        stopping.cancel()
        pool = connecting.result()
        max_model_len = _max_model_len(config, pool.max_position_embeddings)
        limits = ServingLimits(max_model_len, pool.vocab_size, pool.num_kv_blocks * config.block_size,
                               _request_limits(config))
        scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, _token_budget(config, max_model_len), max_model_len, config.preemption_mode,
                            enable_prefix_caching=config.enable_prefix_caching,
                            enable_chunked_prefill=config.enable_chunked_prefill),
            BlockManager(block_size=config.block_size, num_gpu_blocks=pool.num_kv_blocks,
                         num_cpu_blocks=pool.num_swap_blocks, enable_prefix_caching=config.enable_prefix_caching),
        )
        plan_log = PlanLogWriter(config.plan_log) if config.plan_log else None
        engine = Engine(scheduler, link, tokenizer, eos_token_ids, plan_log)
        servicer.start_serving(engine, ServedModel(model.name, limits, config.block_size, pool.num_kv_blocks,
                                                   pool.num_swap_blocks, eos_token_ids, config.max_queued_requests))
        await _set_health(health, health_pb2.HealthCheckResponse.SERVING)
        logger.info("serving %s: %d KV blocks of %d tokens, %d swap blocks, max_model_len %d", model.name,
                    pool.num_kv_blocks, config.block_size, pool.num_swap_blocks, max_model_len)
        return await _serve_until_stopped(config, engine, servicer, health, link, stop)
    finally:
        await server.stop(grace=1.0)
        link.close()


async def _serve_until_stopped(config, engine: Engine, servicer, health, link: WorkerLink, stop) -> int:
    engine_task = asyncio.ensure_future(engine.run())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([engine_task, stopping], return_when=asyncio.FIRST_COMPLETED)
    servicer.stop_accepting("the server is shutting down")
    await _set_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
    if engine_task.done():
        stopping.cancel()
        servicer.stop_accepting(f"the engine stopped: {engine_task.exception()}")
        logger.error("engine failed: %s", engine_task.exception())
        return 1
    deadline = loop_time() + config.shutdown_timeout
    while engine.stats().num_running + engine.stats().num_waiting + engine.stats().num_swapped > 0:
        if loop_time() >= deadline or engine_task.done():
            break
        await asyncio.sleep(0.05)
    engine.abort_all()
    await asyncio.sleep(0.05)  # let the handlers flush their final messages
    engine_task.cancel()
    try:
        await engine_task
    except (asyncio.CancelledError, Exception):
        pass
    await link.shutdown_workers()
    logger.info(engine.step_timer.summary())
    return 0


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def _worker_setup(config: SchedulerConfig, hello: worker_pb2.WorkerHello) -> worker_pb2.WorkerSetup:
    max_model_len = _max_model_len(config, hello.max_position_embeddings)
    return worker_pb2.WorkerSetup(
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=_token_budget(config, max_model_len),
        max_model_len=max_model_len,
    )


def _request_limits(config: SchedulerConfig) -> RequestLimits:
    return RequestLimits(
        max_prompt_tokens=config.max_prompt_tokens,
        max_n=config.max_n,
        max_tokens_limit=config.max_tokens_limit,
        max_stop_strings=config.max_stop_strings,
        max_stop_string_length=config.max_stop_string_length,
        max_logprobs=config.max_logprobs,
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


async def _set_health(health: HealthServicer, status) -> None:
    await health.set("", status)
    await health.set(SERVICE_NAME, status)
