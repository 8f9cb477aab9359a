"""`pagedserve serve` reads like `vllm serve` (issue 18): the model positional, --host/--port for HTTP and
--grpc-host/--grpc-port for gRPC, vLLM's flags with vLLM's meaning forwarded to the right child, the API key
never on a child's command line, and every vLLM flag we cannot honour refused by name. Argv only: no server."""

from __future__ import annotations

import argparse
import json

import pytest

from gateway.config import gateway_config_from_args
from gateway.main import add_arguments as add_gateway_arguments
from pagedserve.cli import parse_args
from pagedserve import launcher
from pagedserve.launcher import _gateway_argv, _scheduler_argv, refuse_bad_text_options, warn_open_binds
from pagedserve.launcher import worker_rank_argvs
from pagedserve.private_server import server_argv
from pagedserve.vllm_flags import REFUSED_FLAGS
from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.config import scheduler_config_from_args
from scheduler_svc.generation_defaults import load_generation_defaults
from scheduler_svc.main import add_arguments as add_scheduler_arguments
from scheduler_svc.text.chat_template_source import chat_template_text
from service_runtime.api_key_source import api_key_from, child_environment
from worker_svc.config import worker_config_from_args
from worker_svc.main import add_arguments as add_worker_arguments


def serve(*argv: str) -> argparse.Namespace:
    return parse_args(["serve", *argv])


def service_args(add_arguments, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


# ---- the model and where serve listens ----------------------------------------------------------------------

def test_the_model_is_the_positional_or_model_and_both_must_agree(capsys):
    assert serve("some/model").model == "some/model"
    assert serve("--model", "some/model").model == "some/model"
    assert serve("some/model", "--model", "some/model").model == "some/model"
    assert serve().model is None  # the embedded default
    with pytest.raises(SystemExit):
        serve("one/model", "--model", "other/model")
    assert "the model is given twice" in capsys.readouterr().err


def test_host_and_port_are_the_http_servers_and_grpc_has_its_own_flags():
    args = serve()
    assert (args.host, args.port, args.grpc_host, args.grpc_port) == ("127.0.0.1", 8000, "127.0.0.1", 50051)
    args = serve("--host", "0.0.0.0", "--port", "9000", "--grpc-host", "::", "--grpc-port", "6000")
    gateway = _gateway_argv(args)
    assert gateway[gateway.index("--host") + 1] == "0.0.0.0" and gateway[gateway.index("--port") + 1] == "9000"
    assert gateway[gateway.index("--grpc-target") + 1] == "127.0.0.1:6000"  # a wildcard bind is reached on loopback
    scheduler = _scheduler_argv(args, [], "ipc:///tmp/x")
    assert scheduler[scheduler.index("--grpc-host") + 1] == "::"
    assert scheduler[scheduler.index("--grpc-port") + 1] == "6000"
    assert "--host" not in scheduler and "--port" not in scheduler


def test_http_port_is_a_deprecated_alias_of_port(capsys):
    assert serve("--http-port", "9001").port == 9001
    assert "--http-port is deprecated" in capsys.readouterr().err
    serve("--port", "9001")
    assert "deprecated" not in capsys.readouterr().err


def test_the_scheduler_alone_takes_grpc_host_and_port_or_the_older_host_and_port():
    args = service_args(add_scheduler_arguments, "--grpc-host", "0.0.0.0", "--grpc-port", "6001")
    assert (args.host, args.port) == ("0.0.0.0", 6001)
    args = service_args(add_scheduler_arguments, "--host", "0.0.0.0", "--port", "6002")
    assert (args.host, args.port) == ("0.0.0.0", 6002)


# ---- vLLM's flags, forwarded -------------------------------------------------------------------------------

def test_tokenizer_seed_chat_template_and_generation_config_reach_the_scheduler(tmp_path):
    args = serve("--tokenizer", "tok/dir", "--seed", "7", "--chat-template", "{{ messages }}",
                 "--generation-config", "vllm")
    argv = _scheduler_argv(args, [], "ipc:///tmp/x")
    for flag, value in (("--tokenizer", "tok/dir"), ("--seed", "7"), ("--chat-template", "{{ messages }}"),
                        ("--generation-config", "vllm")):
        assert argv[argv.index(flag) + 1] == value
    config = scheduler_config_from_args(service_args(add_scheduler_arguments, *argv))
    assert (config.tokenizer, config.seed, config.chat_template, config.generation_config) == (
        "tok/dir", 7, "{{ messages }}", "vllm")
    defaults = scheduler_config_from_args(service_args(add_scheduler_arguments))
    assert (defaults.seed, defaults.generation_config, defaults.chat_template) == (0, "auto", None)  # vLLM V1: seed 0


@pytest.mark.parametrize("flags, budget", [
    ((), 128),  # the CPU default: a step of the embedded model well under a second
    (("--device", "cuda"), 2048),
    (("--max-num-batched-tokens", "512"), 512),
    (("--device", "cuda", "--max-num-batched-tokens", "64"), 64),
])
def test_the_step_token_budget_defaults_by_device_and_the_flag_wins(flags, budget):
    argv = _scheduler_argv(serve(*flags), [], "ipc:///tmp/x")
    config = scheduler_config_from_args(service_args(add_scheduler_arguments, *argv))
    assert config.max_num_batched_tokens == budget
    assert scheduler_config_from_args(service_args(add_scheduler_arguments)).max_num_batched_tokens == 2048


@pytest.mark.parametrize("flags, prefix, chunked", [
    ((), True, True),
    (("--no-enable-prefix-caching", "--no-enable-chunked-prefill"), False, False),
    (("--no-prefix-caching", "--no-chunked-prefill"), False, False),  # the older spellings
    (("--no-enable-prefix-caching", "--enable-prefix-caching", "--enable-chunked-prefill"), True, True),
])
def test_prefix_caching_and_chunked_prefill_have_vllms_positive_and_negative_forms(flags, prefix, chunked):
    args = serve(*flags)
    assert (args.enable_prefix_caching, args.enable_chunked_prefill) == (prefix, chunked)
    config = scheduler_config_from_args(service_args(add_scheduler_arguments, *_scheduler_argv(args, [], "ipc://x")))
    assert (config.enable_prefix_caching, config.enable_chunked_prefill) == (prefix, chunked)


@pytest.mark.parametrize("given, dtype", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"),
                                          ("auto", "auto")])
def test_dtype_takes_vllms_half_and_float(given, dtype):
    (argv,) = worker_rank_argvs(serve("--dtype", given), [], "ipc://x", None)
    argv = [*argv, "--model", "m"]  # `serve` passes --model in model_argv
    config = worker_config_from_args(service_args(add_worker_arguments, *argv))
    assert config.dtype == dtype


def test_enforce_eager_turns_cuda_graphs_off():
    assert serve().cuda_graphs is True
    args = serve("--enforce-eager")
    assert args.cuda_graphs is False
    (argv,) = worker_rank_argvs(args, [], "ipc://x", None)
    assert worker_config_from_args(service_args(add_worker_arguments, *argv)).cuda_graphs is False


def test_disable_custom_all_reduce_reaches_every_rank():
    assert serve().custom_all_reduce is True
    argvs = worker_rank_argvs(serve("-tp", "2", "--disable-custom-all-reduce"), [], "ipc://x", "tcp://127.0.0.1:1")
    assert len(argvs) == 2
    for argv in argvs:
        assert worker_config_from_args(service_args(add_worker_arguments, *argv)).custom_all_reduce is False
    (argv,) = worker_rank_argvs(serve(), [], "ipc://x", None)
    assert worker_config_from_args(service_args(add_worker_arguments, *argv)).custom_all_reduce is True


def test_batch_invariant_reaches_the_worker_from_the_flag_or_vllms_variable(monkeypatch):
    assert serve().batch_invariant is False
    (argv,) = worker_rank_argvs(serve("--batch-invariant"), [], "ipc://x", None)
    assert worker_config_from_args(service_args(add_worker_arguments, *argv)).batch_invariant is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert serve().batch_invariant is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert serve().batch_invariant is False


def test_uvicorn_log_level_and_disable_log_requests_reach_the_gateway():
    plain = gateway_config_from_args(service_args(add_gateway_arguments, *_gateway_argv(serve())))
    assert (plain.uvicorn_log_level, plain.log_requests) == ("info", True)
    argv = _gateway_argv(serve("--uvicorn-log-level", "warning", "--disable-log-requests"))
    config = gateway_config_from_args(service_args(add_gateway_arguments, *argv))
    assert (config.uvicorn_log_level, config.log_requests) == ("warning", False)


def test_max_request_body_bytes_reaches_the_gateway():
    default = gateway_config_from_args(service_args(add_gateway_arguments, *_gateway_argv(serve())))
    assert default.max_request_body_bytes == 16 * 1024 * 1024
    argv = _gateway_argv(serve("--max-request-body-bytes", "1000"))
    assert gateway_config_from_args(service_args(add_gateway_arguments, *argv)).max_request_body_bytes == 1000


# ---- the API key: flag or environment, never a child's argv ------------------------------------------------

def test_the_api_key_comes_from_the_flag_else_pagedserve_api_key_else_vllm_api_key():
    assert api_key_from("flag", {"PAGEDSERVE_API_KEY": "p", "VLLM_API_KEY": "v"}) == "flag"
    assert api_key_from(None, {"PAGEDSERVE_API_KEY": "p", "VLLM_API_KEY": "v"}) == "p"
    assert api_key_from(None, {"VLLM_API_KEY": "v"}) == "v"
    assert api_key_from("", {"VLLM_API_KEY": "v"}) is None  # an empty flag: no key
    assert api_key_from(None, {}) is None


def test_no_child_command_line_carries_the_api_key(monkeypatch):
    args = serve("--api-key", "the-key")
    argvs = [_scheduler_argv(args, [], "ipc://x"), _gateway_argv(args), *worker_rank_argvs(args, [], "ipc://x", None)]
    assert all("the-key" not in " ".join(argv) for argv in argvs)
    monkeypatch.setenv("VLLM_API_KEY", "inherited")
    monkeypatch.setenv("PAGEDSERVE_GRPC_API_KEY", "inherited")
    worker_env = child_environment({})
    assert "VLLM_API_KEY" not in worker_env and "PAGEDSERVE_GRPC_API_KEY" not in worker_env
    assert child_environment({"PAGEDSERVE_API_KEY": "the-key"})["PAGEDSERVE_API_KEY"] == "the-key"


@pytest.mark.parametrize("argv, named", [
    (["--host", "0.0.0.0"], "--host 0.0.0.0"),
    (["--grpc-host", "10.1.2.3"], "--grpc-host 10.1.2.3"),
    (["--host", "::", "--grpc-host", "myhost.lan"], "--grpc-host myhost.lan, --host ::"),
    (["--host", ""], "--host ''"),
])
def test_a_bind_past_loopback_without_a_key_warns_in_one_line_naming_the_flag(argv, named, tmp_path, capsys,
                                                                               monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(SystemExit):  # the warning comes first, before the model is even looked for
        launcher.serve(serve(str(tmp_path / "no-model"), *argv))
    [warning] = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert f"({named})" in warning and "--api-key" in warning and "$PAGEDSERVE_API_KEY" in warning


@pytest.mark.parametrize("argv", [
    [], ["--host", "localhost", "--grpc-host", "::1"], ["--host", "0.0.0.0", "--api-key", "k"],
    ["--no-http", "--host", "0.0.0.0"],
])
def test_loopback_binds_a_key_or_no_http_server_start_without_the_warning(argv, capsys):
    args = serve(*argv)
    warn_open_binds(args, api_key_from(args.api_key, {}))
    assert capsys.readouterr().err == ""


def test_the_scheduler_and_gateway_read_the_key_from_their_environment(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "env-key")
    monkeypatch.setenv("PAGEDSERVE_GRPC_API_KEY", "grpc-key")
    assert scheduler_config_from_args(service_args(add_scheduler_arguments)).api_key == "env-key"
    gateway = gateway_config_from_args(service_args(add_gateway_arguments))
    assert (gateway.api_key, gateway.grpc_api_key) == ("env-key", "grpc-key")


# ---- refused flags -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("refused", REFUSED_FLAGS, ids=lambda refused: refused.names[0])
def test_a_vllm_flag_we_do_not_support_is_refused_with_its_reason(refused, capsys):
    argv = [refused.names[0], "2"] if refused.takes_value else [refused.names[0]]
    with pytest.raises(SystemExit) as exit_info:
        serve(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{refused.names[0]}" in err and "not supported" in err and refused.reason in err


@pytest.mark.parametrize("flag, value", [("--pipeline-parallel-size", "1"), ("-pp", "1"),
                                         ("--kv-cache-dtype", "auto"), ("--cpu-offload-gb", "0"),
                                         ("--quantization", "gguf"), ("--task", "generate")])
def test_a_refused_flag_is_fine_with_the_value_that_means_what_we_do(flag, value):
    serve(flag, value)


def test_quantization_gguf_needs_a_gguf_model_and_trust_remote_code_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--quantization gguf: .* is not a .gguf file"):
        refuse_bad_text_options(serve("--quantization", "gguf"), str(tmp_path))
    with pytest.raises(SystemExit):
        serve("--trust-remote-code")
    assert "never runs a model repository's Python code" in capsys.readouterr().err


def test_an_unknown_flag_is_an_error_not_ignored(capsys):
    with pytest.raises(SystemExit):
        serve("--no-such-vllm-flag")
    assert "unrecognized arguments: --no-such-vllm-flag" in capsys.readouterr().err


# ---- chat template and generation config ---------------------------------------------------------------------

def test_chat_template_is_a_file_or_the_template_itself_and_a_bad_one_stops_start_up(tmp_path):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert chat_template_text(str(tmp_path / "t.jinja")) == template
    assert chat_template_text(template) == template
    with pytest.raises(ValueError, match="--chat-template: .* neither a file nor a Jinja template"):
        chat_template_text(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template: not a valid Jinja template"):
        chat_template_text("{% for m in messages %}")
    with pytest.raises(SystemExit, match="--chat-template"):
        refuse_bad_text_options(serve("--chat-template", "{% if %}"), str(tmp_path))


def write_generation_config(directory, **values):
    directory.mkdir(exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **values}))
    return directory


def test_generation_config_modes_read_the_models_file_none_or_the_given_directory(tmp_path):
    model = write_generation_config(tmp_path / "model", temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                                    repetition_penalty=1.1, max_new_tokens=64, do_sample=True)
    auto = load_generation_defaults("auto", str(model))
    assert (auto.source, dict(auto.values)) == ("auto", {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 64})
    assert dict(load_generation_defaults("vllm", str(model)).values) == {}
    other = write_generation_config(tmp_path / "other", top_k=1)
    assert dict(load_generation_defaults(str(other), str(model)).values) == {"top_k": 1}
    assert dict(load_generation_defaults("auto", str(tmp_path / "model.gguf")).values) == {}  # no file: none
    with pytest.raises(ValueError, match="--generation-config: .* has no generation_config.json"):
        load_generation_defaults(str(tmp_path), str(model))
    bad = write_generation_config(tmp_path / "bad", top_k="many")
    with pytest.raises(ValueError, match="top_k must be a number"):
        load_generation_defaults(str(bad), str(model))


def test_only_unset_fields_take_the_defaults_and_beam_search_keeps_its_greedy_beams(tmp_path):
    model = write_generation_config(tmp_path / "model", temperature=0.6, top_k=20, max_new_tokens=64)
    defaults = load_generation_defaults("auto", str(model))
    unset = defaults.apply(generate_pb2.SamplingParams())
    assert (unset.temperature, unset.top_k, unset.max_tokens) == (pytest.approx(0.6), 20, 64)
    greedy = defaults.apply(generate_pb2.SamplingParams(temperature=0.0, max_tokens=3, stop=["x"]))
    assert (greedy.temperature, greedy.top_k, greedy.max_tokens, list(greedy.stop)) == (0.0, 20, 3, ["x"])
    beams = defaults.apply(generate_pb2.SamplingParams(beam_width=4))
    assert not beams.HasField("temperature") and not beams.HasField("top_k") and beams.max_tokens == 64


# ---- the offline LLM's keywords ------------------------------------------------------------------------------

def test_llm_keywords_become_serve_flags_with_the_api_key_left_to_the_environment():
    assert server_argv("m", dict(seed=5, tensor_parallel_size=2, generation_config="vllm", api_key="k",
                                 enforce_eager=True)) == [
        "--model", "m", "--seed", "5", "--tensor-parallel-size", "2", "--generation-config", "vllm",
        "--enforce-eager"]
    assert server_argv(None, dict(trust_remote_code=True)) == ["--trust-remote-code"]  # the server refuses it


def test_a_seed_out_of_range_is_refused_when_serve_parses_it(capsys):
    with pytest.raises(SystemExit):
        serve("--seed", "-1")
    assert "argument --seed: must lie in [0, 2**63)" in capsys.readouterr().err


def test_override_generation_config_sets_values_over_the_files_or_alone_and_refuses_other_keys(tmp_path, capsys):
    model = write_generation_config(tmp_path / "model", temperature=0.6, top_k=20)
    auto = load_generation_defaults("auto", str(model), {"temperature": 0.2, "max_new_tokens": 8})
    assert dict(auto.values) == {"temperature": 0.2, "top_k": 20, "max_tokens": 8}
    assert dict(load_generation_defaults("vllm", str(model), {"top_p": 0.5}).values) == {"top_p": 0.5}
    with pytest.raises(ValueError, match=r"--override-generation-config: unknown keys \['do_sample'\]"):
        load_generation_defaults("auto", str(model), {"do_sample": True})
    args = serve("--override-generation-config", '{"temperature": 0.2}')
    argv = _scheduler_argv(args, [], "ipc://x")
    config = scheduler_config_from_args(service_args(add_scheduler_arguments, *argv))
    assert dict(config.override_generation_config) == {"temperature": 0.2}
    with pytest.raises(SystemExit):
        serve("--override-generation-config", "[1, 2]")
    assert "must be a JSON object" in capsys.readouterr().err
    assert server_argv(None, dict(override_generation_config={"top_k": 1})) == [
        "--override-generation-config", '{"top_k": 1}']
