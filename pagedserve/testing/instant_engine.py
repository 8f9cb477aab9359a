"""A stand-in engine process for measuring what surrounds the engines (the data-parallel front, the benchmark
client) on a machine without GPUs: the real scheduler service's gRPC API, validation, scheduler, engine loop
and stream publishing, with an instant stand-in worker (instant_worker_link.py) in place of the worker ranks.

    python -m pagedserve.testing.instant_engine --model DIR --grpc-port PORT [--step-ms 7] [--max-num-seqs 256]

Why not the real `python -m scheduler_svc` with a fake worker process: the worker link's framing and heartbeats
would add a process and its CPU to every measurement, and nothing outside the scheduler is what is measured
here. Why a fixed step time (`--step-ms`) rather than flat out: a GPU engine hands out tokens at its device's
pace, and the front and the client must be measured at the message rates a GPU engine produces (one step of
`max_num_seqs` rows, each stream flushed every few steps: --stream-messages-per-step, as the scheduler's).

Sampled tokens are a pure function of (request id, position) in [3, vocab size): ordinary ids of the model's
tokenizer (benchmarks/id_word_tokenizer.py's words for a benchmark shape), never EOS, so every request runs to
its max_tokens. Health turns SERVING once the engine runs; SIGTERM/SIGINT stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import signal
import sys
import zlib
from collections.abc import Sequence

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from pagedserve.testing.instant_worker_link import InstantWorkerLink
from scheduler_svc.api.grpc_server import SERVICE_NAME, GenerationServicer, ServedModel, add_generation_service
from scheduler_svc.api.request_validation import ServingLimits
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.scheduler import Scheduler, SchedulerLimits
from scheduler_svc.engine import Engine
from scheduler_svc.service import public_grpc_server
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model
from service_runtime.service_process import start_service_process

BLOCK_SIZE = 16
DEFAULT_MAX_MODEL_LEN = 2048


def token_sampler(vocab_size: int):
    """The stand-in model: an ordinary id (>= 3: below are <unk>, BOS, EOS) fixed by request and position."""
    span = max(vocab_size - 3, 1)

    def sample(request_id: str, position: int) -> int:
        return 3 + zlib.crc32(f"{request_id}@{position}".encode()) % span

    return sample


async def serve(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    tokenizer = load_tokenizer(model.path)
    vocab_size = tokenizer.vocab_size
    eos_token_ids = tokenizer.eos_token_ids or (2,)
    defaults = SchedulerConfig()
    config = argparse.Namespace(host=args.grpc_host, port=args.grpc_port, api_key=None, tls_cert_file=None,
                                tls_key_file=None, max_message_bytes=defaults.max_message_bytes)
    num_kv_blocks = args.max_num_seqs * -(-args.max_model_len // BLOCK_SIZE) + 64  # every row at full length
    scheduler = Scheduler(SchedulerLimits(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len),
                          BlockManager(block_size=BLOCK_SIZE, num_gpu_blocks=num_kv_blocks, num_cpu_blocks=0),
                          max_steps_in_flight=defaults.max_steps_in_flight)
    link = InstantWorkerLink(token_sampler(vocab_size), step_s=args.step_ms / 1e3)
    engine = Engine(scheduler, link, tokenizer, eos_token_ids, seed=0,
                    max_messages_per_step=args.stream_messages_per_step)
    servicer = GenerationServicer(tokenizer)
    server, address = public_grpc_server(config)
    add_generation_service(servicer, server, config.max_message_bytes)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await server.start()
    limits = ServingLimits(args.max_model_len, vocab_size, num_kv_blocks * BLOCK_SIZE)
    servicer.start_serving(engine, ServedModel(model.name, limits, BLOCK_SIZE, num_kv_blocks, 0, eos_token_ids,
                                               defaults.max_queued_requests))
    gc.freeze()
    running = asyncio.ensure_future(engine.run())
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"instant engine on {address}: step {args.step_ms} ms, {args.max_num_seqs} rows", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await asyncio.wait([running, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    engine.abort_all()
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    await server.stop(grace=0.5)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory whose tokenizer is served (default: embedded)")
    parser.add_argument("--grpc-host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--step-ms", type=float, default=7.0, help="the stand-in device's time per step (0: none)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--stream-messages-per-step", type=int,
                        default=SchedulerConfig().stream_messages_per_step)
    args = parser.parse_args(argv)
    start_service_process("instant engine", exit_with_parent=False)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
