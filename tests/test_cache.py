"""The result cache's sans-IO core driven directly, time an argument: the key, and the
cache's TTL, tenants, invalidation and statistics; the singleflight table under trio.
The policies and their sketch are in tests/test_cache_policies.py."""

from __future__ import annotations

import numpy as np
import outcome
import pytest
import trio
import trio.testing
from runtime_helpers import k
from trioserve import ActorClosed, DeadlineExceeded, InvalidInput, ModelError, Overloaded
from trioserve._many import _SplitLate
from trioserve.actors import (
    RAW_INLINE,
    SHARED_NAMESPACE,
    Cache,
    CacheRule,
    LruPolicy,
    SingleFlight,
    WTinyLFU,
    cache_key,
)
from trioserve.actors._cache_actor import deadline_bound, input_error

X = np.arange(12, dtype=np.float32).reshape(3, 4)


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

    async def __call__(self, *args, late=None):
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


# ---------------------------------------------------------------- a driver's deadline
def test_which_errors_belong_to_the_drivers_deadline():
    assert deadline_bound(DeadlineExceeded("late", in_queue=True), 2.0) == 2.0
    assert deadline_bound(Overloaded("refill after", deadline=1.5), 2.0) == 1.5
    assert deadline_bound(Overloaded("queue full"), 2.0) is None
    assert deadline_bound(ModelError("boom"), 2.0) is None


async def _start_waiters(callers, flights, calls, got):
    """Start ``calls`` (name, deadline, computation) in ``callers`` one after the
    other on one key; what each gets goes into ``got`` by name."""

    async def caller(name, deadline, fn):
        try:
            got[name] = await flights.call("key", fn, name, deadline=deadline)
        except Exception as exc:
            got[name] = exc

    for name, deadline, fn in calls:
        callers.start_soon(caller, name, deadline, fn)
        await trio.testing.wait_all_tasks_blocked()


async def test_a_waiter_with_a_later_deadline_is_not_failed_by_the_drivers(mock_clock):
    """The first caller's computation fails for its deadline: the callers whose own
    deadline is that one get its error; the later ones get a run of their own,
    driven by the earliest of them, with its own function; the others join it."""
    late = DeadlineExceeded("first's deadline passed", in_queue=True)
    first = Computation(error=late)
    never = Computation("second's")
    third, fourth = Computation("third's"), Computation("fourth's")
    got = {}
    async with trio.open_nursery() as owner:
        flights = SingleFlight(owner, deadline_bound=deadline_bound)
        calls = [("first", 1.0, first), ("second", 1.0, never), ("fourth", 3.0, fourth),
                 ("third", 2.0, third)]
        async with trio.open_nursery() as callers:
            await _start_waiters(callers, flights, calls, got)
            first.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert set(got) == {"first", "second"}
            assert all(type(got[n]) is DeadlineExceeded for n in ("first", "second"))
            assert got["first"] is not got["second"]  # each its own copy
            assert (third.runs, fourth.runs, never.runs) == (1, 0, 0)  # the earliest
            assert "key" in flights
            third.release.set()
    assert got["third"] == got["fourth"] == ("third's", "third")
    s = flights.statistics()
    assert (s.started, s.coalesced, s.reruns, s.abandoned, s.in_flight) == (1, 3, 1, 0, 0)


async def test_a_flight_runs_again_at_most_once_per_waiter_and_for_none_earlier(mock_clock):
    """Each run that fails for its driver's deadline passes the flight to the next
    deadline; a driver is answered its own run's error even where the error's
    deadline is earlier than its own (a refusal measured against a sooner one), and
    an error of no deadline answers everyone."""
    refused = Overloaded("credits refill only after the request's deadline", deadline=0.5)
    a = Computation(error=refused)  # its own deadline is 1.0
    b = Computation(error=DeadlineExceeded("b's deadline passed"))
    c = Computation(error=ModelError("boom"))
    got = {}
    async with trio.open_nursery() as owner:
        flights = SingleFlight(owner, deadline_bound=deadline_bound)
        async with trio.open_nursery() as callers:
            calls = [("a", 1.0, a), ("b", 2.0, b), ("c", 3.0, c)]
            await _start_waiters(callers, flights, calls, got)
            a.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert list(got) == ["a"]
            assert (b.runs, c.runs) == (1, 0)
            b.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert list(got) == ["a", "b"]
            assert c.runs == 1
            c.release.set()
    assert [type(got[n]) for n in "abc"] == [Overloaded, DeadlineExceeded, ModelError]
    assert (a.runs, b.runs, c.runs) == (1, 1, 1)
    assert flights.statistics().reruns == 2


async def test_no_run_again_for_a_waiter_whose_own_deadline_has_passed(mock_clock):
    """The driver's run fails for its deadline (1.0) only at 2.5 (a batch that failed
    past it and ran again in parts): the waiter whose own deadline (2.0) has passed
    too gets that error, and runs (and pays) for nothing; the next run is the one
    with time left's."""
    first = Computation(error=DeadlineExceeded("first's deadline passed"))
    second, third = Computation("second's"), Computation("third's")
    got = {}
    async with trio.open_nursery() as owner:
        flights = SingleFlight(owner, deadline_bound=deadline_bound)
        async with trio.open_nursery() as callers:
            calls = [("first", 1.0, first), ("second", 2.0, second), ("third", 3.0, third)]
            await _start_waiters(callers, flights, calls, got)
            mock_clock.jump(2.5)
            first.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert set(got) == {"first", "second"}
            assert type(got["second"]) is DeadlineExceeded
            assert (second.runs, third.runs) == (0, 1)
            third.release.set()
    assert got["third"] == ("third's", "third")
    assert flights.statistics().reruns == 1


async def test_a_waiter_answered_but_not_resumed_drives_no_second_run(mock_clock):
    """The first run fails for its driver's deadline (1.0); the second, driven by the
    waiter of deadline 3.0, is refused at once against an earlier deadline (0.5), with
    no checkpoint: the first caller, answered but not resumed yet, does not drive
    again (its deadline 1.0 is later than 0.5); the waiter of 5.0 does."""
    async def refused(*args):
        raise Overloaded("credits refill only after the request's deadline", deadline=0.5)

    first = Computation(error=DeadlineExceeded("first's deadline passed", in_queue=True))
    last = Computation("last's")
    got = {}
    async with trio.open_nursery() as owner:
        flights = SingleFlight(owner, deadline_bound=deadline_bound)
        async with trio.open_nursery() as callers:
            calls = [("first", 1.0, first), ("last", 5.0, last), ("middle", 3.0, refused)]
            await _start_waiters(callers, flights, calls, got)
            first.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert set(got) == {"first", "middle"}
            assert (first.runs, last.runs) == (1, 1)
            last.release.set()
    assert type(got["first"]) is DeadlineExceeded
    assert type(got["middle"]) is Overloaded
    assert got["last"] == ("last's", "last")
    assert flights.statistics().reruns == 2


async def test_a_driver_gets_its_own_run_though_the_next_began_before_it_woke(mock_clock):
    """The first run fails for its deadline; the second caller's run is refused at
    once (no checkpoint), and the third's begins, all before the second caller wakes:
    it still gets its own run's error, not the third's run's answer (found by the
    fuzz suite's cache flights)."""
    async def refused(*args):
        raise DeadlineExceeded("second's deadline passed", in_queue=True)

    first = Computation(error=DeadlineExceeded("first's deadline passed", in_queue=True))
    third = Computation("third's")
    got = {}
    async with trio.open_nursery() as owner:
        flights = SingleFlight(owner, deadline_bound=deadline_bound)
        async with trio.open_nursery() as callers:
            calls = [("first", 1.0, first), ("second", 2.0, refused), ("third", 3.0, third)]
            await _start_waiters(callers, flights, calls, got)
            first.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert set(got) == {"first", "second"}
            assert type(got["second"]) is DeadlineExceeded
            assert third.runs == 1
            third.release.set()
    assert got["third"] == ("third's", "third")
    assert flights.statistics().reruns == 2


async def test_a_run_again_goes_on_when_its_driver_leaves_and_ends_with_the_last(mock_clock):
    late = DeadlineExceeded("first's deadline passed")
    first, second, third = Computation(error=late), Computation("2"), Computation("3")
    got = {}
    async with trio.open_nursery() as owner:
        flights = SingleFlight(owner, deadline_bound=deadline_bound)
        scopes = {}

        async def caller(name, deadline, fn):
            with trio.CancelScope() as scopes[name]:
                got[name] = await flights.call("key", fn, name, deadline=deadline)

        async with trio.open_nursery() as callers:
            for name, deadline, fn in [("1", 1.0, first), ("2", 2.0, second), ("3", 3.0, third)]:
                callers.start_soon(caller, name, deadline, fn)
                await trio.testing.wait_all_tasks_blocked()
            scopes["1"].cancel()  # its run goes on for the others
            first.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert second.runs == 1
            scopes["2"].cancel()  # the driver of the run again leaves: it goes on
            await trio.testing.wait_all_tasks_blocked()
            assert second.cancelled == 0
            assert "key" in flights
            scopes["3"].cancel()  # the last one out: cancelled
            await trio.testing.wait_all_tasks_blocked()
            assert second.cancelled == 1
            assert "key" not in flights
    assert got == {}
    assert third.runs == 0
    s = flights.statistics()
    assert (s.reruns, s.abandoned, s.in_flight) == (1, 1, 0)


# ---------------------------------------------------------------- a late outcome
class LateComputation(Computation):
    """A computation whose work outlives its deadline's error: when released it
    tells its ``late`` hook to expect the work's outcome, keeps it, and raises
    DeadlineExceeded (as a request answered while its batch runs)."""

    def __init__(self):
        super().__init__(error=DeadlineExceeded("deadline passed while its batch ran"))
        self.late = None

    async def __call__(self, *args, late=None):
        self.late = late
        self.runs += 1
        await self.release.wait()
        late.keep = lambda value: ("kept", value)
        late.expect()
        raise self.error


@pytest.mark.parametrize("work", ["value", "failure"])
async def test_waiters_with_time_left_wait_for_the_late_outcome_of_the_drivers_work(
    mock_clock, work
):
    """The driver's computation raises its deadline's error while its work goes on:
    the driver is answered at once; the waiters with time left wait for the work's
    outcome, each until its own deadline (trio's, without a ``call_at``). A value
    answers them all, kept as the computation keeps its own, and nothing runs
    again; a failure runs the flight again, for the earliest of those left."""
    first = LateComputation()
    second, third = Computation("second's"), Computation("third's")
    got = {}
    async with trio.open_nursery() as owner:
        flights = SingleFlight(owner, deadline_bound=deadline_bound, late_outcomes=True)
        async with trio.open_nursery() as callers:
            calls = [("first", 1.0, first), ("second", 2.0, second), ("third", 3.0, third)]
            await _start_waiters(callers, flights, calls, got)
            mock_clock.jump(1.0)
            first.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert list(got) == ["first"]
            assert type(got["first"]) is DeadlineExceeded
            mock_clock.jump(1.0)  # the second's own deadline passes first
            await trio.testing.wait_all_tasks_blocked()
            assert list(got) == ["first", "second"]
            assert type(got["second"]) is DeadlineExceeded
            assert got["second"] is not got["first"]
            assert second.runs == third.runs == 0
            if work == "value":
                first.late.settle(outcome.Value("the batch's"))
            else:
                first.late.settle(None)
                await trio.testing.wait_all_tasks_blocked()
                assert third.runs == 1
                third.release.set()
    s = flights.statistics()
    if work == "value":
        assert got["third"] == ("kept", "the batch's")
        assert (s.reruns, s.late_answers) == (0, 1)
    else:
        assert got["third"] == ("third's", "third")
        assert (s.reruns, s.late_answers) == (1, 0)
    assert (first.runs, second.runs, s.in_flight) == (1, 0, 0)


class SplitComputation(Computation):
    """The computation of an item run in two parts (``_SplitLate`` on its ``late``
    hook, as ``_infer_split``): when released, the first part is answered
    DeadlineExceeded while its batch runs (its outcome to come) and the second is
    refused before it ran (InvalidInput: its inputs too large for a worker's
    message); the call raises the first error in item order, the first part's."""

    async def __call__(self, *args, late=None):
        self.runs += 1
        await self.release.wait()
        hooks = _SplitLate(late, 2, merge=None)
        try:
            hooks.parts[0].expect()
            expired = DeadlineExceeded("deadline passed while its batch was running")
            refused = InvalidInput("model 'm': its inputs are too many bytes")
            hooks.answered([outcome.Error(expired), outcome.Error(refused)])
            self.refused = refused
            raise expired
        finally:
            hooks.close()


async def test_a_split_items_part_refused_before_it_ran_answers_the_waiters_left(
    mock_clock,
):
    """The driver's item ran in two parts: the first expired while its batch ran,
    the second was refused before it ran (InvalidInput). The waiter with time left
    gets that refusal, as it would get the model's error for a part, and nothing
    runs again: a run again would be refused the same. It used to run the item
    again (its own computation), for that part to be refused again."""
    first = SplitComputation()
    second = Computation("second's")
    got = {}
    async with trio.open_nursery() as owner:
        flights = SingleFlight(
            owner, deadline_bound=deadline_bound, late_outcomes=True,
            input_error=input_error,
        )
        async with trio.open_nursery() as callers:
            calls = [("first", 1.0, first), ("second", 2.0, second)]
            await _start_waiters(callers, flights, calls, got)
            mock_clock.jump(1.0)
            first.release.set()
            await trio.testing.wait_all_tasks_blocked()
            second.release.set()  # (were it run again)
    assert type(got["first"]) is DeadlineExceeded
    assert type(got["second"]) is InvalidInput
    assert str(got["second"]) == str(first.refused)
    s = flights.statistics()
    assert (first.runs, second.runs) == (1, 0)
    assert (s.reruns, s.late_answers, s.in_flight) == (0, 1, 0)
