"""The result cache and in-flight coalescing through ``Runtime.infer``."""

from __future__ import annotations

import threading
from decimal import Decimal

import numpy as np
import pytest
import trio
import trioserve
from runtime_helpers import Recorder, callable_model, item, key
from trioserve import CacheConfig, InvalidInput, ModelConfig, TenantConfig, UnknownModel
from trioserve.actors._cache_actor import OVERHEAD


class Counting:
    """A model doubling ``x`` that counts how often it saw each key; with a gate, a
    batch waits for ``release`` (run it in a thread)."""

    def __init__(self, gated: bool = False) -> None:
        self.seen: list[float] = []
        self.gated = gated
        self.release = threading.Event()
        self.entered = threading.Event()  # set when a batch has started

    def __call__(self, items):
        self.seen.extend(key(it) for it in items)
        self.entered.set()
        if self.gated:
            self.release.wait(30)
        return [{"y": it["x"] * 2} for it in items]


def cfg(*models: ModelConfig, capacity: int = 1 << 20) -> trioserve.Config:
    return trioserve.Config(
        models=models,
        tenants=(TenantConfig(name="a", default=True), TenantConfig(name="b")),
        cache=CacheConfig(capacity_bytes=capacity),
    )


async def test_a_repeat_is_answered_from_the_cache(autojump_clock):
    model = Counting()
    async with trioserve.open_runtime(cfg(callable_model("m", model))) as rt:
        first = await rt.infer("m", item(3))
        again = await rt.infer("m", item(3))
        other = await rt.infer("m", item(4))
        stats = rt.cache_statistics()
    assert model.seen == [3.0, 4.0]
    assert float(first["y"][0]) == float(again["y"][0]) == 6.0
    assert float(other["y"][0]) == 8.0
    assert (stats["hits"], stats["misses"]) == (1, 2)
    assert not again["y"].flags.writeable  # one answer object serves many callers


async def test_each_caller_gets_its_own_mapping_of_a_shared_answer(autojump_clock):
    """The arrays are shared and read-only; the dict is each caller's: one that
    changes it once changed what every later hit (and HTTP request) got."""
    model = Counting()
    async with trioserve.open_runtime(cfg(callable_model("m", model))) as rt:
        first = await rt.infer("m", item(3))
        first.pop("y")
        first["evil"] = 1
        again = await rt.infer("m", item(3))
        assert set(again) == {"y"}
        twins = await rt.infer_batch("m", [item(5), item(5), item(3)])
        assert twins[0] is not twins[1]
        twins[0].clear()
        assert set(await rt.infer("m", item(5))) == {"y"}
        assert float(twins[2]["y"][0]) == 6.0
    assert model.seen == [3.0, 5.0]


async def test_tenants_never_share_results_unless_the_model_is_shareable(autojump_clock):
    private, shared = Counting(), Counting()
    config = cfg(callable_model("p", private), callable_model("s", shared, cache_shared=True))
    async with trioserve.open_runtime(config) as rt:
        for tenant in ("a", "b", "a"):
            await rt.infer("p", item(1), tenant=tenant)
            await rt.infer("s", item(1), tenant=tenant)
    assert private.seen == [1.0, 1.0]  # once per tenant
    assert shared.seen == [1.0]


async def test_a_model_may_opt_out_and_the_cache_is_off_by_default(autojump_clock):
    out, off = Counting(), Counting()
    async with trioserve.open_runtime(cfg(callable_model("m", out, cache=False))) as rt:
        await rt.infer("m", item(1))
        await rt.infer("m", item(1))
        assert rt.cache is None  # no model is cached or coalesced: no cache actor
    default = trioserve.Config(models=(callable_model("m", off),))
    async with trioserve.open_runtime(default) as rt:
        await rt.infer("m", item(1))
        await rt.infer("m", item(1))
    assert out.seen == [1.0, 1.0]
    assert off.seen == [1.0, 1.0]


async def test_entries_expire_after_the_models_ttl(autojump_clock):
    model = Counting()
    async with trioserve.open_runtime(cfg(callable_model("m", model, cache_ttl_s=10))) as rt:
        await rt.infer("m", item(1))
        await trio.sleep(9.9)
        await rt.infer("m", item(1))
        await trio.sleep(0.2)
        await rt.infer("m", item(1))
    assert model.seen == [1.0, 1.0]


async def test_a_batch_takes_its_cached_items_from_the_cache_and_runs_the_rest_together(
    autojump_clock,
):
    model = Recorder()
    async with trioserve.open_runtime(cfg(callable_model("m", model, max_wait_ms=5))) as rt:
        await rt.infer("m", item(1))
        outs = await rt.infer_batch("m", [item(1), item(2), item(3), item(2)])
        assert [float(o["y"][0]) for o in outs] == [3.0, 5.0, 7.0, 5.0]
        assert model.batches[1][1] == [2.0, 3.0]  # the misses, item 2 once, in one batch
        assert outs[1] is not outs[3]  # each its own mapping ...
        assert outs[1]["y"] is outs[3]["y"]  # ... of the one answer's arrays
        assert not outs[2]["y"].flags.writeable
        again = await rt.infer_batch("m", [item(3), item(2), item(1)])
        single = await rt.infer("m", item(2))  # the batch's answer serves single requests
        stats = rt.cache_statistics()
    assert model.seen == [1.0, 2.0, 3.0]
    assert [float(o["y"][0]) for o in again] == [7.0, 5.0, 3.0]
    assert float(single["y"][0]) == 5.0
    # one lookup per distinct item: the repeat of item 2 is neither a miss nor an access
    assert (stats["hits"], stats["misses"]) == (1 + 3 + 1, 1 + 2)


async def test_a_stacked_batch_is_cached_by_item_and_per_tenant(autojump_clock):
    model, shared = Recorder(), Recorder()
    config = cfg(callable_model("m", model), callable_model("s", shared, cache_shared=True))
    stacked = {"x": np.array([[4.0], [5.0]], dtype=np.float32)}
    async with trioserve.open_runtime(config) as rt:
        for tenant in ("a", "b", "a"):
            outs = await rt.infer_batch("m", stacked, tenant=tenant)
            assert [float(o["y"][0]) for o in outs] == [9.0, 11.0]
            await rt.infer_batch("s", stacked, tenant=tenant)
    assert model.seen == [4.0, 5.0, 4.0, 5.0]  # once per tenant
    assert shared.seen == [4.0, 5.0]


async def test_a_failed_batch_keeps_nothing_in_the_cache(autojump_clock):
    model = Recorder(fail_on=13.0)
    async with trioserve.open_runtime(cfg(callable_model("m", model))) as rt:
        with pytest.raises(trioserve.ModelError):
            await rt.infer_batch("m", [item(1), item(13)])
        runs = model.seen.count(1.0)
        assert runs >= 1
        out = await rt.infer("m", item(1))
        stats = rt.cache_statistics()
    assert float(out["y"][0]) == 3.0
    assert model.seen.count(1.0) == runs + 1  # computed again: nothing was kept
    assert stats["entries"] == 1


@pytest.mark.parametrize("capacity", [0, 1 << 20])
async def test_identical_requests_in_flight_share_one_computation(capacity):
    model = Counting(gated=True)
    config = cfg(
        callable_model("m", model, execution="thread", coalesce=True, max_wait_ms=0),
        capacity=capacity,
    )
    try:
        async with trioserve.open_runtime(config) as rt:
            outs = []

            async def one(scope=None):
                outs.append(await rt.infer("m", item(5)))

            async with trio.open_nursery() as nursery:
                leaver = trio.CancelScope()

                async def leaving():
                    with leaver:
                        await rt.infer("m", item(5))

                nursery.start_soon(leaving)  # the first caller, which then leaves
                await trio.testing.wait_all_tasks_blocked()
                for _ in range(3):
                    nursery.start_soon(one)
                await trio.testing.wait_all_tasks_blocked()
                leaver.cancel()  # the others still get the answer
                await trio.testing.wait_all_tasks_blocked()
                model.release.set()
            stats = rt.cache_statistics()
    finally:
        model.release.set()
    assert model.seen == [5.0]
    assert [float(o["y"][0]) for o in outs] == [10.0] * 3
    assert stats["coalesced"] == 3
    assert stats["computations"] == 1


@pytest.mark.parametrize("shared", [False, True])
async def test_a_request_joins_only_a_flight_of_its_own_tenant_and_class(shared):
    """A flight runs with its first caller's class, deadline and credits: a realtime
    request must not wait in a batch request's place, nor a tenant for another's
    credits, even where the model's answers are shared."""
    model = Counting(gated=True)
    config = cfg(
        callable_model(
            "m", model, execution="thread", coalesce=True, max_wait_ms=0,
            cache_shared=shared,
        ),
        capacity=1 << 20 if shared else 0,  # shared: the cache's one namespace
    )
    try:
        async with trioserve.open_runtime(config) as rt:
            async with trio.open_nursery() as nursery:
                for tenant, priority in [
                    ("a", "batch"), ("a", "realtime"), ("b", "batch"), ("a", "batch"),
                ]:
                    nursery.start_soon(
                        lambda t=tenant, p=priority: rt.infer("m", item(5), tenant=t, priority=p)
                    )
                    await trio.testing.wait_all_tasks_blocked()
                model.release.set()
            stats = rt.cache_statistics()
    finally:
        model.release.set()
    assert model.seen == [5.0] * 3
    assert (stats["computations"], stats["coalesced"]) == (3, 1)  # a's second batch one


class Stacking:
    """A model answering each item with a row (a view) of one array for its batch, as
    torch models and the worker processes do."""

    def __call__(self, items):
        y = np.stack([it["x"] for it in items]) * 2
        return [{"y": y[i]} for i in range(len(items))]


async def test_kept_answers_own_their_arrays_not_a_view_of_the_batch(autojump_clock):
    async with trioserve.open_runtime(cfg(callable_model("m", Stacking()))) as rt:
        one = await rt.infer("m", item(3))
        rows = await rt.infer_batch("m", [item(4), item(5)])
        again = await rt.infer("m", item(3))
        stats = rt.cache_statistics()
    for out in (one, *rows):
        assert out["y"].base is None  # a view would keep the whole batch output alive
        assert not out["y"].flags.writeable
    assert again["y"] is one["y"]
    assert [float(o["y"][0]) for o in (one, *rows)] == [6.0, 8.0, 10.0]
    assert stats["entries"] == 3


@pytest.mark.parametrize("batch", [False, True])
async def test_an_answer_computed_across_an_invalidation_is_not_kept(batch):
    model = Counting(gated=True)
    config = cfg(callable_model("m", model, execution="thread", max_wait_ms=0))
    try:
        async with trioserve.open_runtime(config) as rt:
            async with trio.open_nursery() as nursery:
                if batch:
                    nursery.start_soon(rt.infer_batch, "m", [item(7), item(8)])
                else:
                    nursery.start_soon(rt.infer, "m", item(7))
                assert await trio.to_thread.run_sync(model.entered.wait, 30)
                rt.invalidate_cache("m")  # the weights changed while it ran
                model.release.set()
            assert rt.cache_statistics()["entries"] == 0
            await rt.infer("m", item(7))  # computed again with the new weights
    finally:
        model.release.set()
    assert model.seen.count(7.0) == 2


async def test_an_encoded_answer_made_before_an_invalidation_is_not_kept(autojump_clock):
    async with trioserve.open_runtime(cfg(callable_model("m", Counting()))) as rt:
        key = rt.response_key("m", None, "a", b"{...}")
        rt.invalidate_cache("m")
        rt.keep_response(key, (200, [], b"stale"), 5, "a")
        assert rt.cached_response(key) is None
        fresh = rt.response_key("m", None, "a", b"{...}")
        rt.keep_response(fresh, (200, [], b"fresh"), 5, "a")
        assert rt.cached_response(fresh) == (200, [], b"fresh")


async def test_an_edge_answer_is_charged_for_the_body_its_key_holds(autojump_clock):
    async with trioserve.open_runtime(cfg(callable_model("m", Counting()))) as rt:
        cache = rt.cache.cache
        for raw in (b"x" * 1000, b"y" * 100_000):  # held whole; held by its digest
            before = cache.policy.bytes_used
            key = rt.response_key("m", None, "a", raw)
            rt.keep_response(key, (200, [], b"answer"), 6, "a")
            assert rt.cached_response(key) == (200, [], b"answer")
            held = len(raw) if len(raw) <= 4096 else 16
            assert cache.policy.bytes_used - before == 6 + OVERHEAD + held


class Weights(Counting):
    """``y = x * factor``: ``factor`` stands for the model's weights."""

    factor = 2.0

    def __call__(self, items):
        factor = self.factor  # the weights as the batch starts
        super().__call__(items)
        return [{"y": it["x"] * factor} for it in items]


# Regression: a request that came after an invalidation joined an identical one in
# flight from before it, and got (and, at the edge, kept) the old weights' answer.
async def test_a_caller_after_an_invalidation_does_not_join_a_flight_from_before_it():
    model = Weights(gated=True)
    config = cfg(
        callable_model("m", model, execution="thread", max_wait_ms=0, max_batch_size=1)
    )
    outs = {}
    try:
        async with trioserve.open_runtime(config) as rt:

            async def call(name):
                outs[name] = float((await rt.infer("m", item(7)))["y"][0])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "before")
                assert await trio.to_thread.run_sync(model.entered.wait, 30)
                model.factor = 3.0  # new weights ...
                rt.invalidate_cache("m")  # ... announced
                nursery.start_soon(call, "after")
                await trio.testing.wait_all_tasks_blocked()
                model.release.set()
            await call("later")
    finally:
        model.release.set()
    assert outs == {"before": 14.0, "after": 21.0, "later": 21.0}


# Regression (found by `python -m fuzz --suite cache`): a model that is coalesced but
# not cached kept generation 0 in its flights' keys (only a cached model read the
# cache's count of invalidations, and with the cache off invalidate_cache did nothing),
# so a request after an invalidation still joined a flight from before it.
@pytest.mark.parametrize("capacity", [0, 1 << 20])
async def test_a_coalesced_uncached_model_gets_no_flight_from_before_an_invalidation(capacity):
    model = Weights(gated=True)
    config = cfg(
        callable_model(
            "m", model, execution="thread", max_wait_ms=0, max_batch_size=1, cache=False,
            coalesce=True,
        ),
        capacity=capacity,
    )
    outs = {}
    try:
        async with trioserve.open_runtime(config) as rt:

            async def call(name):
                outs[name] = float((await rt.infer("m", item(7)))["y"][0])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "before")
                assert await trio.to_thread.run_sync(model.entered.wait, 30)
                model.factor = 3.0  # new weights ...
                assert rt.invalidate_cache("m") == 0  # ... announced; nothing was kept
                nursery.start_soon(call, "after")
                await trio.testing.wait_all_tasks_blocked()
                model.release.set()
            stats = rt.cache_statistics()
    finally:
        model.release.set()
    assert outs == {"before": 14.0, "after": 21.0}
    assert stats["computations"] == 2
    assert stats["coalesced"] == 0


# Regression: a request naming no version was kept under the first version, while
# the v2 answer names the last (the default), whose invalidation then missed it.
async def test_a_request_naming_no_version_is_kept_under_the_default_the_last(
    autojump_clock,
):
    model = Counting()
    async with trioserve.open_runtime(cfg(callable_model("m", model, versions=["1", "2"]))) as rt:
        await rt.infer("m", item(1))
        await rt.infer("m", item(1), version="2")  # the same answer: a hit
        assert model.seen == [1.0]
        assert rt.invalidate_cache("m", "1") == 0
        assert rt.invalidate_cache("m", "2") == 1
        key = rt.response_key("m", None, "a", b"{}")
        assert key[0] == rt.response_key("m", "2", "a", b"{}")[0]


async def test_the_cache_keeps_its_own_copy_of_an_answer_not_the_callers_input(autojump_clock):
    """echo answers with its input itself: keeping (and freezing) that kept the
    caller's buffer, which it could no longer write, or whose changes reached later
    hits."""
    async with trioserve.open_runtime(
        cfg(trioserve.ModelConfig(name="echo", backend="echo", max_wait_ms=0))
    ) as rt:
        buf = np.array([1.0, 2.0], np.float32)
        await rt.infer("echo", {"x": buf})
        assert buf.flags.writeable
        buf[:] = 7.0
        again = await rt.infer("echo", {"x": np.array([1.0, 2.0], np.float32)})
        assert again["x"].tolist() == [1.0, 2.0]
        assert rt.cache_statistics()["hits"] == 1


async def test_an_answer_is_counted_at_the_bytes_it_holds(autojump_clock):
    """A BYTES answer holds its elements (an object array's nbytes counts only
    pointers): a 64 KiB cache held 20 MiB of them."""
    async with trioserve.open_runtime(
        cfg(trioserve.ModelConfig(name="echo", backend="echo", max_wait_ms=0),
            capacity=64 * 1024)
    ) as rt:
        for i in range(20):
            big = np.array([bytes([i]) * 1_000_000], dtype=object)
            await rt.infer("echo", {"t": big})
        small = np.array([b"x" * 1000], dtype=object)
        await rt.infer("echo", {"t": small})
        stats = rt.cache_statistics()
    assert stats["bytes_used"] <= 64 * 1024
    assert stats["entries"] == 1  # only the small one fits
    assert stats["bytes_used"] > 1000


async def test_an_input_the_cache_key_cannot_encode_is_served_uncached(autojump_clock):
    async with trioserve.open_runtime(
        cfg(trioserve.ModelConfig(name="echo", backend="echo", max_wait_ms=0))
    ) as rt:
        value = np.array([Decimal("1.5")], dtype=object)
        out = await rt.infer("echo", {"d": value})
        assert out["d"].tolist() == [Decimal("1.5")]
        outs = await rt.infer_batch("echo", [{"d": value}, {"d": value}])
        assert [o["d"].tolist() for o in outs] == [[Decimal("1.5")]] * 2


@pytest.mark.parametrize("capacity", [0, 1 << 20])
async def test_credits_past_the_callers_deadline_are_refused_at_once_cached_or_not(
    autojump_clock, capacity
):
    """A cached request is computed in the cache actor's nursery, outside its caller's
    cancel scopes: it once waited for credits that refill only after its caller's
    deadline (and the caller got its own timeout, a 504 over HTTP, instead of
    QuotaExceeded at once with the refill time, a 429)."""
    model = Recorder()
    config = trioserve.Config(
        models=(callable_model("m", model, max_wait_ms=0),),
        tenants=(TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=1.0),),
        cache=CacheConfig(capacity_bytes=capacity),
    )
    async with trioserve.open_runtime(config) as rt:
        await rt.infer("m", item(1), priority="batch")  # spends the burst
        t0 = trio.current_time()
        with trio.fail_after(0.5), pytest.raises(trioserve.QuotaExceeded) as refused:
            await rt.infer("m", item(2), priority="batch")  # waits for credits: 1 s
        assert trio.current_time() == t0
        assert refused.value.retry_after == pytest.approx(1.0)
        assert refused.value.deadline == pytest.approx(t0 + 0.5)  # the caller's
        # without a deadline of its own it waits for the refill, as before
        assert float((await rt.infer("m", item(2), priority="batch"))["y"][0]) == 5.0
        assert trio.current_time() == pytest.approx(t0 + 1.0)
        assert rt.tenant_statistics()["a"]["credits_used"] == 2
    assert model.seen == [1.0, 2.0]


@pytest.mark.parametrize("cached", [True, False])
async def test_invalidating_a_model_or_version_not_served_says_so(autojump_clock, cached):
    """A mistyped name dropped nothing and returned 0, as if done; a version given
    as a number is refused as infer refuses it (versions are names: "02", "v2")."""
    config = cfg(callable_model("m", Counting(), versions=["1", "2"]),
                 capacity=1 << 20 if cached else 0)
    async with trioserve.open_runtime(config) as rt:
        with pytest.raises(UnknownModel, match="unknown model 'mm'; serving: m"):
            rt.invalidate_cache("mm")
        with pytest.raises(UnknownModel, match="model 'm' has no version '3'; versions: 1, 2"):
            rt.invalidate_cache("m", "3")
        with pytest.raises(InvalidInput, match="version must be a string"):
            rt.invalidate_cache("m", 2)
        assert rt.invalidate_cache("m", "2") == 0
        assert rt.invalidate_cache("m") == 0


@pytest.mark.parametrize("floats", [1, 1024])  # 4 bytes and 4 KiB answers
async def test_a_full_cache_holds_about_its_capacity(autojump_clock, floats):
    """What a cache filled through the runtime really holds (tracemalloc, a full gc
    before each snapshot) is within 25% of ``capacity_bytes``, for tiny answers as
    for large ones: the per-entry charge (OVERHEAD) covers the key, the entry, the
    policy's maps and the answer's headers. At 256 bytes an entry, a cache of tiny
    answers held ~3.5 times its capacity."""
    import gc
    import tracemalloc

    capacity = 1 << 20
    echo = trioserve.ModelConfig(name="echo", backend="echo", max_wait_ms=0)
    tracemalloc.start()
    try:
        async with trioserve.open_runtime(cfg(echo, capacity=capacity)) as rt:
            x = np.zeros(floats, np.float32)
            await rt.infer("echo", {"x": x})  # the code paths' first allocations
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            for i in range(1, 2 * capacity // (floats * 4 + OVERHEAD)):  # twice what fits
                x = np.zeros(floats, np.float32)
                x[0] = i
                await rt.infer("echo", {"x": x})
            del x
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
            stats = rt.cache_statistics()
    finally:
        tracemalloc.stop()
    assert stats["evictions"] + stats["admissions_rejected"] > 0  # full
    assert stats["bytes_used"] <= capacity
    assert 0.75 * capacity < held < 1.25 * capacity, (held / capacity, stats["entries"])
