"""Serving metrics the scheduler keeps for GetStats: token totals, finished reasons and histograms.

Why on the scheduler and not in the gateway: admission, scheduling and every generated token happen here,
so the numbers mean the same whatever front end a request came through (gRPC SDK, OpenAI gateway, offline
LLM) and include the queueing the front ends cannot see. The gateway only renders them (gateway/metrics.py),
under vLLM's names.

Ownership: the Engine owns one `ServingMetrics` and feeds it from its loop (a request admitted, a plan sent,
a step's sampled tokens, a request's end); GetStats reads a `ServingMetricsSnapshot`. Everything runs on the
scheduler's one asyncio loop, so nothing here locks. Per client request (n sequences or beams of one request
are one observation), as in vLLM's RequestStateStats:
- queue time: admission -> the first plan that scheduled any of its tokens;
- prefill time: first scheduled -> the first step that sampled a token for any of its sequences;
- decode time: first token -> last token; inference time: first scheduled -> last token;
- time to first token: admission -> first token (observed then, so requests aborted later count too);
- inter-token latency: each gap between two of its token steps (observed as they happen);
- time per output token: its mean gap, (last token - first token) / (token steps - 1), at its end;
- end-to-end latency: admission -> finished.
A request's end is counted by its finish reason (stop, length or abort); the per-request histograms (all but
time to first token and inter-token latency) observe only requests that finished with stop or length.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from scheduler_svc.core.request import FinishReason
from scheduler_svc.metrics.histogram import (
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    Histogram,
    HistogramSnapshot,
    one_two_five_buckets,
)


@dataclass(frozen=True)
class ServingMetricsSnapshot:
    num_prompt_tokens: int
    num_generation_tokens: int
    num_finished: Mapping[FinishReason, int]  # every reason present
    time_to_first_token: HistogramSnapshot
    inter_token_latency: HistogramSnapshot
    time_per_output_token: HistogramSnapshot
    e2e_request_latency: HistogramSnapshot
    request_queue_time: HistogramSnapshot
    request_prefill_time: HistogramSnapshot
    request_decode_time: HistogramSnapshot
    request_inference_time: HistogramSnapshot
    request_prompt_tokens: HistogramSnapshot
    request_generation_tokens: HistogramSnapshot
    request_params_n: HistogramSnapshot
    request_params_max_tokens: HistogramSnapshot
    iteration_tokens: HistogramSnapshot


class _HasRequestId(Protocol):
    request_id: str


@dataclass
class _RequestTimeline:
    """One client request's moments and sizes while it is in the engine; dropped when it ends."""

    admitted: float
    num_prompt_tokens: int
    n: int
    max_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_token_steps: int = 0
    num_generation_tokens: int = 0


class ServingMetrics:
    def __init__(self, max_model_len: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._in_flight: dict[str, _RequestTimeline] = {}  # client request id -> its timeline
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_finished = dict.fromkeys(FinishReason, 0)
        token_buckets = one_two_five_buckets(max_model_len)
        self._histograms: dict[str, Histogram] = {
            "time_to_first_token": Histogram(TIME_TO_FIRST_TOKEN_BUCKETS),
            "inter_token_latency": Histogram(TIME_PER_OUTPUT_TOKEN_BUCKETS),
            "time_per_output_token": Histogram(TIME_PER_OUTPUT_TOKEN_BUCKETS),
            "e2e_request_latency": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_queue_time": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_prefill_time": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_decode_time": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_inference_time": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_prompt_tokens": Histogram(token_buckets),
            "request_generation_tokens": Histogram(token_buckets),
            "request_params_n": Histogram(REQUEST_PARAMS_N_BUCKETS),
            "request_params_max_tokens": Histogram(token_buckets),
            "iteration_tokens": Histogram(ITERATION_TOKENS_BUCKETS),
        }

    def on_admitted(self, request_id: str, num_prompt_tokens: int, n: int, max_tokens: int) -> None:
        self._in_flight[request_id] = _RequestTimeline(self._clock(), num_prompt_tokens, n, max_tokens)
        self._num_prompt_tokens += num_prompt_tokens

    def on_scheduled(self, new_member_ids: Iterable[str], num_scheduled_tokens: int,
                     owners: Mapping[str, _HasRequestId]) -> None:
        """A plan was sent: `new_member_ids` are the scheduler requests it schedules for the first time since
        they (re)entered the running set; a client request's first one marks the end of its queueing."""
        now = self._clock()
        if num_scheduled_tokens > 0:
            self._histograms["iteration_tokens"].observe(num_scheduled_tokens)
        for member_id in new_member_ids:
            owner = owners.get(member_id)
            timeline = None if owner is None else self._in_flight.get(owner.request_id)
            if timeline is not None and timeline.scheduled is None:
                timeline.scheduled = now

    def on_step(self, member_ids: Iterable[str], owners: Mapping[str, _HasRequestId]) -> None:
        """One step's outcome: `member_ids` are the scheduler requests that got a token (sampled, or beam
        candidates); `owners` maps each to the client request (group) it belongs to."""
        now = self._clock()
        tokens_per_request: dict[str, int] = {}
        num_tokens = 0
        owner_of = owners.get  # names bound once: this runs for every token of every step
        for member_id in member_ids:
            num_tokens += 1
            owner = owner_of(member_id)
            if owner is not None:
                request_id = owner.request_id
                tokens_per_request[request_id] = tokens_per_request.get(request_id, 0) + 1
        self._num_generation_tokens += num_tokens
        in_flight = self._in_flight
        inter_token_latency = self._histograms["inter_token_latency"]
        for request_id, num_tokens in tokens_per_request.items():
            timeline = in_flight.get(request_id)
            if timeline is None:
                continue
            if timeline.first_token is None:
                timeline.first_token = now
                self._histograms["time_to_first_token"].observe(now - timeline.admitted)
            else:
                inter_token_latency.observe(now - timeline.last_token)
            timeline.last_token = now
            timeline.num_token_steps += 1
            timeline.num_generation_tokens += num_tokens

    def on_request_end(self, request_id: str, finish_reason: FinishReason) -> None:
        """A client request left the engine: finished by stop or length, or aborted / refused (ABORT)."""
        timeline = self._in_flight.pop(request_id, None)
        if timeline is None:
            return
        self._num_finished[finish_reason] += 1
        if finish_reason is FinishReason.ABORT:
            return
        now = self._clock()
        scheduled = timeline.scheduled if timeline.scheduled is not None else timeline.admitted
        first_token = timeline.first_token if timeline.first_token is not None else now
        last_token = timeline.last_token if timeline.last_token is not None else now
        observe = {
            "e2e_request_latency": now - timeline.admitted,
            "request_queue_time": scheduled - timeline.admitted,
            "request_prefill_time": first_token - scheduled,
            "request_decode_time": last_token - first_token,
            "request_inference_time": last_token - scheduled,
            "request_prompt_tokens": timeline.num_prompt_tokens,
            "request_generation_tokens": timeline.num_generation_tokens,
            "request_params_n": timeline.n,
            "request_params_max_tokens": timeline.max_tokens,
        }
        if timeline.num_token_steps >= 2:
            observe["time_per_output_token"] = (last_token - first_token) / (timeline.num_token_steps - 1)
        for name, value in observe.items():
            self._histograms[name].observe(value)

    def snapshot(self) -> ServingMetricsSnapshot:
        return ServingMetricsSnapshot(
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_finished=dict(self._num_finished),
            **{name: histogram.snapshot() for name, histogram in self._histograms.items()},
        )
