"""Admission through the runtime's front door under MockClock: request
classification (tenants, classes, integer levels), tenant credits (reject or wait,
refunds), calls split between the lanes, class timeouts and per-flow stats. The
FairQueue's decisions themselves are in test_admission.py.
"""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import CostModel, Gate, Recorder, at, callable_model, item
from trioserve import (
    ClassConfig,
    DeadlineExceeded,
    Forbidden,
    InvalidInput,
    ModelConfig,
    Overloaded,
    QuotaExceeded,
    TenantConfig,
    Unauthorized,
)


# ---------------------------------------------------------------- runtime: classification
def tenancy(*tenants: TenantConfig, classes=None, model=None, **runtime) -> trioserve.Config:
    kw = {} if classes is None else {"classes": classes}
    return trioserve.Config(
        models=(model or callable_model("m", Recorder(), max_batch_size=4, max_wait_ms=0),),
        tenants=tenants,
        runtime=trioserve.RuntimeLimits(**runtime),
        **kw,
    )


def flow_stats(rt, model: str = "m"):
    return rt.models[model].scheduler.policy.stats


async def test_unknown_tenants_and_classes_and_forbidden_classes_are_refused(autojump_clock):
    cfg = tenancy(TenantConfig(name="a"), TenantConfig(name="b", classes=("batch",)))
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(Unauthorized, match=r"^unknown tenant 'zz'; tenants: a, b$"):
            await rt.infer("m", item(1), tenant="zz")
        with pytest.raises(
            Unauthorized, match=r"^no tenant given and no default tenant is configured: "
            r"pass tenant= one of 'a', 'b', or set default = true on a tenant in the config$"
        ):
            await rt.infer("m", item(1))
        with pytest.raises(
            InvalidInput,
            match=r"^unknown request class 'urgent'; classes: realtime, batch "
            r"\(or an integer level, 1 = highest\)$",
        ):
            await rt.infer("m", item(1), tenant="a", priority="urgent")
        # "²" and "١" are str.isdigit() but no level; unhashable values are no names
        for bad in (-1, True, "1.5", "\u00b2", "\u0661", ["batch"], {"c": 1}, 1.0):
            with pytest.raises(InvalidInput, match="unknown request class"):
                await rt.infer("m", item(1), tenant="a", priority=bad)
            with pytest.raises(InvalidInput, match="unknown request class"):
                await rt.infer_batch("m", [item(1)], tenant="a", priority=bad)
        for bad in (["a"], {"a": 1}, 7, b"a"):
            with pytest.raises(InvalidInput, match=r"^a tenant is named by a string, got "):
                await rt.infer("m", item(1), tenant=bad)
            with pytest.raises(InvalidInput, match=r"^a tenant is named by a string"):
                await rt.infer_batch("m", [item(1)], tenant=bad)
        with pytest.raises(
            Forbidden,
            match=r"^tenant 'b' may not use request class 'realtime'; allowed: batch$",
        ):
            await rt.infer("m", item(1), tenant="b", priority="realtime")
        with pytest.raises(Forbidden):
            await rt.infer("m", item(1), tenant="b", priority=1)  # level 1 is realtime
        assert flow_stats(rt) == {}  # nothing reached the queue


async def test_a_call_of_more_items_than_the_tenants_queue_share_is_invalid(autojump_clock):
    """It could never be queued whole, so it is a 400, not a 429 no retry cures; a
    call within the share is served."""
    cfg = tenancy(
        TenantConfig(name="a", default=True, queue_share=0.25), TenantConfig(name="b"),
        queue_bound=16,
    )
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(
            InvalidInput,
            match=r"^model 'm': 5 items in one request; tenant 'a' may queue at most 4 "
            r"\(its queue_share of runtime.queue_bound, 16\)$",
        ):
            await rt.infer_batch("m", [item(i) for i in range(5)])
        assert flow_stats(rt) == {}  # refused before anything was queued
        assert len(await rt.infer_batch("m", [item(i) for i in range(4)])) == 4
        assert len(await rt.infer_batch("m", [item(i) for i in range(5)], tenant="b")) == 5


@pytest.mark.parametrize(
    ("tenant", "priority", "cls"),
    [
        ("a", None, "realtime"),  # the tenant's first allowed class
        ("b", None, "batch"),
        ("a", 0, "realtime"),  # 0: the tenant's default
        ("b", "0", "batch"),
        ("a", 1, "realtime"),
        ("a", "1", "realtime"),
        ("a", 2, "batch"),
        ("b", "2", "batch"),
        ("a", 3, "realtime"),  # past the last level: the tenant's default, as Triton
        ("b", 9, "batch"),
        ("a", "0002", "batch"),
        ("b", "9" * 5000, "batch"),  # past the last, however many digits (int() refuses)
        ("a", "0" * 5000 + "2", "batch"),
        ("a", "batch", "batch"),
        (None, None, "realtime"),  # the default tenant, a
    ],
)
async def test_priorities_map_to_classes(autojump_clock, tenant, priority, cls):
    cfg = tenancy(TenantConfig(name="a", default=True), TenantConfig(name="b", classes=("batch",)))
    async with trioserve.open_runtime(cfg) as rt:
        await rt.infer("m", item(1), tenant=tenant, priority=priority)
        stats = flow_stats(rt)
    assert list(stats) == [(tenant or "a", cls)]
    assert stats[tenant or "a", cls].dispatched == 1


# ---------------------------------------------------------------- runtime: credits
CREDIT_CLASSES = (
    ClassConfig(name="realtime", max_queue_wait_ms=0.0, over_quota="reject"),
    ClassConfig(name="batch", max_queue_wait_ms=1000.0, over_quota="wait"),
    ClassConfig(name="bulk", max_queue_wait_ms=1000.0, over_quota="wait", timeout_ms=200),
)


def credits(rate: float, burst: float, **kw) -> trioserve.Config:
    return tenancy(
        TenantConfig(name="a", default=True, credit_rate=rate, credit_burst=burst),
        classes=CREDIT_CLASSES,
        **kw,
    )


@pytest.mark.parametrize(("rate", "shown"), [(1e-300, "1e+300s"), (1e-320, "infs")])
async def test_a_refill_of_ages_reads_short_in_the_message(autojump_clock, rate, shown):
    """It printed the wait with its 300 digits."""
    async with trioserve.open_runtime(credits(rate, 1.0)) as rt:
        await rt.infer("m", item(0))
        with pytest.raises(QuotaExceeded) as e:
            await rt.infer("m", item(1))
    assert str(e.value).endswith(f"; 1 more available in {shown}")


async def test_realtime_over_quota_is_refused_with_the_refill_time(autojump_clock):
    async with trioserve.open_runtime(credits(2.0, 4.0)) as rt:
        t0 = trio.current_time()
        for i in range(4):  # the burst
            await rt.infer("m", item(i))
        with trio.testing.assert_checkpoints(), pytest.raises(
            QuotaExceeded,
            match=r"^tenant 'a' is over its credit rate \(2/s, burst 4\); "
            r"1 more available in 0\.500s$",
        ) as e:
            await rt.infer("m", item(4))  # a refusal, and still a checkpoint
        assert e.value.retry_after == 0.5
        assert trio.current_time() == t0
        assert rt.credits_used["a"] == 4
        assert flow_stats(rt)["a", "realtime"].shed == 1  # a refusal of its flow
        await trio.sleep(0.5)
        await rt.infer("m", item(5))  # refilled
        assert rt.credits_used["a"] == 5


async def test_batch_over_quota_waits_exactly_until_the_refill_then_is_served(autojump_clock):
    rec = Recorder()
    cfg = credits(2.0, 2.0, model=callable_model("m", rec, max_batch_size=4, max_wait_ms=0))
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        await rt.infer_batch("m", [item(0), item(1)], priority="batch")  # the burst
        assert trio.current_time() == t0
        out = await rt.infer("m", item(2), priority="batch")
        assert at(trio.current_time(), t0 + 0.5)  # 1 unit at 2/s
        assert float(out["y"][0]) == 5.0
        stats = flow_stats(rt)["a", "batch"]
        tenant = rt.tenant_statistics()["a"]
        # the wait for credits is counted apart: it was before the queue
        assert (tenant["credit_waits"], tenant["credit_wait_seconds"]) == (1, pytest.approx(0.5))
        wait = stats.wait.summary()
        assert wait.count == 3
        assert wait.max_ms < 500.0
    assert rec.seen == [0.0, 1.0, 2.0]
    assert at(rec.times[-1], t0 + 0.5)
    assert (stats.admitted, stats.dispatched, stats.served_cost) == (3, 3, 3)


async def test_a_waiting_request_whose_refill_is_past_its_deadline_is_refused_at_once(
    autojump_clock,
):
    async with trioserve.open_runtime(credits(2.0, 1.0)) as rt:
        t0 = trio.current_time()
        await rt.infer("m", item(0), priority="bulk")
        with pytest.raises(
            QuotaExceeded,
            match=r"^tenant 'a' is over its credit rate \(2/s\) and its credits refill only "
            r"after the request's deadline$",
        ) as e:
            await rt.infer("m", item(1), priority="bulk")  # refill at +0.5, deadline +0.2
        assert trio.current_time() == t0
        assert e.value.retry_after == 0.5
        assert rt.buckets["a"].used == 1  # nothing taken for it
        assert rt.credits_used["a"] == 1
        with pytest.raises(QuotaExceeded):
            await rt.infer_batch("m", [item(2), item(3)], priority="bulk")
        stats = flow_stats(rt)["a", "bulk"]
        assert (stats.admitted, stats.shed) == (1, 3)  # every item of the call


async def test_cancelling_a_request_waiting_for_credits_refunds_them(autojump_clock):
    async with trioserve.open_runtime(credits(1.0, 2.0)) as rt:
        t0 = trio.current_time()
        await rt.infer_batch("m", [item(0), item(1)], priority="batch")
        # No deadline (a deadline before the refill would refuse it at once): the
        # caller is cancelled from outside while it waits.
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def waiter():
                with scope:
                    await rt.infer("m", item(2), priority="batch")  # would go at t0 + 1

            nursery.start_soon(waiter)
            await trio.sleep(0.5)
            assert rt.credits_used["a"] == 3  # reserved while it waits
            scope.cancel("the caller left")
        assert scope.cancelled_caught
        assert trio.current_time() == t0 + 0.5
        assert rt.credits_used["a"] == 2
        await rt.infer("m", item(3), priority="batch")
        # With the refund it goes at t0 + 1 (without it, at t0 + 2).
        assert at(trio.current_time(), t0 + 1.0)
        assert rt.credits_used["a"] == 3
        assert rt.buckets["a"].used == 3
        # two waits: the one cancelled after 0.5 s, and the last one's 0.5 s
        tenant = rt.tenant_statistics()["a"]
        assert (tenant["credit_waits"], tenant["credit_wait_seconds"]) == (2, pytest.approx(1.0))


# Regression: the refund of a waiting caller took the first reservation still
# waiting for its own, and a reservation refunded stayed among them: of two waiters
# who both left, the second's credits were lost, and the credits shown read
# negative (-0.5 here) while nothing was owed.
async def test_two_waiters_who_leave_both_get_their_credits_back(autojump_clock):
    async with trioserve.open_runtime(credits(1.0, 2.0)) as rt:
        t0 = trio.current_time()
        await rt.infer_batch("m", [item(0), item(1)], priority="batch")  # the burst
        shown = []
        async with trio.open_nursery() as nursery:
            scopes = [trio.CancelScope(), trio.CancelScope()]

            async def waiter(scope):
                with scope:
                    await rt.infer("m", item(2), priority="batch")  # t0 + 1, t0 + 2

            for scope in scopes:
                nursery.start_soon(waiter, scope)
                await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.5)
            shown.append(rt.tenant_statistics()["a"]["credits_available"])  # owed: none
            for scope in scopes:
                scope.cancel("the caller left")
        assert trio.current_time() == t0 + 0.5
        tenant = rt.tenant_statistics()["a"]
        shown.append(tenant["credits_available"])
        assert (tenant["credits_used"], tenant["credits_refunded"]) == (2, 2)
        assert available(rt) == 0.5  # both refunds: what refilled since t0 is there
        await trio.sleep(1.0)
        shown.append(rt.tenant_statistics()["a"]["credits_available"])
    assert shown == [0.0, 0.5, 1.5]


# Fixed in 70474a8 (credits were charged for requests the queue refused).
async def test_a_request_the_queue_refuses_is_not_charged(autojump_clock):
    cfg = credits(
        1.0,
        10.0,
        model=callable_model(
            "m", Recorder(), max_batch_size=8, max_wait_ms=1000, adaptive_limit=False
        ),
        queue_bound=2,
    )
    async with trioserve.open_runtime(cfg) as rt:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rt.infer, "m", item(0))
            nursery.start_soon(rt.infer, "m", item(1))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(Overloaded, match="queue full"):
                await rt.infer("m", item(2))
            with pytest.raises(Overloaded, match="queue full"):
                await rt.infer_batch("m", [item(3), item(4)])
            assert rt.credits_used["a"] == 2  # "cost units admitted per tenant"
            assert rt.buckets["a"].level == 8.0


# Regression: a pushed-out request (it never ran) once kept its credits charged.
async def test_a_request_pushed_out_of_the_queue_is_not_charged(autojump_clock):
    cfg = tenancy(
        TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=10.0),
        TenantConfig(name="b"),
        model=callable_model(
            "m", Recorder(), max_batch_size=8, max_wait_ms=1000, adaptive_limit=False
        ),
        queue_bound=2,
    )
    pushed: list[Overloaded] = []

    async def caller(i):
        try:
            await rt.infer("m", item(i), tenant="a")
        except Overloaded as exc:
            pushed.append(exc)

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(caller, 0)
        nursery.start_soon(caller, 1)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(functools.partial(rt.infer, "m", item(2), tenant="b"))
        await trio.testing.wait_all_tasks_blocked()
        used, level = rt.credits_used["a"], rt.buckets["a"].level
    assert len(pushed) == 1  # b (under its share) pushed out one of a's two
    assert "pushed out" in str(pushed[0])
    assert (used, level) == (1, 9.0)


def available(rt, tenant: str = "a") -> float:
    """The credits tenant's bucket holds now."""
    b = rt.buckets[tenant]
    return min(b.burst, b.level + (trio.current_time() - b.stamp) * b.rate)


def _held(gate: Gate, **kw) -> trioserve.Config:
    """Tenant a with 10 credits (1/s) and a one-replica model that blocks on ``gate``."""
    model = callable_model(
        "m", gate, execution="thread", max_batch_size=1, max_wait_ms=0, timeout_ms=None,
        adaptive_limit=False, **kw,
    )
    return credits(1.0, 10.0, model=model)


async def test_a_request_that_expires_in_the_queue_is_not_charged(autojump_clock, gate):
    """Answered 504 by the queue's timer (the class's timeout), it never ran: its
    credits come back, as a pushed-out request's do; the one that ran keeps its."""
    async with trioserve.open_runtime(_held(gate)) as rt, trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(functools.partial(rt.infer, "m", item(1), priority="batch"))
        await trio.testing.wait_all_tasks_blocked()  # item 1 holds the only replica
        with pytest.raises(DeadlineExceeded, match="in the queue") as info:
            await rt.infer("m", item(2, n=3), priority="bulk")  # 200 ms class timeout
        assert info.value.in_queue
        with pytest.raises(DeadlineExceeded, match="in the queue"):
            await rt.infer_batch("m", [item(3), item(4)], priority="bulk")
        assert rt.credits_used["a"] == 1
        assert rt.credits_refunded["a"] == 3  # counted apart: /metrics' counters only rise
        # what the bucket holds is what one take and the refill since leave
        assert available(rt) == pytest.approx(9.0 + (trio.current_time() - t0))
        gate.release()
    assert gate.seen == [1.0]
    assert rt.credits_used["a"] == 1


async def test_a_request_its_caller_withdraws_while_queued_is_not_charged(
    autojump_clock, gate
):
    async with trioserve.open_runtime(_held(gate)) as rt, trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(functools.partial(rt.infer, "m", item(1), priority="batch"))
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(0.5) as scope:  # the caller's own deadline
            await rt.infer("m", item(2), priority="batch")
        assert scope.cancelled_caught
        with trio.move_on_after(0.5) as scope:
            await rt.infer_batch("m", [item(3), item(4)], priority="batch")
        assert scope.cancelled_caught
        assert rt.credits_used["a"] == 1
        assert available(rt) == pytest.approx(9.0 + (trio.current_time() - t0))
        gate.release()
    assert gate.seen == [1.0]


# Regression: a request whose caller's own deadline (a cancel scope; over HTTP,
# timeout_ms) passed while it was queued was withdrawn uncounted: neither expired
# nor a congestion signal for the adaptive limit, unlike one the queue answers 504.
async def test_a_request_withdrawn_at_its_callers_deadline_is_counted_expired(
    autojump_clock, gate
):
    model = callable_model(
        "m", gate, execution="thread", max_batch_size=1, max_wait_ms=0, timeout_ms=None
    )
    cfg = tenancy(TenantConfig(name="a", default=True), model=model, queue_bound=64)
    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(rt.infer, "m", item(1)))
        await trio.testing.wait_all_tasks_blocked()  # item 1 holds the only replica
        limit = rt.statistics()["m"]["admission_limit"]
        with trio.move_on_after(0.5):
            await rt.infer("m", item(2))
        with trio.move_on_after(0.5):
            await rt.infer_batch("m", [item(3), item(4)])
        flow = rt.statistics()["m"]["flows"]["a/realtime"]
        assert (flow["expired"], flow["withdrawn"], flow["queued"]) == (3, 0, 0)
        assert rt.statistics()["m"]["admission_limit"] < limit
        with trio.CancelScope() as scope:  # a caller leaving before its deadline

            async def leave():
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()

            nursery.start_soon(leave)
            await rt.infer("m", item(5))
        assert scope.cancelled_caught
        flow = rt.statistics()["m"]["flows"]["a/realtime"]
        assert (flow["expired"], flow["withdrawn"]) == (3, 1)  # left: withdrawn
        with trio.CancelScope() as scope:  # a batch call leaving before its deadline
            nursery.start_soon(leave)
            await rt.infer_batch("m", [item(6), item(7)])
        flow = rt.statistics()["m"]["flows"]["a/realtime"]
        assert (flow["expired"], flow["withdrawn"]) == (3, 3)
        gate.release()
    assert gate.seen == [1.0]


async def test_a_batch_whose_caller_leaves_is_refunded_for_its_items_pushed_out(
    autojump_clock, gate
):
    """One item of a's batch is pushed out by b, then a leaves with the other still
    queued: neither ran, so both come back (the pushed-out one's answer had been
    dropped with the caller's withdrawal, and its credits with it)."""
    model = callable_model(
        "m", gate, execution="thread", max_batch_size=1, max_wait_ms=0, timeout_ms=None,
        adaptive_limit=False,
    )
    cfg = tenancy(
        TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=10.0),
        TenantConfig(name="b"),
        model=model,
        queue_bound=2,
    )
    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(functools.partial(rt.infer, "m", item(1)))
        await trio.testing.wait_all_tasks_blocked()  # item 1 holds the only replica
        with trio.move_on_after(0.5) as scope:
            async with trio.open_nursery() as inner:
                inner.start_soon(functools.partial(rt.infer_batch, "m", [item(2), item(3)]))
                await trio.testing.wait_all_tasks_blocked()
                inner.start_soon(functools.partial(rt.infer, "m", item(4), tenant="b"))
                await trio.testing.wait_all_tasks_blocked()
                flows = rt.statistics()["m"]["flows"]
                assert flows["a/realtime"]["queued"] == 1  # item 3 was pushed out
                assert flows["b/realtime"]["queued"] == 1
        assert scope.cancelled_caught
        assert rt.credits_used["a"] == 1
        assert rt.credits_refunded["a"] == 2
        assert available(rt) == pytest.approx(9.0 + (trio.current_time() - t0))
        gate.release()
    assert gate.seen == [1.0]


async def test_a_request_whose_caller_leaves_after_dispatch_stays_charged(autojump_clock, gate):
    async with trioserve.open_runtime(_held(gate)) as rt:
        with trio.move_on_after(0.5) as scope:
            await rt.infer("m", item(1), priority="batch")  # dispatched, then abandoned
        assert scope.cancelled_caught
        assert rt.credits_used["a"] == 1
        assert available(rt) == pytest.approx(9.5)
        gate.release()


async def test_statistics_count_only_live_queued_requests(autojump_clock, gate):
    """A caller that leaves withdraws its request at once; the flow's entry stays
    until passed, but the reported queue depth counts it out at once."""
    async with trioserve.open_runtime(_held(gate)) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(rt.infer, "m", item(1), priority="batch"))
        await trio.testing.wait_all_tasks_blocked()
        async with trio.open_nursery() as callers:
            for i in range(3):
                callers.start_soon(functools.partial(rt.infer, "m", item(10 + i),
                                                     priority="batch"))
            await trio.testing.wait_all_tasks_blocked()
            assert rt.statistics()["m"]["flows"]["a/batch"]["queued"] == 3
            callers.cancel_scope.cancel()  # the three callers leave
        flow = rt.statistics()["m"]["flows"]["a/batch"]
        assert (flow["queued"], flow["admitted"], flow["dispatched"]) == (0, 4, 1)
        assert flow_stats(rt)["a", "batch"].queued == 3  # entries held, all dead
        gate.release()
    assert rt.statistics()["m"]["flows"]["a/batch"]["queued"] == 0


# Fixed in 70474a8 (retry_after used the cost, not min(cost, burst)).
async def test_retry_after_for_a_cost_above_the_burst_is_when_it_would_be_admitted(
    autojump_clock,
):
    backend = CostModel()
    cfg = credits(
        1.0,
        4.0,
        model=ModelConfig(
            name="m", backend=backend, max_batch_size=4, max_batch_tokens=64, max_wait_ms=0
        ),
    )
    async with trioserve.open_runtime(cfg) as rt:
        await rt.infer("m", item(0, n=8), priority="bulk")  # full bucket: served, level -4
        with pytest.raises(QuotaExceeded) as e:
            await rt.infer("m", item(1, n=8), priority="bulk")
        # A bucket at -4 refilling at 1/s holds the burst (4, what a cost of 8 needs)
        # after 8 s (the bug said 12: (cost - level) / rate).
        assert e.value.retry_after == 8.0


async def test_refusal_of_a_cost_above_the_burst_says_a_full_bucket_is_what_comes(
    autojump_clock,
):
    # The message said "8 more available in 8.000s": the bucket never holds 8; a cost
    # above the burst waits for a full bucket and takes it below zero.
    backend = CostModel()
    cfg = credits(
        1.0,
        4.0,
        model=ModelConfig(
            name="m", backend=backend, max_batch_size=4, max_batch_tokens=64, max_wait_ms=0
        ),
    )
    async with trioserve.open_runtime(cfg) as rt:
        await rt.infer("m", item(0, n=8))  # full bucket: served, level -4
        with pytest.raises(
            QuotaExceeded,
            match=r"^tenant 'a' is over its credit rate \(1/s, burst 4\); a full bucket "
            r"\(4\) available in 8\.000s; a request costing 8 > 4 drains it below zero$",
        ) as e:
            await rt.infer("m", item(1, n=8))
        assert e.value.retry_after == 8.0  # when the bucket is full again
        await trio.sleep(8.0)
        await rt.infer("m", item(2, n=8))  # and then it is admitted


# ---------------------------------------------------------------- runtime: the slow lane
def _two_lanes(backend: CostModel) -> trioserve.Config:
    """Tenants a (default) and b; model m on two replicas, items of cost >= 10 in the
    slow lane, two requests queued per lane at most, batches closing only on size."""
    return tenancy(
        TenantConfig(name="a", default=True),
        TenantConfig(name="b"),
        model=ModelConfig(
            name="m", backend=backend, replicas=2, slow_lane_cost=10, max_batch_size=8,
            max_wait_ms=10_000, timeout_ms=None, adaptive_limit=False,
        ),
        queue_bound=2,
    )


def _calls_into(rt, outcomes: dict[str, object]):
    """A task that makes one infer_batch call of model m, its result or Overloaded
    kept in ``outcomes`` under its name."""

    async def call(name, items, tenant):
        try:
            outcomes[name] = await rt.infer_batch("m", items, tenant=tenant)
        except Overloaded as exc:
            outcomes[name] = exc

    return call


# Regression: the items of a call split between a model's two lanes were queued one
# by one, so a short item queued in the fast lane pushed out another tenant's newest
# request (answered 503) before the long item was refused by the full slow lane, and
# the call was then withdrawn whole: a shed for nothing.
async def test_a_call_split_between_the_lanes_and_refused_in_one_sheds_nobody(
    autojump_clock,
):
    backend = CostModel()
    outcomes: dict[str, object] = {}

    async with trioserve.open_runtime(_two_lanes(backend)) as rt:
        call = _calls_into(rt, outcomes)
        served = rt.models["m"]
        fast, slow = served.scheduler.policy, served.slow_scheduler.policy
        async with trio.open_nursery() as nursery:
            for i in range(2):  # a fills the fast lane, b the slow one
                nursery.start_soon(call, f"a{i}", [item(i)], "a")
                nursery.start_soon(call, f"b{i}", [item(10 + i, n=20)], "b")
            await trio.testing.wait_all_tasks_blocked()
            assert (len(fast), len(slow)) == (2, 2)
            # b's short item alone would push out a's newest request (b is under its
            # share of the fast lane); its long one finds b at its share of the full
            # slow lane: refused, so the whole call is, and nobody may be shed for it.
            with pytest.raises(Overloaded, match=r"^model 'm': queue full \(2 requests"):
                await rt.infer_batch("m", [item(20), item(21, n=20)], tenant="b")
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == {}  # nobody answered: a's two are still queued
            assert len(fast) == 2
            assert [r.tenant for r in fast] == ["a", "a"]
            assert (fast.stats["a", "realtime"].shed, slow.stats["b", "realtime"].queued) == (
                0,
                2,
            )
            # the refused call counts whole as shed, each item in its own lane
            assert fast.stats["b", "realtime"].shed == 1
            assert slow.stats["b", "realtime"].shed == 1
            assert fast.stats["b", "realtime"].admitted == 0
            nursery.cancel_scope.cancel()


async def test_a_call_split_between_the_lanes_and_admitted_pushes_out_as_item_by_item(
    autojump_clock,
):
    """With room in the slow lane, b's call goes in whole: its short item pushes out
    a's newest request in the fast lane, as offering the items one by one would."""
    backend = CostModel()
    outcomes: dict[str, object] = {}

    async with trioserve.open_runtime(_two_lanes(backend)) as rt:
        call = _calls_into(rt, outcomes)
        served = rt.models["m"]
        fast, slow = served.scheduler.policy, served.slow_scheduler.policy
        async with trio.open_nursery() as nursery:
            for i in range(2):  # one after the other: a1 is a's newest
                nursery.start_soon(call, f"a{i}", [item(i)], "a")
                await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(call, "b", [item(20), item(21, n=20)], "b")
            await trio.testing.wait_all_tasks_blocked()
            assert (len(fast), len(slow)) == (2, 1)
            assert sorted(r.tenant for r in fast) == ["a", "b"]
            assert list(outcomes) == ["a1"]  # a's newest, pushed out
            assert "pushed out" in str(outcomes["a1"])
            assert fast.stats["b", "realtime"].admitted == 1
            assert slow.stats["b", "realtime"].admitted == 1
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- runtime: class timeout
@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.release()


async def test_class_timeout_answers_deadline_exceeded_at_exactly_that_time(autojump_clock, gate):
    classes = (
        ClassConfig(name="realtime", max_queue_wait_ms=0.0, timeout_ms=100),
        ClassConfig(name="batch", max_queue_wait_ms=1000.0),
    )
    model = callable_model(
        "m", gate, execution="thread", max_batch_size=1, max_wait_ms=0, timeout_ms=None
    )
    cfg = tenancy(TenantConfig(name="a", default=True), classes=classes, model=model)
    async with trioserve.open_runtime(cfg) as rt:
        async with trio.open_nursery() as nursery:
            # A batch-class request (no class timeout) holds the only replica.
            nursery.start_soon(functools.partial(rt.infer, "m", item(1), priority="batch"))
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            with pytest.raises(
                DeadlineExceeded, match=r"^model 'm': deadline passed after 0\.100s"
            ):
                await rt.infer("m", item(2), priority="realtime")
            assert at(trio.current_time(), t0 + 0.1)
            gate.release()
        stats = flow_stats(rt)
    assert gate.seen == [1.0]  # the expired one never ran
    assert (stats["a", "realtime"].expired, stats["a", "realtime"].dispatched) == (1, 0)


# ---------------------------------------------------------------- runtime: per-flow stats
async def test_per_tenant_and_class_stats_count_admitted_dispatched_and_cost(autojump_clock):
    backend = CostModel()
    model = ModelConfig(name="m", backend=backend, max_batch_size=8, max_wait_ms=0)
    cfg = tenancy(TenantConfig(name="a", default=True), TenantConfig(name="b"), model=model)
    async with trioserve.open_runtime(cfg) as rt:
        await rt.infer_batch("m", [item(0, n=3), item(1, n=3)], tenant="a")
        await rt.infer("m", item(2, n=2), tenant="a", priority="batch")
        await rt.infer("m", item(3, n=5), tenant="b", priority="batch")
        stats = flow_stats(rt)
    summary = {
        k: (s.admitted, s.dispatched, s.served_cost, s.shed, s.expired, s.queued)
        for k, s in stats.items()
    }
    assert summary == {
        ("a", "realtime"): (2, 2, 6, 0, 0, 0),
        ("a", "batch"): (1, 1, 2, 0, 0, 0),
        ("b", "batch"): (1, 1, 5, 0, 0, 0),
    }
    assert rt.models["m"].scheduler.policy.service() == {"a": 8, "b": 5}
    assert rt.models["m"].scheduler.policy.service("batch") == {"a": 2, "b": 5}
