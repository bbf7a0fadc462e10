"""Suite ``runtime``: whole scenarios through ``open_runtime`` under MockClock.

A :class:`Scenario` is a script: a config (model limits, replicas, classes with aging,
timeouts and over-quota policies, tenants with weights, credits and queue shares, the
queue bound, the shutdown grace) and a list of calls (arrival time, tenant, class, items
with costs, model latencies, stragglers, model errors and replica crashes, caller
cancellations by deadline or by ``cancel()``), optionally cut short by an early
shutdown. :func:`run_scenario` plays it in ``trio.run`` with
``MockClock(autojump_threshold=0)``, so a scenario replays exactly, and checks:

- the queue's invariants (QueueObserver on the runtime's own FairQueue): FIFO per flow,
  batch budgets, deadlines, aging, the fair-share lag, bounded queue, nothing dispatched
  twice or lost between the queue and a batcher;
- every batch a replica starts, fresh or handed back for a retry: within the budgets,
  nothing in it past its deadline; an item runs again only after a batch whose model
  raised (the batch is split and retried);
- every caller gets exactly one outcome, one its situation allows (a result only if
  the last batch of each of its items succeeded; ModelError only for an input that
  raises — model errors reach only their own input; ActorBroken only if its batch
  crashed the replica; DeadlineExceeded only after its timeout; ActorClosed only after
  shutdown began; a cancelled caller returns exactly at its cancel time ...);
- each result is the caller's own output, in the order it submitted its items;
- credits: a tenant's admitted cost stays within burst + rate × elapsed;
- no task outlives the runtime.

Model time is simulated: the batchers are the product's, with ``_execute`` preceded by
a trio sleep for the batch's latency (the slowest item's, a straggler holds the whole
batch back) and, for a "crash" item, a raise that crashes the replica so its
supervisor restarts it. The model itself runs inline and echoes its input.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing
import trioserve
import trioserve._runtime as _assembly
import trioserve.actors
from hypothesis import strategies as st
from hypothesis.internal.entropy import deterministic_PRNG
from trioserve import (
    ActorBroken,
    ActorClosed,
    DeadlineExceeded,
    Forbidden,
    InvalidInput,
    ModelBackend,
    ModelError,
    Overloaded,
    TensorSpec,
)

from ._checker import InvariantViolation, QueueObserver, batch_cost
from ._product import PRODUCT, Product, observed_queue_class, submission
from ._replicas import Replicas, scheduler_class
from ._stats import count_example, expect, note

expect(
    "runtime",
    "oversize: items run in parts",
    "pipeline: batches pulled while another was in flight",
)

MS = 1e-3
#: How long after the last arrival a caller may take before it counts as lost (trio
#: time: free under the autojump clock).
HORIZON_S = 3600.0
#: An item's x is KEY_SPAN * key + [0, 1, ..., cost - 1]: each part of a split item
#: still names its call and item, and the exact output proves whose answer it is.
KEY_SPAN = 1000


# ---------------------------------------------------------------- the script
@attrs.frozen(kw_only=True)
class Item:
    """One item: its cost (token units), the model's latency on it, and a planted
    fault: "error" (the model raises on a batch holding it) or "crash" (the replica
    running it crashes)."""

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
_MODE = st.sampled_from(["plain", "hedge", "broken", "both"])
#: without a slow lane (so that its three replicas serve one lane)
_MODE_ONE_LANE = st.sampled_from(["plain", "hedge", "broken", "both", "apart", "apart"])
_HEDGE_AFTER = st.sampled_from([1, 2, 5, 20])
#: "apart": hedges sent early, one replica broken from the start, the others pipelined
_APART_HEDGE_AFTER = st.sampled_from([1, 2])
_APART_UNTIL = st.sampled_from([None, None, 50, 200])
_APART_PIPELINE = st.sampled_from([2, 3])
_APART_SLOWER = st.sampled_from([5, 20])
_APART_MAX_WAIT = st.sampled_from([1, 5, 20])
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
    most_items: int, crash: bool = True,
) -> st.SearchStrategy[list[Call]]:
    """The calls of a scenario, their ``at_ms`` the gap after the previous call."""
    cost = st.integers(1, 4) if max_tokens is None else st.integers(1, max_tokens + 2)
    # (several replicas hedging or broken: poison inputs more often)
    fault = _FAULT if plain else _POISON if crash else _POISON_NO_CRASH
    item = st.builds(Item, cost=cost, latency_ms=_BUSY if busy else _LATENCY, fault=fault)
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
    return st.lists(call, min_size=8, max_size=40)


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


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
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
    classes = tuple(
        ClassSetup(
            aging_ms=draw(_AGING),
            timeout_ms=draw(_CLASS_TIMEOUT),
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
    gaps = draw(_calls(
        max_tokens=max_tokens, busy=slow_cost is not None, plain=mode == "plain",
        n_tenants=n_tenants, n_classes=n_classes, most_items=most_items,
        crash=max(pipeline, default=1) == 1,
    ))
    if slow_cost is not None:
        # (moved to the slow lane, an item stays within the token budget when it can)
        top = max(slow_cost, 4 if max_tokens is None else max_tokens)
        gaps = [_in_both_lanes(c, slow_cost, top=top) for c in gaps]
    at, calls = 0, []
    for c in gaps:  # arrival times accumulate the gaps
        at += c.at_ms
        calls.append(attrs.evolve(c, at_ms=at))
    return Scenario(
        max_batch_size=draw(st.integers(1, 5)),
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
        shutdown_at_ms=draw(_SHUTDOWN),
        hedge_after_ms=hedge_after,
        replica_delay_ms=delays,
        pipeline=pipeline,
        broken=broken,
        classes=classes,
        tenants=tuple(tenants),
        calls=tuple(calls),
    )


# ---------------------------------------------------------------- the model
X = TensorSpec(name="x", datatype="FP64", shape=(-1,))
Y = TensorSpec(name="y", datatype="FP64", shape=(-1,))


def item_input(key: int, cost: int) -> np.ndarray:
    return KEY_SPAN * key + np.arange(cost, dtype=np.float64)


def part_id(x: np.ndarray) -> tuple[int, int]:
    """(item key, offset of the part's first element)."""
    first = int(x[0])
    return first // KEY_SPAN, first % KEY_SPAN


class EchoModel(ModelBackend):
    """Items cost their length; returns each input as its output; raises on a batch
    holding an item whose fault is "error". Runs inline."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "inline"
    supports_split = True

    def __init__(self, run: Run, *, padded: bool) -> None:
        self._run = run
        self.padded = padded

    def prepare(self, name: str, inputs: Any) -> tuple[Any, int]:
        it, _ = super().prepare(name, inputs)
        return it, int(it["x"].shape[0])

    def load(self, device: str, *, torch_threads: int = 1) -> Any:
        run = self._run

        def forward(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
            ex = run.current
            run.current = None
            parts = [part_id(it["x"]) for it in items]
            if ex is None or ex.parts != parts:
                run.violations.append(
                    ("duplicated", f"the model ran {parts} outside a batch a replica started")
                )
            bad = [k for k, _ in parts if run.fault(k) == "error"]
            broken = ex is not None and run.broken_at(ex.replica, trio.current_time())
            if ex is not None:
                run.replicas.at_model(ex, ex.reqs, broken)
                ex.status = "error" if bad or broken else "ok"
            if broken:
                raise RuntimeError(f"planted broken replica {ex.replica}")  # type: ignore[union-attr]
            if bad:
                raise ValueError(f"planted model error on item {bad[0]}")
            return [{"y": it["x"].copy()} for it in items]

        return forward

    def split(self, item: Any, budget: int) -> list[tuple[Any, int]]:
        x = item["x"]
        chunks = [x[i : i + budget] for i in range(0, len(x), budget)]
        return [({"x": c}, len(c)) for c in chunks]

    def merge(self, parts: list[Any]) -> dict[str, np.ndarray]:
        return {"y": np.concatenate([p["y"] for p in parts])}


@attrs.define(eq=False)
class Execution:
    """One batch a replica started: when, which parts, and how it ended: "ok" (the
    model answered), "error" (the model raised), "crash" (the replica crashed), or
    "cut" (cancelled at shutdown before the model ran)."""

    at: float
    replica: int
    parts: list[tuple[int, int]]
    #: its requests (for the reference of the replicas, fuzz/_replicas.py)
    reqs: list[Any] = attrs.Factory(list)
    status: str = "cut"
    end: float | None = None
    #: per request: (part, hedge copy?), and whether it ran before (a retry)
    keys: list[tuple[int, int, bool]] = attrs.Factory(list)
    retried: list[bool] = attrs.Factory(list)
    #: when the model was called: its replica broken, each reply still answerable,
    #: another replica of its lane ready, each hedge twin still answerable
    broken: bool = False
    answerable: list[bool] = attrs.Factory(list)
    others_ready: bool = False
    twins_answerable: list[bool] = attrs.Factory(list)
    #: it raised on a part alone that is to run once on another replica
    marked: bool = False


def batcher_class(base: type, run: Run) -> type:
    """The product's batcher (``base``) on a simulated device: each batch first takes
    its latency in trio time, and a batch holding a "crash" item crashes the replica.
    Every batch a replica starts (fresh from the queue or handed back for a retry) is
    checked against the deadlines and budgets here."""

    class SimulatedDevice(base):  # type: ignore[misc, valid-type]
        def _stage(self, batch: list[Any]) -> Execution:
            """``batch`` is handed to this replica's device: checked, and noted."""
            parts = [part_id(req.item["x"]) for req in batch]
            ex = Execution(
                at=trio.current_time(), replica=self.index, parts=parts, reqs=list(batch)
            )
            run.executions.append(ex)
            run.check_started(ex, batch)
            run.replicas.started(ex, batch)
            return ex

        async def _execute(self, batch: list[Any], ex: Execution | None = None) -> None:
            if ex is None:
                ex = self._stage(batch)
            try:
                latency = (
                    run.scenario.batch_latency_ms + run.replica_delay(self.index)
                    + max(run.latency(k) for k, _ in ex.parts)
                )
                if latency:
                    await trio.sleep(latency * MS)
                crash = [k for k, _ in ex.parts if run.fault(k) == "crash"]
                if crash:
                    ex.status = "crash"
                    raise RuntimeError(f"planted replica crash on item {crash[0]}")
                run.current = ex  # the inline model runs synchronously inside the next call
                await super()._execute(batch)
            finally:
                # (inline: the model ran and its answers were delivered with no
                # checkpoint since)
                ex.end = trio.current_time()
                run.replicas.ended(ex, batch, ex.end)

        async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            pipeline = run.scenario.pipeline
            slots = pipeline[self.index] if self.index < len(pipeline) else 1
            if slots <= 1:
                await super().run(task_status=task_status)
                return
            # The pipeline of a worker-process replica (BatcherActor._serve_worker):
            # it pulls while it has room, so it holds batches in flight when it
            # pulls (``holds``, ``_keep_apart``), and the device runs them in order.
            # Its worker's loss and replacement are not simulated.
            if self._runner is None:
                self._runner = self._backend.load(self.device)
            task_status.started(self)
            room = trio.Semaphore(slots)
            staged_send, staged_recv = trio.open_memory_channel[tuple[list[Any], Execution]](
                slots
            )
            pull = self._scheduler.pull
            twins = self._scheduler.twins
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._device, staged_recv, room)
                while True:
                    await self._wait_breaker()
                    await room.acquire()
                    batch = await pull(self)
                    if self._in_flight:
                        note("runtime", "pipeline: batches pulled while another was in flight")
                    if twins:
                        batch = self._keep_apart(batch)
                        if not batch:
                            room.release()
                            continue
                    self._in_flight.append(batch)
                    await staged_send.send((batch, self._stage(batch)))
                    if trioserve.actors.retried(batch) and self._scheduler.replicas > 1:
                        # as _serve_worker: nothing staged behind a retry
                        for _ in range(slots):
                            await room.acquire()
                        for _ in range(slots):
                            room.release()

        async def _device(self, staged: Any, room: trio.Semaphore) -> None:
            async for batch, ex in staged:
                await self._execute(batch, ex)
                if self._in_flight and self._in_flight[0] is batch:
                    self._in_flight.popleft()
                room.release()

    return SimulatedDevice


# ---------------------------------------------------------------- one run
@attrs.define(eq=False)
class Outcome:
    kind: str  # "result", "error", "cancelled"
    value: Any
    at: float


@attrs.define(eq=False)
class Run:
    scenario: Scenario
    product: Product
    items: dict[int, tuple[int, Item]] = attrs.Factory(dict)  # key -> (call index, item)
    outcomes: dict[int, Outcome] = attrs.Factory(dict)
    executions: list[Execution] = attrs.Factory(list)
    current: Execution | None = None
    violations: list[tuple[str, str]] = attrs.Factory(list)
    queues: list[Any] = attrs.Factory(list)
    #: the queue of each lane: "fast" (the model's own) and, with a slow lane, "slow"
    lanes: dict[str, Any] = attrs.Factory(dict)
    t0: float = 0.0
    credits_used: dict[str, float] = attrs.Factory(dict)
    shutdown_at: float = math.inf
    end: float = 0.0
    replicas: Replicas = attrs.field(init=False)
    #: model calls per replica (a flaky replica succeeds on every n-th)
    model_calls: collections.Counter[int] = attrs.Factory(collections.Counter)
    #: the scheduler class open_runtime is to build (the product's, observed)
    scheduler_class: type | None = None

    def __attrs_post_init__(self) -> None:
        self.replicas = Replicas(lane_of=self.lane_of_replica)

    def replica_delay(self, index: int) -> int:
        delays = self.scenario.replica_delay_ms
        return delays[index] if index < len(delays) else 0

    def broken_at(self, index: int, now: float) -> bool:
        """Whether replica ``index``'s model raises on its call now (each call
        counts, for a flaky spell)."""
        self.model_calls[index] += 1
        n = self.model_calls[index]
        for b in self.scenario.broken:
            if b.replica != index or now < self.t0 + b.from_ms * MS:
                continue
            if (b.until_ms is None or now < self.t0 + b.until_ms * MS) and (
                b.every == 1 or n % b.every
            ):
                return True
        return False

    def check_started(self, ex: Execution, batch: list[Any]) -> None:
        """A replica starts ``batch``: within the budgets, nothing past its deadline."""
        sc = self.scenario
        if len(batch) > sc.max_batch_size:
            self.violations.append(
                (
                    "batch-budget",
                    f"replica {ex.replica} started a batch of {len(batch)} at t={ex.at:.6g}, "
                    f"over max_batch_size {sc.max_batch_size}",
                )
            )
        costs = [req.cost for req in batch]
        cost = batch_cost(costs, sc.padded)
        if sc.max_batch_tokens is not None and cost > sc.max_batch_tokens and len(batch) > 1:
            self.violations.append(
                (
                    "batch-budget",
                    f"replica {ex.replica} started a batch costing {cost} (costs {costs}) at "
                    f"t={ex.at:.6g}, over max_batch_tokens {sc.max_batch_tokens}",
                )
            )
        lane = self.lane_of_replica(ex.replica)
        for req, p in zip(batch, ex.parts, strict=True):
            if self.lane_of_cost(req.cost) != lane:
                self.violations.append(
                    (
                        "lane",
                        f"replica {ex.replica} of the {lane} lane started item {p[0]} (part "
                        f"at {p[1]}, cost {req.cost}) at t={ex.at:.6g}: slow_lane_cost is "
                        f"{self.scenario.slow_lane_cost}",
                    )
                )
            if req.deadline <= ex.at:
                self.violations.append(
                    (
                        "deadline",
                        f"replica {ex.replica} started item {p[0]} (part at {p[1]}) at "
                        f"t={ex.at:.6g}, {ex.at - req.deadline:.6g}s after its deadline",
                    )
                )

    def fault(self, key: int) -> str | None:
        return self.items[key][1].fault

    def latency(self, key: int) -> int:
        return self.items[key][1].latency_ms

    def lane_of_cost(self, cost: int) -> str:
        slow = self.scenario.slow_lane_cost
        return "slow" if slow is not None and cost >= slow else "fast"

    def lane_of_replica(self, index: int) -> str:
        sc = self.scenario
        if sc.slow_lane_cost is not None and index >= sc.replicas - sc.slow_lane_replicas:
            return "slow"
        return "fast"

    @property
    def observers(self) -> list[QueueObserver]:
        """The observers of the lanes' queues, the fast lane's first."""
        return [q.observer for q in self.lanes.values()]


def config_of(sc: Scenario, run: Run) -> trioserve.Config:
    classes = tuple(
        trioserve.ClassConfig(
            name=f"c{i}",
            max_queue_wait_ms=c.aging_ms,
            timeout_ms=c.timeout_ms,
            over_quota=c.over_quota,
        )
        for i, c in enumerate(sc.classes)
    )
    tenants = tuple(
        trioserve.TenantConfig(
            name=f"t{i}",
            default=i == 0,
            weight=t.weight,
            classes=tuple(f"c{c}" for c in t.classes),
            credit_rate=t.credit_rate,
            credit_burst=t.credit_burst,
            queue_share=t.queue_share,
        )
        for i, t in enumerate(sc.tenants)
    )
    model = trioserve.ModelConfig(
        name="m",
        backend=EchoModel(run, padded=sc.padded),
        replicas=sc.replicas,
        slow_lane_cost=sc.slow_lane_cost,
        slow_lane_replicas=sc.slow_lane_replicas,
        max_batch_size=sc.max_batch_size,
        max_batch_tokens=sc.max_batch_tokens,
        max_wait_ms=sc.max_wait_ms,
        oversize=sc.oversize,
        timeout_ms=sc.timeout_ms,
        execution="inline",
        adaptive_limit=sc.adaptive,
        hedge=sc.hedge_after_ms is not None,
        hedge_after_ms=sc.hedge_after_ms,
    )
    return trioserve.Config(
        models=(model,),
        tenants=tenants,
        classes=classes,
        runtime=trioserve.RuntimeLimits(
            queue_bound=sc.queue_bound,
            restart_intensity=10_000,
            restart_period_s=1.0,
            graceful_timeout_s=sc.graceful_ms * MS,
        ),
    )


@contextlib.contextmanager
def product_installed(run: Run) -> Iterator[None]:
    """open_runtime builds its queues and batchers from ``trioserve.actors``, and its
    Runtime from ``trioserve._runtime.Runtime``: point those names at the observed
    product (or planted-bug) classes while it starts."""
    actors = trioserve.actors
    saved = (
        actors.FairQueue, actors.BatcherActor, actors.SchedulerActor, actors.Breaker,
        _assembly.Runtime,
    )
    actors.FairQueue = observed_queue_class(run.product.queue_class, run.queues.append)
    actors.BatcherActor = batcher_class(run.product.batcher_class, run)
    run.scheduler_class = scheduler_class(
        run.product.scheduler_class, run.replicas, lambda req: part_id(req.item["x"])
    )
    actors.SchedulerActor = run.scheduler_class
    actors.Breaker = run.product.breaker_class
    _assembly.Runtime = run.product.runtime_class
    try:
        yield
    finally:
        (
            actors.FairQueue, actors.BatcherActor, actors.SchedulerActor, actors.Breaker,
            _assembly.Runtime,
        ) = saved


def _lanes(run: Run, rt: trioserve.Runtime) -> dict[str, Any]:
    """The observed queue of each lane of the runtime's model "m"."""
    served = rt.models["m"]
    lanes = {"fast": served.scheduler.policy}
    if served.slow_scheduler is not None:
        lanes["slow"] = served.slow_scheduler.policy
    schedulers = [served.scheduler, served.slow_scheduler]
    if type(rt) is not run.product.runtime_class or not all(
        any(q is mine for mine in run.queues) for q in lanes.values()
    ) or any(s is not None and type(s) is not run.scheduler_class for s in schedulers) or any(
        type(b._breaker) is not run.product.breaker_class for b in served.batchers
    ):
        raise RuntimeError(
            "fuzz: open_runtime did not build its Runtime, its lanes' queues and schedulers "
            "or its breakers from the names fuzz/_runtime.py:product_installed replaces; "
            "update it"
        )
    return lanes


def _tasks() -> list[trio.lowlevel.Task]:
    out: list[trio.lowlevel.Task] = []
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        out.append(task)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return out


async def _play(run: Run) -> None:
    sc = run.scenario
    cfg = config_of(sc, run)
    before = {id(t) for t in _tasks()}
    done = trio.Event()
    left = len(sc.calls)

    async def caller(i: int, call: Call, rt: trioserve.Runtime, nursery: trio.Nursery) -> None:
        nonlocal left
        await trio.sleep_until(run.t0 + call.at_ms * MS)
        tenant = f"t{call.tenant}"
        cls = None if call.cls is None else f"c{call.cls}"
        inputs = [item_input(_key(i, j), it.cost) for j, it in enumerate(call.items)]
        result: Outcome | None = None
        with trio.CancelScope() as scope:
            if call.cancel_ms is not None:
                when = trio.current_time() + call.cancel_ms * MS
                if call.cancel_how == "deadline":
                    scope.deadline = when
                else:
                    nursery.start_soon(_cancel_at, scope, when)
            try:
                if len(inputs) == 1:
                    value: Any = await rt.infer("m", inputs[0], tenant=tenant, priority=cls)
                else:
                    value = await rt.infer_batch("m", inputs, tenant=tenant, priority=cls)
                result = Outcome("result", value, trio.current_time())
            except Exception as exc:
                result = Outcome("error", exc, trio.current_time())
        if scope.cancelled_caught:
            result = Outcome("cancelled", None, trio.current_time())
        assert result is not None
        run.outcomes[i] = result
        left -= 1
        if not left:
            done.set()

    async with trio.open_nursery() as callers:
        with product_installed(run):
            async with trioserve.open_runtime(cfg) as rt:
                run.lanes = _lanes(run, rt)
                run.replicas.batchers = list(rt.models["m"].batchers)
                run.t0 = trio.current_time()
                for i, call in enumerate(sc.calls):
                    for j, it in enumerate(call.items):
                        run.items[_key(i, j)] = (i, it)
                    callers.start_soon(caller, i, call, rt, callers)
                last = run.t0 + (sc.calls[-1].at_ms * MS if sc.calls else 0.0)
                if sc.shutdown_at_ms is None:
                    with trio.move_on_at(last + HORIZON_S):
                        await done.wait()
                else:
                    await trio.sleep_until(run.t0 + sc.shutdown_at_ms * MS)
                run.shutdown_at = trio.current_time()
            with trio.move_on_at(max(trio.current_time(), last) + HORIZON_S):
                await done.wait()
            run.end = trio.current_time()
            run.credits_used = dict(rt.credits_used)
            callers.cancel_scope.cancel("fuzz: the run is over")
    leaked = [t for t in _tasks() if id(t) not in before]
    if leaked:
        raise InvariantViolation(
            "leak",
            f"{len(leaked)} task(s) outlived the runtime: "
            + ", ".join(sorted(t.name for t in leaked)),
        )


async def _cancel_at(scope: trio.CancelScope, when: float) -> None:
    await trio.sleep_until(when)
    scope.cancel("fuzz: the caller gives up")


def _key(call: int, item: int) -> int:
    return call * 4 + item


def run_scenario(scenario: Scenario, product: Product = PRODUCT) -> None:
    """Play ``scenario`` against ``product`` and raise InvariantViolation on the first
    broken invariant (the queue's first, then the callers')."""
    count_example("runtime")
    run = play(scenario, product)
    check(run)


def play(scenario: Scenario, product: Product = PRODUCT) -> Run:
    """Play ``scenario`` and return what happened, unchecked. Deterministic: trio's
    scheduler is seeded as in a hypothesis example (importing hypothesis makes its
    task order depend on that seed only), so a pasted reproduction replays exactly."""
    run = Run(scenario=scenario, product=product)
    clock = trio.testing.MockClock(autojump_threshold=0)
    with deterministic_PRNG(0):
        trio.run(_play, run, clock=clock)
    return run


# ---------------------------------------------------------------- the checks
def check(run: Run) -> None:
    sc = run.scenario
    if not run.lanes:
        raise RuntimeError(
            "fuzz: open_runtime did not build its queue from trioserve.actors.FairQueue; "
            "update fuzz/_runtime.py:product_installed"
        )
    observers = run.observers
    for obs in observers:
        for feature, n in obs.exercised.items():
            note("runtime", feature, n)
    for out in run.outcomes.values():
        kind = type(out.value).__name__ if out.kind == "error" else out.kind
        note("runtime", f"outcome: {kind}")
    # Each request's batches: a hedge copy is a request of its own.
    history: dict[tuple[int, int, bool], list[Execution]] = {}
    for ex in run.executions:
        for k in ex.keys:
            history.setdefault(k, []).append(ex)
        note("runtime", f"replica batches: {ex.status}")
    note("runtime", "parts retried", sum(len(h) > 1 for h in history.values()))
    note("runtime", "oversize: items run in parts", len({p[0] for p in history if p[1]}))
    if sc.shutdown_at_ms is not None:
        note("runtime", "early shutdowns")
    run.replicas.finish()
    for obs in observers:
        obs.raise_first()
    if run.violations:
        raise InvariantViolation(*run.violations[0])
    if run.replicas.violations:
        raise InvariantViolation(*run.replicas.violations[0])
    _check_lanes(run)
    for p, runs in history.items():
        for ex in runs[:-1]:
            if ex.status != "error":
                raise InvariantViolation(
                    "duplicated",
                    f"item {p[0]} (part at {p[1]}{', hedge copy' if p[2] else ''}) ran "
                    f"again at t={runs[-1].at:.6g} after its batch at t={ex.at:.6g} ended "
                    f"{ex.status!r}: only a batch whose model raised is retried",
                )
    for i, call in enumerate(sc.calls):
        _check_call(run, i, call, history)
    _check_credits(run)


def _check_lanes(run: Run) -> None:
    """Each lane's queue took only requests of its costs; a call refused, in either
    lane, pushed nobody out of either (its lanes decide before either queues)."""
    def call_of(req: Any) -> int:
        return run.items[part_id(req.item["x"])[0]][0]

    refused = {k: (lane, req) for lane, q in run.lanes.items() for k, (_, req) in q.refused.items()}
    queued_in: dict[int, set[str]] = {}
    for lane, q in run.lanes.items():
        for t in q.observer.tracked.values():
            req = t.request
            if run.lane_of_cost(req.cost) != lane:
                raise InvariantViolation(
                    "lane",
                    f"the {lane} lane's queue took {q.observer.describe(t)} of call "
                    f"#{call_of(req)}: slow_lane_cost is {run.scenario.slow_lane_cost}",
                )
            queued_in.setdefault(id(submission(req)), set()).add(lane)
        for t, by, at in q.pushed:
            note("runtime", "push-outs")
            k = id(submission(by))
            if k in refused:
                where, req = refused[k]
                raise InvariantViolation(
                    "push-out",
                    f"{q.observer.describe(t)} was pushed out of the {lane} lane's queue at "
                    f"t={at:.6g} (answered Overloaded) for an item (cost {by.cost}) of "
                    f"{_describe(call_of(by), run.scenario.calls[call_of(by)])}, which the "
                    f"{where} lane then refused (at its item of cost {req.cost}): it was "
                    "shed for nothing",
                )
    if run.scenario.slow_lane_cost is not None:
        note("runtime", "lanes: calls queued in both", sum(len(v) > 1 for v in queued_in.values()))
        costs = (
            {run.lane_of_cost(it.cost) for it in run.scenario.calls[call_of(req)].items}
            for _, req in refused.values()
        )
        note("runtime", "lanes: refused calls with items in both", sum(len(c) > 1 for c in costs))


def _describe(i: int, call: Call) -> str:
    return (
        f"call #{i} (at {call.at_ms} ms, tenant t{call.tenant}, class "
        f"{'default' if call.cls is None else f'c{call.cls}'}, {len(call.items)} item(s))"
    )


def _check_call(
    run: Run, i: int, call: Call, history: dict[tuple[int, int, bool], list[Execution]]
) -> None:
    sc = run.scenario
    who = _describe(i, call)
    out = run.outcomes.get(i)
    keys = [_key(i, j) for j in range(len(call.items))]
    mine = {p: h for p, h in history.items() if p[0] in keys}
    if out is None:
        raise InvariantViolation(
            "lost",
            f"{who} never got an answer ({HORIZON_S:g} s of trio time after the last "
            f"arrival); its parts started on a replica: {sorted(mine)}",
        )
    arrival = run.t0 + call.at_ms * MS
    cancel_at = None if call.cancel_ms is None else arrival + call.cancel_ms * MS
    if cancel_at is not None and out.at > cancel_at + 1e-9:
        raise InvariantViolation(
            "outcome", f"{who} returned at t={out.at:.6g}, after its cancel time {cancel_at:.6g}"
        )
    if out.kind == "cancelled":
        if cancel_at is None or abs(out.at - cancel_at) > 1e-9:
            raise InvariantViolation(
                "outcome", f"{who} was cancelled at t={out.at:.6g} but nobody cancelled it then"
            )
        return
    if out.kind == "result":
        values = [out.value] if len(call.items) == 1 else list(out.value)
        if len(values) != len(call.items):
            raise InvariantViolation(
                "misrouted", f"{who} got {len(values)} results for {len(call.items)} items"
            )
        for j, (value, it) in enumerate(zip(values, call.items, strict=True)):
            want = item_input(keys[j], it.cost)
            got = np.asarray(value["y"])
            if got.shape != want.shape or not np.array_equal(got, want):
                whose = part_id(got) if got.size else None
                raise InvariantViolation(
                    "misrouted",
                    f"{who}: result {j} is not its own (expected the output of item "
                    f"{keys[j]}, got that of {whose[0] if whose else 'nothing'}"
                    f"{f' part at {whose[1]}' if whose and whose[1] else ''})",
                )
        for key in keys:
            # the item's parts, or its hedge copy, all answered by their last batch
            tries = [
                [runs for p, runs in mine.items() if p[0] == key and p[2] is copy]
                for copy in (False, True)
            ]
            if not any(t and all(r[-1].status == "ok" for r in t) for t in tries):
                ended = {
                    f"{'copy' if p[2] else 'part'} at {p[1]}": runs[-1].status
                    for p, runs in mine.items() if p[0] == key
                }
                raise InvariantViolation(
                    "outcome",
                    f"{who} got a result though no run of item {key} (nor of its hedge "
                    f"copy) ended with one: last batches {ended}",
                )
        return
    exc = out.value
    name = type(exc).__name__
    ok = False
    if isinstance(exc, ModelError):
        ok, why = _model_error_allowed(run, mine)
        if not ok:
            raise InvariantViolation("outcome", f"{who} raised {name}: {exc} — {why}")
    elif isinstance(exc, ActorBroken):
        ok = any(runs[-1].status == "crash" for runs in mine.values())
    elif isinstance(exc, DeadlineExceeded):
        timeout = _timeout_ms(sc, call)
        ok = timeout is not None and out.at >= arrival + timeout * MS - 1e-9
    elif isinstance(exc, ActorClosed):
        ok = out.at >= run.shutdown_at
    elif isinstance(exc, Overloaded):  # QuotaExceeded too
        # Refused, or pushed out of the queue: never ran, unless the call was several
        # requests (items, or the parts of a split item) of which others ran.
        split = (
            sc.oversize == "split"
            and sc.max_batch_tokens is not None
            and any(it.cost > sc.max_batch_tokens for it in call.items)
        )
        ok = len(call.items) > 1 or split or not mine
    elif isinstance(exc, InvalidInput):
        ok = (
            sc.max_batch_tokens is not None
            and sc.oversize == "reject"
            and any(it.cost > sc.max_batch_tokens for it in call.items)
        ) or (
            # more items than the queue ever holds (for this tenant): refused before
            # any of them ran
            len(call.items) > _most_queued(sc, call.tenant) and not mine
        )
    elif isinstance(exc, Forbidden):
        allowed = sc.tenants[call.tenant].classes
        ok = call.cls is not None and bool(allowed) and call.cls not in allowed
    if not ok:
        raise InvariantViolation(
            "outcome", f"{who} raised {name}: {exc} — not an outcome its situation allows"
        )


def _model_error_allowed(
    run: Run, mine: dict[tuple[int, int, bool], list[Execution]]
) -> tuple[bool, str]:
    """A ModelError reaches a caller only from a request that raised alone (a
    failed batch of several is split and retried), and only for an input that
    raises (poison) or on a replica broken then: a sound input in a fresh batch of
    its own there, a part with no other ready replica of its lane to run it, or one
    that raised alone on two replicas. A part of a failed batch that raised alone on
    a replica while another was ready runs once elsewhere instead."""
    why = "no request of it raised alone (a failed batch of several is retried in parts)"
    for p, runs in mine.items():
        last = runs[-1]
        if last.status != "error" or len(last.parts) != 1:
            continue
        poison = run.fault(p[0]) == "error"
        if last.marked:
            why = (
                f"item {p[0]} (part at {p[1]}) raised alone as a retry on replica "
                f"{last.replica} at t={last.at:.6g} while another replica was ready: it "
                "runs once elsewhere, not answered that replica's error"
            )
            continue
        if poison or last.broken:
            how = "fresh, alone"
            if last.retried[0]:
                how = "a part, raised alone elsewhere too" if any(
                    ex.marked for ex in runs
                ) else "a part, no other replica ready"
            note(
                "runtime",
                "ModelError: poison items" if poison else
                f"ModelError: sound items on a broken replica ({how})",
            )
            return True, ""
        why = f"item {p[0]} does not raise and replica {last.replica} was not broken"
    return False, why


def _most_queued(sc: Scenario, tenant: int) -> int:
    share = sc.tenants[tenant].queue_share
    if share >= 1.0:
        return sc.queue_bound
    return max(1, int(share * sc.queue_bound))


def _timeout_ms(sc: Scenario, call: Call) -> float | None:
    tenant = sc.tenants[call.tenant]
    cls = call.cls
    if cls is None:
        cls = min(tenant.classes) if tenant.classes else 0
    options = [t for t in (sc.timeout_ms, sc.classes[cls].timeout_ms) if t is not None]
    return min(options) if options else None


def _check_credits(run: Run) -> None:
    """A tenant with credits is admitted at most its burst, plus its rate over the run,
    plus one payment's worth of debt (a call pays for all its items at once, and a
    payment may leave the bucket negative)."""
    sc = run.scenario
    max_cost = max((sum(it.cost for it in c.items) for c in sc.calls), default=0)
    for i, t in enumerate(sc.tenants):
        if t.credit_rate is None:
            continue
        burst = t.credit_burst if t.credit_burst is not None else t.credit_rate
        used = run.credits_used.get(f"t{i}", 0)
        envelope = burst + t.credit_rate * (run.end - run.t0) + max_cost
        if used > envelope + 1e-6:
            raise InvariantViolation(
                "credits",
                f"tenant t{i} (rate {t.credit_rate:g}/s, burst {burst:g}) was admitted "
                f"{used:g} cost units in {run.end - run.t0:.6g}s, over its envelope "
                f"{envelope:.6g} (burst + rate x elapsed + one payment's debt)",
            )
