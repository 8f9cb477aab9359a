"""Serving metrics: the scheduler's counters and histograms (scheduler_svc/metrics, on a fake clock), their
rendering as vLLM's `vllm:*` families beside pagedserve's own (gateway/metrics.py), and the gateway's
/metrics on a real server, which parses with prometheus_client's parser and whose counters and histograms
move by exactly what the requests did."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.types import ModelInfo, ServerStats
from gateway.metrics import render_metrics
from gateway.vllm_metrics import ServedModel
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.core.request import FinishReason
from scheduler_svc.metrics import Histogram, ServingMetrics, fill_stats_response
from scheduler_svc.metrics.histogram import one_two_five_buckets

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "pagedserve-dashboard.json"
SERVED_NAME = 'tiny "qwen" \\ metrics'  # a quote and a backslash: label escaping must round-trip
# Every vLLM family /metrics exports (counters without `_total`, as the parser names families).
VLLM_FAMILIES = {
    "gauge": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
              "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cache_config_info"),
    "counter": ("vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:spec_decode_num_drafts",
                "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                "vllm:spec_decode_num_accepted_tokens_per_pos"),
    "histogram": ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                  "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
                  "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                  "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                  "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens",
                  "vllm:request_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
                  "vllm:iteration_tokens_total"),
}


class _Group:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_histogram_buckets_follow_prometheus_le():
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        histogram.observe(value)
    snapshot = histogram.snapshot()
    assert snapshot.counts == (2, 2, 1)  # 0.1 falls in le=0.1, 1.0 in le=1.0, 7.0 in +Inf
    assert (snapshot.count, snapshot.sum) == (5, pytest.approx(8.65))


def test_token_count_buckets_are_vllms_1_2_5_series_up_to_max_model_len():
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five_buckets(4096)[-3:] == (500, 1000, 2000)  # 5000 > 4096


def test_latencies_are_per_client_request_and_aborted_requests_are_not_finished():
    clock = FakeClock()
    metrics = ServingMetrics(max_model_len=128, clock=clock)
    owners = {"a": _Group("a"), "b#0": _Group("b"), "b#1": _Group("b"), "c": _Group("c")}
    metrics.on_admitted("a", 10, n=1, max_tokens=3)
    metrics.on_admitted("b", 4, n=2, max_tokens=2)
    metrics.on_admitted("c", 3, n=1, max_tokens=16)
    metrics.on_step(["a", "b#0", "b#1"], owners)  # first tokens of a and b (b's two sequences count once)
    clock.now += 0.1
    metrics.on_step(["a", "b#0", "b#1", "c"], owners)
    clock.now += 0.1
    metrics.on_step(["a"], owners)
    metrics.on_request_end("a", FinishReason.LENGTH)
    metrics.on_request_end("b", FinishReason.STOP)
    metrics.on_request_end("c", FinishReason.ABORT)  # aborted: its first token counts, its end does not
    snapshot = metrics.snapshot()
    assert (snapshot.num_prompt_tokens, snapshot.num_generation_tokens) == (17, 8)
    assert snapshot.num_finished == {FinishReason.STOP: 1, FinishReason.LENGTH: 1, FinishReason.ABORT: 1}
    assert snapshot.time_to_first_token.count == 3
    assert snapshot.e2e_request_latency.count == 2
    assert snapshot.e2e_request_latency.sum == pytest.approx(0.2 + 0.2)
    assert snapshot.time_per_output_token.count == 2
    assert snapshot.time_per_output_token.sum == pytest.approx(0.1 + 0.1)  # a: 0.2 s over 2 gaps; b: 0.1 s over 1
    assert snapshot.inter_token_latency.count == 3  # a's two gaps, b's one (c's first token is no gap)
    assert snapshot.request_generation_tokens.sum == 3 + 4  # a: 3 tokens; b: 2 sequences x 2
    assert snapshot.request_prompt_tokens.sum == 10 + 4
    assert (snapshot.request_params_n.sum, snapshot.request_params_max_tokens.sum) == (1 + 2, 3 + 2)


def test_queue_prefill_decode_and_inference_times_split_a_request_at_its_first_schedule_and_token():
    clock = FakeClock()
    metrics = ServingMetrics(max_model_len=128, clock=clock)
    owners = {"r": _Group("r"), "other": _Group("other")}
    metrics.on_admitted("r", 30, n=1, max_tokens=8)
    clock.now += 2.0  # waits
    metrics.on_scheduled(["r"], num_scheduled_tokens=20, owners=owners)  # a first chunk of its prompt
    clock.now += 0.5
    metrics.on_scheduled(["r"], num_scheduled_tokens=10, owners=owners)  # rescheduled (after a preemption)
    clock.now += 0.25
    metrics.on_step(["r"], owners)  # first token
    clock.now += 1.0
    metrics.on_step(["r"], owners)
    clock.now += 0.5
    metrics.on_request_end("r", FinishReason.STOP)
    snapshot = metrics.snapshot()
    assert snapshot.request_queue_time.sum == pytest.approx(2.0)
    assert snapshot.request_prefill_time.sum == pytest.approx(0.75)
    assert snapshot.request_decode_time.sum == pytest.approx(1.0)
    assert snapshot.request_inference_time.sum == pytest.approx(1.75)
    assert snapshot.e2e_request_latency.sum == pytest.approx(4.25)
    assert snapshot.time_to_first_token.sum == pytest.approx(2.75)
    assert (snapshot.iteration_tokens.count, snapshot.iteration_tokens.sum) == (2, 30)
    assert snapshot.iteration_tokens.counts[:6] == (0, 0, 1, 1, 0, 0)  # 10 in le=16, 20 in le=32


def _rendered(model_name: str = SERVED_NAME) -> tuple[str, dict]:
    """Fills a GetStatsResponse from a real ServingMetrics (one stop, one length, one abort), reads it back as
    the client does, and renders it as the gateway does."""
    clock = FakeClock()
    metrics = ServingMetrics(max_model_len=128, clock=clock)
    owners = {rid: _Group(rid) for rid in ("s", "l", "a")}
    for rid in owners:
        metrics.on_admitted(rid, 5, n=1, max_tokens=4)
    metrics.on_scheduled(list(owners), num_scheduled_tokens=15, owners=owners)
    clock.now += 0.03
    metrics.on_step(list(owners), owners)
    clock.now += 0.02
    metrics.on_step(["s", "l"], owners)
    metrics.on_request_end("s", FinishReason.STOP)
    metrics.on_request_end("l", FinishReason.LENGTH)
    metrics.on_request_end("a", FinishReason.ABORT)
    response = generate_pb2.GetStatsResponse(num_running=2, num_kv_blocks=10, num_free_kv_blocks=4,
                                             prefix_cache_query_tokens=30, prefix_cache_hit_tokens=12,
                                             spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                                             spec_decode_num_accepted_tokens=7,
                                             spec_decode_num_accepted_tokens_per_pos=[4, 2, 1])
    fill_stats_response(response, metrics.snapshot())
    info = ModelInfo(model_name="the-model", max_model_len=128, vocab_size=100, block_size=16, num_kv_blocks=10,
                     num_swap_blocks=3, eos_token_ids=(2,), has_tokenizer=True, has_chat_template=False)
    text = render_metrics(ServerStats.from_response(response), ServedModel(model_name, info)).decode()
    return text, {family.name: family for family in text_string_to_metric_families(text)}


def test_vllm_families_have_vllms_types_labels_and_values():
    text, families = _rendered()
    for kind, names in VLLM_FAMILIES.items():
        for name in names:
            assert families[name].type == kind, name
            exposed = name + "_total" if kind == "counter" else name  # prometheus_client's (and vLLM's) text
            assert f"# HELP {exposed} " in text and f"# TYPE {exposed} {kind}\n" in text
            for sample in families[name].samples:
                assert (sample.labels["model_name"], sample.labels["engine"]) == (SERVED_NAME, "0"), sample
    value = {(s.name, s.labels.get("finished_reason"), s.labels.get("le")): s.value
             for family in families.values() for s in family.samples if s.labels.get("model_name") == SERVED_NAME}
    assert value[("vllm:kv_cache_usage_perc", None, None)] == pytest.approx(0.6)
    assert value[("vllm:gpu_cache_usage_perc", None, None)] == pytest.approx(0.6)
    assert value[("vllm:num_requests_running", None, None)] == 2
    assert value[("vllm:prefix_cache_queries_total", None, None)] == 30
    assert value[("vllm:prefix_cache_hits_total", None, None)] == 12
    assert value[("vllm:generation_tokens_total", None, None)] == 5
    assert value[("vllm:spec_decode_num_accepted_tokens_total", None, None)] == 7
    positions = {s.labels["position"]: s.value for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
                 if s.name.endswith("_total")}
    assert positions == {"0": 4, "1": 2, "2": 1}
    for reason in ("stop", "length", "abort"):
        assert value[("vllm:request_success_total", reason, None)] == 1
    assert value[("vllm:e2e_request_latency_seconds_count", None, None)] == 2
    assert value[("vllm:e2e_request_latency_seconds_bucket", None, "0.3")] == 2  # cumulative
    assert value[("vllm:time_to_first_token_seconds_bucket", None, "0.02")] == 0
    assert value[("vllm:time_to_first_token_seconds_bucket", None, "0.04")] == 3
    assert value[("vllm:inter_token_latency_seconds_count", None, None)] == 2
    assert value[("vllm:time_per_output_token_seconds_count", None, None)] == 2  # the older name, same data
    assert value[("vllm:request_generation_tokens_bucket", None, "2.0")] == 2
    assert value[("vllm:request_generation_tokens_bucket", None, "1.0")] == 0
    assert value[("vllm:iteration_tokens_total_sum", None, None)] == 15
    info = families["vllm:cache_config_info"].samples[0]
    assert (info.value, info.labels["block_size"], info.labels["num_gpu_blocks"]) == (1, "16", "10")
    # The label value on the wire is escaped as the text format requires, and parsed back intact above.
    assert 'model_name="tiny \\"qwen\\" \\\\ metrics"' in text


def test_the_text_format_is_strict_exposition():
    """Beyond what the parser tolerates: every sample belongs to the family whose HELP and TYPE precede it,
    counters end in _total, histogram buckets rise to +Inf and +Inf equals _count, bounds strictly increase."""
    text, _ = _rendered(model_name="plain")
    family, kind = None, None
    buckets: dict[str, list[tuple[str, float]]] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            family = line.split()[2]
            continue
        if line.startswith("# TYPE "):
            assert line.split()[2] == family
            kind = line.split()[3]
            continue
        match = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)', line)
        assert match, line
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if kind == "counter":  # HELP and TYPE name the counter with its _total, as vLLM's own /metrics does
            assert family.endswith("_total"), family
        suffixes = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}[kind]
        assert any(name == family + suffix for suffix in suffixes), (family, kind, line)
        if name.endswith("_bucket"):
            le = re.search(r'le="([^"]+)"', labels).group(1)
            buckets.setdefault(family, []).append((le, value))
        if kind == "histogram" and name.endswith("_count"):
            counts[family] = value
    assert set(buckets) == set(counts) and len(buckets) == 14 + 3  # vLLM's and pagedserve's histograms
    for name, series in buckets.items():
        assert series[-1][0] == "+Inf" and series[-1][1] == counts[name]
        values = [value for _, value in series]
        assert values == sorted(values), name
        bounds = [float(le) for le, _ in series[:-1]]
        assert bounds == sorted(set(bounds)), name


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("models"), "qwen2", seed=4)
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--max-model-len", "128",
                        "--num-kv-blocks", "64", "--served-model-name", SERVED_NAME, http=True) as running:
        yield running


def scrape_text(server) -> str:
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as response:
        return response.read().decode()


def scrape(server) -> dict[str, float]:
    return {(sample.name + _labels(sample.labels)): sample.value
            for family in text_string_to_metric_families(scrape_text(server)) for sample in family.samples}


def _labels(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def test_metrics_parse_and_move_as_requests_run(server):
    from openai import OpenAI

    before = scrape(server)
    assert before["pagedserve_scheduler_up"] == 1
    assert before["pagedserve_kv_cache_usage_ratio"] == 0
    prompts = [list(range(3, 23)), [9, 10, 11]]  # 20 tokens: one full block for the prefix cache to look up
    with OpenAI(base_url=f"{server.http_url}/v1", api_key="-", max_retries=0) as api:
        completion = api.completions.create(model=SERVED_NAME, prompt=prompts, max_tokens=6, temperature=0)
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


def test_vllm_metrics_count_requests_by_finished_reason_and_phase(server):
    labels = {"engine": "0", "model_name": SERVED_NAME}
    before = scrape(server)
    with server.client() as client:
        probe = client.generate([5, 6, 7], max_tokens=6, temperature=0, ignore_eos=True)  # length
        assert probe.finish_reason == "length"
        stopped = client.generate([5, 6, 7], max_tokens=6, temperature=0, ignore_eos=True,
                                  stop_token_ids=[probe.token_ids[2]])  # stop, at its third token or before
        assert stopped.finish_reason == "stop"
        stream = client.generate_stream([8, 9], request_id="metrics-abort", max_tokens=100, ignore_eos=True)
        next(stream)
        assert client.abort("metrics-abort")
        assert [chunk.finish_reason for chunk in stream][-1] == "abort"
    after = scrape(server)

    def moved(name: str, **extra: str) -> float:
        key = name + _labels({**labels, **extra})
        return after[key] - before.get(key, 0.0)

    for reason in ("stop", "length", "abort"):
        assert moved("vllm:request_success_total", finished_reason=reason) == 1, reason
    for phase in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                  "request_inference_time", "request_time_per_output_token"):
        assert moved(f"vllm:{phase}_seconds_count") == 2, phase  # the stopped and the length-capped one
        assert moved(f"vllm:{phase}_seconds_bucket", le="+Inf") == 2, phase
    assert moved("vllm:e2e_request_latency_seconds_sum") > 0
    assert moved("vllm:time_to_first_token_seconds_count") == 3  # the aborted one got its first token too
    assert moved("vllm:request_prompt_tokens_sum") == 6
    assert moved("vllm:request_generation_tokens_sum") == 6 + len(stopped.token_ids)
    assert moved("vllm:request_params_max_tokens_sum") == 12
    assert moved("vllm:prompt_tokens_total") == 3 + 3 + 2
    assert moved("vllm:generation_tokens_total") >= 6 + len(stopped.token_ids) + 1
    assert moved("vllm:iteration_tokens_total_count") >= 6
    assert after["vllm:num_requests_running" + _labels(labels)] == 0
    assert after["vllm:kv_cache_usage_perc" + _labels(labels)] == 0


def test_every_metric_the_dashboard_queries_is_exported(server):
    families = {family.name for family in text_string_to_metric_families(scrape_text(server))}
    samples = {sample.name for family in text_string_to_metric_families(scrape_text(server))
               for sample in family.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for expr in _expressions(dashboard) for name in re.findall(r"vllm:[a-zA-Z0-9_:]+", expr)}
    assert len(queried) >= 12
    missing = sorted(name for name in queried if name not in samples and name not in families)
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "model_name")
    assert "vllm:" in json.dumps(variable["query"])
    assert all('model_name=~"$model_name"' in expr or "model_name=\"$model_name\"" in expr
               for expr in _expressions(dashboard) if "vllm:" in expr and "label_values" not in expr)


def _expressions(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [expr for key, value in node.items() if key != "expr" for expr in _expressions(value)]
    if isinstance(node, list):
        return [expr for value in node for expr in _expressions(value)]
    return []
