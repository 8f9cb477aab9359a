"""`pagedserve bench throughput` and `pagedserve bench latency` (vLLM's offline benchmarks): the random
dataset's requests, the results' arithmetic and JSON keys, the engine flags handed to the private server, and
both commands run end to end on a tiny model, writing JSON that holds what they measured."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pagedserve.bench.latency import LatencyResult, measure_latency
from pagedserve.bench.offline_engine import engine_options
from pagedserve.bench.random_token_requests import FIRST_ORDINARY_TOKEN_ID, random_requests
from pagedserve.bench.throughput import ThroughputResult, measure_throughput
from pagedserve.cli import parse_args
from pagedserve.private_server import server_argv
from pagedserve.testing.server_harness import REPO_ROOT
from pagedserve.testing.tiny_models import make_tiny_model

SERVER_FLAGS = ["--max-model-len", "64", "--num-kv-blocks", "64"]


def test_random_requests_have_the_asked_lengths_ordinary_token_ids_and_depend_only_on_the_seed():
    requests = random_requests(5, 12, 7, vocab_size=50, seed=4)
    assert [len(r.prompt_token_ids) for r in requests] == [12] * 5
    assert [r.output_len for r in requests] == [7] * 5
    assert all(FIRST_ORDINARY_TOKEN_ID <= t < 50 for r in requests for t in r.prompt_token_ids)
    assert random_requests(5, 12, 7, vocab_size=50, seed=4) == requests
    assert random_requests(5, 12, 7, vocab_size=50, seed=5) != requests


def test_a_range_ratio_spreads_lengths_within_its_bounds():
    requests = random_requests(200, 100, 40, vocab_size=1000, seed=0, range_ratio=0.5)
    prompt_lens = {len(r.prompt_token_ids) for r in requests}
    output_lens = {r.output_len for r in requests}
    assert min(prompt_lens) >= 50 and max(prompt_lens) <= 150 and len(prompt_lens) > 20
    assert min(output_lens) >= 20 and max(output_lens) <= 60 and len(output_lens) > 10


@pytest.mark.parametrize("arguments, named", [
    (dict(num_prompts=0), "num_prompts"), (dict(input_len=0), "input_len"), (dict(output_len=0), "output_len"),
    (dict(range_ratio=1.0), "range_ratio"), (dict(vocab_size=3), "vocab_size"),
])
def test_random_requests_refuse_what_cannot_give_a_request_naming_the_argument(arguments, named):
    call = dict(num_prompts=2, input_len=4, output_len=4, vocab_size=100) | arguments
    range_ratio = call.pop("range_ratio", 0.0)
    with pytest.raises(ValueError, match=named):
        random_requests(**call, range_ratio=range_ratio)


def test_throughput_result_has_vllms_keys_and_rates():
    result = ThroughputResult(elapsed_time=2.0, num_requests=4, total_prompt_tokens=40, total_output_tokens=20)
    assert result.to_json() == {
        "elapsed_time": 2.0, "num_requests": 4, "total_num_tokens": 60, "requests_per_second": 2.0,
        "tokens_per_second": 30.0, "total_prompt_tokens": 40, "total_output_tokens": 20,
        "output_tokens_per_second": 10.0}
    assert result.summary().splitlines()[0] == "Throughput: 2.00 requests/s, 30.00 total tokens/s, 10.00 output tokens/s"


def test_latency_result_has_vllms_keys_mean_and_linear_percentiles():
    result = LatencyResult(tuple(float(x) for x in range(1, 11)))
    data = result.to_json()
    assert set(data) == {"avg_latency", "latencies", "percentiles"}
    assert data["avg_latency"] == 5.5 and data["latencies"] == list(range(1, 11))
    assert data["percentiles"] == {"10": 1.9, "25": 3.25, "50": 5.5, "75": 7.75, "90": 9.1, "99": pytest.approx(9.91)}
    assert result.summary().splitlines()[0] == "Avg latency: 5.5 seconds"
    assert "99% percentile latency: 9.9" in result.summary()


def test_only_engine_flags_that_differ_from_their_defaults_reach_the_server_as_serve_flags():
    args = parse_args(["bench", "throughput", "--model", "m", "--load-format", "dummy", "--no-enable-prefix-caching",
                       "-tp", "2", "--seed", "3", "--max-model-len", "64", "--max-num-seqs", "256",
                       "--num-prompts", "9"])
    options = engine_options(args)
    assert options == {"load_format": "dummy", "enable_prefix_caching": False, "tensor_parallel_size": 2, "seed": 3,
                       "max_model_len": 64}
    argv = server_argv(args.model, options)
    assert argv[:2] == ["--model", "m"]
    assert {"--load-format", "dummy", "--no-prefix-caching", "--tensor-parallel-size", "2", "--seed", "3"} <= set(argv)
    assert "--max-num-seqs" not in argv  # its default: left to the server


def test_a_parsed_speculative_config_goes_to_the_server_as_the_json_it_came_from():
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1024}'
    args = parse_args(["bench", "throughput", "--model", "m", "--speculative-config", spec])
    argv = server_argv(args.model, engine_options(args))
    served = parse_args(["serve", *argv])
    assert served.speculative_config == args.speculative_config
    assert served.speculative_config.disable_by_batch_size == 1024


@pytest.mark.parametrize("command, flags, message", [
    ("throughput", ["--num-prompts", "0"], "--num-prompts must be at least 1"),
    ("throughput", ["--disable-detokenize"], "--disable-detokenize: not supported"),
    ("latency", ["--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_bad_workload_flags_are_refused_by_name_before_any_engine_starts(command, flags, message):
    args = parse_args(["bench", command, "--model", "/nonexistent", *flags])
    with pytest.raises(SystemExit, match=message):
        args.bench_run(args)


def test_vllm_flags_pagedserve_does_not_support_are_refused_by_the_bench_commands_too(capsys):
    with pytest.raises(SystemExit):
        parse_args(["bench", "latency", "--pipeline-parallel-size", "2"])
    assert "--pipeline-parallel-size 2: not supported" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=5)


@pytest.fixture(scope="module")
def config_only_dir(model_dir, tmp_path_factory):
    """The model's config.json alone: served with --load-format dummy, as benchmarks of a named shape are."""
    directory = tmp_path_factory.mktemp("config-only")
    shutil.copy(model_dir / "config.json", directory / "config.json")
    return directory


def _bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", "bench", *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)


def test_bench_throughput_runs_every_request_and_writes_vllms_json(config_only_dir, tmp_path):
    out = tmp_path / "throughput.json"
    done = _bench("throughput", "--model", str(config_only_dir), "--load-format", "dummy", *SERVER_FLAGS,
                  "--input-len", "8", "--output-len", "5", "--num-prompts", "6", "--n", "2", "--num-iters-warmup", "1",
                  "--output-json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["num_requests"] == 6
    assert result["total_prompt_tokens"] == 6 * 8
    assert result["total_output_tokens"] == 6 * 5 * 2  # EOS ignored, n outputs each
    assert result["total_num_tokens"] == 6 * 8 + 6 * 5 * 2
    assert result["elapsed_time"] > 0
    assert math.isclose(result["tokens_per_second"], result["total_num_tokens"] / result["elapsed_time"])
    assert math.isclose(result["requests_per_second"], 6 / result["elapsed_time"])
    assert f"Throughput: {result['requests_per_second']:.2f} requests/s" in done.stdout
    assert "Processed prompts" in done.stderr  # the tqdm bar


def test_bench_latency_times_each_iteration_and_writes_vllms_json(model_dir, tmp_path):
    out = tmp_path / "latency.json"
    done = _bench("latency", "--model", str(model_dir), *SERVER_FLAGS, "--input-len", "8", "--output-len", "4",
                  "--batch-size", "3", "--num-iters-warmup", "1", "--num-iters", "4", "--output-json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 4 and all(latency > 0 for latency in result["latencies"])
    assert math.isclose(result["avg_latency"], float(np.mean(result["latencies"])))
    assert result["percentiles"].keys() == {"10", "25", "50", "75", "90", "99"}
    assert math.isclose(result["percentiles"]["50"], float(np.median(result["latencies"])))
    assert f"Avg latency: {result['avg_latency']} seconds" in done.stdout
    assert "Profiling iterations" in done.stderr


class _RecordingLLM:
    """The real LLM, with a record of the beam-search calls measure_latency makes on it."""

    def __init__(self, llm):
        self.llm = llm
        self.beam_searches = []

    def beam_search(self, prompts, params):
        outputs = self.llm.beam_search(prompts, params)
        self.beam_searches.append((params, outputs))
        return outputs


def test_measurements_count_what_the_engine_generated_and_latency_can_time_beam_search(model_dir):
    from pagedserve import LLM

    with LLM(str(model_dir), max_model_len=64, num_kv_blocks=64) as llm:
        requests = random_requests(3, 6, 4, llm.model_info.vocab_size, seed=1)
        result = measure_throughput(llm, requests, n=3, use_tqdm=False)
        assert (result.num_requests, result.total_prompt_tokens, result.total_output_tokens) == (3, 18, 36)
        recording = _RecordingLLM(llm)
        latency = measure_latency(recording, [r.prompt_token_ids for r in requests], output_len=4, n=2,
                                  use_beam_search=True, num_iters_warmup=1, num_iters=2)
    assert len(latency.latencies) == 2 and all(value > 0 for value in latency.latencies)
    assert len(recording.beam_searches) == 3  # one warm-up, two measured
    params, outputs = recording.beam_searches[-1]
    assert (params.beam_width, params.max_tokens, params.ignore_eos) == (2, 4, True)
    assert [len(output.sequences) for output in outputs] == [2, 2, 2]
