"""Admission decisions: the FairQueue's shed decisions (full queue, push-out, queue
share, estimated wait, withdrawn requests, hedge copies), driven directly with time as
an argument. The runtime's front door is in test_admission_runtime.py.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trioserve import Overloaded, QuotaExceeded, Request, RequestState
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
    assert e.value.deadline is None  # the load's refusal, whatever the deadline
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
    assert e.value.deadline == now + 3.0  # measured against it: a later one may fit
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
        # b's items wait 1, 2 and 2.5 s (each shares with as much of a's backlog as
        # it has of its own, a's less the requests the items before it pushed out, as
        # ``offer`` finds it item by item); the third's 2.5 s are past the 2.2 s left.
        now, deadline = 2.0, 4.2
        error, match = Overloaded, r"^model 'm': estimated time to serve it 2500 ms"
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


def test_an_idle_device_between_full_batches_is_not_measured_as_service():
    """The service rate was the second of two full batches' cost over the time between
    their completions, idle time included: bursts of one full batch 10 s apart measured
    a device doing 4 items in 10 ms at 0.4 items/s, and a burst then got 503 for a
    1 s deadline it would have met 100 times over. A batch that started after the one
    before it completed is measured from its own start."""
    q = queue(16, max_size=4)
    for t in (0.0, 10.0, 20.0):
        fill(q, "a", 4, arrival=t)
        batch = q.next_batch(t)
        for r in batch:
            r.reply.run = (t, 0.01)  # as the batcher sets it: (start, seconds)
        q.completed(batch, t + 0.01)
    assert q.rate == pytest.approx(400.0)
    for _ in range(8):
        q.offer(req("a", arrival=30.0, deadline=31.0), 30.0)
    assert len(q) == 8
    # Batches overlapping on two replicas: from the previous completion, as before.
    b1, b2 = q.next_batch(30.0), q.next_batch(30.0)
    for r in b1 + b2:
        r.reply.run = (30.0, 0.01)
    q.completed(b1, 30.01)
    q.completed(b2, 30.015)  # 4 items 5 ms after the last: 800/s
    assert q.rate == pytest.approx(0.9 * 400.0 + 0.1 * 800.0)


def test_a_deadline_shorter_than_one_batchs_run_is_refused_once_measured():
    """The estimate was the cost ahead over the measured rate, a throughput that
    leaves a batch's fixed time out: on a near-empty queue of a device taking 0.5 s
    a batch (4 items), a request with 0.3 s to go was estimated at 0.125 s, admitted,
    and answered late. No request is answered sooner than the shortest batch run
    measured: it is refused at once now. A model with nothing measured refuses
    nothing for its deadline."""
    cold = queue(16, max_size=4)
    cold.offer(req("a", arrival=0.0, deadline=0.001), 0.0)
    assert len(cold) == 1
    q = queue(16, max_size=4)
    for t in (0.0, 10.0, 20.0):
        fill(q, "a", 4, arrival=t)
        batch = q.next_batch(t)
        for r in batch:
            r.reply.run = (t, 0.5)  # as the batcher sets it: (start, seconds)
        q.completed(batch, t + 0.5)
    assert q.rate == pytest.approx(8.0)
    assert q.batch_time == 0.5
    assert q.estimated_wait("a", 0, 1) == 0.5  # not 1 / 8 s
    with pytest.raises(
        Overloaded,
        match=r"^model 'm': estimated time to serve it 500 ms exceeds the request's "
        r"deadline \(300 ms left\)$",
    ) as e:
        q.offer(req("a", arrival=30.0, deadline=30.3), 30.0)
    assert e.value.retry_after == 0.5
    with pytest.raises(Overloaded, match="estimated time to serve it 500 ms"):
        q.offer_all([req("b", arrival=30.0, deadline=30.3)], 30.0)
    assert len(q) == 0
    q.offer(req("a", arrival=30.0, deadline=30.6), 30.0)
    assert len(q) == 1
    # A shorter batch run lowers it (the shortest is kept).
    batch = q.next_batch(30.0)
    for r in batch:
        r.reply.run = (30.0, 0.2)
    q.completed(batch, 30.2)
    assert q.batch_time == 0.2
    q.offer(req("a", arrival=31.0, deadline=31.3), 31.0)
    assert len(q) == 1


def test_a_lower_class_request_is_not_refused_for_a_backlog_its_aging_jumps():
    """The estimated wait counted every request of the higher classes ahead, though
    its aging bound puts it before them: under a realtime backlog of 5 s a batch
    request with 3 s to go was refused 503, yet it is served once aged, after 1 s."""
    classes = [ClassSpec(name="rt"), ClassSpec(name="batch", aging=1.0)]
    q = queue(1000, max_size=10, classes=classes)
    q.rate = 100.0
    for _ in range(500):
        q.offer(req("a", cls="rt"), 0.0)
    # 1 s of aging, then its own unit at 100 units/s
    assert q.estimated_wait("b", 1, 1) == pytest.approx(1.01)
    q.offer(req("b", cls="batch", deadline=3.0), 0.0)
    # 1 s, then the aged unit ahead of it, one realtime unit taking its turn after
    # that one, and its own: 1.03 s
    late = req("b", cls="batch", deadline=1.01)
    with pytest.raises(Overloaded, match="estimated time to serve it 1030 ms"):
        q.offer(late, 0.0)
    served_at = None
    for step in range(1, 20):
        batch = q.next_batch(step * 0.1)
        if any(r.tenant == "b" for r in batch):
            served_at = step * 0.1
            break
    assert served_at == pytest.approx(1.0)


def test_a_lower_class_request_s_estimate_counts_the_top_class_s_turns_once_aged():
    """Once aged, a batch request shares the service half and half with a realtime
    backlog: the aged units ahead of it are each followed by as much of realtime's.
    The estimate counts them, and the queue serves it by then: it used to count the
    aged units alone, as if they all went first."""
    classes = [ClassSpec(name="rt"), ClassSpec(name="batch", aging=1.0)]
    q = queue(1000, max_size=10, classes=classes)
    q.rate = 100.0
    fill(q, "a", 500, cls="rt")
    fill(q, "b", 10, cls="batch")
    # 1 s, then 10 aged units, 10 of realtime's and its own at 100 units/s
    assert q.estimated_wait("b", 1, 1) == pytest.approx(1.21)
    mine = req("b", cls="batch", deadline=1.22)
    q.offer(mine, 0.0)
    # One more behind it: 11 aged units ahead, 11 of realtime's, its own
    with pytest.raises(Overloaded, match="estimated time to serve it 1230 ms"):
        q.offer(req("b", cls="batch", deadline=1.22), 0.0)
    served_at = None
    for step in range(1, 30):  # a full batch every 0.1 s: 100 units/s
        batch = q.next_batch(step * 0.1)
        assert len(batch) == 10
        if mine in batch:
            served_at = step * 0.1
            break
    assert served_at == pytest.approx(1.2)  # dispatched by then, done 0.1 s later
