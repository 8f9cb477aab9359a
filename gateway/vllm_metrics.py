"""The scheduler's GetStats as vLLM's `vllm:*` metric families, so a dashboard or alert built for vLLM works.

Names, types, bucket bounds and labels are vLLM's (vllm/v1/metrics/loggers.py): every family carries
`model_name` (the served model name) and `engine` ("0" for a lone scheduler; "0".."N-1", one sample set per
engine, behind a data-parallel front), and
`vllm:request_success_total` also `finished_reason` (stop, length, abort). Two names export one histogram:
`vllm:time_per_output_token_seconds` is vLLM's older name of `vllm:inter_token_latency_seconds` (each gap
between a request's token steps); `vllm:request_time_per_output_token_seconds` is the per-request mean.
`vllm:gpu_cache_usage_perc` is the older name of `vllm:kv_cache_usage_perc`; `vllm:num_requests_swapped` is
vLLM V0's (V1 does not swap; pagedserve does).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from client.types import LatencyHistogram, ModelInfo, ServerStats

_LABELS = ("model_name", "engine")
_ENGINE = "0"


@dataclass(frozen=True)
class ServedModel:
    """Who the metrics are about: the name clients use (--served-model-name, else the model's) and its info."""

    name: str
    info: ModelInfo


def vllm_families(stats: ServerStats, served: ServedModel) -> Iterator[Metric]:
    """Every family, with one sample set per engine: a data-parallel front's stats carry each engine's own
    (`engine` "0".."N-1", as vLLM's data-parallel engines); a lone scheduler's are engine "0"."""
    engines = [(str(entry.engine), entry.stats) for entry in stats.engines] or [(_ENGINE, stats)]
    merged: dict[str, Metric] = {}
    for engine, engine_stats in engines:
        for family in _engine_families(engine_stats, served, engine):
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family
    yield from merged.values()


def _engine_families(stats: ServerStats, served: ServedModel, engine: str) -> Iterator[Metric]:
    labels = [served.name, engine]
    kv_cache_usage = used_fraction(stats.num_kv_blocks, stats.num_free_kv_blocks)
    gauges = (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
        ("vllm:num_requests_swapped", "Number of requests swapped to CPU.", stats.num_swapped),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage),
        ("vllm:gpu_cache_usage_perc",
         "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
         kv_cache_usage),
    )
    for name, documentation, value in gauges:
        gauge = GaugeMetricFamily(name, documentation, labels=_LABELS)
        gauge.add_metric(labels, value)
        yield gauge
    yield _cache_config_info(served, engine)
    counters = (
        ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.num_preemptions),
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.num_prompt_tokens),
        ("vllm:generation_tokens", "Number of generation tokens processed.", stats.num_generation_tokens),
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
         stats.prefix_cache_query_tokens),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
         stats.prefix_cache_hit_tokens),
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", stats.spec_decode_num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", stats.spec_decode_num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", stats.spec_decode_num_accepted_tokens),
    )
    for name, documentation, value in counters:
        counter = CounterMetricFamily(name, documentation, labels=_LABELS)
        counter.add_metric(labels, value)
        yield counter
    per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted tokens per draft position.", labels=(*_LABELS, "position"))
    for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
        per_position.add_metric([*labels, str(position)], value)
    yield per_position
    success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                  labels=(*_LABELS, "finished_reason"))
    for reason, value in (("stop", stats.num_finished_stop), ("length", stats.num_finished_length),
                          ("abort", stats.num_finished_abort)):
        success.add_metric([*labels, reason], value)
    yield success
    histograms = (
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         stats.time_to_first_token),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
         stats.inter_token_latency),
        ("vllm:time_per_output_token_seconds",
         "Histogram of time per output token in seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
         stats.inter_token_latency),
        ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
         stats.time_per_output_token),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
         stats.e2e_request_latency),
        ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
         stats.request_queue_time),
        ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
         stats.request_prefill_time),
        ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
         stats.request_decode_time),
        ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
         stats.request_inference_time),
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", stats.request_prompt_tokens),
        ("vllm:request_generation_tokens", "Number of generation tokens processed.",
         stats.request_generation_tokens),
        ("vllm:request_params_n", "Histogram of the n request parameter.", stats.request_params_n),
        ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
         stats.request_params_max_tokens),
        ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", stats.iteration_tokens),
    )
    for name, documentation, histogram in histograms:
        yield histogram_family(name, documentation, histogram, _LABELS, labels)


def histogram_family(name: str, documentation: str, histogram: LatencyHistogram,
                     label_names: tuple[str, ...] = (), label_values: list[str] | None = None) -> HistogramMetricFamily:
    """Per-bucket counts -> Prometheus' cumulative `le` buckets, ending with +Inf (= the count)."""
    buckets, cumulative = [], 0
    for upper_bound, count in zip(histogram.upper_bounds, histogram.counts):
        cumulative += count
        buckets.append((floatToGoString(upper_bound), cumulative))
    buckets.append(("+Inf", histogram.count))
    family = HistogramMetricFamily(name, documentation, labels=label_names)
    family.add_metric(label_values or [], buckets, sum_value=histogram.sum)
    return family


def _cache_config_info(served: ServedModel, engine: str) -> GaugeMetricFamily:
    """vLLM's info gauge (always 1) whose labels carry the KV-cache configuration."""
    info = served.info
    values = {"model_name": served.name, "engine": engine, "block_size": str(info.block_size),
              "num_gpu_blocks": str(info.num_kv_blocks), "num_cpu_blocks": str(info.num_swap_blocks)}
    family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                               labels=tuple(values))
    family.add_metric(list(values.values()), 1)
    return family


def used_fraction(total: int, free: int) -> float:
    return (total - free) / total if total else 0.0
