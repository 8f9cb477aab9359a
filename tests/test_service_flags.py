"""Each service's flags are declared once, on its config's fields (service_runtime/config_flags.py), and every
place derived from that declaration agrees with it: the service's own parser, its defaults, the argv a
launcher writes for it, and what `pagedserve serve` forwards to its children. Argv only: no server.

Each service has an example config that sets every field away from its default; a new field left out of the
example, a field without a flag, a flag without a field, or a shared flag the launcher drops fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from types import MappingProxyType

import pytest

from gateway import main as gateway_main
from gateway.config import GatewayConfig, gateway_config_from_args
from pagedserve.cli import parse_args
from pagedserve.engine_replicas import engine_replicas, front_argv
from pagedserve.launcher import _gateway_argv, _scheduler_argv, worker_rank_argvs
from scheduler_svc import main as scheduler_main
from scheduler_svc.config import SchedulerConfig, scheduler_config_from_args
from scheduler_svc.core.speculative_config import SpeculativeConfig
from scheduler_svc.data_parallel import main as front_main
from scheduler_svc.data_parallel.config import FrontConfig, front_config_from_args
from service_runtime.config_flags import add_config_arguments, config_argv, flag, flag_of, flagged_fields
from service_runtime.lora_modules import LoraModule
from worker_svc import main as worker_main
from worker_svc.config import WorkerConfig, worker_config_from_args


@pytest.fixture(autouse=True)
def no_environment_defaults(monkeypatch):
    """Parsed defaults here are the declared ones: the variables that flags take defaults from are unset (the
    test suite sets VLLM_CPU_OMP_THREADS_BIND for its own servers, tests/conftest.py)."""
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(name, raising=False)


KEY_VARIABLES = ("PAGEDSERVE_API_KEY", "VLLM_API_KEY", "PAGEDSERVE_GRPC_API_KEY", "VLLM_BATCH_INVARIANT")

EXAMPLES = {
    WorkerConfig: WorkerConfig(
        model="some/model", scheduler_address="ipc://workers", device="cuda:1", dtype="float16", kv_cache_dtype="fp8",
        num_kv_blocks=64,
        gpu_memory_utilization=0.5, cpu_kv_cache_space=2.0, swap_space=1.0, load_format="dummy",
        attention_backend="torch", cuda_graphs=False, custom_all_reduce=False, batch_invariant=True,
        quantization="fp8", fail_at_step=7, crash_on_token_id=42, crash_at_output_token=3,
        prefill_seconds_per_token=0.01, cpu_omp_threads_bind="0-1|2-3", cpu_num_reserved_cpu=2, rank=1,
        world_size=2, distributed_init_method="tcp://127.0.0.1:29500", heartbeat_interval=0.5),
    SchedulerConfig: SchedulerConfig(
        model="some/model", host="0.0.0.0", port=6000, worker_address="ipc://workers", num_workers=2,
        tokenizer="tok/dir", chat_template="{{ messages }}", generation_config="vllm",
        override_generation_config=MappingProxyType({"temperature": 0.5}), seed=7, block_size=32, max_num_seqs=8,
        max_num_batched_tokens=512, max_model_len=1024, preemption_mode="swap", shutdown_timeout=5.0,
        enable_prefix_caching=False, enable_chunked_prefill=False, plan_log="/tmp/plans", async_scheduling=False,
        max_steps_in_flight=2, stream_messages_per_step=4, max_queued_requests=10, max_prompt_tokens=100,
        max_n=4, max_tokens_limit=50, max_stop_strings=3, max_stop_string_length=10, max_logprobs=5,
        max_message_bytes=1000, structured_outputs_config=MappingProxyType({"disable_any_whitespace": True,
                                                                           "max_repetition": 50}),
        api_key="the-key", tls_cert_file="cert.pem", tls_key_file="key.pem", heartbeat_interval=0.5,
        max_worker_restarts=1, heartbeat_grace=5.0, worker_ready_timeout=60.0,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2,
                                             disable_by_batch_size=4),
        enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4, allow_runtime_lora_updating=True,
        lora_modules=(LoraModule("a", "/adapters/a"), LoraModule("b=c", "/adapters/b", base_model_name="base"))),
    GatewayConfig: GatewayConfig(
        grpc_target="10.0.0.1:6000", host="0.0.0.0", port=9000, api_key="the-key", served_model_name="mine",
        uvicorn_log_level="warning", log_requests=False, max_request_body_bytes=1000, enable_auto_tool_choice=True,
        tool_call_parser="hermes", reasoning_parser="qwen3", retry_after_s=3, shutdown_timeout=5.0,
        resume_timeout=10.0, grpc_api_key="grpc-key", grpc_root_cert="cert.pem"),
    FrontConfig: FrontConfig(
        engine_targets=("127.0.0.1:7001", "127.0.0.1:7002"), router_policy="least-load", router_load_bound=3,
        api_server_count=2, api_server_rank=1,
        host="0.0.0.0", port=6000, model="some/model", tokenizer="tok/dir", chat_template="{{ messages }}",
        api_key="the-key", tls_cert_file="cert.pem", tls_key_file="key.pem", max_message_bytes=1000,
        shutdown_timeout=5.0),
}
SERVICES = {WorkerConfig: (worker_main.add_arguments, worker_config_from_args),
            SchedulerConfig: (scheduler_main.add_arguments, scheduler_config_from_args),
            GatewayConfig: (gateway_main.add_arguments, gateway_config_from_args),
            FrontConfig: (front_main.add_arguments, front_config_from_args)}


@pytest.fixture(autouse=True)
def no_key_variables(monkeypatch):
    """Keys and switches from the environment would stand in for flags that are never forwarded."""
    for name in KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def service_config(config_class, argv: list[str]):
    """What the service itself makes of `argv`: its own parser, then its config."""
    add_arguments, config_from_args = SERVICES[config_class]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def values_of(config) -> dict:
    return {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}


def without_flags(config_class) -> list[str]:
    return [field.name for field in dataclasses.fields(config_class) if flag_of(field) is None]


def parsed_without_fields(config_class) -> list[str]:
    """Destinations of the service's parser that are no field of its config (a flag added by hand)."""
    parser = argparse.ArgumentParser()
    SERVICES[config_class][0](parser)
    names = {field.name for field in dataclasses.fields(config_class)}
    return sorted({action.dest for action in parser._actions} - names - {"help"})


def never_forwarded(config_class) -> set[str]:
    return {field.name for field, declared in flagged_fields(config_class) if not declared.forwarded}


def shared(config_class) -> list[str]:
    return [field.name for field, _ in flagged_fields(config_class, shared_only=True)]


@pytest.mark.parametrize("config_class", list(SERVICES), ids=lambda cls: cls.__name__)
def test_every_field_has_a_flag_and_every_flag_a_field(config_class):
    assert without_flags(config_class) == []
    assert parsed_without_fields(config_class) == []


@pytest.mark.parametrize("config_class", list(SERVICES), ids=lambda cls: cls.__name__)
def test_parsing_no_flags_gives_the_declared_defaults(config_class):
    assert service_config(config_class, []) == config_class()


@pytest.mark.parametrize("config_class", list(SERVICES), ids=lambda cls: cls.__name__)
def test_the_example_sets_every_field_away_from_its_default(config_class):
    """Else the round trips below would not test the new field's forwarding."""
    default, example = values_of(config_class()), values_of(EXAMPLES[config_class])
    assert [name for name in default if default[name] == example[name]] == []


@pytest.mark.parametrize("config_class", list(SERVICES), ids=lambda cls: cls.__name__)
def test_a_config_written_as_argv_parses_back_into_the_same_config(config_class):
    example = EXAMPLES[config_class]
    argv = config_argv(config_class, values_of(example))
    assert all(str(getattr(example, name)) not in argv for name in never_forwarded(config_class))
    unforwarded = {name: getattr(config_class(), name) for name in never_forwarded(config_class)}
    assert service_config(config_class, argv) == dataclasses.replace(example, **unforwarded)


def test_hidden_flags_stay_out_of_help_but_parse_and_forward(capsys):
    hidden = ["--fail-at-step", "--crash-on-token-id", "--crash-at-output-token", "--prefill-seconds-per-token"]
    parser = argparse.ArgumentParser()
    worker_main.add_arguments(parser)
    assert not any(name in parser.format_help() for name in hidden)
    (argv,) = worker_rank_argvs(parse_args(["serve", "--fail-at-step", "7", "--crash-on-token-id", "42",
                                            "--crash-at-output-token", "3", "--prefill-seconds-per-token",
                                            "0.01"]), [], "ipc://x", None)
    assert all(name in argv for name in hidden)


# ---- what `pagedserve serve` forwards ------------------------------------------------------------------------

def serve_flags(config_class) -> list[str]:
    """The example's values of every flag `serve` shares, as flags given to `serve`."""
    example = values_of(EXAMPLES[config_class])
    return config_argv(config_class, {name: example[name] for name in shared(config_class)})


def launched(config_class, args: argparse.Namespace):
    """The config a child started by `serve` with `args` makes of the argv the launcher gives it."""
    model_argv = [] if args.model is None else ["--model", args.model]
    if config_class is WorkerConfig:
        (argv,) = worker_rank_argvs(args, model_argv, "ipc://x", None)
    elif config_class is SchedulerConfig:
        argv = _scheduler_argv(args, model_argv, "ipc://x")
    elif config_class is FrontConfig:
        argv = front_argv(args, model_argv, engine_replicas(args, "/tmp", "ipc://x"))
    else:
        argv = _gateway_argv(args)
    return service_config(config_class, argv)


@pytest.mark.parametrize("config_class", list(SERVICES), ids=lambda cls: cls.__name__)
def test_every_shared_flag_given_to_serve_reaches_its_child_with_its_value(config_class):
    """The worker's device is rank 0's of --device (`cuda:1` stays `cuda:1`); keys go by the environment."""
    args = parse_args(["serve", *serve_flags(config_class)])
    child, example = launched(config_class, args), EXAMPLES[config_class]
    differing = [name for name in shared(config_class)
                 if name not in never_forwarded(config_class) and getattr(child, name) != getattr(example, name)]
    assert differing == []


@pytest.mark.parametrize("config_class, changed", [
    (WorkerConfig, []),
    (SchedulerConfig, ["model", "max_num_batched_tokens"]),  # the CPU's step budget (scheduler_svc/config.py)
    (GatewayConfig, []),
    (FrontConfig, []),
], ids=lambda value: getattr(value, "__name__", ""))
def test_serve_given_only_a_model_leaves_its_children_their_defaults(config_class, changed):
    child = launched(config_class, parse_args(["serve", "m"]))
    assert [name for name in shared(config_class) if getattr(child, name) != getattr(config_class(), name)] == changed


# ---- the checks themselves see drift -------------------------------------------------------------------------

@dataclass(frozen=True)
class DriftedConfig:
    port: int = flag("--port", default=1, help="a port")
    added_without_a_flag: int = 0


def test_a_field_without_a_flag_and_a_flag_without_a_field_are_caught(monkeypatch):
    assert without_flags(DriftedConfig) == ["added_without_a_flag"]

    def add_with_a_stray_flag(parser):
        add_config_arguments(parser, DriftedConfig)
        parser.add_argument("--stray", default=None)

    monkeypatch.setitem(SERVICES, DriftedConfig, (add_with_a_stray_flag, None))
    assert parsed_without_fields(DriftedConfig) == ["stray"]


def test_a_shared_flag_the_launcher_dropped_would_be_caught(monkeypatch):
    """A launcher that forgot --swap-space: the child keeps its default, which the example does not hold."""
    from pagedserve import launcher

    forward = launcher.config_argv

    def dropping_swap_space(config_class, values, **options):
        return forward(config_class, {name: value for name, value in values.items() if name != "swap_space"},
                       **options)

    monkeypatch.setattr(launcher, "config_argv", dropping_swap_space)
    child = launched(WorkerConfig, parse_args(["serve", *serve_flags(WorkerConfig)]))
    assert child.swap_space == WorkerConfig().swap_space != EXAMPLES[WorkerConfig].swap_space
