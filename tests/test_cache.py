"""The result cache's sans-IO core (policies, sketch, key) driven directly, time an
argument; the singleflight table under trio. Property tests use plain hypothesis: LRU
against a reference OrderedDict model, W-TinyLFU against its invariants."""

from __future__ import annotations

import collections
import math
import random

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from trioserve import ActorClosed, ModelError
from trioserve.actors import (
    RAW_INLINE,
    SHARED_NAMESPACE,
    Cache,
    CacheKey,
    CacheRule,
    CountMinSketch,
    LruPolicy,
    SingleFlight,
    WTinyLFU,
    cache_key,
)

X = np.arange(12, dtype=np.float32).reshape(3, 4)


def k(model="m", version="1", namespace="t", digest=b"d"):
    return CacheKey(namespace, model, version, digest)


# ---------------------------------------------------------------- cache_key
def test_same_values_in_another_memory_layout_give_the_same_key():
    fortran = np.asfortranarray(X)
    assert not fortran.flags.c_contiguous
    wide = np.zeros((3, 8), dtype=np.float32)
    wide[:, ::2] = X
    strided = wide[:, ::2]  # a non-contiguous view holding the same values
    big_endian = X.astype(">f4")
    keys = {cache_key("m", "1", "t", {"x": a}) for a in (X, fortran, strided, big_endian)}
    assert len(keys) == 1


@pytest.mark.parametrize(
    "other",
    [
        X.astype(np.float64),  # same values, another dtype
        X.astype(np.int32),
        X.reshape(4, 3),  # same bytes, another shape
        X.reshape(12),
        X + 1,
        X.tolist(),  # a list is not an array
    ],
)
def test_a_different_dtype_shape_or_value_gives_a_different_key(other):
    assert cache_key("m", "1", "t", {"x": X}) != cache_key("m", "1", "t", {"x": other})


def test_key_parts_and_canonical_params():
    key = cache_key("m", 2, "t", "hello")
    assert (key.namespace, key.model, key.version, len(key.digest)) == ("t", "m", "2", 16)
    assert cache_key("m", "1", "t", X) == cache_key("m", "1", "t", X, {})
    assert cache_key("m", "1", "t", X, {"a": 1, "b": 2.5}) == cache_key(
        "m", "1", "t", X, {"b": 2.5, "a": 1}
    )
    assert cache_key("m", "1", "t", X, {"a": 1}) != cache_key("m", "1", "t", X, {"a": 2})
    assert cache_key("m", "1", "t", X, {"a": 1}) != cache_key("m", "1", "t", X, {"a": True})
    assert cache_key("m", "1", "t", "ab") != cache_key("m", "1", "t", b"ab")
    assert cache_key("m", "1", "t", ["a", "b"]) != cache_key("m", "1", "t", ["ab"])
    assert cache_key("m", "1", "t", X) != cache_key("m", "1", "u", X)  # the namespace
    assert cache_key("m", "1", "t", X) != cache_key("m", "2", "t", X)  # the version


def test_object_arrays_are_hashed_by_content():
    a = np.array([b"spam", b"eggs"], dtype=object)
    b = np.array([bytes(bytearray(b"spam")), b"eggs"], dtype=object)
    assert cache_key("m", "1", "t", a) == cache_key("m", "1", "t", b)
    assert cache_key("m", "1", "t", a) != cache_key("m", "1", "t", a[::-1].copy())


def test_a_bytes_tensors_string_elements_are_hashed_as_their_utf8_bytes():
    """v2 JSON decodes a BYTES tensor to strings, the binary extension to bytes: the
    same tensor, one key."""
    text = np.array(["spam", "caf\u00e9", ""], dtype=object)
    raw = np.array([b"spam", "caf\u00e9".encode(), b""], dtype=object)
    mixed = np.array(["spam", "caf\u00e9".encode(), ""], dtype=object)
    keys = {cache_key("m", "1", "t", {"x": a}) for a in (text, raw, mixed)}
    assert len(keys) == 1
    assert cache_key("m", "1", "t", {"x": text}) != cache_key(
        "m", "1", "t", {"x": np.array(["spam", "cafe", ""], dtype=object)}
    )
    assert cache_key("m", "1", "t", {"x": text}) != cache_key(
        "m", "1", "t", {"x": text.reshape(3, 1)}
    )


def test_strings_and_bytes_stay_distinct_outside_bytes_tensors():
    """As parameters or plain values a string and bytes are different types."""
    assert cache_key("m", "1", "t", "ab") != cache_key("m", "1", "t", b"ab")
    assert cache_key("m", "1", "t", X, {"p": "ab"}) != cache_key("m", "1", "t", X, {"p": b"ab"})
    assert cache_key("m", "1", "t", ["ab"]) != cache_key("m", "1", "t", [b"ab"])
    # within an object array, a list element keeps its own elements' types
    nested = np.empty(1, dtype=object)
    nested[0] = ["ab"]
    other = np.empty(1, dtype=object)
    other[0] = [b"ab"]
    assert cache_key("m", "1", "t", nested) != cache_key("m", "1", "t", other)


def test_a_string_element_with_a_lone_surrogate_equals_no_bytes_element():
    """A lone surrogate has no UTF-8 form (no v2 body carries it): its element keeps
    the string tag, so it never shares a key with the bytes "surrogatepass" makes."""
    lone = np.array(["a\ud800"], dtype=object)
    passed = np.array(["a\ud800".encode("utf-8", "surrogatepass")], dtype=object)
    assert cache_key("m", "1", "t", lone) != cache_key("m", "1", "t", passed)
    assert cache_key("m", "1", "t", lone) == cache_key(
        "m", "1", "t", np.array(["a\ud800"], dtype=object)
    )
    assert cache_key("m", "1", "t", lone) != cache_key(
        "m", "1", "t", np.array(["a\ud801"], dtype=object)
    )


def test_raw_keys_hold_a_small_body_a_digest_of_a_large_one_and_never_equal_a_key():
    cache = Cache(1 << 20)
    small = b'{"inputs": []}' * 10
    key = cache.raw_key("m", "1", "A", small)
    assert key == cache.raw_key("m", "1", "A", bytes(bytearray(small)))  # by value
    assert key != cache.raw_key("m", "1", "A", small + b" ")
    assert key != cache.raw_key("m", "1", "B", small)  # the tenant's namespace
    assert cache.key_bytes(key) == len(small)  # the key holds the body
    large = b"x" * (RAW_INLINE + 1)
    big = cache.raw_key("m", "1", "A", large)
    assert big == cache.raw_key("m", "1", "A", bytes(bytearray(large)))
    assert cache.key_bytes(big) == 16  # a digest, not the body
    # a small body equal to a large one's digest gets another key
    assert cache.raw_key("m", "1", "A", big.digest[1]) != big
    # nor is a raw key ever a key of inputs, whatever the body
    digest = cache.key("m", "1", "A", X).digest
    assert cache.raw_key("m", "1", "A", digest) != cache.key("m", "1", "A", X)


def test_unhashable_inputs_are_refused_with_a_precise_message():
    with pytest.raises(TypeError, match="mapping keys must be strings"):
        cache_key("m", "1", "t", {1: X})
    with pytest.raises(TypeError, match="cannot hash a object"):
        cache_key("m", "1", "t", object())


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


# ---------------------------------------------------------------- TTL
@pytest.mark.parametrize("policy", ["tinylfu", "lru"])
def test_ttl_with_an_explicit_now(policy):
    cache = Cache(1000, policy=policy, rules={"m": CacheRule(ttl=10.0)})
    key = cache.key("m", "1", "t", X)
    assert cache.put(key, "v", size=10, now=100.0)
    assert cache.next_expiry() == 110.0
    assert cache.get(key, 109.999) == "v"
    assert cache.get(key, 110.0) is None  # expired at its expiry time exactly
    assert key not in cache
    s = cache.statistics()
    assert (s.hits, s.misses, s.expirations, s.bytes_used) == (1, 1, 1, 0)


def test_expire_sweeps_only_what_is_due_and_forgets_replaced_entries():
    p = WTinyLFU(1000)
    p.put("a", 1, size=1, now=0.0, expires=5.0)
    p.put("b", 2, size=1, now=0.0, expires=10.0)
    p.put("a", 3, size=1, now=1.0, expires=20.0)  # replaced: the 5.0 expiry is stale
    p.put("c", 4, size=1, now=0.0)  # no expiry
    assert p.next_expiry() == 10.0
    assert p.expire(9.0) == 0
    assert p.expire(10.0) == 1
    assert set(p) == {"a", "c"}
    assert p.next_expiry() == 20.0
    assert not p.put("d", 5, size=1, now=30.0, expires=30.0)  # born expired


def test_the_expiry_heap_stays_bounded_under_rewrites():
    p = LruPolicy(1000)
    for n in range(10_000):
        p.put("a", n, size=1, now=0.0, expires=1e9 + n)
    assert len(p._expiry) <= 2 * len(p) + 65


async def test_ttl_follows_trio_time_under_mock_clock(mock_clock):
    cache = Cache(1000, rules={"m": CacheRule(ttl=30.0)})
    key = cache.key("m", "1", "t", X)
    cache.put(key, "v", size=10, now=trio.current_time())
    mock_clock.jump(29.5)
    assert cache.get(key, trio.current_time()) == "v"
    mock_clock.jump(0.5)
    assert cache.get(key, trio.current_time()) is None


# ---------------------------------------------------------------- tenants
def test_tenants_never_share_a_value_unless_the_model_is_shareable():
    cache = Cache(10_000, rules={"shared": CacheRule(shareable=True)})
    ka = cache.key("private", "1", "A", X)
    kb = cache.key("private", "1", "B", X)
    assert ka != kb
    cache.put(ka, "A's", size=10, now=0.0)
    assert cache.get(kb, 0.0) is None
    cache.put(kb, "B's", size=10, now=0.0)
    assert (cache.get(ka, 0.0), cache.get(kb, 0.0)) == ("A's", "B's")
    assert len(cache) == 2

    sa = cache.key("shared", "1", "A", X)
    sb = cache.key("shared", "1", "B", X)
    assert sa == sb
    assert sa.namespace == SHARED_NAMESPACE
    cache.put(sa, "anyone's", size=10, now=0.0, tenant="A")
    assert cache.get(sb, 0.0) == "anyone's"
    assert cache.tenant_bytes("A") == 20
    assert cache.tenant_bytes("B") == 10


def test_a_model_may_opt_out():
    cache = Cache(10_000, rules={"dice": CacheRule(enabled=False)})
    assert cache.key("dice", "1", "A", X) is None
    assert not cache.put(k(model="dice"), "v", size=1, now=0.0)
    assert len(cache) == 0


@pytest.mark.parametrize("policy", ["tinylfu", "lru"])
def test_a_tenant_over_its_quota_loses_its_own_least_recent_entries(policy):
    cache = Cache(100_000, policy=policy, quotas={"A": 3000})
    a = [cache.key("m", "1", "A", np.float32(i)) for i in range(5)]
    b = cache.key("m", "1", "B", X)
    cache.put(b, "b", size=5000, now=0.0)
    for key in a[:3]:
        assert cache.put(key, key.digest, size=1000, now=0.0)
    cache.get(a[0], 0.0)  # a[1] is now A's least recent
    assert cache.put(a[3], "3", size=1000, now=0.0)
    assert a[1] not in cache
    assert {a[0], a[2], a[3], b} <= set(cache.policy)
    assert cache.tenant_bytes("A") == 3000
    assert not cache.put(a[4], "too big", size=3001, now=0.0)
    assert a[4] not in cache
    assert cache.tenant_bytes("A") == 3000
    assert cache.statistics().evictions == 1


# ---------------------------------------------------------------- invalidation
@pytest.mark.parametrize("policy", ["tinylfu", "lru"])
def test_invalidate_a_model_version_or_a_whole_model(policy):
    cache = Cache(100_000, policy=policy)
    keys = {
        (m, v): [cache.key(m, v, "t", np.float32(i)) for i in range(3)]
        for m in ("m", "other")
        for v in ("1", "2")
    }
    for ks in keys.values():
        for key in ks:
            cache.put(key, "v", size=1, now=0.0)
    assert cache.invalidate("m", "1") == 3
    assert not any(key in cache for key in keys["m", "1"])
    assert all(key in cache for key in keys["m", "2"] + keys["other", "1"])
    assert cache.invalidate("m") == 3
    assert cache.invalidate("m") == 0
    assert len(cache) == 6
    assert set(cache.policy._index) == {"other"}
    assert cache.statistics().invalidations == 6


def test_unknown_policy_names_are_refused():
    with pytest.raises(ValueError, match="'tinylfu', 'lru'"):
        Cache(100, policy="arc")
    with pytest.raises(ValueError, match="positive number of bytes"):
        WTinyLFU(0)


def test_statistics_hit_rate():
    cache = Cache(100)
    key = k()
    cache.get(key, 0.0)
    cache.put(key, 1, size=1, now=0.0)
    cache.get(key, 0.0)
    cache.get(key, 0.0)
    s = cache.statistics()
    assert (s.hits, s.misses, s.entries, s.policy) == (2, 1, 1, "tinylfu")
    assert s.hit_rate == pytest.approx(2 / 3)


# ---------------------------------------------------------------- singleflight
class Computation:
    """An async computation the test releases by hand; it counts its runs."""

    def __init__(self, value="result", error=None):
        self.value = value
        self.error = error
        self.release = trio.Event()
        self.runs = 0
        self.cancelled = 0

    async def __call__(self, *args):
        self.runs += 1
        try:
            await self.release.wait()
        except trio.Cancelled:
            self.cancelled += 1
            raise
        if self.error is not None:
            raise self.error
        return (self.value, *args)


async def test_identical_calls_share_one_computation_and_a_cancelled_waiter_leaves_alone():
    compute = Computation()
    results = {}
    async with trio.open_nursery() as owner:
        flights = SingleFlight(owner)
        async with trio.open_nursery() as callers:
            scopes = {}

            async def caller(name):
                with trio.CancelScope() as scope:
                    scopes[name] = scope
                    results[name] = await flights.call("key", compute, 7)

            for name in ("first", "second", "third"):
                callers.start_soon(caller, name)
                await trio.testing.wait_all_tasks_blocked()
            assert compute.runs == 1
            scopes["first"].cancel()  # the caller that started the computation
            await trio.testing.wait_all_tasks_blocked()
            assert "key" in flights
            assert compute.cancelled == 0
            compute.release.set()
    assert results == {"second": ("result", 7), "third": ("result", 7)}
    assert compute.runs == 1
    s = flights.statistics()
    assert (s.started, s.coalesced, s.abandoned, s.in_flight) == (1, 2, 0, 0)


async def test_when_every_waiter_leaves_the_computation_is_cancelled():
    compute = Computation()
    async with trio.open_nursery() as owner:
        flights = SingleFlight(owner)
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as callers:
                for _ in range(2):
                    callers.start_soon(flights.call, "key", compute)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert compute.cancelled == 1
        assert "key" not in flights
        # A new call starts afresh rather than joining the cancelled one.
        again = Computation("again")
        again.release.set()
        assert await flights.call("key", again) == ("again",)
    assert flights.statistics().abandoned == 1


async def test_an_error_reaches_every_waiter_and_is_not_cached():
    cache = Cache(1000)
    key = cache.key("m", "1", "t", X)
    failing = Computation(error=ModelError("boom"))

    async def compute_and_cache(c):
        value = await c()
        cache.put(key, value, size=1, now=trio.current_time())
        return value

    errors = []
    async with trio.open_nursery() as owner:
        flights = SingleFlight(owner)

        async def caller():
            try:
                await flights.call(key, compute_and_cache, failing)
            except ModelError as exc:
                errors.append(exc)

        async with trio.open_nursery() as callers:
            for _ in range(3):
                callers.start_soon(caller)
            await trio.testing.wait_all_tasks_blocked()
            failing.release.set()
        assert len(errors) == 3
        # Each waiter its own copy: one object raised in every waiter gathered all
        # their frames into one traceback (and kept their locals alive).
        assert len({id(e) for e in errors}) == 3
        assert {(type(e), str(e)) for e in errors} == {(ModelError, "boom")}
        assert len({_traceback_length(e) for e in errors}) == 1
        assert failing.runs == 1
        assert key not in cache
        assert key not in flights
        ok = Computation("fine")
        ok.release.set()
        assert await flights.call(key, compute_and_cache, ok) == ("fine",)
    assert cache.get(key, trio.current_time()) == ("fine",)


def _traceback_length(exc: BaseException) -> int:
    n, tb = 0, exc.__traceback__
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


async def test_waiters_get_actor_closed_when_the_owner_nursery_is_cancelled():
    compute = Computation()
    got = []

    async def caller(flights):
        try:
            await flights.call("key", compute)
        except ActorClosed as exc:
            got.append(exc)

    async with trio.open_nursery() as callers:
        async with trio.open_nursery() as owner:
            flights = SingleFlight(owner)
            callers.start_soon(caller, flights)
            callers.start_soon(caller, flights)
            await trio.testing.wait_all_tasks_blocked()
            owner.cancel_scope.cancel()
    assert len(got) == 2
    assert compute.cancelled == 1
    assert "cancelled before it finished" in str(got[0])


async def test_a_call_after_the_owner_nursery_closed_is_refused():
    async with trio.open_nursery() as owner:
        flights = SingleFlight(owner)
    with pytest.raises(ActorClosed, match="nursery is closed"):
        await flights.call("key", Computation())
    assert len(flights) == 0
