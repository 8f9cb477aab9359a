"""ServingMetricsSnapshot -> GetStatsResponse's metric fields (15 and up); the engine's counters (1 to 14) are
copied by the servicer from EngineStats."""

from __future__ import annotations

import dataclasses

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.core.request import FinishReason
from scheduler_svc.metrics.histogram import HistogramSnapshot
from scheduler_svc.metrics.serving_metrics import ServingMetricsSnapshot

_FINISHED_FIELDS = {
    FinishReason.STOP: "num_finished_stop",
    FinishReason.LENGTH: "num_finished_length",
    FinishReason.ABORT: "num_finished_abort",
}


def fill_stats_response(response: generate_pb2.GetStatsResponse, snapshot: ServingMetricsSnapshot) -> None:
    response.num_prompt_tokens = snapshot.num_prompt_tokens
    response.num_generation_tokens = snapshot.num_generation_tokens
    for reason, field_name in _FINISHED_FIELDS.items():
        setattr(response, field_name, snapshot.num_finished[reason])
    for field in dataclasses.fields(snapshot):
        histogram = getattr(snapshot, field.name)
        if isinstance(histogram, HistogramSnapshot):
            wire = getattr(response, field.name)
            wire.upper_bounds.extend(histogram.upper_bounds)
            wire.counts.extend(histogram.counts)
            wire.sum = histogram.sum
            wire.count = histogram.count
