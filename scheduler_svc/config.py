"""The scheduler service's one configuration (frozen). Each field declares its own flag (service_runtime/
config_flags.py): `pagedserve scheduler` parses them all, `pagedserve serve` takes the shared ones and
forwards them to its scheduler from this declaration (see pagedserve/launcher.py); docker compose passes the
same flags.

Frozen: every component receives the same immutable object at start-up, so no setting can drift at run time
and no other module reads the environment (only the API key may come from it: api_key_from).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from scheduler_svc.api.grammar_limits import GrammarLimits
from scheduler_svc.core.json_flag import json_object_flag
from scheduler_svc.core.speculative_config import SpeculativeConfig, speculative_config
from scheduler_svc.text.chat_template_source import chat_template_text
from service_runtime.api_key_source import API_KEY_ENV, VLLM_API_KEY_ENV, api_key_from
from service_runtime.config_flags import add_config_arguments, flag, flag_values, shared_flag_field
from service_runtime.lora_modules import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoraModule, lora_module
from service_runtime.worker_link_flags import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_WORKER_ADDRESS, HEARTBEAT_INTERVAL


# The step token budget (vLLM's max_num_batched_tokens) when none is given. A step is the unit an abort waits
# for and a new request's first token queues behind, so on the CPU it is sized in time: 128 prompt tokens of the
# embedded model keep a step under a second on 2 cores even deep into a long prompt, 2048 take many seconds
# (docs/benchmarks.md has the figures). `pagedserve serve --device cpu` takes
# the CPU one; the scheduler alone cannot know its workers' device and takes the GPU one.
GPU_MAX_NUM_BATCHED_TOKENS = 2048
CPU_MAX_NUM_BATCHED_TOKENS = 128


def structured_outputs_config(text: str) -> dict:
    """--structured-outputs-config's value: vLLM's JSON object; the keys llguidance serves, else an argparse error."""
    options = json_object_flag(text)
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


def _json_text(options: Mapping[str, Any]) -> str:
    """How a JSON-object flag's value is written on a child's command line."""
    return json.dumps(dict(options))


def _lora_module(value: str) -> LoraModule:
    """--lora-modules' type: `name=path` or vLLM's JSON object, refused by argparse otherwise."""
    try:
        return lora_module(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _no_options() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class SchedulerConfig:
    model: str | None = flag("--model", default=None,
                             help="model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    # Where `pagedserve scheduler` listens: `--grpc-host`/`--grpc-port`, as `pagedserve serve` names them (whose
    # --host/--port are the HTTP server's, as vLLM's), or the older `--host`/`--port`.
    host: str = flag("--grpc-host", "--host", default="127.0.0.1", help="gRPC bind address", shared=False)
    port: int = flag("--grpc-port", "--port", default=50051, help="gRPC port", shared=False)
    # ZeroMQ address the scheduler binds; workers connect to it. `serve` picks a private one.
    worker_address: str = flag("--worker-address", default=DEFAULT_WORKER_ADDRESS, help="ZeroMQ address to bind",
                               shared=False)
    # `serve` gives its --tensor-parallel-size.
    num_workers: int = flag("--num-workers", default=1, help="worker ranks to wait for", shared=False)
    # A tokenizer directory, .gguf file or hub id other than the model's (vLLM's --tokenizer); None: the model's.
    tokenizer: str | None = flag("--tokenizer", default=None,
                                 help="tokenizer directory, .gguf file or hub id to use instead of the model's")
    # The text of the template that replaces the tokenizer's chat template (--chat-template: a file or the
    # template itself, read when the flags are parsed); None: the tokenizer's.
    chat_template: str | None = flag(
        "--chat-template", default=None,
        help="chat template replacing the tokenizer's: a Jinja file path or the template itself")
    # Where unset sampling fields take their defaults from (generation_defaults.py): "auto" (the model's
    # generation_config.json), "vllm" (vLLM's built-in defaults), or a directory holding a generation_config.json.
    generation_config: str = flag("--generation-config", default="auto",
                                  help="defaults of unset sampling fields: auto (the model's generation_config.json), "
                                       "vllm (vLLM's defaults), or a directory with a generation_config.json")
    # vLLM's --override-generation-config: generation_config.json keys set over the file's (read-only).
    override_generation_config: Mapping[str, Any] = flag(
        "--override-generation-config", default_factory=_no_options, parse=_json_object, parsed_default=None,
        show=_json_text,
        help='generation_config.json values set over the model\'s, as JSON: \'{"temperature": 0.5}\'')
    # Seeds the source of the per-request seeds of requests that carry none (engine.py), so that the same
    # requests in the same order sample the same tokens after a restart. vLLM V1's default is 0 too.
    seed: int = flag("--seed", default=0, parse=_seed,
                     help="seeds the seeds of requests that give none: the same requests in the same order "
                          "sample the same tokens after a restart")
    block_size: int = flag("--block-size", default=16, choices=(8, 16, 32, 64, 128))
    max_num_seqs: int = flag("--max-num-seqs", default=256, help="most requests in one step")
    # `serve` gives the device's default when the flag is not given (parsed as None).
    max_num_batched_tokens: int = flag(
        "--max-num-batched-tokens", default=GPU_MAX_NUM_BATCHED_TOKENS, parsed_default=None,
        help=f"most tokens in one step (default {GPU_MAX_NUM_BATCHED_TOKENS}; `pagedserve serve --device cpu`: "
             f"{CPU_MAX_NUM_BATCHED_TOKENS})")
    # None: the model's own context limit.
    max_model_len: int | None = flag("--max-model-len", default=None, help="context limit (default: the model's)")
    preemption_mode: str = flag("--preemption-mode", default="recompute", choices=("recompute", "swap"))
    # Seconds in-flight requests get to finish on SIGTERM before they are aborted.
    shutdown_timeout: float = flag("--shutdown-timeout", default=30.0, help="drain time on SIGTERM")
    enable_prefix_caching: bool = flag(
        "--enable-prefix-caching", default=True, switch="both",
        help="reuse the KV blocks of earlier requests' common prefixes (default: on)",
        negations=("--no-prefix-caching",), negation_help="the same as --no-enable-prefix-caching")
    enable_chunked_prefill: bool = flag(
        "--enable-chunked-prefill", default=True, switch="both",
        help="split long prompts over steps (default: on; off needs --max-num-batched-tokens >= max model len)",
        negations=("--no-chunked-prefill",), negation_help="the same as --no-enable-chunked-prefill")
    # Append every StepPlan to this file (see plan_log.py); None: no log.
    plan_log: str | None = flag("--plan-log", default=None,
                                help="append every step plan to this file (replay, tests)")
    # Plan step N+1 while the worker runs step N (see scheduler.py); off: plan, wait, apply, plan.
    async_scheduling: bool = flag("--no-async-scheduling", default=True, switch="off",
                                  help="wait for each step's result before planning the next (default: plan step "
                                       "N+1 while the worker runs step N)")
    # With async scheduling: how many planned steps may wait for their results (2: one step ahead of the
    # worker's results; 3, the default, absorbs the scheduler's jitter: more W1 throughput, docs/benchmarks.md).
    max_steps_in_flight: int = flag("--max-steps-in-flight", default=3,
                                    help="with async scheduling: planned steps whose results are not back yet (2: "
                                         "plan one step ahead; 3 absorbs the scheduler's jitter, at up to one more "
                                         "wasted token per stop)")
    # Beyond this many streams, each stream's tokens are handed to gRPC every k-th step (stream_pacing.py).
    # 16 keeps the device busier in steady decode at W1's 256 streams than 64 does (docs/benchmarks.md).
    stream_messages_per_step: int = flag("--stream-messages-per-step", default=16,
                                         help="streams given new tokens per step; with more streams each one gets a "
                                              "few tokens per message every few steps (the event loop also runs the "
                                              "engine)")
    # Admission and size limits (see request_limits.py): refused requests get RESOURCE_EXHAUSTED (queue full)
    # or INVALID_ARGUMENT (over a size limit) before any token.
    max_queued_requests: int = flag("--max-queued-requests", default=1024,
                                    help="most requests waiting for a first step; more are refused with "
                                         "RESOURCE_EXHAUSTED")
    max_prompt_tokens: int | None = flag("--max-prompt-tokens", default=None,
                                         help="longest prompt (default: max model len - 1)")
    max_n: int = flag("--max-n", default=64, help="largest n, best_of and beam_width")
    max_tokens_limit: int | None = flag("--max-tokens-limit", default=None, help="largest max_tokens (default: any)")
    max_stop_strings: int = flag("--max-stop-strings", default=32, help="most stop strings in one request")
    max_stop_string_length: int = flag("--max-stop-string-length", default=1024,
                                       help="longest stop string (characters)")
    max_logprobs: int = flag("--max-logprobs", default=20, help="most logprobs one request may ask for")
    max_message_bytes: int = flag("--max-message-bytes", default=4 * 1024 * 1024,
                                  help="largest gRPC request message; larger ones get INVALID_ARGUMENT (beyond "
                                       "twice it, gRPC's own RESOURCE_EXHAUSTED)")
    # vLLM's JSON options of the constraint engine (the properties below read them): disable_any_whitespace,
    # and what one grammar may cost (grammar_limits.py says why and gives the defaults).
    structured_outputs_config: Mapping[str, Any] = flag(
        "--structured-outputs-config", default_factory=_no_options, parse=structured_outputs_config,
        show=_json_text,
        help="vLLM's JSON options of the constraint engine: {\"backend\": \"auto\"|\"guidance\"|\"llguidance\", "
             "\"disable_any_whitespace\": true|false} (the engine is llguidance); pagedserve's grammar limits too: "
             "max_repetition, max_grammar_size, max_items_in_row, initial_lexer_fuel, step_lexer_fuel, "
             "step_max_items, max_lexer_states, grammar_compile_timeout_s (scheduler_svc/api/grammar_limits.py)")
    # vLLM's speculative decoding options (core/speculative_config.py); None: off. N-gram proposals, or a draft
    # model's or an EAGLE-3 or EAGLE-1 head's (which the workers load: WorkerSetup.draft_model).
    speculative_config: SpeculativeConfig | None = flag(
        "--speculative-config", default=None, parse=speculative_config, show=SpeculativeConfig.to_json,
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 3, '
             '"prompt_lookup_max": 5, "prompt_lookup_min": 5, "disable_by_batch_size": 8}, or {"method": '
             '"draft_model", "eagle3" or "eagle", "model": DIR, "num_speculative_tokens": 3} '
             '(docs/speculative_decoding.md)')
    # Multi-LoRA (docs/lora.md), vLLM's flags: the adapters served from the start (a request names one by
    # `lora_name`), the workers' GPU slots (--max-loras: also the most distinct adapters in one step), the rank
    # they are padded to, the adapters each worker keeps in host memory; and whether adapters may be loaded and
    # unloaded while serving (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING environment variable, as a flag).
    enable_lora: bool = flag("--enable-lora", default=False, switch="on",
                             help="serve LoRA adapters (--lora-modules) beside the base model (docs/lora.md)")
    lora_modules: tuple[LoraModule, ...] = flag(
        "--lora-modules", default=(), parse=_lora_module, show=LoraModule.to_flag, nargs="+",
        metavar="NAME=PATH",
        help='PEFT LoRA adapters to serve: name=path, or vLLM\'s JSON {"name": ..., "path": ..., '
             '"base_model_name": ...}; requests select one by name (the OpenAI `model` field)')
    max_loras: int = flag("--max-loras", default=DEFAULT_MAX_LORAS,
                          help="LoRA adapters held on the GPU at once (slots, least recently used evicted), so the "
                               "most distinct adapters in one step; requests of other adapters wait, first come "
                               "first served")
    max_lora_rank: int = flag("--max-lora-rank", default=DEFAULT_MAX_LORA_RANK,
                              help="largest adapter rank served (every adapter is padded to it); a larger one is "
                                   "refused at start")
    max_cpu_loras: int | None = flag("--max-cpu-loras", default=None,
                                     help="LoRA adapters each worker keeps in host memory (least recently used "
                                          "dropped), so a slot reloads them without the disk (default and "
                                          "minimum: --max-loras)")
    allow_runtime_lora_updating: bool = flag(
        "--allow-runtime-lora-updating", default=False, switch="on",
        help="allow loading and unloading LoRA adapters while serving (/v1/load_lora_adapter, "
             "/v1/unload_lora_adapter); replaces vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
    # Access (see access.py): a key every RPC but health must carry (never on a command line `serve` builds: it
    # goes in the child's environment); TLS when both files are given.
    api_key: str | None = flag("--api-key", default=None, shared=False, forwarded=False,
                               help="require `authorization: Bearer KEY` (or `x-api-key: KEY`) metadata on every "
                                    f"RPC but health (default: ${API_KEY_ENV}, else ${VLLM_API_KEY_ENV})")
    tls_cert_file: str | None = flag("--tls-cert-file", default=None,
                                     help="PEM certificate chain: serve gRPC over TLS")
    tls_key_file: str | None = flag("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    # Seconds between heartbeats to the workers; a worker silent for 3 of its intervals is dead.
    heartbeat_interval: float = shared_flag_field(DEFAULT_HEARTBEAT_INTERVAL, HEARTBEAT_INTERVAL)
    # Worker crash recovery: how many times lost workers are replaced (their supervisor restarts them, the
    # scheduler waits for them) with every request in flight resuming by recompute; 0: a lost worker fails
    # everything and the scheduler exits 1.
    max_worker_restarts: int = flag("--max-worker-restarts", default=3,
                                    help="times a lost worker is replaced (restarted by `serve`, or by its "
                                         "container's restart policy) while every request in flight waits and "
                                         "resumes by recompute; 0: a lost worker ends every request and the server "
                                         "exits 1")
    # A worker silent past 3 intervals is only reported; dead once silent this long (or at once when its
    # connection closes): worker_io/worker_health.py says why.
    heartbeat_grace: float = flag("--heartbeat-grace", default=30.0,
                                  help="seconds of silence after which a worker that missed its heartbeats counts as "
                                       "dead (a closed connection counts at once); shorter silences are only logged")
    # How long to wait for every worker to connect and report its KV pool (and for replacements of lost ones).
    worker_ready_timeout: float = flag("--worker-ready-timeout", default=600.0, shared=False,
                                       help="seconds to wait for every worker to connect and report its KV pool, "
                                            "and for the replacements of lost ones")

    def __post_init__(self) -> None:
        """The checks that span fields, as usage errors naming the flags."""
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise SystemExit("--max-model-len must be at least 2")
        if self.heartbeat_interval <= 0:
            raise SystemExit("--heartbeat-interval must be > 0")
        if self.max_worker_restarts < 0:
            raise SystemExit("--max-worker-restarts must be >= 0")
        if self.heartbeat_grace < 0:
            raise SystemExit("--heartbeat-grace must be >= 0")
        for name in ("max_steps_in_flight", "stream_messages_per_step", "max_queued_requests", "max_prompt_tokens",
                     "max_n", "max_tokens_limit", "max_stop_string_length", "max_message_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("max_stop_strings", "max_logprobs"):
            if getattr(self, name) < 0:
                raise SystemExit(f"--{name.replace('_', '-')} must be at least 0")
        if self.speculative_config is not None:
            refusal = self.speculative_config.tensor_parallel_refusal(self.num_workers)
            if refusal is not None:
                raise SystemExit(f"--speculative-config: {refusal}")
        refusal = self.lora_refusal()
        if refusal is not None:
            raise SystemExit(refusal)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise SystemExit("--tls-cert-file and --tls-key-file go together")

    def lora_refusal(self, *, with_speculation: bool = False) -> str | None:
        """Why the LoRA flags cannot go together (lora_flags_refusal), or None. `with_speculation`: also refuse
        --enable-lora beside --speculative-config, which the scheduler's start checks (the config itself may hold
        both: the flag tests set every field at once)."""
        return lora_flags_refusal(self.enable_lora, self.lora_modules, self.max_loras, self.max_lora_rank,
                                  self.max_cpu_loras, with_speculation and self.speculative_config is not None,
                                  self.allow_runtime_lora_updating)

    @property
    def structured_outputs_disable_any_whitespace(self) -> bool:
        """vLLM's disable_any_whitespace: JSON constraints without free whitespace for every request (a
        request's own disable_any_whitespace true applies either way)."""
        return bool(self.structured_outputs_config.get("disable_any_whitespace", False))

    @property
    def grammar_limits(self) -> GrammarLimits:
        """What one grammar may cost, from --structured-outputs-config keys of the same names."""
        return GrammarLimits.from_options(self.structured_outputs_config)


def lora_flags_refusal(enable_lora: bool, lora_modules: tuple[LoraModule, ...], max_loras: int, max_lora_rank: int,
                       max_cpu_loras: int | None, speculative: bool, allow_runtime_lora_updating: bool = False,
                       ) -> str | None:
    """Why the LoRA flags cannot go together, or None (`serve` asks before any child starts; the adapters
    themselves are read by the launcher and the workers: service_runtime/lora_modules.py)."""
    given = [name for name, value, default in (
        ("--lora-modules", tuple(lora_modules), ()), ("--max-loras", max_loras, DEFAULT_MAX_LORAS),
        ("--max-lora-rank", max_lora_rank, DEFAULT_MAX_LORA_RANK), ("--max-cpu-loras", max_cpu_loras, None),
        ("--allow-runtime-lora-updating", allow_runtime_lora_updating, False))
        if value != default]
    if not enable_lora:
        return f"{', '.join(given)}: LoRA flags need --enable-lora" if given else None
    if speculative:
        return "--enable-lora cannot go with --speculative-config (docs/lora.md)"
    if max_loras < 1 or max_lora_rank < 1:
        return "--max-loras and --max-lora-rank must be at least 1"
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        return f"--max-cpu-loras ({max_cpu_loras}) must be at least --max-loras ({max_loras})"
    names = [module.name for module in lora_modules]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        return f"--lora-modules: {', '.join(twice)} given more than once"
    return None


def add_scheduler_arguments(parser: argparse.ArgumentParser, *, shared_only: bool = True) -> None:
    """Scheduler flags: those `pagedserve serve` shares (the default), or all of them (`pagedserve scheduler`)."""
    add_config_arguments(parser, SchedulerConfig, shared_only=shared_only)


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    """The config of parsed scheduler flags: the step budget's default, the API key (flag, else the
    environment) and the chat template's text resolved; a generation config that is not auto, vllm or a
    directory refused."""
    values = flag_values(SchedulerConfig, args)
    if values["max_num_batched_tokens"] is None:
        values["max_num_batched_tokens"] = GPU_MAX_NUM_BATCHED_TOKENS
    if values["generation_config"] not in ("auto", "vllm") and not os.path.isdir(values["generation_config"]):
        raise SystemExit(f"--generation-config: {values['generation_config']!r} is not auto, vllm or a directory")
    try:
        if values["chat_template"] is not None:
            values["chat_template"] = chat_template_text(values["chat_template"])
    except ValueError as error:
        raise SystemExit(str(error)) from None
    values["api_key"] = api_key_from(values["api_key"], os.environ)
    values["override_generation_config"] = MappingProxyType(dict(values["override_generation_config"] or {}))
    values["structured_outputs_config"] = MappingProxyType(dict(values["structured_outputs_config"]))
    values["lora_modules"] = tuple(values["lora_modules"] or ())
    return SchedulerConfig(**values)
