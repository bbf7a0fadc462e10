"""Per-model measurements: hdrhistogram latencies (integer µs from trio time deltas),
counters and batch fill. Recording is O(1); percentiles are computed on demand."""

from __future__ import annotations

import collections

import attrs
from hdrh.histogram import HdrHistogram

_MAX_US = 3_600_000_000  # one hour


@attrs.frozen(kw_only=True)
class LatencySummary:
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    overflow: int


class Latency:
    """An hdrhistogram of microseconds; counts values above its range as overflow."""

    __slots__ = ("hist", "overflow")

    def __init__(self) -> None:
        self.hist = HdrHistogram(1, _MAX_US, 2)
        self.overflow = 0

    def record(self, seconds: float) -> None:
        us = int(seconds * 1e6)
        if not self.hist.record_value(us if us > 0 else 1):
            self.overflow += 1

    def summary(self) -> LatencySummary:
        h = self.hist
        q = h.get_percentile_to_value_dict([50, 90, 99])
        return LatencySummary(
            count=h.get_total_count(),
            p50_ms=q[50] / 1e3,
            p90_ms=q[90] / 1e3,
            p99_ms=q[99] / 1e3,
            max_ms=h.get_max_value() / 1e3,
            mean_ms=h.get_mean_value() / 1e3 if h.get_total_count() else 0.0,
            overflow=self.overflow,
        )

    def reset(self) -> None:
        self.hist.reset()
        self.overflow = 0


@attrs.define(eq=False)
class ModelMetrics:
    """What one model's actors record."""

    model: str
    max_batch_size: int
    queue_wait: Latency = attrs.Factory(Latency)
    batch_exec: Latency = attrs.Factory(Latency)
    end_to_end: Latency = attrs.Factory(Latency)
    batches: int = 0
    items: int = 0
    statuses: collections.Counter = attrs.Factory(collections.Counter)

    def record_batch(self, size: int, seconds: float) -> None:
        self.batches += 1
        self.items += size
        self.batch_exec.record(seconds)

    @property
    def fill_ratio(self) -> float:
        """Mean batch fill: items per batch over max_batch_size."""
        return self.items / (self.batches * self.max_batch_size) if self.batches else 0.0

    def reset(self) -> None:
        for lat in (self.queue_wait, self.batch_exec, self.end_to_end):
            lat.reset()
        self.batches = self.items = 0
        self.statuses.clear()
