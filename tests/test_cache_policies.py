"""The result cache's eviction policies and their sketch driven directly, time an
argument. Property tests use plain hypothesis: LRU against a reference OrderedDict
model, W-TinyLFU against a reference model and its invariants."""

from __future__ import annotations

import collections
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from runtime_helpers import k
from trioserve.actors import (
    Cache,
    CacheKey,
    CountMinSketch,
    LruPolicy,
    WTinyLFU,
)


# ---------------------------------------------------------------- the sketch
def test_sketch_counts_saturate_and_halve_on_reset():
    s = CountMinSketch(64, sample_factor=1000)
    for _ in range(20):
        s.increment(hash("hot"))
    for _ in range(3):
        s.increment(hash("warm"))
    assert s.frequency(hash("hot")) == 15
    assert s.frequency(hash("warm")) >= 3
    assert s.frequency(hash("cold")) <= 1  # collisions may add, never subtract
    s.reset()
    assert s.frequency(hash("hot")) == 7
    assert s.resets == 1


def test_sketch_ages_after_its_sample():
    s = CountMinSketch(10, sample_factor=10)  # a reset after 100 counted additions
    for i in range(99):
        s.increment(i)
    assert s.resets == 0
    s.increment(99)
    assert s.resets == 1
    assert s.additions < 100


@settings(max_examples=50, deadline=None)
@given(keys=st.lists(st.integers(0, 50), max_size=200))
def test_sketch_never_underestimates_before_a_reset(keys):
    s = CountMinSketch(16, sample_factor=1000)
    for key in keys:
        s.increment(hash(key))
    counts = collections.Counter(keys)
    for key, n in counts.items():
        assert s.frequency(hash(key)) >= min(n, 15)


# ---------------------------------------------------------------- LRU against a model
class RefLru:
    """The reference: an OrderedDict of key -> (value, size), least recent first."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.d = collections.OrderedDict()

    def get(self, key):
        if key not in self.d:
            return None
        self.d.move_to_end(key)
        return self.d[key][0]

    def put(self, key, value, size):
        self.d.pop(key, None)
        if size > self.capacity:
            return False
        self.d[key] = (value, size)
        while sum(s for _, s in self.d.values()) > self.capacity:
            self.d.popitem(last=False)
        return True


OPS = st.lists(
    st.tuples(
        st.sampled_from(["get", "put", "remove"]),
        st.integers(0, 12),  # key
        st.integers(1, 40),  # size
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 100), ops=OPS)
def test_lru_policy_equals_the_reference_lru(capacity, ops):
    lru = LruPolicy(capacity)
    ref = RefLru(capacity)
    for n, (op, key, size) in enumerate(ops):
        if op == "get":
            assert lru.get(key, 0.0) == ref.get(key)
        elif op == "put":
            assert lru.put(key, n, size=size, now=0.0) == ref.put(key, n, size)
        else:
            assert lru.remove(key) == (ref.d.pop(key, None) is not None)
        assert lru.keys_by_recency() == list(ref.d)
        assert lru.bytes_used == sum(s for _, s in ref.d.values()) <= capacity


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(["tinylfu", "lru"]),
    capacity=st.integers(1, 200),
    ops=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 250)), max_size=150),
)
def test_byte_capacity_is_never_exceeded(policy, capacity, ops):
    cache = Cache(capacity, policy=policy)
    for n, (key, size) in enumerate(ops):
        ck = k(digest=bytes([key]))
        if cache.get(ck, 0.0) is None:
            resident = cache.put(ck, n, size=size, now=0.0)
            assert not (size > capacity and resident)  # too big: never admitted
        st_ = cache.statistics()
        assert st_.bytes_used <= capacity
        assert st_.bytes_used == sum(cache.policy._data[x].size for x in cache.policy)


class RefTinyLfu:
    """The reference W-TinyLFU, written from its description with plain lists (least
    recent first): a new entry enters the window; the window's overflow, least recent
    first, are candidates, each admitted to probation only by beating, one by one, the
    victims it displaces (probation's least recent, else protected's, else the
    window's; a warm loser still gets in with probability 1/128); a probation hit
    moves to protected, whose overflow goes back to probation. ``freq`` is the
    frequency oracle (the policy's own sketch: the sketch is tested apart)."""

    def __init__(self, capacity, window_max, protected_max, freq, seed):
        self.capacity, self.window_max, self.protected_max = capacity, window_max, protected_max
        self.freq = freq
        self.rng = random.Random(seed)
        self.window, self.probation, self.protected = [], [], []
        self.size = {}

    def _segment(self, key):
        return next((s for s in (self.window, self.probation, self.protected) if key in s), None)

    def _bytes(self, keys):
        return sum(self.size[x] for x in keys)

    def _drop(self, key):
        seg = self._segment(key)
        if seg is not None:
            seg.remove(key)
        del self.size[key]

    def _victim(self):
        return next(s[0] for s in (self.probation, self.protected, self.window) if s)

    def get(self, key):
        seg = self._segment(key)
        if seg is None:
            return False
        seg.remove(key)
        if seg is self.probation:
            self.protected.append(key)
            while self._bytes(self.protected) > self.protected_max:
                self.probation.append(self.protected.pop(0))
        else:
            seg.append(key)
        return True

    def put(self, key, size):
        if key in self.size:
            self._drop(key)
        if size > self.capacity:
            return False
        self.size[key] = size
        self.window.append(key)
        candidates = []
        while self._bytes(self.window) > self.window_max:
            candidates.append(self.window.pop(0))
        for i, c in enumerate(candidates):
            excess = sum(self.size.values()) - self._bytes(candidates[i + 1 :]) - self.capacity
            while excess > 0:
                v = self._victim()
                cf, vf = self.freq(c), self.freq(v)
                if cf > vf or (cf >= 6 and self.rng.getrandbits(7) == 0):
                    excess -= self.size[v]
                    self._drop(v)
                else:
                    del self.size[c]
                    break
            else:
                self.probation.append(c)
        while sum(self.size.values()) > self.capacity:
            self._drop(self._victim())
        return key in self.size


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 150),
    window_fraction=st.sampled_from([0.01, 0.1, 0.3, 0.6]),
    ops=st.lists(
        st.tuples(st.sampled_from(["get", "get", "put", "remove"]), st.integers(0, 12),
                  st.integers(1, 40)),
        max_size=150,
    ),
)
def test_tinylfu_equals_the_reference_model(capacity, window_fraction, ops):
    """Every hit, admission, eviction and segment order of W-TinyLFU is the reference's
    (sizes in bytes; an exact frequency oracle: int keys, a sketch far larger than the
    keys, no aging, no shift detection)."""
    p = WTinyLFU(
        capacity, window_fraction=window_fraction, expected_entries=256, sample_factor=1000,
        detect_shifts=False, seed=3,
    )
    ref = RefTinyLfu(
        capacity, p.window_max, p.protected_max, lambda x: p.sketch.frequency(hash(x)), seed=3
    )
    for n, (op, key, size) in enumerate(ops):
        if op == "get":
            assert (p.get(key, 0.0) is not None) == ref.get(key)
        elif op == "put":
            assert p.put(key, n, size=size, now=0.0) == ref.put(key, size)
        else:
            assert p.remove(key) == (key in ref.size)
            if key in ref.size:
                ref._drop(key)
        assert p.segments() == (ref.window, ref.probation, ref.protected)
        assert p.bytes_used == sum(ref.size.values()) <= capacity


# ---------------------------------------------------------------- W-TinyLFU invariants
class TinyLfuMachine(RuleBasedStateMachine):
    """Random gets, puts (sizes, TTLs, tenants with quotas), removals, invalidations and
    expiry sweeps; after each step the accounting and the bounds must hold, and a value
    returned must be the last one put under that key."""

    def __init__(self):
        super().__init__()
        self.p = WTinyLFU(120, window_fraction=0.05, expected_entries=8, quotas={"q": 50}, seed=1)
        self.now = 0.0
        self.last: dict[CacheKey, int] = {}
        self.n = 0

    keys = st.builds(
        k,
        model=st.sampled_from(["a", "b"]),
        version=st.sampled_from(["1", "2"]),
        namespace=st.sampled_from(["t", "q"]),
        digest=st.binary(min_size=1, max_size=1).map(lambda b: bytes([b[0] % 6])),
    )

    @rule(key=keys)
    def get(self, key):
        v = self.p.get(key, self.now)
        if v is not None:
            assert v == self.last[key]

    @rule(key=keys, size=st.integers(1, 70), ttl=st.sampled_from([math.inf, 1.0, 5.0]))
    def put(self, key, size, ttl):
        self.n += 1
        self.last[key] = self.n
        tenant = key.namespace
        resident = self.p.put(
            key, self.n, size=size, now=self.now, expires=self.now + ttl, tenant=tenant
        )
        assert resident == (key in self.p)
        if tenant == "q" and size > 50:
            assert not resident

    @rule(key=keys)
    def remove(self, key):
        was = key in self.p
        assert self.p.remove(key) == was
        assert key not in self.p

    @rule(model=st.sampled_from(["a", "b"]), version=st.sampled_from([None, "1", "2"]))
    def invalidate(self, model, version):
        before = len(self.p)
        n = self.p.invalidate(model, version)
        assert len(self.p) == before - n
        assert not any(
            x.model == model and (version is None or x.version == version) for x in self.p
        )

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def advance(self, dt):
        self.now += dt

    @rule()
    def sweep(self):
        self.p.expire(self.now)
        assert self.p.next_expiry() > self.now

    @rule()
    def popularity_shift(self):
        # What the detector does when it fires; the accounting must survive it.
        self.p._shifted()
        assert self.p.protected_bytes == 0

    @invariant()
    def accounting_and_bounds(self):
        p = self.p
        window, probation, protected = p.segments()
        everything = window + probation + protected
        assert len(everything) == len(set(everything)) == len(p)
        assert set(everything) == set(p)
        size = {x: p._data[x].size for x in everything}
        assert p.bytes_used == sum(size.values()) <= p.capacity
        assert p.window_bytes == sum(size[x] for x in window) <= p.window_max
        assert p.protected_bytes == sum(size[x] for x in protected) <= p.protected_max
        assert p.probation_bytes == sum(size[x] for x in probation)
        assert p.tenant_bytes("q") == sum(size[x] for x in everything if x.namespace == "q")
        assert p.tenant_bytes("q") <= 50
        indexed = {x for vs in p._index.values() for ks in vs.values() for x in ks}
        assert indexed == set(everything)


TestTinyLfuMachine = TinyLfuMachine.TestCase


TestTinyLfuMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_tinylfu_keeps_a_hot_set_through_a_scan_that_flushes_lru():
    hot = list(range(20))
    for policy in (WTinyLFU(50, expected_entries=50), LruPolicy(50)):
        for _ in range(10):
            for key in hot:
                if policy.get(key, 0.0) is None:
                    policy.put(key, True, size=1, now=0.0)
        for key in range(1000, 1200):  # a scan of one-time keys
            if policy.get(key, 0.0) is None:
                policy.put(key, True, size=1, now=0.0)
        kept = sum(key in policy for key in hot)
        if isinstance(policy, WTinyLFU):
            assert kept == 20
            assert policy.admissions_rejected >= 150
        else:
            assert kept == 0


def _zipf_keys(rng, n, keys, s=0.9):
    w = np.arange(1, keys + 1, dtype=np.float64) ** -s
    cdf = np.cumsum(w) / w.sum()
    return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), keys - 1)


def _hit_rate(policy, trace):
    hits = 0
    for key in trace:
        if policy.get(key, 0.0) is None:
            policy.put(key, True, size=1, now=0.0)
        else:
            hits += 1
    return hits / len(trace)


def test_a_popularity_shift_is_detected_and_the_new_hot_set_gets_in_sooner():
    rng = np.random.default_rng(7)
    ranks = _zipf_keys(rng, 120_000, 20_000)
    before = rng.permutation(20_000)[ranks[:60_000]].tolist()
    after = rng.permutation(20_000)[ranks[60_000:]].tolist()  # the same law, new hot keys
    rates = {}
    for detect in (True, False):
        p = WTinyLFU(500, expected_entries=500, detect_shifts=detect)
        _hit_rate(p, before)
        assert p.shifts == 0  # a stationary load never fires it
        rates[detect] = _hit_rate(p, after[:20_000])
        assert p.shifts == (1 if detect else 0)
        window, probation, protected = p.segments()
        assert p.bytes_used == len(window) + len(probation) + len(protected) <= 500
    assert rates[True] > rates[False] + 0.01


def test_a_scan_does_not_look_like_a_popularity_shift():
    rng = np.random.default_rng(8)
    base = rng.permutation(20_000)[_zipf_keys(rng, 100_000, 20_000)].tolist()
    trace = []
    fresh = 1_000_000
    for start in range(0, len(base), 20_000):  # every 20k requests, a scan of 8k new keys
        trace += base[start : start + 20_000] + list(range(fresh, fresh + 8_000))
        fresh += 8_000
    p = WTinyLFU(500, expected_entries=500)
    _hit_rate(p, trace)
    assert p.sketch.resets > 0
    assert p.shifts == 0


def test_a_shift_before_the_sketch_first_ages_is_detected():
    # A 40x sample halves the sketch only after ~20k counted accesses at 500 entries;
    # the detector waits for its warm-up periods, not for that first halving.
    rng = np.random.default_rng(9)
    ranks = _zipf_keys(rng, 24_000, 20_000)
    before = rng.permutation(20_000)[ranks[:12_000]].tolist()
    after = rng.permutation(20_000)[ranks[12_000:]].tolist()
    p = WTinyLFU(500, expected_entries=500)
    _hit_rate(p, before)
    assert p.shifts == 0  # warming up from empty is not a shift
    assert p.sketch.resets == 0  # nor has the sketch aged yet
    _hit_rate(p, after)
    assert p.shifts == 1
    assert p.sketch.resets == 0


@pytest.mark.parametrize("sample_factor", [10, 40])
def test_a_detected_shift_clears_the_sketch(sample_factor):
    p = WTinyLFU(100, expected_entries=100, sample_factor=sample_factor)
    keys = [hash(f"k{i}") for i in range(50)]
    for i, h in enumerate(keys):
        for _ in range(i % 16):
            p.sketch.increment(h)
    assert max(p.sketch.frequency(h) for h in keys) == 15
    p._shifted()
    assert [p.sketch.frequency(h) for h in keys] == [0] * len(keys)
    assert p.sketch.additions == 0
    assert p.shifts == 1


def test_tinylfu_promotes_on_a_probation_hit_and_demotes_protected_overflow():
    p = WTinyLFU(100, window_fraction=0.01, protected_fraction=0.8, expected_entries=100)
    for key in range(100):
        p.put(key, key, size=1, now=0.0)
    window, probation, protected = p.segments()
    assert (len(window), len(probation), len(protected)) == (1, 99, 0)
    for key in range(90):
        assert p.get(key, 0.0) == key
    window, probation, protected = p.segments()
    assert len(protected) == p.protected_max == 79
    assert protected == list(range(11, 90))  # the 11 least recent were demoted
    assert probation[-11:] == list(range(11))


def test_an_entry_larger_than_the_capacity_is_never_admitted():
    for policy in (WTinyLFU(100), LruPolicy(100)):
        policy.put("small", 1, size=10, now=0.0)
        assert not policy.put("big", 2, size=101, now=0.0)
        assert "big" not in policy
        assert "small" in policy
        assert policy.admissions_rejected == 1
        for _ in range(3):  # read-through: misses first, so the sketch knows it
            policy.get("exact", 0.0)
        assert policy.put("exact", 3, size=100, now=0.0)
        assert policy.bytes_used == 100


def test_the_sketch_grows_with_the_entries_when_not_sized():
    p = WTinyLFU(10_000)
    first = p.sketch
    for key in range(3000):
        p.put(key, key, size=1, now=0.0)
    assert p.sketch is not first
    assert p.sketch.expected_entries >= 2048
    assert len(p) == 3000
