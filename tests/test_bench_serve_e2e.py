"""`pagedserve bench serve` against a real server (processes: scheduler, worker, HTTP gateway) on a tiny random
model without a tokenizer, as the GPU benchmarks serve a config.json with random weights: over HTTP
(/v1/completions, token-id prompts from --tokenizer's config.json vocab_size, output chunks with no text)
and over gRPC (the server's ModelInfo gives the vocab size), every request completes with the exact
token counts asked for, and the JSON record holds the percentiles asked for, in order."""

from __future__ import annotations

import json

import pytest

from pagedserve.cli import main
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 12, 6
PERCENTILES = ("p50", "p90", "p99")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=5)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model_dir), "--max-model-len", "128",
                        "--num-kv-blocks", "64", "--swap-space", "0.01", http=True) as running:
        yield running


def bench(tmp_path, *flags: str) -> dict:
    code = main(["bench", "serve", *flags, "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN),
                 "--random-output-len", str(OUTPUT_LEN), "--ignore-eos", "--request-rate", "50",
                 "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                 "--disable-tqdm", "--result-dir", str(tmp_path), "--result-filename", "result.json"])
    assert code == 0
    return json.loads((tmp_path / "result.json").read_text())


def assert_complete_with_percentiles(record: dict) -> None:
    assert (record["completed"], record["failed"]) == (NUM_PROMPTS, 0), record["errors"]
    assert record["input_lens"] == [INPUT_LEN] * NUM_PROMPTS  # the server's usage count: no BOS on token ids
    assert record["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert record["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    # Chunks may carry several tokens (on a loaded machine one chunk may carry a whole output: no gap to time).
    assert all(len(itls) <= OUTPUT_LEN - 1 for itls in record["itls"]) and any(record["itls"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        values = [record[f"{p}_{metric}_ms"] for p in PERCENTILES]
        # Two SSE events read from one socket buffer are timed together: an inter-token gap may be 0, and so
        # may a request's TPOT when all its tokens after the first arrive with it (a loaded machine's step).
        floor_ok = values[0] >= 0 if metric in ("itl", "tpot") else values[0] > 0
        assert floor_ok and values[0] <= values[1] <= values[2], (metric, values)
        assert record[f"mean_{metric}_ms"] >= (0 if metric in ("itl", "tpot") else 1e-9)
        assert record[f"std_{metric}_ms"] >= 0
    # TPOT by its definition, whatever the timing: each request's (latency - TTFT) over its tokens after the first.
    tpots = [(latency - ttft) / (OUTPUT_LEN - 1) for latency, ttft in zip(record["latencies"], record["ttfts"])]
    assert record["mean_tpot_ms"] == pytest.approx(1e3 * sum(tpots) / len(tpots))
    assert record["p99_ttft_ms"] < record["p99_e2el_ms"]
    assert record["request_rate"] == 50.0 and record["request_throughput"] > 0


def test_http_completions_with_token_id_prompts(server, model_dir, tmp_path, capsys):
    record = bench(tmp_path, "--base-url", server.http_url, "--tokenizer", str(model_dir))
    assert_complete_with_percentiles(record)
    assert record["backend"] == "openai" and record["model_id"] == model_dir.name
    summary = capsys.readouterr().out
    for label in ("Serving Benchmark Result", "Successful requests:", "Benchmark duration (s):",
                  "Request throughput (req/s):", "Output token throughput (tok/s):", "Median TTFT (ms):",
                  "P99 TPOT (ms):", "P90 ITL (ms):", "P50 E2EL (ms):"):
        assert label in summary, label


def test_grpc_backend(server, tmp_path):
    record = bench(tmp_path, "--backend", "grpc", "--port", str(server.port))
    assert_complete_with_percentiles(record)
    assert record["backend"] == "grpc"
