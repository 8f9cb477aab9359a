"""The scheduler service's one configuration, parsed from its command line in one place.

Frozen: every component receives the same immutable object at start-up, so no setting can drift at run time
and no other module reads the environment (only the API key may come from it: api_key_from). `pagedserve
serve` builds this command line for its child process from its own flags (see pagedserve/launcher.py), and
docker compose passes the same flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from scheduler_svc.api.grammar_limits import GrammarLimits
from scheduler_svc.text.chat_template_source import chat_template_text
from service_runtime.api_key_source import API_KEY_ENV, VLLM_API_KEY_ENV, api_key_from
from service_runtime.worker_link_flags import DEFAULT_WORKER_ADDRESS, add_heartbeat_argument


# The step token budget (vLLM's max_num_batched_tokens) when none is given. A step is the unit an abort waits
# for and a new request's first token queues behind, so on the CPU it is sized in time: one step of the
# embedded SmolLM2-135M at 128 prompt tokens measured 0.19 s on 2 cores at the start of a prompt and 0.63 s at
# position 2,000 (README, "Reliability"); at 2048 tokens, 13 s and more. `pagedserve serve --device cpu` takes
# the CPU one; the scheduler alone cannot know its workers' device and takes the GPU one.
GPU_MAX_NUM_BATCHED_TOKENS = 2048
CPU_MAX_NUM_BATCHED_TOKENS = 128


@dataclass(frozen=True)
class SchedulerConfig:
    model: str | None
    host: str = "127.0.0.1"
    port: int = 50051
    # ZeroMQ address the scheduler binds; workers connect to it.
    worker_address: str = DEFAULT_WORKER_ADDRESS
    num_workers: int = 1
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = GPU_MAX_NUM_BATCHED_TOKENS
    # None: the model's own context limit.
    max_model_len: int | None = None
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Append every StepPlan to this file (see plan_log.py); None: no log.
    plan_log: str | None = None
    # How long to wait for every worker to connect and report its KV pool.
    worker_ready_timeout: float = 600.0
    # Seconds in-flight requests get to finish on SIGTERM before they are aborted.
    shutdown_timeout: float = 30.0
    # Plan step N+1 while the worker runs step N (see scheduler.py); off: plan, wait, apply, plan.
    async_scheduling: bool = True
    # With async scheduling: how many planned steps may wait for their results (2: one step ahead of the
    # worker's results; 3, the default, absorbs the scheduler's jitter: measured 12% more W1 throughput).
    max_steps_in_flight: int = 3
    # Beyond this many streams, each stream's tokens are handed to gRPC every k-th step (stream_pacing.py).
    # 16: W1 at 256 streams on an H200 kept the device 99% busy in steady decode, against 88-92% with 64.
    stream_messages_per_step: int = 16
    # Seconds between heartbeats to the workers; a worker silent for 3 of its intervals is dead.
    heartbeat_interval: float = 2.0
    # A worker silent past 3 intervals is only reported; dead once silent this long (or at once when its
    # connection closes): worker_io/worker_health.py says why.
    heartbeat_grace: float = 30.0
    # Worker crash recovery: how many times lost workers are replaced (their supervisor restarts them, the
    # scheduler waits for them) with every request in flight resuming by recompute; 0: a lost worker fails
    # everything and the scheduler exits 1.
    max_worker_restarts: int = 3
    # Admission and size limits (see request_limits.py): refused requests get RESOURCE_EXHAUSTED (queue full)
    # or INVALID_ARGUMENT (over a size limit) before any token.
    max_queued_requests: int = 1024
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    max_n: int = 64
    max_tokens_limit: int | None = None
    max_stop_strings: int = 32
    max_stop_string_length: int = 1024
    max_logprobs: int = 20
    max_message_bytes: int = 4 * 1024 * 1024
    # vLLM's --structured-outputs-config disable_any_whitespace: JSON constraints without free whitespace
    # for every request (a request's own disable_any_whitespace true applies either way).
    structured_outputs_disable_any_whitespace: bool = False
    # What one grammar may cost (grammar_limits.py says why and gives the defaults); set with
    # --structured-outputs-config keys of the same names.
    grammar_limits: GrammarLimits = GrammarLimits()
    # Access (see access.py): a key every RPC but health must carry; TLS when both files are given.
    api_key: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # A tokenizer directory, .gguf file or hub id other than the model's (vLLM's --tokenizer); None: the model's.
    tokenizer: str | None = None
    # The text of the template that replaces the tokenizer's chat template (--chat-template: a file or the
    # template itself, read when the flags are parsed); None: the tokenizer's.
    chat_template: str | None = None
    # Where unset sampling fields take their defaults from (generation_defaults.py): "auto" (the model's
    # generation_config.json), "vllm" (vLLM's built-in defaults), or a directory holding a generation_config.json.
    generation_config: str = "auto"
    # vLLM's --override-generation-config: generation_config.json keys set over the file's (read-only).
    override_generation_config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # Seeds the source of the per-request seeds of requests that carry none (engine.py), so that the same
    # requests in the same order sample the same tokens after a restart. vLLM V1's default is 0 too.
    seed: int = 0


def structured_outputs_config(text: str) -> dict:
    """--structured-outputs-config's value: vLLM's JSON object; the keys llguidance serves, else an argparse error."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    known = ("backend", "disable_any_whitespace", *(limit.name for limit in dataclasses.fields(GrammarLimits)))
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(f"unsupported key(s) {', '.join(unknown)} ({', '.join(known)})")
    if options.get("backend", "auto") not in ("auto", "guidance", "llguidance"):
        raise argparse.ArgumentTypeError("backend: the engine is llguidance (auto, guidance or llguidance)")
    if not isinstance(options.get("disable_any_whitespace", False), bool):
        raise argparse.ArgumentTypeError("disable_any_whitespace must be true or false")
    GrammarLimits.from_options(options)  # refuses a bad limit here, naming it
    return options


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    """Scheduler flags, shared by `pagedserve scheduler` and `pagedserve serve`."""
    parser.add_argument("--model", default=None, help="model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory, .gguf file or hub id to use instead of the model's")
    parser.add_argument("--chat-template", default=None,
                        help="chat template replacing the tokenizer's: a Jinja file path or the template itself")
    parser.add_argument("--generation-config", default="auto",
                        help="defaults of unset sampling fields: auto (the model's generation_config.json), vllm "
                             "(vLLM's defaults), or a directory with a generation_config.json")
    parser.add_argument("--override-generation-config", type=_json_object, default=None,
                        help='generation_config.json values set over the model\'s, as JSON: \'{"temperature": 0.5}\'')
    parser.add_argument("--seed", type=_seed, default=0,
                        help="seeds the seeds of requests that give none: the same requests in the same order "
                             "sample the same tokens after a restart")
    parser.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64, 128))
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help=f"most tokens in one step (default {GPU_MAX_NUM_BATCHED_TOKENS}; `pagedserve serve "
                             f"--device cpu`: {CPU_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    parser.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="drain time on SIGTERM")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV blocks of earlier requests' common prefixes (default: on)")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="the same as --no-enable-prefix-caching")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="split long prompts over steps (default: on; off needs --max-num-batched-tokens >= "
                             "max model len)")
    parser.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                        help="the same as --no-enable-chunked-prefill")
    parser.add_argument("--plan-log", default=None, help="append every step plan to this file (replay, tests)")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="wait for each step's result before planning the next (default: plan step N+1 "
                             "while the worker runs step N)")
    parser.add_argument("--max-steps-in-flight", type=int, default=3,
                        help="with async scheduling: planned steps whose results are not back yet (2: plan one "
                             "step ahead; 3 absorbs the scheduler's jitter, at up to one more wasted token per stop)")
    parser.add_argument("--stream-messages-per-step", type=int, default=16,
                        help="streams given new tokens per step; with more streams each one gets a few tokens "
                             "per message every few steps (the event loop also runs the engine)")
    parser.add_argument("--max-queued-requests", type=int, default=1024,
                        help="most requests waiting for a first step; more are refused with RESOURCE_EXHAUSTED")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest prompt (default: max model len - 1)")
    parser.add_argument("--max-n", type=int, default=64, help="largest n, best_of and beam_width")
    parser.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens (default: any)")
    parser.add_argument("--max-stop-strings", type=int, default=32, help="most stop strings in one request")
    parser.add_argument("--max-stop-string-length", type=int, default=1024, help="longest stop string (characters)")
    parser.add_argument("--max-logprobs", type=int, default=20, help="most logprobs one request may ask for")
    parser.add_argument("--max-message-bytes", type=int, default=4 * 1024 * 1024,
                        help="largest gRPC request message; larger ones get INVALID_ARGUMENT (beyond twice it, "
                             "gRPC's own RESOURCE_EXHAUSTED)")
    parser.add_argument("--structured-outputs-config", type=structured_outputs_config, default={},
                        help="vLLM's JSON options of the constraint engine: {\"backend\": \"auto\"|\"guidance\"|"
                             "\"llguidance\", \"disable_any_whitespace\": true|false} (the engine is llguidance); "
                             "pagedserve's grammar limits too: max_repetition, max_grammar_size, max_items_in_row, "
                             "initial_lexer_fuel, step_lexer_fuel, step_max_items, max_lexer_states, "
                             "grammar_compile_timeout_s (scheduler_svc/api/grammar_limits.py)")
    parser.add_argument("--tls-cert-file", default=None, help="PEM certificate chain: serve gRPC over TLS")
    parser.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    add_heartbeat_argument(parser)
    parser.add_argument("--max-worker-restarts", type=int, default=3,
                        help="times a lost worker is replaced (restarted by `serve`, or by its container's restart "
                             "policy) while every request in flight waits and resumes by recompute; 0: a lost "
                             "worker ends every request and the server exits 1")
    parser.add_argument("--heartbeat-grace", type=float, default=30.0,
                        help="seconds of silence after which a worker that missed its heartbeats counts as dead "
                             "(a closed connection counts at once); shorter silences are only logged")


def _seed(value: str) -> int:
    """--seed's type: refused by argparse, naming the flag, in `serve` before any child starts."""
    seed = int(value)
    if not 0 <= seed < 2**63:
        raise argparse.ArgumentTypeError("must lie in [0, 2**63)")
    return seed


def _json_object(value: str) -> dict[str, Any]:
    """--override-generation-config's type: a JSON object, refused by argparse otherwise."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return parsed


def add_grpc_listen_arguments(parser: argparse.ArgumentParser) -> None:
    """Where `pagedserve scheduler` listens: `--grpc-host`/`--grpc-port`, as `pagedserve serve` names them
    (whose --host/--port are the HTTP server's, as vLLM's), or the older `--host`/`--port`."""
    parser.add_argument("--grpc-host", "--host", dest="host", default="127.0.0.1", help="gRPC bind address")
    parser.add_argument("--grpc-port", "--port", dest="port", type=int, default=50051, help="gRPC port")


def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    """`--api-key` of `pagedserve scheduler` (`pagedserve serve` has its own, which guards gRPC and HTTP)."""
    parser.add_argument("--api-key", default=None,
                        help="require `authorization: Bearer KEY` (or `x-api-key: KEY`) metadata on every RPC "
                             f"but health (default: ${API_KEY_ENV}, else ${VLLM_API_KEY_ENV})")


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = GPU_MAX_NUM_BATCHED_TOKENS
    for flag in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise SystemExit("--max-model-len must be at least 2")
    if args.heartbeat_interval <= 0:
        raise SystemExit("--heartbeat-interval must be > 0")
    if args.max_worker_restarts < 0:
        raise SystemExit("--max-worker-restarts must be >= 0")
    if args.heartbeat_grace < 0:
        raise SystemExit("--heartbeat-grace must be >= 0")
    for flag in ("max_steps_in_flight", "stream_messages_per_step", "max_queued_requests", "max_prompt_tokens", "max_n", "max_tokens_limit", "max_stop_string_length",
                 "max_message_bytes"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("max_stop_strings", "max_logprobs"):
        if getattr(args, flag) < 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 0")
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        raise SystemExit("--tls-cert-file and --tls-key-file go together")
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(args.generation_config):
        raise SystemExit(f"--generation-config: {args.generation_config!r} is not auto, vllm or a directory")
    try:
        chat_template = None if args.chat_template is None else chat_template_text(args.chat_template)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    return SchedulerConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        worker_address=args.worker_address,
        num_workers=getattr(args, "num_workers", 1),
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        preemption_mode=args.preemption_mode,
        shutdown_timeout=args.shutdown_timeout,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        plan_log=args.plan_log,
        async_scheduling=args.async_scheduling,
        stream_messages_per_step=args.stream_messages_per_step,
        max_steps_in_flight=args.max_steps_in_flight,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_grace=args.heartbeat_grace,
        max_worker_restarts=args.max_worker_restarts,
        max_queued_requests=args.max_queued_requests,
        max_prompt_tokens=args.max_prompt_tokens,
        max_n=args.max_n,
        max_tokens_limit=args.max_tokens_limit,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_length=args.max_stop_string_length,
        max_logprobs=args.max_logprobs,
        max_message_bytes=args.max_message_bytes,
        structured_outputs_disable_any_whitespace=bool(
            args.structured_outputs_config.get("disable_any_whitespace", False)),
        grammar_limits=GrammarLimits.from_options(args.structured_outputs_config),
        api_key=api_key_from(getattr(args, "api_key", None), os.environ),
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        tokenizer=args.tokenizer,
        chat_template=chat_template,
        generation_config=args.generation_config,
        override_generation_config=MappingProxyType(args.override_generation_config or {}),
        seed=args.seed,
    )
