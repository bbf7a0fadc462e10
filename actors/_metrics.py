"""Per-model measurements: hdrhistogram latencies (integer µs from trio time deltas),
counters and batch fill. Recording is O(1); percentiles are computed on demand."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from fractions import Fraction

import attrs
import numpy as np
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
    """An hdrhistogram of microseconds; counts values above its range as overflow.

    ``record`` only appends to a buffer (~0.1 µs); the buffer is folded into the
    histogram in bulk (vectorised, exactly what ``record_value`` would do per value)
    when it fills or before any read. hdrh's own ``record_value`` is pure Python at
    ~1.5 µs, which on the per-request path was 7% of the event loop's time.
    """

    __slots__ = ("_pending", "hist", "overflow", "total_us")
    _FOLD_AT = 4096

    def __init__(self) -> None:
        self.hist = HdrHistogram(1, _MAX_US, 2)
        self.overflow = 0
        #: The exact sum of every folded value (overflow included), in µs.
        self.total_us = 0
        self._pending: list[int] = []

    def record(self, seconds: float) -> None:
        pending = self._pending
        pending.append(int(seconds * 1e6))
        if len(pending) >= self._FOLD_AT:
            self.fold()

    def record_many(self, seconds: list[float]) -> None:
        """``record`` each of ``seconds`` (one call for a batch's requests)."""
        pending = self._pending
        pending += [int(v * 1e6) for v in seconds]
        if len(pending) >= self._FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Move buffered values into the histogram."""
        if not self._pending:
            return
        values = np.maximum(np.asarray(self._pending, dtype=np.int64), 1)
        self._pending = []
        self.total_us += int(values.sum())
        h = self.hist
        # hdrh's counts index, vectorised: bit length of (v | sub_bucket_mask) gives the
        # bucket; the sub-bucket is v shifted by the bucket's magnitude.
        _, pow2ceiling = np.frexp((values | h.sub_bucket_mask).astype(np.float64))
        bucket = pow2ceiling - h.unit_magnitude - (h.sub_bucket_half_count_magnitude + 1)
        sub = values >> (bucket + h.unit_magnitude)
        index = ((bucket + 1) << h.sub_bucket_half_count_magnitude) + sub - h.sub_bucket_half_count
        in_range = index < h.counts_len
        self.overflow += int(values.size - np.count_nonzero(in_range))
        values, index = values[in_range], index[in_range]
        if not values.size:
            return
        counts = np.ctypeslib.as_array(h.counts)
        counts += np.bincount(index, minlength=h.counts_len)[: h.counts_len].astype(counts.dtype)
        h.total_count += int(values.size)
        h.min_value = min(h.min_value, int(values.min()))
        h.max_value = max(h.max_value, int(values.max()))

    def summary(self) -> LatencySummary:
        self.fold()
        h = self.hist
        if not h.get_total_count():
            return LatencySummary(
                count=0, p50_ms=0.0, p90_ms=0.0, p99_ms=0.0, max_ms=0.0, mean_ms=0.0,
                overflow=self.overflow,
            )
        q = h.get_percentile_to_value_dict([50, 90, 99])
        return LatencySummary(
            count=h.get_total_count(),
            p50_ms=q[50] / 1e3,
            p90_ms=q[90] / 1e3,
            p99_ms=q[99] / 1e3,
            max_ms=h.get_max_value() / 1e3,
            # the exact mean, from the exact sum (overflow included): hdrh's own
            # get_mean_value walks every bucket in Python, ~20 ms a summary
            mean_ms=self.total_us / (h.get_total_count() + self.overflow) / 1e3,
            overflow=self.overflow,
        )

    def percentile_s(self, percentile: float) -> float:
        """The value at ``percentile`` (0 < percentile <= 100), in seconds, as hdrh's
        ``get_value_at_percentile`` gives it, found with numpy (~10 µs; hdrh's own
        walks every bucket in Python, ~120 µs). 0.0 when nothing was recorded."""
        self.fold()
        h = self.hist
        target = h.get_target_count_at_percentile(percentile)
        if not h.get_total_count():
            return 0.0
        counts = np.ctypeslib.as_array(h.counts)[: h.counts_len]
        index = int(np.searchsorted(np.cumsum(counts), target))
        if index >= h.counts_len:
            return 0.0
        return h.get_highest_equivalent_value(h.get_value_from_index(index)) / 1e6

    def totals(self) -> tuple[int, int]:
        """(values recorded, their exact sum in µs), overflow included."""
        self.fold()
        return self.hist.get_total_count() + self.overflow, self.total_us

    def reset(self) -> None:
        self._pending = []
        self.hist.reset()
        self.overflow = 0
        self.total_us = 0


def values_at(hists: Sequence[HdrHistogram], percentiles: Sequence[float]) -> list[int] | None:
    """The values (µs) at ``percentiles`` (each in (0, 100]) of the values the
    hdrhistograms ``hists`` (of one range) hold together: what hdrh's
    ``get_percentile_to_value_dict`` gives for one histogram holding them all, found
    with numpy (one cumulative sum, tens of µs) where hdrh walks every bucket in Python
    (hundreds of µs a histogram, the most for an empty one). None when they hold none.
    """
    total = sum(h.get_total_count() for h in hists)
    if not total:
        return None
    first = hists[0]
    counts = np.ctypeslib.as_array(first.counts)[: first.counts_len].astype(np.int64)
    for h in hists[1:]:
        counts += np.ctypeslib.as_array(h.counts)[: h.counts_len].astype(np.int64)
    cumulative = np.cumsum(counts)
    last = first.counts_len - 1
    out = []
    for percentile in percentiles:
        target = max(int(min(percentile, 100.0) * total / 100 + 0.5), 1)
        index = min(int(np.searchsorted(cumulative, target)), last)
        out.append(first.get_highest_equivalent_value(first.get_value_from_index(index)))
    return out


#: The names ModelMetrics.statuses counts: items ``retried`` or answered
#: ``model_error``, ``poison`` requests, ``straggler`` batches cut, ``worker_lost``
#: workers, ``worker_broken`` workers replaced because the model kept raising there.
OUTCOMES = (
    "device_lost", "invalid_input", "model_error", "poison", "retried", "straggler",
    "worker_broken", "worker_lost",
)


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
    #: Requests answered with a result after running (a call of ``infer`` or
    #: ``infer_batch``, however many items and batches), and over them, in integer
    #: µs: the wait from arrival to the first execution that ran one of its items,
    #: and the time of the executions that ran its items (each whole, as Triton counts
    #: a batch's time for every request in it).
    requests_run: int = 0
    request_queue_us: int = 0
    request_compute_us: int = 0
    #: When the last batch finished (trio time; None: none has).
    last_batch_end: float | None = None
    #: Abnormal batch outcomes by name (see OUTCOMES).
    statuses: collections.Counter = attrs.Factory(collections.Counter)
    #: Items run, by the ``max_batch_size`` of the copy whose replica ran their batch
    #: (a load's config may change it): the fill is each batch's against its own
    #: copy's, so a reload to a smaller one does not read earlier batches as overfull.
    items_by_max_batch: collections.Counter = attrs.Factory(collections.Counter)
    #: Batches answered with results, on any replica, since the model was loaded.
    #: Never reset (``reset`` leaves it): each replica's breaker weighs a model
    #: raise against its growth (``Breaker.raised``).
    successes: int = 0

    def record_batch(
        self, size: int, seconds: float, end: float | None = None,
        *, max_batch_size: int | None = None,
    ) -> None:
        """A batch of ``size`` items ran in ``seconds``, closed under ``max_batch_size``
        (its copy's; None: this model's)."""
        self.successes += 1
        self.batches += 1
        self.items += size
        self.items_by_max_batch[max_batch_size or self.max_batch_size] += size
        if end is not None:
            self.last_batch_end = end
        self.batch_exec.record(seconds)

    def record_request(self, queued: float, computed: float) -> None:
        """One request answered: ``queued`` seconds before its first execution,
        ``computed`` seconds of the executions that ran it."""
        self.requests_run += 1
        self.request_queue_us += int(queued * 1e6)
        self.request_compute_us += int(computed * 1e6)

    @property
    def fill_ratio(self) -> float:
        """Mean batch fill: each batch's items over the max_batch_size of the copy
        that ran it, averaged over the batches."""
        if not self.batches:
            return 0.0
        by_max = self.items_by_max_batch
        if len(by_max) == 1:  # one max_batch_size throughout: exact
            ((largest, items),) = by_max.items()
            return items / (self.batches * largest)
        return float(
            sum(Fraction(items, largest) for largest, items in by_max.items()) / self.batches
        )

    def reset(self) -> None:
        for lat in (self.queue_wait, self.batch_exec, self.end_to_end):
            lat.reset()
        self.batches = self.items = 0
        self.items_by_max_batch.clear()
        self.requests_run = self.request_queue_us = self.request_compute_us = 0
        self.last_batch_end = None
        self.statuses.clear()
