"""The scheduler's serving metrics (GetStats): histograms with vLLM's buckets (histogram.py), what the engine
feeds them (serving_metrics.py), and their copy onto the wire (stats_response.py)."""

from scheduler_svc.metrics.histogram import Histogram, HistogramSnapshot
from scheduler_svc.metrics.serving_metrics import ServingMetrics, ServingMetricsSnapshot
from scheduler_svc.metrics.stats_response import fill_stats_response

__all__ = ["Histogram", "HistogramSnapshot", "ServingMetrics", "ServingMetricsSnapshot", "fill_stats_response"]
