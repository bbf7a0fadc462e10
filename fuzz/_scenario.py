"""The runtime suite's scenarios: the script a run plays, and its hypothesis strategies.

A :class:`Scenario` is a config (model limits, replicas, classes with aging, timeouts
and over-quota policies, tenants with weights, credits and queue shares, the queue
bound, the shutdown grace) and a list of calls (arrival time, tenant, class, items with
costs, model latencies, stragglers, model errors and replica crashes, caller
cancellations by deadline or by ``cancel()``), optionally cut short by an early
shutdown. :func:`scenarios` draws one; ``fuzz/_runtime.py`` plays it.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
from hypothesis import strategies as st

MS = 1e-3
#: How long after the last arrival a caller may take before it counts as lost (trio
#: time: free under the autojump clock).
HORIZON_S = 3600.0


# ---------------------------------------------------------------- the script
@attrs.frozen(kw_only=True)
class Item:
    """One item: its cost (token units), the model's latency on it, and a planted
    fault: "error" (the model raises on a batch holding it) or "crash" (the replica
    running it crashes; in a ``running`` scenario, its worker dies at the end of the
    batch's latency)."""

    cost: int = 1
    latency_ms: int = 0
    fault: str | None = None


@attrs.frozen(kw_only=True)
class Call:
    """A caller arriving at ``at_ms``: ``infer`` (one item) or ``infer_batch``.
    ``cancel_ms`` (after arrival): "deadline" sets its cancel scope's deadline (the
    runtime sees it), "cancel" calls ``scope.cancel()`` then (it does not)."""

    at_ms: int = 0
    tenant: int = 0
    cls: int | None = None
    items: tuple[Item, ...] = (Item(),)
    cancel_ms: int | None = None
    cancel_how: str = "deadline"


@attrs.frozen(kw_only=True)
class Broken:
    """Replica ``replica`` is broken from ``from_ms`` until ``until_ms`` (None: for
    good) after the runtime opened: its model raises on every call there (a sticky
    device error), whatever the inputs; with ``every`` n > 1, on all but every n-th
    of its calls (a flaky device, which succeeds now and then)."""

    replica: int = 0
    from_ms: int = 0
    until_ms: int | None = None
    every: int = 1


@attrs.frozen(kw_only=True)
class ClassSetup:
    aging_ms: int = 1000
    timeout_ms: int | None = None
    over_quota: str = "reject"


@attrs.frozen(kw_only=True)
class TenantSetup:
    weight: float = 1.0
    classes: tuple[int, ...] = ()
    credit_rate: float | None = None
    credit_burst: float | None = None
    queue_share: float = 1.0


@attrs.frozen(kw_only=True)
class Scenario:
    max_batch_size: int = 4
    max_batch_tokens: int | None = None
    padded: bool = False
    oversize: str = "alone"
    max_wait_ms: int = 0
    timeout_ms: int | None = None
    replicas: int = 1
    #: requests of at least this cost go to the slow lane: its own queue, served by
    #: the last ``slow_lane_replicas`` replicas (fewer than ``replicas``)
    slow_lane_cost: int | None = None
    slow_lane_replicas: int = 1
    adaptive: bool = False
    batch_latency_ms: int = 0
    queue_bound: int = 64
    graceful_ms: int = 1000
    shutdown_at_ms: int | None = None
    #: ``hedge = true`` with ``hedge_after_ms``: a top-class request alone still
    #: unanswered after it sends a copy for another replica of its lane
    hedge_after_ms: int | None = None
    #: extra latency of every batch on each replica (by index; missing: none)
    replica_delay_ms: tuple[int, ...] = ()
    #: batches each replica (by index; missing: 1) holds in flight (running, or staged
    #: behind the one running), as a worker process's pipeline does: 1 is the
    #: product's inline loop
    pipeline: tuple[int, ...] = ()
    broken: tuple[Broken, ...] = ()
    #: the replicas run their batches off the event loop, as worker processes do
    #: (simulated in trio time, fuzz/_device.py): a batch runs while the scheduler and
    #: the callers move on, so a request's timeout can pass while its batch runs (its
    #: replica answers it then), a batch past ``cut_off_ms`` is cut off (its worker
    #: killed, the batch handed back), and a "crash" item's worker dies. ``pipeline``
    #: is then each worker's number of batches in flight.
    running: bool = False
    #: with ``running``: how long a batch may run before it is cut off
    cut_off_ms: int = 1000
    classes: tuple[ClassSetup, ...] = (ClassSetup(),)
    tenants: tuple[TenantSetup, ...] = (TenantSetup(),)
    calls: tuple[Call, ...] = ()


# ---------------------------------------------------------------- strategies
# Every strategy a scenario draws from is built once (at import, or once per
# combination of the parameters drawn before it, cached), never inside a draw: a
# fresh strategy object is validated and has its properties (emptiness, reusable
# values) computed again on its first draw, which cost more than playing the
# scenario. The draws, and so the examples of a seed, are the same either way.
_LATENCY = st.sampled_from([0, 0, 0, 1, 2, 5, 20, 250])
_GAPS = st.sampled_from([0, 0, 0, 0, 0, 1, 2, 5, 20, 100])
#: with a slow lane: replicas busier and calls closer together, so that queues fill
_BUSY = st.sampled_from([1, 2, 5, 20, 250])
_BURSTS = st.sampled_from([0] * 8 + [1, 2, 5, 20, 100])
_FAULT = st.sampled_from([None] * 12 + ["error", "crash"])
#: with several replicas hedging or broken: inputs that raise (poison) more often
_POISON = st.sampled_from([None] * 16 + ["error", "crash"])
#: the same on pipelined replicas: a crash there would take the batches staged behind
#: with it, which the simulated pipeline does not hand back as a worker's loss does
_POISON_NO_CRASH = st.sampled_from([None] * 16 + ["error"])
#: batches a replica holds in flight, with several replicas hedging (1: the inline
#: loop; more: a worker process's pipeline, so a replica pulls while it holds a
#: hedge twin)
_PIPELINE = st.sampled_from([1, 1, 2, 3])
_REPLICA_DELAY = st.sampled_from([0, 2, 5, 20, 100])
_MAX_TOKENS = st.none() | st.integers(1, 10)
_BATCH_SIZE = st.integers(1, 5)
#: "flaky": batches of several, which fail there and are split into parts
_FLAKY_BATCH = st.integers(2, 5)
_MODE = st.sampled_from(["plain", "hedge", "broken", "both"])
#: without a slow lane (so that its three replicas serve one lane)
_MODE_ONE_LANE = st.sampled_from(
    ["plain", "hedge", "broken", "both", "apart", "apart", "flaky"]
)
_HEDGE_AFTER = st.sampled_from([1, 2, 5, 20])
#: "apart": hedges sent early, one replica broken from the start, the others pipelined
_APART_HEDGE_AFTER = st.sampled_from([1, 2])
_APART_UNTIL = st.sampled_from([None, None, 50, 200])
_APART_PIPELINE = st.sampled_from([2, 3])
_APART_SLOWER = st.sampled_from([5, 20])
_APART_MAX_WAIT = st.sampled_from([1, 5, 20])
#: "flaky": one replica fails all but every n-th of its model's calls, for good
_FLAKY_EVERY = st.sampled_from([3, 4])
#: "flaky": the sound replicas this much slower than the flaky one
_FLAKY_SLOWER = st.sampled_from([2, 5, 20])
#: "flaky": quick items, so that the flaky replica runs several batches while a part
#: of one it failed runs on a slower replica
_FLAKY_LATENCY = st.sampled_from([0, 0, 1, 2, 5])
_AGING = st.sampled_from([0, 2, 10, 50, 1000])
_CLASS_TIMEOUT = st.none() | st.sampled_from([1, 10, 100])
_OVER_QUOTA = st.sampled_from(["reject", "wait"])
_CREDIT_RATE = st.none() | st.none() | st.sampled_from([5.0, 50.0, 500.0])
_CREDIT_BURST = st.none() | st.sampled_from([1.0, 4.0, 20.0])
_WEIGHT = st.sampled_from([1.0, 1.0, 2.0, 0.5, 3.0])
_QUEUE_SHARE = st.sampled_from([1.0, 1.0, 1.0, 0.5])
_CLS = {n: st.none() | st.integers(0, n - 1) for n in (1, 2, 3)}
_ALLOWED = {
    n: st.just(frozenset()) | st.sets(st.integers(0, n - 1), max_size=n) for n in (1, 2, 3)
}
_CANCEL_MS = st.none() | st.none() | st.sampled_from([0, 1, 3, 10, 50])
_CANCEL_HOW = st.sampled_from(["deadline", "cancel"])
_OVERSIZE = st.sampled_from(["alone", "reject", "split"])
_MAX_WAIT = st.sampled_from([0, 0, 1, 5, 20, 50])
#: the model's timeout: with replicas hedging or broken, parts wait for another
#: replica, so a long one if any, so that they get there
_TIMEOUT = {
    True: st.none() | st.sampled_from([5, 50, 1000]),
    False: st.none() | st.sampled_from([1000]),
}
_BATCH_LATENCY = st.sampled_from([0, 1, 5])
_GRACEFUL = st.sampled_from([0, 10, 1000])
_SHUTDOWN = st.sampled_from([None] * 15 + [0, 5, 30, 200])
_SPELLS = st.integers(1, 6)
_SPELL_START = st.sampled_from([0, 0, 0, 5, 20, 100])
_SPELL_LENGTH = st.sampled_from([None, None, None, 2, 5, 10, 20, 50])
_SPELL_EVERY = st.sampled_from([1, 1, 1, 2, 3])


@functools.cache
def _broken(replicas: int) -> st.SearchStrategy[tuple[Broken, ...]]:
    """One to six spells of brokenness on one or more replicas: for good, or for a
    while (so that a replica that raised succeeds again, and evidence taken before
    goes stale)."""
    replica = st.integers(0, replicas - 1)

    @st.composite
    def spells(draw: st.DrawFn) -> tuple[Broken, ...]:
        out = []
        for _ in range(draw(_SPELLS)):
            start = draw(_SPELL_START)
            length = draw(_SPELL_LENGTH)
            out.append(Broken(
                replica=draw(replica),
                from_ms=start,
                until_ms=None if length is None else start + length,
                every=draw(_SPELL_EVERY),
            ))
        return tuple(out)

    return spells()


@functools.cache
def _calls(
    *, max_tokens: int | None, busy: bool, plain: bool, n_tenants: int, n_classes: int,
    most_items: int, crash: bool = True, flaky: bool = False,
) -> st.SearchStrategy[list[Call]]:
    """The calls of a scenario, their ``at_ms`` the gap after the previous call."""
    cost = st.integers(1, 4) if max_tokens is None else st.integers(1, max_tokens + 2)
    # (several replicas hedging or broken: poison inputs more often)
    fault = _FAULT if plain else _POISON if crash else _POISON_NO_CRASH
    latency = _BUSY if busy else _FLAKY_LATENCY if flaky else _LATENCY
    item = st.builds(Item, cost=cost, latency_ms=latency, fault=fault)
    call = st.builds(
        Call,
        # after the previous call (in bursts with several replicas hedging or broken:
        # work queues up while a replica raises, then heals)
        at_ms=_BURSTS if busy or not plain else _GAPS,
        tenant=st.integers(0, n_tenants - 1),
        cls=_CLS[n_classes],
        items=st.lists(item, min_size=1, max_size=most_items).map(tuple) | st.tuples(item),
        cancel_ms=_CANCEL_MS,
        cancel_how=_CANCEL_HOW,
    )
    # (several replicas hedging or broken: longer runs, so that breakers see their
    # evidence pile up and open)
    if plain:
        return st.lists(call, min_size=1, max_size=30)
    return st.lists(call, min_size=16 if flaky else 8, max_size=40)


def _in_both_lanes(call: Call, slow_cost: int, *, top: int) -> Call:
    """``call`` with its last item moved to the other lane (its cost mapped into that
    lane's range, ``slow_cost`` to ``top`` or below ``slow_cost``) when it has
    several items, all of them fall in one lane, and their costs add up to an even
    number (so that half such calls stay in one lane: a two-lane model's call all
    slow or all fast is a case of its own).

    A mapping of the values drawn, not another draw: hypothesis makes the same
    choices, so a seed's examples stay the same (the "apart" mode's among them)
    but for these costs. The two-lane scenarios' share of a chunk's examples is
    what hypothesis's mutations make of it (an apart scenario, calls of one item,
    yields more variants and takes examples from the others), so their calls of
    several items, about half of them in one lane before, now a quarter.
    """
    items = call.items
    if len(items) < 2:
        return call
    slow = [it.cost >= slow_cost for it in items]
    if (any(slow) and not all(slow)) or sum(it.cost for it in items) % 2:
        return call
    last = items[-1]
    if slow[-1]:
        cost = 1 + (last.cost - slow_cost) % (slow_cost - 1)
    else:
        cost = slow_cost + (last.cost - 1) % (top - slow_cost + 1)
    return attrs.evolve(call, items=(*items[:-1], attrs.evolve(last, cost=cost)))


#: a quarter of the scenarios run their batches off the event loop
_RUNNING = st.sampled_from([False, False, False, True])
#: (one batch held at a time half the time: it pulls only when it is free, so that
#: batches of several, of several deadlines, run)
_RUNNING_SLOTS = st.sampled_from([1, 1, 2, 3])
_RUNNING_CUT_OFF = st.sampled_from([5, 20, 100, 1000])
#: timeouts and latencies of the same order, so that deadlines pass while batches
#: run (or are staged), before and after a cut-off
_RUNNING_LATENCY = st.sampled_from([0, 1, 2, 5, 10, 20, 20, 50, 250])
_RUNNING_TIMEOUT = st.sampled_from([None, 5, 10, 20, 50, 1000])
_RUNNING_CLASS_TIMEOUT = st.sampled_from([None, 1, 5, 10, 20, 50, 100])
_RUNNING_MAX_WAIT = st.sampled_from([0, 1, 5, 20])
#: calls close together, so that a batch holds requests of several arrivals (and
#: deadlines)
_RUNNING_GAPS = st.sampled_from([0, 0, 1, 2, 3, 5, 10, 50])


def _setups(
    draw: st.DrawFn, n_classes: int, n_tenants: int, class_timeout: st.SearchStrategy[Any]
) -> tuple[tuple[ClassSetup, ...], list[TenantSetup]]:
    """The classes (each's timeout from ``class_timeout``) and the tenants of a scenario."""
    classes = tuple(
        ClassSetup(
            aging_ms=draw(_AGING),
            timeout_ms=draw(class_timeout),
            over_quota=draw(_OVER_QUOTA),
        )
        for _ in range(n_classes)
    )
    tenants = []
    for _ in range(n_tenants):
        allowed = draw(_ALLOWED[n_classes])
        rate = draw(_CREDIT_RATE)
        tenants.append(
            TenantSetup(
                weight=draw(_WEIGHT),
                classes=tuple(sorted(allowed)),
                credit_rate=rate,
                credit_burst=None if rate is None else draw(_CREDIT_BURST),
                queue_share=draw(_QUEUE_SHARE),
            )
        )
    return classes, tenants


#: a quarter of the scenarios (but the running ones) open with a surge: their first
#: calls arrive at once, as at a traffic spike (a client's retry storm, a batch job
#: starting, a failover), so that the queue is at its deepest and every tenant of a
#: class backlogged together, served a batch at a time: where the fair share between
#: tenants of different weights shows (the lag check needs two of them backlogged
#: for several batches) and a low class waits longest
_SURGE = st.sampled_from([0, 0, 0, 12])


#: half the surges are a contest for the share: drawn after the surge, only with one
_CONTEST = st.booleans()
#: a contest's second tenant's weight when the first's is the same (a ratio of 3 to 6)
_OTHER_WEIGHT = {1.0: 3.0, 2.0: 0.5, 0.5: 3.0, 3.0: 0.5}


def _contest(scenario: Scenario, surge: int) -> Scenario:
    """``scenario`` (two tenants or more, with a surge) made a contest for the share
    between tenants t0 and t1: where the fair-share lag check has work to do, two
    tenants of different weights backlogged together in one class for several pulls.
    The surged calls alternate between the two, in their default class, the first
    allowed to t0 (t1 allowed the same classes), with no caller leaving early; the
    two have no credits and their whole share of the queue, the model and that class
    no timeout shorter than a second, the queue room for the surge, and the runtime
    is not shut down early. A mapping of the values drawn, not other draws."""
    first, second = scenario.tenants[0], scenario.tenants[1]
    weight = second.weight
    if weight == first.weight:
        weight = _OTHER_WEIGHT[first.weight]
    common = {"credit_rate": None, "credit_burst": None, "queue_share": 1.0}
    tenants = (
        attrs.evolve(first, **common),
        attrs.evolve(second, weight=weight, classes=first.classes, **common),
        *scenario.tenants[2:],
    )
    top = first.classes[0] if first.classes else 0
    classes = tuple(
        attrs.evolve(c, timeout_ms=None)
        if i == top and c.timeout_ms is not None and c.timeout_ms < 1000
        else c
        for i, c in enumerate(scenario.classes)
    )
    calls = tuple(
        attrs.evolve(c, tenant=i % 2, cls=None, cancel_ms=None) if i < surge else c
        for i, c in enumerate(scenario.calls)
    )
    timeout = scenario.timeout_ms
    return attrs.evolve(
        scenario,
        tenants=tenants,
        classes=classes,
        calls=calls,
        timeout_ms=None if timeout is not None and timeout < 1000 else timeout,
        queue_bound=max(scenario.queue_bound, 2 * surge),
        shutdown_at_ms=None,
    )


def _surged(gaps: list[Call], surge: int) -> list[Call]:
    """``gaps`` with the first ``surge`` calls arriving at once (a gap of 0 after the
    previous call): a mapping of the values drawn, not other draws."""
    return [attrs.evolve(c, at_ms=0) if i < surge and c.at_ms else c for i, c in enumerate(gaps)]


def _arrivals(gaps: list[Call]) -> list[Call]:
    """The calls at their arrival times: the gaps between them accumulated."""
    at, calls = 0, []
    for c in gaps:
        at += c.at_ms
        calls.append(attrs.evolve(c, at_ms=at))
    return calls


@st.composite
def running_scenarios(draw: st.DrawFn) -> Scenario:
    """A scenario whose replicas (one to three, one lane, no hedges, none broken) run
    their batches off the event loop, each holding one to three in flight: the
    model's and the classes' timeouts fall while batches run or wait staged, late
    answers come after them, batches are cut off and workers die."""
    max_tokens = draw(_MAX_TOKENS)
    replicas = draw(st.integers(1, 3))
    n_classes = draw(st.integers(1, 3))
    n_tenants = draw(st.integers(1, 3))
    classes, tenants = _setups(draw, n_classes, n_tenants, _RUNNING_CLASS_TIMEOUT)
    gaps = draw(_running_calls(max_tokens=max_tokens, n_tenants=n_tenants, n_classes=n_classes))
    calls = _arrivals(gaps)
    return Scenario(
        max_batch_size=draw(st.integers(1, 5)),
        max_batch_tokens=max_tokens,
        padded=draw(st.booleans()),
        oversize=draw(_OVERSIZE),
        max_wait_ms=draw(_RUNNING_MAX_WAIT),
        timeout_ms=draw(_RUNNING_TIMEOUT),
        replicas=replicas,
        adaptive=draw(st.booleans()),
        batch_latency_ms=draw(_BATCH_LATENCY),
        queue_bound=draw(st.integers(1, 32)),
        graceful_ms=draw(_GRACEFUL),
        shutdown_at_ms=draw(_SHUTDOWN),
        pipeline=tuple(draw(_RUNNING_SLOTS) for _ in range(replicas)),
        running=True,
        cut_off_ms=draw(_RUNNING_CUT_OFF),
        classes=classes,
        tenants=tuple(tenants),
        calls=tuple(calls),
    )


@functools.cache
def _running_calls(
    *, max_tokens: int | None, n_tenants: int, n_classes: int
) -> st.SearchStrategy[list[Call]]:
    """The calls of a running scenario, their ``at_ms`` the gap after the previous."""
    cost = st.integers(1, 4) if max_tokens is None else st.integers(1, max_tokens + 2)
    item = st.builds(Item, cost=cost, latency_ms=_RUNNING_LATENCY, fault=_FAULT)
    call = st.builds(
        Call,
        at_ms=_RUNNING_GAPS,
        tenant=st.integers(0, n_tenants - 1),
        cls=_CLS[n_classes],
        items=st.lists(item, min_size=1, max_size=3).map(tuple) | st.tuples(item),
        cancel_ms=_CANCEL_MS,
        cancel_how=_CANCEL_HOW,
    )
    return st.lists(call, min_size=4, max_size=30)


_RUNNING_SCENARIOS = running_scenarios()


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    if draw(_RUNNING):
        return draw(_RUNNING_SCENARIOS)
    max_tokens = draw(_MAX_TOKENS)
    # A slow lane in half the scenarios, then on two or three replicas. Its cost
    # threshold lies within the costs of the items under the token budget (cost 1 is
    # always fast), so the items of a call, and the parts of a split item, fall in
    # both lanes; calls are longer (up to four items) and the queue bound smaller, so
    # that the lanes fill, push out and refuse
    # (two tenants at least: only another tenant's request is pushed out).
    slow_cost, slow_replicas, most_items = None, 1, 3
    replicas = draw(st.integers(1, 3))
    if draw(st.booleans()):
        replicas = draw(st.integers(2, 3))
        slow_cost = draw(st.integers(2, max(2, max_tokens or 4)))
        slow_replicas = draw(st.integers(1, replicas - 1))
        most_items = 4
    bound = draw(st.integers(1, 32) if slow_cost is None else st.integers(1, 4))
    # With several replicas, in most scenarios: hedged requests, replicas broken for a
    # while or for good (the others sound, or all broken), poison inputs, and
    # replicas slower than others (so that a copy on a fast one answers first, and a
    # part waits for the replica it is kept for).
    # "apart" aims at a part that raised alone on a broken replica while its hedge
    # twin runs on another, pipelined one, which pulls the part, keeps it apart, and
    # leaves it for a third (SchedulerActor._next_apart): three replicas and no
    # slow lane, one broken from the start, inline and faster than the others, which
    # pull while they hold batches in flight; copies sent after 1-2 ms.
    hedge_after, delays, broken, pipeline = None, (), (), ()
    mode = "plain"
    if replicas > 1:
        mode = draw(_MODE if slow_cost is not None else _MODE_ONE_LANE)
    if mode == "apart":
        replicas, most_items = 3, 1  # (calls of one item: each may be hedged)
    if mode != "plain":
        delays = tuple(draw(_REPLICA_DELAY) for _ in range(replicas))
    if mode in ("hedge", "both"):
        if slow_cost is None:  # (a slow lane's replicas stay busy, so that it fills)
            pipeline = (draw(_PIPELINE),) * replicas
        hedge_after = draw(_HEDGE_AFTER)
    if mode in ("broken", "both"):
        broken = draw(_broken(replicas))
    if mode == "flaky":
        max_tokens = None
        bad = draw(st.integers(0, replicas - 1))
        broken = (Broken(replica=bad, every=draw(_FLAKY_EVERY)),)
        delays = tuple(
            0 if i == bad else d + draw(_FLAKY_SLOWER) for i, d in enumerate(delays)
        )
    if mode == "apart":
        hedge_after = draw(_APART_HEDGE_AFTER)
        bad = draw(st.integers(0, replicas - 1))
        # (the broken one inline: it pulls again as soon as its batch failed, so it
        # takes a part of it, which raises alone there)
        pipeline = tuple(1 if i == bad else draw(_APART_PIPELINE) for i in range(replicas))
        broken = (Broken(replica=bad, until_ms=draw(_APART_UNTIL)),)
        # the sound replicas slower than the broken one: a copy there still runs
        # when the part has raised alone on the broken one
        delays = tuple(
            0 if i == bad else d + draw(_APART_SLOWER) for i, d in enumerate(delays)
        )
    n_classes = draw(st.integers(1, 3))
    n_tenants = draw(st.integers(1 if slow_cost is None else 2, 3))
    classes, tenants = _setups(draw, n_classes, n_tenants, _CLASS_TIMEOUT)
    gaps = draw(_calls(
        max_tokens=max_tokens, busy=slow_cost is not None, plain=mode == "plain",
        n_tenants=n_tenants, n_classes=n_classes, most_items=most_items,
        crash=max(pipeline, default=1) == 1, flaky=mode == "flaky",
    ))
    if slow_cost is not None:
        # (moved to the slow lane, an item stays within the token budget when it can)
        top = max(slow_cost, 4 if max_tokens is None else max_tokens)
        gaps = [_in_both_lanes(c, slow_cost, top=top) for c in gaps]
    scenario = Scenario(
        max_batch_size=draw(_FLAKY_BATCH if mode == "flaky" else _BATCH_SIZE),
        max_batch_tokens=max_tokens,
        padded=draw(st.booleans()),
        oversize=draw(_OVERSIZE),
        # ("apart": batches wait for company, so that a broken replica fails a batch
        # of several, whose parts it then runs alone)
        max_wait_ms=draw(_APART_MAX_WAIT if mode == "apart" else _MAX_WAIT),
        timeout_ms=draw(_TIMEOUT[mode == "plain"]),
        replicas=replicas,
        slow_lane_cost=slow_cost,
        slow_lane_replicas=slow_replicas,
        adaptive=draw(st.booleans()),
        batch_latency_ms=draw(_BATCH_LATENCY),
        queue_bound=bound,
        graceful_ms=draw(_GRACEFUL),
        # ("flaky": served to the end, so that parts reach another replica)
        shutdown_at_ms=None if mode == "flaky" else draw(_SHUTDOWN),
        hedge_after_ms=hedge_after,
        replica_delay_ms=delays,
        pipeline=pipeline,
        broken=broken,
        classes=classes,
        tenants=tuple(tenants),
    )
    # (drawn last, so that the draws before it, and the scenarios of a seed without
    # a surge, are as they were)
    surge = draw(_SURGE)
    scenario = attrs.evolve(scenario, calls=tuple(_arrivals(_surged(gaps, surge))))
    # (drawn after it, only with a surge: the scenarios without one are as they were)
    if surge and n_tenants > 1 and draw(_CONTEST):
        scenario = _contest(scenario, surge)
    return scenario

