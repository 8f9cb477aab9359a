"""Serving metrics: the scheduler's token totals and latency histograms (scheduler_svc/metrics.py, on a fake
clock), and the gateway's /metrics on a real server, which parses with prometheus_client's parser and whose
counters and histograms move by exactly what the requests did."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model
from scheduler_svc.metrics import LatencyHistogram, ServingMetrics


class _Group:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_histogram_buckets_follow_prometheus_le():
    histogram = LatencyHistogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        histogram.observe(value)
    snapshot = histogram.snapshot()
    assert snapshot.counts == (2, 2, 1)  # 0.1 falls in le=0.1, 1.0 in le=1.0, 7.0 in +Inf
    assert (snapshot.count, snapshot.sum) == (5, pytest.approx(8.65))


def test_latencies_are_per_client_request_and_aborted_requests_are_not_finished():
    clock = FakeClock()
    metrics = ServingMetrics(clock)
    owners = {"a": _Group("a"), "b#0": _Group("b"), "b#1": _Group("b"), "c": _Group("c")}
    metrics.on_admitted("a", 10)
    metrics.on_admitted("b", 4)
    metrics.on_admitted("c", 3)
    clock.now += 0.5
    metrics.on_step(["a", "b#0", "b#1"], owners)  # first tokens of a and b (b's two sequences count once)
    clock.now += 0.1
    metrics.on_step(["a", "b#0", "b#1", "c"], owners)
    clock.now += 0.1
    metrics.on_step(["a"], owners)
    metrics.on_request_end("a", completed=True)
    metrics.on_request_end("b", completed=True)
    metrics.on_request_end("c", completed=False)  # aborted: its first token counts, its end does not
    snapshot = metrics.snapshot()
    assert (snapshot.num_prompt_tokens, snapshot.num_generation_tokens) == (17, 8)
    assert snapshot.time_to_first_token.count == 3
    assert snapshot.time_to_first_token.sum == pytest.approx(0.5 + 0.5 + 0.6)
    assert snapshot.e2e_request_latency.count == 2
    assert snapshot.e2e_request_latency.sum == pytest.approx(0.7 + 0.7)
    assert snapshot.time_per_output_token.count == 2
    assert snapshot.time_per_output_token.sum == pytest.approx(0.1 + 0.1)  # a: 0.2 s over 2 gaps; b: 0.1 s over 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("models"), "qwen2", seed=4)
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--max-model-len", "128",
                        "--num-kv-blocks", "64", http=True) as running:
        yield running


def scrape(server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name + _labels(sample.labels)): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _labels(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def test_metrics_parse_and_move_as_requests_run(server):
    from openai import OpenAI

    before = scrape(server)
    assert before["pagedserve_scheduler_up"] == 1
    assert before["pagedserve_kv_cache_usage_ratio"] == 0
    prompts = [list(range(3, 23)), [9, 10, 11]]  # 20 tokens: one full block for the prefix cache to look up
    with OpenAI(base_url=f"{server.http_url}/v1", api_key="-", max_retries=0) as api:
        completion = api.completions.create(model=server_model(api), prompt=prompts, max_tokens=6, temperature=0)
    assert completion.usage.completion_tokens == 12
    after = scrape(server)

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert moved("pagedserve_prompt_tokens_total") == 23
    assert moved("pagedserve_generation_tokens_total") == 12
    assert moved("pagedserve_requests_finished_total") == 2
    assert moved("pagedserve_scheduler_steps_total") >= 6
    assert moved("pagedserve_prefix_cache_queries_total") > 0
    for histogram in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        name = f"pagedserve_{histogram}_seconds"
        assert moved(f"{name}_count") == 2
        assert moved(f'{name}_bucket{{le="+Inf"}}') == 2
        assert moved(f"{name}_sum") > 0
    assert after["pagedserve_num_requests_running"] == 0
    assert after["pagedserve_num_kv_blocks"] == 64


def server_model(api) -> str:
    return api.models.list().data[0].id
