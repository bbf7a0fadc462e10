"""Aging between classes in the sans-IO FairQueue (time is an argument): a request
queued past its class's aging bound is *aged*, and while aged requests and others (the
top class, lower ones not yet aged) both wait, the two groups share the service half
and half by cost, through a counter carried across batches and reset whenever one
group is served alone. So no class starves, the top one included.

The simpler cases (promotion at the bound, earliest promotion first, the starvation
bound of a batch request) are in test_scheduling.py.
"""

from __future__ import annotations

import collections
import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st
from trioserve import Request, RequestState
from trioserve.actors import BatchLimits, ClassSpec, FairQueue

QUEUED = RequestState.QUEUED


def req(tenant: str, cls: str, arrival: float, cost: int = 1) -> Request:
    return Request(
        model="m",
        item=None,
        cost=cost,
        tenant=tenant,
        priority=cls,
        arrival=arrival,
        deadline=math.inf,
    )


def fair(limits: BatchLimits, classes: tuple[ClassSpec, ...]) -> FairQueue:
    return FairQueue(limits, bound=100_000, model="m", adaptive=False, classes=classes)


TWO_CLASSES = (ClassSpec(name="realtime"), ClassSpec(name="batch", aging=1.0))


def test_realtime_is_served_at_its_rate_under_a_backlog_of_aged_batch_requests():
    """100 items/s (a batch of 10 every 0.1 s), 1000 batch-class requests kept
    queued, aging 1 s, realtime offered at 30% of capacity. The aged requests used to
    go before everything: realtime was served only when a batch had room after them,
    so it got almost nothing (27 of 897 in a simulation of this). Now realtime keeps
    half the service: every realtime request goes in the batch pulled when it comes,
    and batch takes the other 70%."""
    q = fair(BatchLimits(max_size=10), TWO_CLASSES)
    batch_queued = 0
    offered = served = batch_served = 0
    for step in range(900):  # 90 s
        now = step / 10
        while batch_queued < 1000:
            q.offer(req("backfill", "batch", now), now)
            batch_queued += 1
        rt = [req("interactive", "realtime", now) for _ in range(3)]
        for r in rt:
            q.offer(r, now)
        offered += 3
        batch = q.next_batch(now)
        assert batch is not None
        assert len(batch) == 10
        assert all(r in batch for r in rt)  # served in the pull it arrived at
        served += sum(r.priority == "realtime" for r in batch)
        n = sum(r.priority == "batch" for r in batch)
        batch_served += n
        batch_queued -= n
    assert (offered, served) == (2700, 2700)
    assert batch_served == 6300


def test_aged_requests_keep_half_the_service_under_a_realtime_backlog():
    """Realtime always has more than a batch queued, and the batch-class backlog has
    aged: the aged requests still get half the service by cost (within one request's
    cost), in arrival order, whatever the costs."""
    rnd = random.Random(7)
    q = fair(BatchLimits(max_size=8), TWO_CLASSES)
    aged_order = []
    for i in range(400):
        r = req(f"b{i % 3}", "batch", 0.0, cost=rnd.randint(1, 4))
        q.offer(r, 0.0)
        aged_order.append(r)
    served = collections.Counter()
    taken_batch = []
    now = 2.0  # every batch-class request has waited past its 1 s bound
    for _ in range(60):
        while sum(q.queued_by_flow().values()) - 400 + len(taken_batch) < 16:
            q.offer(req("rt", "realtime", now, cost=rnd.randint(1, 4)), now)
        batch = q.next_batch(now)
        assert batch is not None
        for r in batch:
            served[r.priority] += r.cost
            if r.priority == "batch":
                taken_batch.append(r)
        now += 0.1
    assert taken_batch == aged_order[: len(taken_batch)]  # earliest promotion first
    assert abs(served["batch"] - served["realtime"]) <= 4
    assert served["batch"] >= 200


def test_the_rest_served_alone_banks_nothing_against_the_aged_requests():
    """Realtime served alone for 1 s (nothing aged yet) earns no lead: once the batch
    requests age, the two groups take turns at once, aged first."""
    q = fair(BatchLimits(max_size=1), TWO_CLASSES)
    for _ in range(5):
        q.offer(req("b", "batch", 0.0), 0.0)
    for _ in range(30):
        q.offer(req("a", "realtime", 0.0), 0.0)
    got = [q.next_batch(step / 10)[0].priority for step in range(16)]
    assert got == ["realtime"] * 10 + ["batch", "realtime"] * 3


def test_the_aged_group_served_alone_banks_nothing_against_the_rest():
    """The lead an aged request of cost 5 took while realtime waited is dropped once
    aged requests are served with realtime empty: realtime arriving later gets its
    turn after one aged request, as at the start, not before it."""
    q = fair(BatchLimits(max_size=1), TWO_CLASSES)
    big = req("b", "batch", 0.0, cost=5)
    aged = [big] + [req("b", "batch", 0.0) for _ in range(3)]
    for r in aged:
        q.offer(r, 0.0)
    r1 = req("a", "realtime", 1.0)
    q.offer(r1, 1.0)
    assert q.next_batch(1.0) == [big]  # the lead is 5: realtime is owed 5
    assert q.next_batch(1.0) == [r1]  # owed 4 more, but realtime is empty now
    assert q.next_batch(1.0) == [aged[1]]  # served alone: the lead is 0 again
    r2, r3 = req("a", "realtime", 1.5), req("a", "realtime", 1.5)
    q.offer(r2, 1.5)
    q.offer(r3, 1.5)
    assert q.next_batch(1.5) == [aged[2]]  # aged first, as from a lead of 0
    assert q.next_batch(1.5) == [r2]
    assert q.next_batch(1.5) == [aged[3]]
    assert q.next_batch(1.5) == [r3]


def test_with_nothing_aged_strict_priority_is_unchanged():
    """No request aged: realtime goes first, whatever the lead left from before."""
    q = fair(BatchLimits(max_size=2), TWO_CLASSES)
    b = [req("b", "batch", 0.0) for _ in range(3)]
    for r in b:
        q.offer(r, 0.0)
    assert q.next_batch(1.0) == b[:2]  # aged and alone
    rt = [req("a", "realtime", 1.2) for _ in range(2)]
    young = req("b", "batch", 1.2)
    for r in [*rt, young]:
        q.offer(r, 1.2)
    assert q.next_batch(1.2) == [b[2], rt[0]]  # b[2] aged: the groups take turns
    assert q.next_batch(1.3) == [rt[1], young]  # nothing aged: strict priority


@settings(max_examples=80, deadline=None)
@given(
    max_size=st.integers(1, 6),
    max_tokens=st.one_of(st.none(), st.integers(4, 12)),
    aging_units=st.tuples(st.integers(0, 8), st.integers(0, 8)),
    three=st.booleans(),
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 3),  # steps since the previous arrival
            st.sampled_from("xyz"),
            st.integers(0, 2),  # class (2 only with three classes)
            st.integers(1, 5),  # cost
        ),
        min_size=1,
        max_size=80,
    ),
    pull_every=st.integers(1, 3),
)
def test_neither_group_waits_unboundedly_while_the_other_is_served(
    max_size, max_tokens, aging_units, three, arrivals, pull_every
):
    """Over random arrivals and pulls: whenever a request is taken while aged
    requests and others both wait, the cost served to each group since both began to
    wait (a run of such takes, across batches) stays within one request's cost of
    the other's: neither waits for more than about twice the largest cost while the
    other is served. Aged requests go earliest promotion first; the others in strict
    priority; nothing is lost. The groups are worked out here from the requests
    queued (no deadlines, nobody leaves), flow by flow: a flow whose first request
    has aged is the aged group's."""
    unit = 0.25
    names = ("rt", "mid", "low")[: 3 if three else 2]
    agings = (math.inf, aging_units[0] * unit, aging_units[1] * unit)
    classes = tuple(
        ClassSpec(name=n, aging=agings[i]) if i else ClassSpec(name=n)
        for i, n in enumerate(names)
    )
    q = fair(BatchLimits(max_size=max_size, max_tokens=max_tokens), classes)
    rank = {n: i for i, n in enumerate(names)}
    queued: list[Request] = []  # in offer order
    top_cost = 5
    run = 0  # aged cost less the others' over the current run of takes with both waiting
    step, total = 0, 0

    def promotion(r: Request) -> float:
        c = rank[r.priority]
        return r.arrival + agings[c] if c else math.inf

    def pull(now: float) -> None:
        nonlocal run
        batch = q.next_batch(now) or []
        for r in batch:
            heads: dict[tuple[str, str], Request] = {}
            for x in queued:
                heads.setdefault((x.tenant, x.priority), x)
            aged = [h for h in heads.values() if promotion(h) <= now]
            rest = [h for h in heads.values() if promotion(h) > now]
            assert r in heads.values()  # FIFO within a flow
            if aged and rest:
                if promotion(r) <= now:
                    assert promotion(r) == min(map(promotion, aged))
                    run += r.cost
                else:
                    assert rank[r.priority] == min(rank[h.priority] for h in rest)
                    run -= r.cost
                assert -top_cost < run <= top_cost, run
            else:
                run = 0
                if aged:
                    assert promotion(r) == min(map(promotion, aged))
                else:
                    assert rank[r.priority] == min(rank[h.priority] for h in rest)
            queued.remove(r)

    for gap, tenant, c, cost in arrivals:
        for _ in range(gap):
            step += 1
            if step % pull_every == 0:
                pull(step * unit)
        now = step * unit
        r = req(tenant, names[c % len(names)], now, cost)
        q.offer(r, now)
        queued.append(r)
        total += 1
    while queued:
        step += 1
        pull(step * unit)
        assert step < 10_000
    assert sum(s.dispatched for s in q.stats.values()) == total
