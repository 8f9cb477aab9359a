"""The front's GetStats: the engines' responses summed into one, as if one engine had served everything, and
each engine's own beside the sums (`engines`, for the metrics' `engine` label).

Counters, gauges (queue lengths, block counts) and histograms (same bounds on every engine: the engines run one
build) add up; the prefix-cache hit rate is recomputed from the summed hits and queries; per-position counts
add position by position. Read from the message's descriptor, so a field added to GetStatsResponse is summed
without a change here.
"""

from __future__ import annotations

from collections.abc import Sequence

from protos.pagedserve.v1 import generate_pb2

_HISTOGRAM = generate_pb2.LatencyHistogram.DESCRIPTOR


def front_stats(per_engine: dict[int, generate_pb2.GetStatsResponse], routed: Sequence[int],
                in_flight: Sequence[int], policy: str) -> generate_pb2.GetStatsResponse:
    """The sums of the engines that answered (`per_engine`: engine index -> its GetStats), each of them, and the
    router's counts per engine."""
    total = summed_stats(list(per_engine.values()))
    total.router_policy = policy
    for engine, stats in sorted(per_engine.items()):
        total.engines.add(engine=engine, stats=stats, routed_requests=routed[engine],
                          in_flight_requests=in_flight[engine])
    return total


def summed_stats(responses: Sequence[generate_pb2.GetStatsResponse]) -> generate_pb2.GetStatsResponse:
    total = generate_pb2.GetStatsResponse()
    for field in generate_pb2.GetStatsResponse.DESCRIPTOR.fields:
        if field.message_type is _HISTOGRAM:
            _add_histograms(getattr(total, field.name), [getattr(r, field.name) for r in responses])
        elif field.message_type is not None:  # engines: the front fills them in
            continue
        elif field.is_repeated:
            values = [list(getattr(r, field.name)) for r in responses]
            getattr(total, field.name).extend(_add_elementwise(values))
        elif field.type not in (field.TYPE_DOUBLE, field.TYPE_STRING):  # the hit rate: below; the policy: the front's
            setattr(total, field.name, sum(getattr(r, field.name) for r in responses))
    if total.prefix_cache_query_tokens:
        total.prefix_cache_hit_rate = total.prefix_cache_hit_tokens / total.prefix_cache_query_tokens
    return total


def _add_histograms(total: generate_pb2.LatencyHistogram, parts: list[generate_pb2.LatencyHistogram]) -> None:
    bounded = [part for part in parts if part.upper_bounds]
    if bounded:
        total.upper_bounds.extend(bounded[0].upper_bounds)
    total.counts.extend(_add_elementwise([list(part.counts) for part in parts]))
    total.sum = sum(part.sum for part in parts)
    total.count = sum(part.count for part in parts)


def _add_elementwise(rows: list[list[int]]) -> list[int]:
    width = max((len(row) for row in rows), default=0)
    return [sum(row[i] for row in rows if i < len(row)) for i in range(width)]
