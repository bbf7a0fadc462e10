"""Admission: the FairQueue's shed decisions (full queue, push-out, queue share,
estimated wait, withdrawn requests), driven directly with time as an argument; and the
runtime's front door under MockClock: request classification (tenants, classes,
integer levels), tenant credits (reject or wait), class timeouts and per-flow stats.
"""

from __future__ import annotations

import functools
import math

import pytest
import trio
import trio.testing
import trioserve
from hypothesis import given
from hypothesis import strategies as st
from runtime_helpers import CostModel, Gate, Recorder, at, callable_model, item
from trioserve import (
    ClassConfig,
    DeadlineExceeded,
    Forbidden,
    InvalidInput,
    ModelConfig,
    Overloaded,
    QuotaExceeded,
    Request,
    RequestState,
    TenantConfig,
    Unauthorized,
)
from trioserve.actors import BatchLimits, ClassSpec, FairQueue

QUEUED = RequestState.QUEUED
DONE = RequestState.DONE
CANCELLED = RequestState.CANCELLED


def req(
    tenant: str = "a",
    cost: int = 1,
    *,
    cls: str = "default",
    arrival: float = 0.0,
    deadline: float = math.inf,
) -> Request:
    return Request(
        model="m",
        item=None,
        cost=cost,
        tenant=tenant,
        priority=cls,
        arrival=arrival,
        deadline=deadline,
        answer_expiry=deadline < math.inf,
    )


def queue(bound: int, *, max_size: int = 1, max_wait: float = 0.0, **kw) -> FairQueue:
    return FairQueue(
        BatchLimits(max_size=max_size, max_wait=max_wait),
        bound=bound,
        model="m",
        adaptive=False,
        **kw,
    )


def fill(q: FairQueue, tenant: str, n: int, **kw) -> list[Request]:
    rs = [req(tenant, **kw) for _ in range(n)]
    for r in rs:
        q.offer(r, 0.0)
    return rs


async def error_of(r: Request) -> BaseException:
    """The error ``r`` was answered with."""
    assert r.reply.state is DONE
    try:
        await r.reply.wait()
    except Exception as exc:
        return exc
    raise AssertionError("answered with a value")


# ---------------------------------------------------------------- full queue
def test_a_full_queue_refuses_with_overloaded_a_message_and_retry_after():
    q = queue(3, max_wait=0.2)
    fill(q, "a", 3)
    with pytest.raises(Overloaded, match=r"^model 'm': queue full \(3 requests waiting\)$") as e:
        q.offer(req("a"), 0.0)
    assert type(e.value) is Overloaded
    assert e.value.retry_after == 0.2  # no service rate yet: the batch wait
    assert len(q) == 3
    assert q.stats["a", "default"].admitted == 3
    assert q.stats["a", "default"].shed == 1


def test_retry_after_is_the_queued_work_over_the_measured_rate():
    q = queue(4, max_size=2)
    fill(q, "a", 4)
    b1, b2 = q.next_batch(0.0), q.next_batch(0.0)
    q.completed(b1, 1.0)
    q.completed(b2, 2.0)  # two full batches 1 s apart: 2 units/s
    assert q.rate == 2.0
    fill(q, "a", 4)
    with pytest.raises(Overloaded) as e:
        q.offer(req("a"), 2.0)
    assert e.value.retry_after == 2.0  # 4 units queued at 2 units/s


# ---------------------------------------------------------------- push-out
async def test_a_tenant_under_its_share_pushes_out_the_newest_of_the_most_over_share():
    q = queue(4)
    a = fill(q, "a", 4)
    b1 = req("b")
    q.offer(b1, 0.0)  # b holds 0 of its share 2; a holds 4
    assert b1.reply.state is QUEUED
    assert [r.reply.state for r in a] == [QUEUED] * 3 + [DONE]  # only a's newest
    err = await error_of(a[3])
    assert type(err) is Overloaded
    assert str(err) == (
        "model 'm': pushed out of a full queue by another tenant's request "
        "(this tenant is over its share)"
    )
    assert err.retry_after > 0
    q.offer(req("b"), 0.0)  # b holds 1 of 2: a's next newest goes
    assert [r.reply.state for r in a] == [QUEUED, QUEUED, DONE, DONE]
    assert len(q) == 4
    assert q.stats["a", "default"].shed == 2
    assert q.stats["a", "default"].queued == 2


def balance(q: FairQueue) -> dict[tuple[str, str], tuple[int, int]]:
    """Per flow: admitted, and what its admitted requests became (dispatched, expired,
    withdrawn, closed, pushed out, or still queued)."""
    live = q.queued_by_flow()
    return {
        k: (s.admitted, s.dispatched + s.expired + s.withdrawn + s.closed + s.pushed_out
            + live.get(k, 0))
        for k, s in q.stats.items()
    }


def test_a_request_pushed_out_counts_in_pushed_out_and_shed_and_the_flows_balance():
    q = queue(4)
    a = [req("a", deadline=5.0), req("a"), req("a"), req("a")]
    for r in a:
        q.offer(r, 0.0)
    with pytest.raises(Overloaded):  # a holds the whole queue: refused, never admitted
        q.offer(req("a"), 0.0)
    sa = q.stats["a", "default"]
    assert (sa.admitted, sa.shed, sa.pushed_out) == (4, 1, 0)
    b = [req("b"), req("b")]
    for r in b:  # b under its share 2: each pushes out a's newest
        q.offer(r, 0.0)
    assert [r.reply.state for r in a] == [QUEUED, QUEUED, DONE, DONE]
    sb = q.stats["b", "default"]
    assert (sa.admitted, sa.shed, sa.pushed_out) == (4, 3, 2)  # shed as ever, 2 of it admitted
    assert (sb.admitted, sb.shed, sb.pushed_out) == (2, 0, 0)
    assert balance(q) == {("a", "default"): (4, 4), ("b", "default"): (2, 2)}
    a[1].reply.withdraw()  # its caller left
    q.withdrawn_by_caller(a[1])
    batch = q.next_batch(0.0)
    assert batch is not None
    assert [r.tenant for r in batch] == ["a"]
    assert batch[0] is a[0]
    assert q.expire(6.0) == 0  # a[0] was dispatched before its deadline
    drained = q.drain()
    assert drained == b
    assert (sa.dispatched, sa.withdrawn, sa.pushed_out, sa.closed) == (1, 1, 2, 0)
    assert (sb.dispatched, sb.closed, sb.pushed_out) == (0, 2, 0)
    assert balance(q) == {("a", "default"): (4, 4), ("b", "default"): (2, 2)}
    assert q.queued_by_flow() == {}


def test_an_admitted_call_counts_those_it_pushes_out_and_a_refused_one_none():
    # d's weight counts only once d holds or offers requests.
    q = queue(6, weights={"a": 1.0, "c": 1.5, "b": 1.5, "d": 3.0})
    a, c = fill(q, "a", 3), fill(q, "c", 3)
    call = [req("b") for _ in range(3)]
    q.offer_all(call, 0.0)  # pushes out a's newest, c's newest, a's next (see above)
    assert [r.reply.state for r in a + c] == [QUEUED, DONE, DONE, QUEUED, QUEUED, DONE]
    sa, sb, sc = (q.stats[t, "default"] for t in "abc")
    assert (sa.shed, sa.pushed_out, sc.shed, sc.pushed_out) == (2, 2, 1, 1)
    assert (sb.admitted, sb.shed, sb.pushed_out) == (3, 0, 0)
    with pytest.raises(Overloaded):  # b at its share now: the whole call refused
        q.offer_all([req("b"), req("b")], 0.0)
    assert (sb.admitted, sb.shed, sb.pushed_out) == (3, 2, 0)  # shed, never admitted
    assert balance(q) == {k: (3, 3) for k in q.stats}
    # The lanes' way: planned first, then applied; the push-outs count when applied.
    d = [req("d") for _ in range(2)]
    plan = q.plan_all(d, 0.0)
    assert ("d", "default") not in q.stats
    assert (sa.pushed_out, sb.pushed_out, sc.pushed_out) == (2, 0, 1)
    q.offer_planned(plan, 0.0)
    assert [r.reply.state for r in d] == [QUEUED] * 2
    # Shares of 6 now: a 6/7, b and c 9/7, d 18/7. Item 1: b (3) is most over and
    # loses its newest; item 2: b and c tie (2 each), c, first to hold, loses its.
    assert [r.reply.state for r in call] == [QUEUED, QUEUED, DONE]
    assert [r.reply.state for r in c] == [QUEUED, DONE, DONE]
    assert (sa.pushed_out, sb.pushed_out, sc.pushed_out) == (2, 1, 2)
    assert (sa.shed, sb.shed, sc.shed) == (2, 3, 2)
    assert balance(q) == {k: (s.admitted, s.admitted) for k, s in q.stats.items()}
    assert sum(n for n in q.queued_by_flow().values()) == 6


def test_a_request_refused_for_its_deadline_pushes_nobody_out():
    """The push-out came first: a's newest was answered 503 to make room for a request
    of b that the estimated wait then refused too, two sheds for nothing."""
    q = queue(4, max_size=2)
    fill(q, "a", 4)
    b1, b2 = q.next_batch(0.0), q.next_batch(0.0)
    q.completed(b1, 1.0)
    q.completed(b2, 2.0)  # two full batches 1 s apart: 2 units/s
    a = fill(q, "a", 4)  # full, and 2 s of work ahead
    with pytest.raises(Overloaded, match="estimated time to serve it"):
        q.offer(req("b", deadline=2.5), 2.0)  # b is under its share: it would push out
    assert [r.reply.state for r in a] == [QUEUED] * 4
    assert q.stats["a", "default"].shed == 0
    late = req("b", deadline=10.0)
    q.offer(late, 2.0)  # in time: now it does push out a's newest
    assert [r.reply.state for r in a] == [QUEUED] * 3 + [DONE]


def test_a_tenant_at_or_over_its_share_of_a_full_queue_is_refused():
    q = queue(4)
    a = fill(q, "a", 4)
    fill(q, "b", 2)  # pushes out two of a's: 2 and 2, both at their share
    with pytest.raises(Overloaded, match="queue full"):
        q.offer(req("b"), 0.0)
    with pytest.raises(Overloaded, match="queue full"):
        q.offer(req("a"), 0.0)
    assert [r.reply.state for r in a] == [QUEUED, QUEUED, DONE, DONE]
    assert len(q) == 4


async def test_push_out_follows_weights_and_takes_the_victims_lowest_class_first():
    classes = (ClassSpec(name="hi"), ClassSpec(name="lo"))
    q = queue(6, classes=classes, weights={"a": 1.0, "b": 2.0, "c": 1.0})
    a_lo = fill(q, "a", 1, cls="lo")
    a_hi = fill(q, "a", 2, cls="hi")  # newer than a_lo, but of a higher class
    b = fill(q, "b", 3)  # shares of 6 among a, b: a 2, b 4
    # c (weight 1 of 4): shares a 1.5, b 3, c 1.5; a is most over (1.5), b at 0.
    c = req("c", cls="hi")
    q.offer(c, 0.0)
    assert c.reply.state is QUEUED
    assert a_lo[0].reply.state is DONE
    assert type(await error_of(a_lo[0])) is Overloaded
    assert all(r.reply.state is QUEUED for r in a_hi + b)
    assert q.stats["a", "lo"].shed == 1


# ---------------------------------------------------------------- queue share
def test_a_tenant_holding_its_queue_share_gets_quota_exceeded_others_still_get_in():
    q = queue(10, shares={"a": 0.5})
    fill(q, "a", 5)
    with pytest.raises(
        QuotaExceeded, match=r"^model 'm': tenant 'a' holds its queue share \(0\.5 of 10\)$"
    ) as e:
        q.offer(req("a"), 0.0)
    assert e.value.retry_after > 0
    fill(q, "b", 5)  # the rest of the queue is open to others
    assert len(q) == 10
    assert q.stats["a", "default"].shed == 1
    q.next_batch(0.0)  # one of a's leaves: a may queue one more
    q.offer(req("a"), 0.0)


# ---------------------------------------------------------------- estimated wait
def _measured(max_size: int = 2) -> FairQueue:
    """A queue that has measured a service rate of 2 units/s (and holds nothing)."""
    q = queue(100, max_size=max_size)
    fill(q, "a", 2 * max_size)
    b1, b2 = q.next_batch(0.0), q.next_batch(0.0)
    q.completed(b1, 1.0)
    q.completed(b2, 2.0)
    assert q.rate == 2.0
    assert q.in_service == 0
    return q


def test_a_request_whose_estimated_wait_passes_its_deadline_is_shed_at_once():
    q = _measured()
    now = 2.0
    for _ in range(6):
        q.offer(req("a", arrival=now), now)
    # a's 7th unit waits for its own 6 ahead: 7 / 2 = 3.5 s > 3 s left.
    with pytest.raises(
        Overloaded,
        match=r"^model 'm': estimated time to serve it 3500 ms exceeds the request's deadline "
        r"\(3000 ms left\)$",
    ) as e:
        q.offer(req("a", arrival=now, deadline=now + 3.0), now)
    assert e.value.retry_after == 3.5
    # b's first unit shares fairly with a's backlog: 1 of its own + 1 of a's ahead.
    assert q.estimated_wait("b", 0, 1) == 1.0
    q.offer(req("b", arrival=now, deadline=now + 3.0), now)
    assert q.stats["a", "default"].shed == 1
    assert q.stats["b", "default"].admitted == 1


def test_estimated_wait_counts_higher_classes_and_work_in_service():
    classes = (ClassSpec(name="hi"), ClassSpec(name="lo"))
    q = FairQueue(BatchLimits(max_size=2), bound=100, classes=classes, model="m", adaptive=False)
    fill(q, "x", 4, cls="hi")
    b1, b2 = q.next_batch(0.0), q.next_batch(0.0)
    q.completed(b1, 1.0)
    q.completed(b2, 2.0)
    fill(q, "x", 2, cls="hi")
    assert q.next_batch(2.0) is not None  # 2 units in service now
    fill(q, "x", 3, cls="hi")
    # lo: 2 in service + 3 of hi + its own 1 = 6 units at 2/s.
    assert q.estimated_wait("y", 1, 1) == 3.0
    assert q.estimated_wait("y", 0, 1) == 2.0  # in hi: 2 + 1 of x's (fair share) + 1


# ---------------------------------------------------------------- withdrawn requests
def test_withdrawn_requests_hold_no_capacity():
    q = queue(4)
    rs = fill(q, "a", 4)
    with pytest.raises(Overloaded):
        q.offer(req("a"), 0.0)
    for r in rs:
        r.reply.withdraw()
    assert len(q) == 0
    new = req("a")
    q.offer(new, 0.0)
    assert new.reply.state is QUEUED
    assert q.next_batch(0.0) == [new]


# The next three were bugs (withdrawn entries counted as held) fixed in 70474a8.
def test_withdrawn_requests_do_not_count_against_a_tenants_share_for_push_out():
    q = queue(8, weights={"a": 3.0, "b": 1.0})
    fill(q, "a", 8)
    bs = fill(q, "b", 2)  # b's share of 8 is 2: two of a's are pushed out
    for r in bs:
        r.reply.withdraw()  # b's callers left: b holds nothing live
    a = fill(q, "a", 2)  # the queue is full again with a's (8 live, 2 dead entries)
    assert len(q) == 8
    mine = req("b")
    q.offer(mine, 0.0)  # b holds 0 of its share 2: it pushes out a's newest
    assert mine.reply.state is QUEUED
    assert [r.reply.state for r in a] == [QUEUED, DONE]


def test_withdrawn_requests_do_not_count_against_the_queue_share():
    q = queue(10, shares={"a": 0.5})
    for r in fill(q, "a", 5):
        r.reply.withdraw()
    assert len(q) == 0
    q.offer(req("a"), 0.0)  # a holds nothing live
    assert q.stats["a", "default"].shed == 0


def test_queue_full_message_counts_only_live_requests():
    q = queue(8)
    rs = fill(q, "a", 8)
    rs[0].reply.withdraw()
    q.offer(req("a"), 0.0)  # takes the withdrawn one's place: 8 live, 1 dead entry
    with pytest.raises(Overloaded, match=r"queue full \(8 requests waiting\)"):
        q.offer(req("a"), 0.0)


def test_a_call_is_queued_whole_or_not_at_all_and_a_refusal_counts_it_shed():
    q = queue(8)
    fill(q, "a", 5)
    call = [req("a") for _ in range(4)]
    with pytest.raises(Overloaded, match=r"queue full \(8 requests waiting\)"):
        q.offer_all(call, 0.0)  # three fit, the fourth does not
    assert [r.reply.state for r in call[:3]] == [RequestState.CANCELLED] * 3
    assert len(q) == 5
    stats = q.stats["a", "default"]  # the three withdrawn again are not admitted
    assert (stats.admitted, stats.shed) == (5, 4)
    q.offer_all(call2 := [req("a") for _ in range(3)], 0.0)
    assert len(q) == 8
    assert all(r.reply.state is QUEUED for r in call2)
    assert (stats.admitted, stats.shed) == (8, 4)


# Regression: once the adaptive limit was down to its floor, a call of more items
# than the limit was refused 503 for as long as nothing else was dispatched (only
# dispatches raise the limit), though the queue was empty.
def test_an_idle_queue_takes_a_call_larger_than_the_adaptive_limit():
    q = FairQueue(BatchLimits(max_size=2), bound=64, model="m", min_limit=4)
    now = 0.0
    while q.limit.value > 4:  # expiries in the queue drove it to its floor
        now += 1.0
        q.limit.on_congestion(now)
    q._update_capacity()
    assert q.capacity() == 4
    call = [req("a") for _ in range(10)]
    q.offer_all(call, now)
    assert len(q) == 10
    assert q.capacity() == 4  # the limit itself is unchanged
    with pytest.raises(Overloaded):  # not idle now: the limit holds
        q.offer_all([req("a") for _ in range(2)], now)
    assert len(q) == 10


# Regression: the items of a call went in one by one, so those before a refused item
# had already pushed out other tenants' newest requests (answered 503) for a call that
# was then withdrawn whole, sheds for nothing. The whole call is decided first now.
@pytest.mark.parametrize("why", ["queue full", "queue share", "estimated wait"])
def test_a_call_refused_at_its_third_item_pushes_nobody_out_and_queues_nothing(why):
    now, deadline = 0.0, math.inf
    if why == "queue full":
        q = queue(4)  # b's share of 4 beside a is 2: its third item finds it at its share
        error, match = Overloaded, r"^model 'm': queue full \(4 requests waiting\)$"
    elif why == "queue share":
        q = queue(4, shares={"b": 0.5})
        error, match = QuotaExceeded, r"^model 'm': tenant 'b' holds its queue share"
    else:
        q = queue(4, max_size=2)
        fill(q, "a", 4)
        b1, b2 = q.next_batch(0.0), q.next_batch(0.0)
        q.completed(b1, 1.0)
        q.completed(b2, 2.0)  # 2 units/s
        # b's items wait 1, 2 and 3 s (each shares with as much of a's backlog as it
        # has of its own); the third's 3 s are past the 2.2 s left.
        now, deadline = 2.0, 4.2
        error, match = Overloaded, r"^model 'm': estimated time to serve it 3000 ms"
    a = fill(q, "a", 4)  # full
    call = [req("b", arrival=now, deadline=deadline) for _ in range(3)]
    with pytest.raises(error, match=match) as e:
        q.offer_all(call, now)  # items 1 and 2 alone would each push out one of a's
    assert type(e.value) is error
    assert [r.reply.state for r in a] == [QUEUED] * 4  # nobody pushed out
    assert [r.reply.state for r in call] == [CANCELLED] * 3  # withdrawn, never queued
    assert len(q) == 4
    assert list(q) == a
    sa, sb = q.stats["a", "default"], q.stats["b", "default"]
    assert (sa.shed, sa.queued) == (0, 4)
    assert (sb.admitted, sb.shed, sb.queued) == (0, 3, 0)  # the whole call shed


def test_an_admitted_call_pushes_out_the_newest_of_whoever_is_most_over_its_share_each_time():
    weights = {"a": 1.0, "c": 1.5, "b": 1.5}

    def full() -> tuple[FairQueue, list[Request], list[Request]]:
        q = queue(6, weights=weights)
        return q, fill(q, "a", 3), fill(q, "c", 3)

    # Shares of 6: a 1.5, c 2.25, b 2.25. Item 1: a is most over (1.5 against c's
    # 0.75) and loses its newest; item 2: now c is (0.75 against 0.5); item 3: a again.
    q, a, c = full()
    call = [req("b") for _ in range(3)]
    q.offer_all(call, 0.0)
    assert [r.reply.state for r in call] == [QUEUED] * 3
    assert [r.reply.state for r in a] == [QUEUED, DONE, DONE]
    assert [r.reply.state for r in c] == [QUEUED, QUEUED, DONE]
    assert len(q) == 6
    assert (q.stats["a", "default"].shed, q.stats["c", "default"].shed) == (2, 1)
    assert q.stats["b", "default"].admitted == 3
    # The same as its items offered one by one.
    q2, a2, c2 = full()
    for r in [req("b") for _ in range(3)]:
        q2.offer(r, 0.0)
    assert [r.reply.state for r in a2 + c2] == [r.reply.state for r in a + c]


def test_plan_all_decides_without_changing_or_counting_and_offer_planned_applies_it():
    q = queue(4)
    a = fill(q, "a", 4)  # full
    call = [req("b") for _ in range(2)]
    plan = q.plan_all(call, 0.0)
    assert [r.reply.state for r in a] == [QUEUED] * 4  # nobody pushed out yet
    assert len(q) == 4
    assert ("b", "default") not in q.stats
    q.offer_planned(plan, 0.0)
    assert [r.reply.state for r in a] == [QUEUED, QUEUED, DONE, DONE]  # a's newest two
    assert list(q) == [*a[:2], *call]
    with pytest.raises(Overloaded):  # b is at its share now: refused, nothing counted
        q.plan_all([req("b")], 0.0)
    assert (q.stats["b", "default"].admitted, q.stats["b", "default"].shed) == (2, 0)
    with pytest.raises(ValueError, match="another queue"):
        queue(4).offer_planned(plan, 0.0)


def test_a_call_mixing_tenants_or_classes_is_refused_as_a_programming_error():
    q = queue(4, classes=(ClassSpec(name="hi"), ClassSpec(name="lo")))
    with pytest.raises(ValueError, match="one tenant and class"):
        q.offer_all([req("a", cls="hi"), req("b", cls="hi")], 0.0)
    with pytest.raises(ValueError, match="one tenant and class"):
        q.offer_all([req("a", cls="hi"), req("a", cls="lo")], 0.0)
    assert len(q) == 0


_T = ("a", "b", "c")
_C = ("hi", "lo")


@given(
    bound=st.integers(1, 8),
    weights=st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0]), min_size=3, max_size=3),
    shares=st.lists(st.sampled_from([1.0, 1.0, 0.5, 0.25]), min_size=3, max_size=3),
    before=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 1), st.booleans(), st.booleans()),
        max_size=12,
    ),
    caller=st.integers(0, 2),
    cls=st.integers(0, 1),
    n=st.integers(1, 5),
)
def test_a_call_is_admitted_exactly_when_its_items_one_by_one_would_be_and_sheds_the_same(
    bound, weights, shares, before, caller, cls, n
):
    """Without a service rate (no estimated wait), ``offer_all`` admits a call exactly
    when offering its items one by one admits them all, and then leaves the queue as
    that would; otherwise it raises what the first refused item would, having changed
    nothing (the items one by one had shed others on their way)."""

    def build() -> tuple[FairQueue, list[Request]]:
        q = queue(
            bound,
            classes=tuple(ClassSpec(name=x) for x in _C),
            weights=dict(zip(_T, weights, strict=True)),
            shares=dict(zip(_T, shares, strict=True)),
        )
        held = []
        for t, c, spare, withdraw in before:
            r = req(_T[t], cls=_C[c])
            held.append(r)
            if spare:
                q.offer_spare(r, 0.0)
                continue
            try:
                q.offer(r, 0.0)
            except Overloaded:
                continue
            if withdraw:
                r.reply.withdraw()
        return q, held

    q1, held1 = build()
    q2, held2 = build()
    call1 = [req(_T[caller], cls=_C[cls]) for _ in range(n)]
    call2 = [req(_T[caller], cls=_C[cls]) for _ in range(n)]
    states = [r.reply.state for r in held1]
    assert states == [r.reply.state for r in held2]
    length = len(q1)
    counted = {k: (s.admitted, s.shed) for k, s in q1.stats.items()}
    flow = (_T[caller], _C[cls])
    refused2 = None
    for r in call2:
        try:
            q2.offer(r, 0.0)
        except Overloaded as exc:
            refused2 = exc
            break
    if refused2 is None:
        q1.offer_all(call1, 0.0)
        assert [r.reply.state for r in held1] == [r.reply.state for r in held2]
        assert [r.reply.state for r in call1] == [QUEUED] * n
        assert len(q1) == len(q2)
        assert [(r.tenant, r.priority) for r in q1 if r.reply.state is QUEUED] == [
            (r.tenant, r.priority) for r in q2 if r.reply.state is QUEUED
        ]
        for key, s in q2.stats.items():
            s1 = q1.stats[key]
            assert (s1.admitted, s1.shed, s1.hedged) == (s.admitted, s.shed, s.hedged)
    else:
        with pytest.raises(type(refused2)) as e:
            q1.offer_all(call1, 0.0)
        assert str(e.value) == str(refused2)
        assert [r.reply.state for r in held1] == states  # nobody shed
        assert [r.reply.state for r in call1] == [CANCELLED] * n
        assert len(q1) == length
        assert {k: (s.admitted, s.shed) for k, s in q1.stats.items()} == {
            **counted, flow: (counted.get(flow, (0, 0))[0], counted.get(flow, (0, 0))[1] + n)
        }


# Regression: the estimated wait once counted withdrawn entries not yet compacted.
def test_withdrawn_requests_do_not_count_in_the_estimated_wait():
    q = _measured()  # 2 units/s
    now = 2.0
    rs = [req("a", arrival=now) for _ in range(4)]
    for r in rs:
        q.offer(r, now)
    rs[3].reply.withdraw()  # 3 live and 1 dead entry (too few dead to compact)
    assert len(q) == 3
    # Really 3 ahead + its own 1 = 4 units: 2.0 s, within the 2.2 s left; the queue
    # counts 5 units (2.5 s) and sheds it.
    q.offer(req("a", arrival=now, deadline=now + 2.2), now)


# ---------------------------------------------------------------- hedge copies
def test_a_hedge_copy_is_refused_by_a_full_queue_without_pushing_out_or_counting():
    q = queue(2)
    b = fill(q, "b", 2)
    assert not q.offer_spare(req("a"), 0.0)  # a is under its share: a request would push out
    assert [r.reply.state for r in b] == [QUEUED, QUEUED]
    assert q.stats["b", "default"].shed == 0
    assert ("a", "default") not in q.stats  # nothing counted for a
    assert len(q) == 2


async def test_a_hedge_copy_takes_free_room_and_gives_it_back_to_a_new_request():
    q = queue(2)
    a = fill(q, "a", 1)
    copy = req("a")
    assert q.offer_spare(copy, 0.0)
    sa = q.stats["a", "default"]
    assert (sa.admitted, sa.hedged, len(q)) == (1, 1, 2)
    b = req("b")
    q.offer(b, 0.0)  # full: the copy's room goes first, before any push-out
    assert b.reply.state is QUEUED
    assert a[0].reply.state is QUEUED
    err = await error_of(copy)
    assert type(err) is Overloaded
    assert str(err) == "model 'm': a hedge copy gave its room in the queue to a new request"
    assert (sa.admitted, sa.hedged, sa.shed, sa.queued) == (1, 1, 0, 1)
    assert q.stats["b", "default"].admitted == 1
    assert q.next_batch(0.0) == [a[0]]  # the copy left its flow
    assert q.next_batch(0.0) == [b]


def test_a_tenant_at_its_queue_share_gets_the_room_of_its_own_hedge_copy():
    q = queue(4, shares={"a": 0.5})
    fill(q, "a", 1)
    copy = req("a")
    assert q.offer_spare(copy, 0.0)
    assert not q.offer_spare(req("a"), 0.0)  # a holds its share: no second copy
    q.offer(req("a"), 0.0)  # its own request takes the copy's room
    assert copy.reply.state is DONE
    with pytest.raises(QuotaExceeded):
        q.offer(req("a"), 0.0)
    assert q.stats["a", "default"].shed == 1  # only the request refused above


# Regression: a request of a tenant at its queue share took the room of the tenant's
# own newest hedge copy (answered Overloaded) before its estimated wait was checked, so
# a request then refused for its deadline had dropped the copy for nothing.
def test_a_request_refused_for_its_deadline_leaves_its_tenants_hedge_copy_queued():
    q = queue(8, max_size=2, shares={"a": 0.5})  # a may hold 4
    fill(q, "a", 4)
    b1, b2 = q.next_batch(0.0), q.next_batch(0.0)
    q.completed(b1, 1.0)
    q.completed(b2, 2.0)
    assert q.rate == 2.0
    now = 2.0
    held = fill(q, "a", 3, arrival=now)
    copy = req("a", arrival=now)
    assert q.offer_spare(copy, now)  # a holds its share now
    # a's request waits for its own 4 units ahead (the copy it would drop counted):
    # 5 / 2 = 2.5 s; without the copy 2 s, still past the 1.5 s left.
    with pytest.raises(
        Overloaded, match=r"^model 'm': estimated time to serve it 2500 ms exceeds"
    ):
        q.offer(req("a", arrival=now, deadline=now + 1.5), now)
    assert copy.reply.state is QUEUED  # its room was not given away
    assert list(q) == [*held, copy]
    s = q.stats["a", "default"]
    assert (s.admitted, s.hedged, s.shed) == (4 + 3, 1, 1)
    late = req("a", arrival=now)  # no deadline: takes the copy's room
    q.offer(late, now)
    assert copy.reply.state is DONE
    assert list(q) == [*held, late]


def test_a_hedge_copy_that_would_wait_past_its_deadline_is_refused_quietly():
    q = _measured()
    now = 2.0
    for _ in range(6):
        q.offer(req("a", arrival=now), now)
    assert not q.offer_spare(req("a", arrival=now, deadline=now + 3.0), now)
    assert q.offer_spare(req("a", arrival=now, deadline=now + 4.0), now)  # 3.5 s: in time
    s = q.stats["a", "default"]
    assert (s.admitted, s.hedged, s.shed) == (6 + 4, 1, 0)


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
            Unauthorized, match=r"^no tenant given and no default tenant is configured$"
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
