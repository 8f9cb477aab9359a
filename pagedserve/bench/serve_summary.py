"""`bench serve`'s printed summary and its JSON record, in `vllm bench serve`'s layout and key names.

The summary block prints the same labels, widths and order as vLLM's (a script that parses vLLM's output
parses ours); the JSON record has vLLM's --save-result keys: the run's settings, the totals, for each of
--percentile-metrics mean/median/std and pNN in milliseconds, and the per-request lists (input_lens,
output_lens, ttfts, itls, latencies, errors, ...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.bench.request_outcome import RequestOutcome
from pagedserve.bench.serve_metrics import BenchmarkMetrics

METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass(frozen=True)
class RunSettings:
    """What the summary and the record say about how the run was driven."""

    backend: str
    label: str
    model_id: str
    tokenizer_id: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    percentile_metrics: tuple[str, ...]
    goodput: dict[str, float]


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def summary_lines(metrics: BenchmarkMetrics, settings: RunSettings, duration_s: float) -> list[str]:
    row = "{:<40} {:<10}".format
    num = "{:<40} {:<10.2f}".format
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             row("Successful requests:", metrics.completed),
             row("Failed requests:", metrics.failed)]
    if settings.max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", settings.max_concurrency))
    if not math.isinf(settings.request_rate):
        lines.append(num("Request rate configured (RPS):", settings.request_rate))
    lines += [num("Benchmark duration (s):", duration_s),
              row("Total input tokens:", metrics.total_input),
              row("Total generated tokens:", metrics.total_output),
              num("Request throughput (req/s):", metrics.request_throughput)]
    if settings.goodput:
        lines.append(num("Request goodput (req/s):", metrics.request_goodput))
    lines += [num("Output token throughput (tok/s):", metrics.output_throughput),
              num("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s),
              num("Peak concurrent requests:", metrics.max_concurrent_requests),
              num("Total token throughput (tok/s):", metrics.total_token_throughput)]
    for name in settings.percentile_metrics:
        short, header = METRIC_HEADERS[name]
        stats = metrics.latency[name]
        lines += ["{s:{c}^{n}}".format(s=header, n=50, c="-"),
                  num(f"Mean {short} (ms):", stats.mean_ms),
                  num(f"Median {short} (ms):", stats.median_ms)]
        lines += [num(f"P{percentile_word(p)} {short} (ms):", value) for p, value in stats.percentiles]
    lines.append("=" * 50)
    return lines


def result_record(metrics: BenchmarkMetrics, settings: RunSettings, duration_s: float, date: str,
                  outcomes: Sequence[RequestOutcome]) -> dict:
    record = {
        "date": date, "backend": settings.backend, "label": settings.label, "model_id": settings.model_id,
        "tokenizer_id": settings.tokenizer_id, "num_prompts": settings.num_prompts,
        "request_rate": "inf" if math.isinf(settings.request_rate) else settings.request_rate,
        "burstiness": settings.burstiness, "max_concurrency": settings.max_concurrency,
        "duration": duration_s, "completed": metrics.completed, "failed": metrics.failed,
        "total_input_tokens": metrics.total_input, "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if settings.goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    if settings.goodput:
        record["goodput"] = settings.goodput
    for name in settings.percentile_metrics:
        stats = metrics.latency[name]
        record[f"mean_{name}_ms"] = stats.mean_ms
        record[f"median_{name}_ms"] = stats.median_ms
        record[f"std_{name}_ms"] = stats.std_ms
        for p, value in stats.percentiles:
            record[f"p{percentile_word(p)}_{name}_ms"] = value
    record.update({
        "input_lens": [o.prompt_len for o in outcomes],
        "output_lens": list(metrics.output_lens),
        "ttfts": [o.ttft for o in outcomes],
        "itls": [o.itl for o in outcomes],
        "latencies": [o.latency for o in outcomes],
        "start_times": [o.start_time for o in outcomes],
        "generated_texts": [o.generated_text for o in outcomes],
        "errors": [o.error for o in outcomes],
    })
    return record
