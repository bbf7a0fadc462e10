import numpy as np
from hdrh.histogram import HdrHistogram
from hypothesis import given
from hypothesis import strategies as st
from trioserve.actors import Latency


@given(values=st.lists(st.integers(min_value=0, max_value=10**13), max_size=300))
def test_bulk_fold_equals_per_value_recording(values):
    lat = Latency()
    ref = HdrHistogram(1, 3_600_000_000, 2)
    overflow = 0
    for us in values:
        lat.record(us / 1e6)
        overflow += not ref.record_value(max(int(us / 1e6 * 1e6), 1))
    lat.fold()
    assert np.array_equal(np.ctypeslib.as_array(lat.hist.counts), np.ctypeslib.as_array(ref.counts))
    assert lat.hist.total_count == ref.total_count
    assert lat.overflow == overflow
    if ref.total_count:
        assert lat.hist.min_value == ref.min_value
        assert lat.hist.max_value == ref.max_value
    # the exact count and sum, overflow included (values below 1 µs count as 1)
    assert lat.totals() == (len(values), sum(max(int(us / 1e6 * 1e6), 1) for us in values))


def test_summary_reads_buffered_values():
    lat = Latency()
    for ms in (1, 2, 3, 4, 100):
        lat.record(ms / 1e3)
    s = lat.summary()
    assert s.count == 5
    assert 2.9 <= s.p50_ms <= 3.1
    assert 99 <= s.max_ms <= 101
    lat.record(0.5)  # still buffered: totals() folds it
    assert lat.totals() == (6, 1_000 + 2_000 + 3_000 + 4_000 + 100_000 + 500_000)
    lat.reset()
    assert lat.summary().count == 0
    assert lat.totals() == (0, 0)
