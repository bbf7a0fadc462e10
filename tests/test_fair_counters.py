"""The fair-share counters of the sans-IO FairQueue over a long run: rebased once they
grow (``actors/_vtime.py``), with every decision of the queue unchanged, and fair share
kept after service that would otherwise have grown them past the precision of a
request's increment. The weights' bounds that keep the increments representable are
configuration (``tenants.NAME.weight``), checked here too."""

from __future__ import annotations

import collections
import math
import random

import pytest
import trioserve
from hypothesis import given, settings
from hypothesis import strategies as st
from trioserve import Request, RequestState
from trioserve.actors import BatchLimits, ClassSpec, FairQueue
from trioserve.actors._vtime import REBASE_AT, rebase

QUEUED = RequestState.QUEUED


def req(tenant: str, cost: int, *, cls: str = "default", arrival: float = 0.0,
        deadline: float = math.inf, answer_expiry: bool = False, item: object = None) -> Request:
    return Request(
        model="m", item=item, cost=cost, tenant=tenant, priority=cls, arrival=arrival,
        deadline=deadline, answer_expiry=answer_expiry,
    )


class Counting(FairQueue):
    """A FairQueue that counts its rebases."""

    rebases = 0

    def _rebase(self, c: int) -> None:
        self.rebases += 1
        super()._rebase(c)


class RebasingAtOne(Counting):
    REBASE_AT = 1.0


class RebasingAlways(Counting):
    """Rebases after every request served (the queue's own rule waits for the counters
    to double when a rebase could not move them far)."""

    REBASE_AT = 0.0

    def _rebase(self, c: int) -> None:
        super()._rebase(c)
        self._rebase_at[c] = 0.0


class NeverRebasing(Counting):
    REBASE_AT = math.inf


def build(cls: type[FairQueue], limits: BatchLimits, **kw) -> FairQueue:
    kw.setdefault("bound", 10_000)
    kw.setdefault("adaptive", False)
    return cls(limits, model="m", **kw)


# ---------------------------------------------------------------- a rebase changes nothing
#: Weights whose increments (cost / weight) and their sums are exact in floats, so the
#: two queues below compute the same numbers, up to the rebase's exact shift.
DYADIC = {"a": 0.25, "b": 1.0, "c": 4.0, "d": 2.0}

_OPS = ("offer", "pull", "withdraw", "tick", "expire", "drain")
_OP_WEIGHTS = (45, 30, 8, 10, 5, 2)


def _steps(rnd: random.Random, n: int) -> list[tuple]:
    """``n`` random steps: mostly offers and pulls, some withdrawals, clock ticks,
    expiries and drains (hypothesis draws the seed: its lists of steps came out a
    handful of steps long, too short to serve much)."""
    steps: list[tuple] = []
    for op in rnd.choices(_OPS, _OP_WEIGHTS, k=n):
        if op == "offer":
            steps.append((
                op, rnd.choice(sorted(DYADIC)), rnd.choice(["hi", "lo"]), rnd.randint(1, 40),
                rnd.choice([None, None, "answer", "caller"]),
            ))
        elif op == "withdraw":
            steps.append((op, rnd.randrange(10_000)))
        elif op == "tick":
            steps.append((op, rnd.randint(1, 4)))
        else:
            steps.append((op,))
    return steps


@settings(max_examples=150)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 400),
    max_size=st.integers(1, 6),
    max_tokens=st.one_of(st.none(), st.integers(8, 60)),
    aging=st.sampled_from([0.25, 0.5, math.inf]),
)
def test_the_order_of_service_with_rebases_is_the_order_without(
    seed, n, max_size, max_tokens, aging
):
    """The same offers, withdrawals, pulls, expiries and drains, given to a queue that
    rebases after every request served and to one that never does, dispatch the
    same requests in the same batches and answer the same ones expired; their
    counters differ, at every step, by one shift per class."""
    steps = _steps(random.Random(seed), n)
    limits = BatchLimits(max_size=max_size, max_tokens=max_tokens, oversize="alone")
    classes = (ClassSpec(name="hi"), ClassSpec(name="lo", aging=aging))
    queues = [
        build(q, limits, classes=classes, weights=DYADIC) for q in (RebasingAlways, NeverRebasing)
    ]
    offered: list[list[Request]] = [[], []]
    logs: list[list[object]] = [[], []]
    now = 0.0
    for step in steps:
        if step[0] == "tick":
            now += step[1] * 0.125
            continue
        for k, q in enumerate(queues):
            log = logs[k]
            if step[0] == "offer":
                _, tenant, cls, cost, deadline = step
                r = req(
                    tenant, cost, cls=cls, arrival=now, item=len(offered[k]),
                    deadline=math.inf if deadline is None else now + 0.5,
                    answer_expiry=deadline == "answer",
                )
                try:
                    q.offer(r, now)
                except trioserve.Overloaded as exc:
                    log.append(("refused", r.item, type(exc).__name__))
                offered[k].append(r)
            elif step[0] == "pull":
                log.append([r.item for r in q.next_batch(now) or []])
            elif step[0] == "withdraw":
                if offered[k]:
                    offered[k][step[1] % len(offered[k])].reply.withdraw()
            elif step[0] == "expire":
                log.append(("expired", q.expire(now)))
            else:
                log.append(("drained", sorted(r.item for r in q.drain())))
        assert logs[0] == logs[1], step
        rebased, plain = queues
        for c in range(len(classes)):
            assert rebased._active[c].keys() == plain._active[c].keys()
            shift = plain._floor[c] - rebased._floor[c]
            for t in rebased._active[c]:
                assert plain._vt[c][t] - rebased._vt[c][t] == shift, (c, t)
    states = [[r.reply.state for r in offered[k]] for k in (0, 1)]
    assert states[0] == states[1]
    assert queues[1].rebases == 0


def test_rebases_happen_and_keep_the_counters_small():
    """Two tenants backlogged for 2,000 batches: the rebasing queue moved its counters
    down many times and they stay within one request's increment of the threshold
    (doubled), where the other's grew with the service."""
    limits = BatchLimits(max_size=2)
    queues = [
        build(q, limits, weights={"a": 1.0, "b": 0.5}) for q in (RebasingAtOne, NeverRebasing)
    ]
    rnd = random.Random(3)
    costs = [rnd.randint(1, 8) for _ in range(6_000)]
    highest: dict[FairQueue, float] = {}
    for q in queues:
        it = iter(costs)
        for _ in range(2_000):
            for t in ("a", "b"):
                while sum(r.reply.state is QUEUED for r in q if r.tenant == t) < 3:
                    q.offer(req(t, next(it)), 0.0)
            q.next_batch(0.0)
            highest[q] = max(highest.get(q, 0.0), *q._vt[0].values())
    rebased, plain = queues
    assert rebased.rebases > 1_000
    assert highest[rebased] < 100.0
    assert max(plain._vt[0].values()) > 4_000.0
    assert rebased.service() == plain.service()


# ---------------------------------------------------------------- fair share after huge service
def _lag_after_huge_service(queue_class: type[FairQueue]) -> tuple[float, dict[str, int]]:
    """A tenant of weight 1e-3 served 2**62 cost units (a long run's worth, at once):
    the class's counters stand at about 4.6e21, where a request's increment of the
    tenants below (1e-3 for weight 1e3, 1 for weight 1, cost 1) is far under the
    rounding step. Then those two stay backlogged for 2,002 batches of one request.
    Returns the largest lag |S_a / w_a - S_b / w_b| seen after a batch, and the
    service."""
    weights = {"long": 1e-3, "a": 1e3, "b": 1.0}
    q = build(queue_class, BatchLimits(max_size=1), weights=weights)
    first = req("long", 2**62)
    q.offer(first, 0.0)
    assert q.next_batch(0.0) == [first]
    queued = collections.Counter()
    worst = 0.0
    for _ in range(2_002):
        for t in ("a", "b"):
            while queued[t] < 2:
                q.offer(req(t, 1), 0.0)
                queued[t] += 1
        [taken] = q.next_batch(0.0)
        queued[taken.tenant] -= 1
        served = q.service()
        lag = abs(served.get("a", 0) / weights["a"] - served.get("b", 0) / weights["b"])
        worst = max(worst, lag)
    return worst, q.service()


def test_fair_share_holds_after_huge_service():
    """The invariant (a backlogged tenant gets service in proportion to its weight,
    within a bounded lag: here one request's increment of each, 1e-3 + 1) holds after
    service that took the counters far past the precision of an increment."""
    worst, served = _lag_after_huge_service(Counting)
    assert worst <= 1e-3 + 1.0 + 1e-9
    assert (served["a"], served["b"]) == (2_000, 2)


def test_without_rebases_huge_service_stops_fair_share():
    """The same run on counters never rebased: no increment moves them, one tenant is
    served every time, and the lag grows past the bound (what the rebase is for)."""
    worst, served = _lag_after_huge_service(NeverRebasing)
    assert worst > 1e-3 + 1.0
    assert 0 in (served.get("a", 0), served.get("b", 0))


def test_fair_share_holds_across_many_rebases_with_inexact_weights():
    """Weights whose increments round (1/3, 1/0.7): the lag bound of test_scheduling.py
    holds after every batch across hundreds of rebases."""
    class Low(Counting):
        REBASE_AT = 16.0

    weights = {"a": 3.0, "b": 0.7, "c": 1.0}
    max_cost = 8
    q = build(Low, BatchLimits(max_size=3, max_tokens=12), weights=weights)
    rnd = random.Random(11)
    queued = collections.Counter()
    for _ in range(3_000):
        for t in weights:
            while queued[t] <= 3:
                q.offer(req(t, rnd.randint(1, max_cost)), 0.0)
                queued[t] += 1
        for r in q.next_batch(0.0) or []:
            queued[r.tenant] -= 1
        served = q.service()
        for i in weights:
            for j in weights:
                bound = max(max_cost / weights[i], max_cost / weights[j])
                assert abs(served[i] / weights[i] - served[j] / weights[j]) <= bound + 1e-6
    assert q.rebases > 300
    assert max(q._vt[0].values()) < 4 * 16.0 + 2 * max_cost / 0.7


# ---------------------------------------------------------------- the rebase itself
def test_a_rebase_is_exact_keeps_every_order_and_drops_idle_counters_below_the_floor():
    # "ahead" (idle) is far above: the least counter, 2**40 + 0.75, subtracted from it
    # would round (its ulp is 2); the shift is 2**40, a multiple of that ulp
    vt = {"busy": 2.0**40 + 3.0, "next": 2.0**40 + 0.75, "gone": 5.0, "ahead": 2.0**53 + 2.0}
    before = dict(vt)
    floor, due = rebase(vt, {"busy": None, "next": None}, 2.0**40 + 3.0, REBASE_AT)
    # the idle tenant below the least backlogged counter is dropped: it would be
    # lifted to the floor anyway; the idle one ahead keeps its place
    assert set(vt) == {"busy", "next", "ahead"}
    shift = before["busy"] - vt["busy"]
    assert shift == 2.0**40
    assert all(before[t] - vt[t] == shift for t in vt)
    assert before["busy"] - floor == shift
    assert min(vt.values()) >= 0.0
    assert due == max(REBASE_AT, 2 * max(vt.values()))


def test_a_rebase_keeps_counters_that_differ_by_one_ulp_apart():
    """Counters one rounding step apart stay apart: the shift is a multiple of the
    largest counter's ulp, so no subtraction rounds."""
    big = 2.0**52 + 2.0**30
    near = math.nextafter(big, math.inf)
    vt = {"x": big, "y": near, "z": 2.0**53 - 1}
    rebase(vt, {"x": None, "y": None, "z": None}, big, REBASE_AT)
    assert vt["x"] < vt["y"] < vt["z"]
    assert vt["y"] - vt["x"] == near - big


# ---------------------------------------------------------------- the weights' bounds
@pytest.mark.parametrize("weight", [1e-3, 1.0, 1e3])
def test_a_weight_within_its_bounds_is_taken(weight):
    assert trioserve.TenantConfig(name="t", weight=weight).weight == weight


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (1e-9, "tenants.t.weight: must be a finite number >= 0.001, got 1e-09"),
        (0.0009, "tenants.t.weight: must be a finite number >= 0.001, got 0.0009"),
        (1e12, "tenants.t.weight: must be a finite number <= 1000.0, got 1000000000000.0"),
        (1001, "tenants.t.weight: must be a finite number <= 1000.0, got 1001"),
    ],
)
def test_a_weight_out_of_its_bounds_is_a_config_error(weight, message):
    with pytest.raises(trioserve.ConfigError) as info:
        trioserve.config_from_mapping(
            {"models": {"m": {"backend": "echo"}}, "tenants": {"t": {"weight": weight}}}
        )
    assert str(info.value) == message


def test_a_tenant_lifted_and_withdrawn_unserved_is_not_left_behind_newcomers():
    """A tenant that joined while only one with a higher counter waited is lifted to
    that counter; withdrawn before any service, it keeps it. The class's start for a
    newcomer never goes below the counters it lifted to, so when the tenant comes back
    beside a newcomer the two are served in turn (it came back 3 behind: where service
    last was had gone back to a tenant served after the first)."""
    q = FairQueue(BatchLimits(max_size=1), bound=64, classes=(ClassSpec(name="c0"),),
                  weights={}, adaptive=False)

    def offer(tenant: str, cost: int, now: float) -> Request:
        r = req(tenant, cost, cls="c0", arrival=now)
        q.offer(r, now)
        return r

    offer("A", 4, 0.0)
    offer("E", 1, 0.0)
    assert [r.tenant for r in q.next_batch(0.0)] == ["A"]  # first come, counters equal
    assert [r.tenant for r in q.next_batch(0.0)] == ["E"]  # A at 4, E at 1
    a, b = offer("A", 1, 1.0), offer("B", 1, 1.0)  # B lifted to A's 4
    a.reply.withdraw()
    b.reply.withdraw()
    assert q.next_batch(1.0) is None  # both gone unserved: the class is idle
    for _ in range(6):
        offer("D", 1, 2.0)  # a newcomer to the idle class
    for _ in range(3):
        offer("B", 1, 2.0)
    order = [q.next_batch(2.0)[0].tenant for _ in range(6)]
    assert order == ["D", "B", "D", "B", "D", "B"]
