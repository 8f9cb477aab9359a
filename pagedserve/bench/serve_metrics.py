"""The arithmetic of `bench serve`'s figures, vLLM's definitions (vllm/benchmarks/serve.py calculate_metrics).

Over successful requests only: TTFT, ITL (every gap of every request, pooled), TPOT per request =
(latency - ttft) / (output_tokens - 1) for requests with more than one output token, E2EL = latency.
Output tokens of a request: the server's usage count, else the tokenizer's count of its text, else its
number of output chunks. Goodput: requests per second that met every --goodput SLO (TPOT 0 for one-token
outputs, as vLLM). Percentiles: numpy's linear interpolation, as vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedserve.bench.prompt_tokenizer import TextTokenizer
from pagedserve.bench.request_outcome import RequestOutcome

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class LatencyStats:
    """One metric's summary in milliseconds: `percentiles` pairs (p, value) in --metric-percentiles order."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
        values = np.asarray(seconds if len(seconds) else [0.0]) * 1000.0
        return cls(float(np.mean(values)), float(np.median(values)), float(np.std(values)),
                   tuple((p, float(np.percentile(values, p))) for p in percentiles))


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latency: dict[str, LatencyStats]  # keyed by PERCENTILE_METRICS
    output_lens: tuple[int, ...]  # per request, 0 for a failed one


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """`ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); ValueError naming a bad pair."""
    slos = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: expected NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {pair!r}: the SLO must be non-negative")
    return slos


def output_tokens(outcome: RequestOutcome, tokenizer: TextTokenizer | None) -> int:
    if outcome.output_tokens is not None:
        return outcome.output_tokens
    if tokenizer is not None:
        return len(tokenizer.encode(outcome.generated_text))
    return outcome.num_output_chunks


def calculate_metrics(outcomes: Sequence[RequestOutcome], duration_s: float, tokenizer: TextTokenizer | None,
                      percentiles: Sequence[float], goodput: dict[str, float]) -> BenchmarkMetrics:
    output_lens = [output_tokens(o, tokenizer) if o.success else 0 for o in outcomes]
    succeeded = [(o, n) for o, n in zip(outcomes, output_lens) if o.success]
    ttfts = [o.ttft for o, _ in succeeded]
    e2els = [o.latency for o, _ in succeeded]
    itls = [gap for o, _ in succeeded for gap in o.itl]
    all_tpots = [(o.latency - o.ttft) / (n - 1) if n > 1 else 0.0 for o, n in succeeded]
    tpots = [tpot for tpot, (_, n) in zip(all_tpots, succeeded) if n > 1]
    per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
    good = sum(all(per_request[name][i] * 1000.0 <= slo for name, slo in goodput.items())
               for i in range(len(succeeded))) if goodput else 0
    total_input = sum(o.prompt_len for o, _ in succeeded)
    total_output = sum(output_lens)
    return BenchmarkMetrics(
        completed=len(succeeded),
        failed=len(outcomes) - len(succeeded),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(succeeded) / duration_s,
        request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=_peak_output_chunks_per_second([o for o, _ in succeeded]),
        max_concurrent_requests=_peak_concurrency([o for o, _ in succeeded]),
        latency={"ttft": LatencyStats.of(ttfts, percentiles), "tpot": LatencyStats.of(tpots, percentiles),
                 "itl": LatencyStats.of(itls, percentiles), "e2el": LatencyStats.of(e2els, percentiles)},
        output_lens=tuple(output_lens),
    )


def _peak_output_chunks_per_second(outcomes: Sequence[RequestOutcome]) -> float:
    """The most output chunks that arrived within one whole second of the run (vLLM's peak output token
    throughput, which also counts chunks)."""
    if not outcomes:
        return 0.0
    origin = min(o.start_time for o in outcomes)
    buckets: dict[int, int] = {}
    for outcome in outcomes:
        arrival = outcome.start_time + outcome.ttft
        for gap in [0.0, *outcome.itl]:
            arrival += gap
            buckets[int(arrival - origin)] = buckets.get(int(arrival - origin), 0) + 1
    return float(max(buckets.values()))


def _peak_concurrency(outcomes: Sequence[RequestOutcome]) -> int:
    """The most requests in flight at once, over half-open [start, start + latency) intervals."""
    events = sorted([(o.start_time, 1) for o in outcomes] + [(o.start_time + o.latency, -1) for o in outcomes])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak
