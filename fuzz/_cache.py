"""Suite ``cache``: the result cache and in-flight coalescing, through ``open_runtime``
under MockClock.

A :class:`CacheScenario` is a script: the cache (a small capacity in bytes, so entries
are evicted; its policy; an optional per-tenant quota), one to three models, each
cached or not, shareable between tenants or not, with or without a TTL and coalescing,
per-key model latencies, keys whose first runs raise, and a list of calls (arrival,
tenant, class, model, the keys asked, ``infer`` or ``infer_batch``, a cancellation by
deadline or by ``cancel()``) and of invalidations (``rt.invalidate_cache(model)``: new
weights under the same version). Every caller asks for keys of a small set, so hits,
misses and joined flights all happen.

The model answers ``[model, key, generation, tenant, run]``: the key asked, the
generation of the weights it ran with (the suite bumps it at each invalidation), the
tenant of the request that computed it and the number of the model run, so an answer
says where it came from. A model runs inline, or off the event loop
(``ModelRule.running``: a :class:`CacheWorker`, a worker process in trio time, the
runtime's watchdog answering a request's deadline while its batch runs, so a
flight's waiters may be answered by the late answer of their driver's batch). Such a
model meets the faults of real deployments: its batches are cut off (``cut_off``),
keys straggle past the cut-off or kill their worker, its workers hold several
batches, and its replicas' breakers open and close within the scenario; every batch
a replica takes is recorded (:class:`Dispatched`: its requests, how it left), and
the outcomes those faults give (a poison request's ModelError, a late outcome of a
batch that failed) are accepted only as that record allows.
:func:`run_cache_scenario` plays the script and checks:

- each answer is the model's, for the caller's own model and key, from a run that
  computed it (``misrouted``);
- a model that is not shareable never answers one tenant with another's computation
  (``isolation``);
- an answer computed before an invalidation never reaches a caller that started after
  it, from the cache or by joining a flight, and none is kept after it (``freshness``);
- no hit is served at or after its entry's expiry: kept at t, expired at t + TTL (``ttl``);
- a ModelError reaches only callers that were there when the run raised: an error is
  never kept (``cached-error``);
- every caller gets one outcome, one its situation allows: a caller that left
  cancels nothing others wait for; a poison request's ModelError only after a request
  of its key failed alone ``POISON_ATTEMPTS`` times (cut off, or its worker dead);
  a late outcome exactly as the driver's batch leaves its replica (``outcome``,
  ``lost``);
- bytes used never exceed the capacity nor a tenant its quota, and the resident
  entries add up to them (``memory``); the counters agree with what the cache was
  asked (``statistics``);
- no task outlives the runtime (``leak``).

Time is counted in ticks of 2**-10 s: sums of ticks are exact in binary floating point,
so an entry kept at t with a TTL of n ticks expires at the very instant a caller
arriving n ticks later looks it up (a TTL compared at the wrong instant shows).

The scenario and its strategies are in ``fuzz/_cache_scenario.py``, the model and the
simulated devices in ``fuzz/_cache_model.py``, the checks of a played scenario in
``fuzz/_cache_checks.py``; this module plays one through
``open_runtime`` (:func:`play_cache`, :func:`run_cache_scenario`).
"""

from __future__ import annotations

import contextlib
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

from ._cache_checks import GEN, KEY, MODEL, RUN, check_cache
from ._cache_flights import ASK, FlightRecord, observed_flights
from ._cache_model import Dispatched, KeyModel, ModelRun, device_class
from ._cache_scenario import HORIZON_S, TICK, Ask, CacheScenario, Invalidate
from ._cache_scenario import cache_scenarios as cache_scenarios
from ._checker import InvariantViolation
from ._driven import NoZygote, watchdog_class
from ._product import PRODUCT, Product
from ._runtime import Outcome, _cancel_at, _tasks, leaked_since, replay
from ._stats import count_example, expect, note

#: A request that failed alone this many times (cut off, or its worker died) is
#: poison: answered ModelError, not retried (the models' ``poison_attempts``).
POISON_ATTEMPTS = 2

# The faults of the models off the event loop, shown in the summary even when a run
# meets none.
expect(
    "cache",
    "straggling batches",
    "batches cut off",
    "workers died running a batch",
    "batches handed back as they were",
    "breakers opened",
    "workers replaced (their breaker opened)",
    "late outcomes of a batch that failed",
    "callers answered as poison requests",
)

# ---------------------------------------------------------------- observing the cache
@attrs.frozen(kw_only=True)
class Kept:
    """An answer the cache accepted: when, until when (by the model's rule), and its
    run."""

    value: Any
    at: float
    expires: float
    gen: int
    run: int


def observed_cache_class(base: type, run: CacheRun) -> type:
    """``base`` (the product's Cache or a planted bug) reporting every lookup and every
    answer it keeps."""

    class ObservedCache(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            run.caches.append(self)
            inner = self.get

            def get(key: Any, now: float, default: Any = None) -> Any:
                value = inner(key, now, default)
                run.looked_up(key, now, value is not default and value is not None, value)
                return value

            self.get = get

        def put(self, key: Any, value: Any, *, size: int, now: float,
                tenant: str | None = None) -> bool:
            ok = super().put(key, value, size=size, now=now, tenant=tenant)
            run.kept_or_refused(self, key, value, now, ok)
            return ok

    ObservedCache.__name__ = ObservedCache.__qualname__ = f"Observed{base.__name__}"
    return ObservedCache


def observed_actor_class(base: type, run: CacheRun) -> type:
    """``base`` (the product's CacheActor or a planted bug) telling the suite whether a
    lookup comes from a single request (which may go on to a flight) or a batch, what
    its flights do (:func:`observed_flights`) and how many items a batch computes."""

    class ObservedCacheActor(base):  # type: ignore[misc, valid-type]
        _flights = observed_flights(base, run)

        async def answer(self, *args: Any, **kw: Any) -> Any:
            # The lookup happens before the first checkpoint of ``answer``, so no
            # other task changes ``mode`` in between.
            run.mode = "single"
            run.single_calls += 1
            return await super().answer(*args, **kw)

        async def answer_many(
            self, model: str, version: str, tenant: str, items: Any, compute: Any
        ) -> Any:
            run.mode = "batch"
            i = ASK.get()

            def counted(idx: list[int]) -> Any:
                run.batch_charges[i] = run.batch_charges.get(i, 0) + len(idx)
                return compute(idx)

            return await super().answer_many(model, version, tenant, items, counted)

    return ObservedCacheActor


# ---------------------------------------------------------------- one run
@attrs.define(eq=False)
class CacheRun:
    scenario: CacheScenario
    product: Product
    gen: list[int] = attrs.Factory(list)
    runs: list[ModelRun] = attrs.Factory(list)
    dispatched: list[Dispatched] = attrs.Factory(list)
    tries: dict[tuple[int, int], int] = attrs.Factory(dict)
    current: tuple[float, int, list[tuple[int, str]], Dispatched | None] | None = None
    started: dict[int, tuple[float, int]] = attrs.Factory(dict)  # ask -> (time, generation)
    outcomes: dict[int, Outcome] = attrs.Factory(dict)
    violations: list[tuple[str, str]] = attrs.Factory(list)
    caches: list[Any] = attrs.Factory(list)
    kept: dict[Any, Kept] = attrs.Factory(dict)
    lookups: int = 0
    hits: int = 0
    mode: str = ""
    single_calls: int = 0
    single_hits: int = 0
    hit_asks: set[int] = attrs.Factory(set)
    flights: dict[str, int] = attrs.Factory(dict)  # the final flight statistics
    #: what the flights did (fuzz/_cache_flights.py): each flight, and per caller
    #: that went to one its flight and the deadline it brought
    flight_records: list[FlightRecord] = attrs.Factory(list)
    flight_calls: dict[int, tuple[FlightRecord | None, float]] = attrs.Factory(dict)
    flights_unobserved: bool = False
    #: items a batch call (``answer_many``) computed, by ask; units charged by tenant
    batch_charges: dict[int, int] = attrs.Factory(dict)
    charged: dict[str, float] = attrs.Factory(dict)
    #: with a ``running`` model: the runtime's watchdog, on trio's clock
    watchdog: Any = None
    t0: float = 0.0
    #: batches on a worker per (model, key) so far: which straggle, which kill it
    staged: dict[tuple[int, int], int] = attrs.Factory(dict)
    deaths: dict[tuple[int, int], int] = attrs.Factory(dict)
    #: the runtime is closing (every caller is back): what it cuts off is no fault
    closing: bool = False
    closed_at: float = math.inf
    #: the replicas' breakers, as the runtime built them
    breakers: list[Any] = attrs.Factory(list)

    def __attrs_post_init__(self) -> None:
        self.gen = [0] * len(self.scenario.models)

    def at(self, t: float) -> str:
        """A time as ticks since the start."""
        return f"tick {(t - self.t0) / TICK:g}"

    # ------------------------------------------------------------ the cache's reports
    def looked_up(self, key: Any, now: float, hit: bool, value: Any) -> None:
        self.lookups += 1
        if not hit:
            return
        self.hits += 1
        if self.mode == "single":
            self.hit_asks.add(ASK.get())
        if self.mode == "single":
            self.single_hits += 1
        kept = self.kept.get(key)
        if kept is None or kept.value is not value:
            self.violations.append(
                (
                    "statistics",
                    f"at {self.at(now)} a lookup of model {key.model} (namespace "
                    f"{key.namespace!r}) hit a value the cache never kept under that key",
                )
            )
            return
        if now >= kept.expires:
            self.violations.append(
                (
                    "ttl",
                    f"at {self.at(now)} a lookup of model {key.model} (namespace "
                    f"{key.namespace!r}) hit the answer of run {kept.run}, kept at "
                    f"{self.at(kept.at)} with a TTL of "
                    f"{self.ttl_ticks(key.model)} ticks: it expired at {self.at(kept.expires)}",
                )
            )

    def kept_or_refused(self, cache: Any, key: Any, value: Any, now: float, ok: bool) -> None:
        self.kept.pop(key, None)
        y = np.asarray(value["y"]) if isinstance(value, dict) and "y" in value else None
        if y is None or y.shape != (5,):
            self.violations.append(("misrouted", f"the cache was offered {value!r}"))
            return
        m, r, g = int(y[MODEL]), int(y[RUN]), int(y[GEN])
        if ok:
            ttl = self.scenario.models[m].ttl
            self.kept[key] = Kept(
                value=value, at=now, expires=math.inf if ttl is None else now + ttl * TICK,
                gen=g, run=r,
            )
            if g != self.gen[m]:
                self.violations.append(
                    (
                        "freshness",
                        f"at {self.at(now)} the cache kept the answer of run {r} (key "
                        f"{int(y[KEY])} of m{m}), computed with generation {g} of the "
                        f"weights, though m{m} was invalidated since (generation "
                        f"{self.gen[m]}): it would be served after its invalidation",
                    )
                )
        self.check_bytes(cache, now)

    def ttl_ticks(self, model: str) -> str:
        ttl = self.scenario.models[int(model[1:])].ttl
        return "no" if ttl is None else str(ttl)

    # ------------------------------------------------------------ cheap checks
    def check_bytes(self, cache: Any, now: float) -> None:
        sc = self.scenario
        s = cache.statistics()
        if s.bytes_used > sc.capacity:
            self.violations.append(
                (
                    "memory",
                    f"at {self.at(now)} the cache holds {s.bytes_used} bytes, over its "
                    f"capacity of {sc.capacity}",
                )
            )
        sizes = sum(e.size for e in cache.policy._data.values())
        if s.bytes_used != sizes or s.entries != len(cache):
            self.violations.append(
                (
                    "memory",
                    f"at {self.at(now)} the cache counts {s.bytes_used} bytes in "
                    f"{s.entries} entries, but its {len(cache)} resident entries hold {sizes}",
                )
            )
        if sc.quota is not None:
            for t in range(sc.tenants):
                held = cache.tenant_bytes(f"t{t}")
                if held > sc.quota:
                    self.violations.append(
                        (
                            "memory",
                            f"at {self.at(now)} tenant t{t} holds {held} bytes of the "
                            f"cache, over its quota of {sc.quota}",
                        )
                    )

    def check_statistics(self, rt: trioserve.Runtime, now: float) -> None:
        """``rt.cache_statistics()`` against what the suite saw the cache asked."""
        if not self.caches:
            return
        s = rt.cache_statistics()
        self.check_bytes(self.caches[0], now)
        if "hits" not in s:  # no model goes through the cache actor
            return
        if s["hits"] != self.hits or s["misses"] != self.lookups - self.hits:
            self.violations.append(
                (
                    "statistics",
                    f"at {self.at(now)} the cache reports {s['hits']} hits and "
                    f"{s['misses']} misses; it was looked up {self.lookups} times and "
                    f"returned a value {self.hits} times",
                )
            )


def config_of(sc: CacheScenario, run: CacheRun) -> trioserve.Config:
    models = tuple(
        trioserve.ModelConfig(
            name=f"m{j}",
            backend=KeyModel(run, j),
            replicas=sc.replicas,
            max_batch_size=sc.max_batch_size,
            max_wait_ms=0,
            timeout_ms=None if rule.timeout is None else rule.timeout * TICK * 1e3,
            execution="process" if rule.running else "inline",
            # (on a worker: a batch is cut off at cut_off, whatever the batches
            # before took)
            batch_timeout_floor_ms=1000.0 if sc.cut_off is None else sc.cut_off * TICK * 1e3,
            batch_timeout_cap_ms=1000.0 if sc.cut_off is None else sc.cut_off * TICK * 1e3,
            poison_attempts=POISON_ATTEMPTS,
            adaptive_limit=False,
            cache=rule.cache,
            # (with the cache off these do nothing, and are refused)
            cache_ttl_s=None if rule.ttl is None or not rule.cache else rule.ttl * TICK,
            cache_shared=rule.shared and rule.cache,
            coalesce=rule.coalesce,
        )
        for j, rule in enumerate(sc.models)
    )
    return trioserve.Config(
        models=models,
        tenants=tuple(
            trioserve.TenantConfig(name=f"t{i}", default=i == 0) for i in range(sc.tenants)
        ),
        classes=tuple(
            trioserve.ClassConfig(
                name=f"c{i}", timeout_ms=None if t is None else t * TICK * 1e3
            )
            for i, t in enumerate(_class_timeouts(sc))
        ),
        runtime=trioserve.RuntimeLimits(queue_bound=256, graceful_timeout_s=1.0),
        cache=trioserve.CacheConfig(
            capacity_bytes=sc.capacity, policy=sc.policy, tenant_quota_bytes=sc.quota
        ),
    )


def _class_timeouts(sc: CacheScenario) -> list[int | None]:
    given = list(sc.class_timeouts[: sc.classes])
    return given + [None] * (sc.classes - len(given))


@contextlib.contextmanager
def product_installed(run: CacheRun) -> Iterator[None]:
    """open_runtime builds its batchers, cache and cache actor from ``trioserve.actors``:
    point those names at the simulated and observed classes while it starts (with a
    ``running`` model, its watchdog on trio's clock and no zygote, as the runtime
    suite's)."""
    actors = trioserve.actors
    saved = (
        actors.BatcherActor, actors.Cache, actors.CacheActor, actors.Watchdog,
        _assembly.Zygote, actors.Breaker,
    )
    actors.BatcherActor = device_class(run.product.batcher_class, run)
    actors.Breaker = breaker_class(run.product.breaker_class, run)
    actors.Cache = observed_cache_class(run.product.cache_class, run)
    actors.CacheActor = observed_actor_class(run.product.cache_actor_class, run)
    if _running(run.scenario):
        actors.Watchdog = watchdog_class(run)
        _assembly.Zygote = NoZygote
    try:
        yield
    finally:
        (
            actors.BatcherActor, actors.Cache, actors.CacheActor, actors.Watchdog,
            _assembly.Zygote, actors.Breaker,
        ) = saved


def breaker_class(base: type, run: CacheRun) -> type:
    """The product's breaker (``base``) with the scenario's threshold and cooldown
    (``CacheScenario.breaker``; the product's own without one), counting how often
    it opens."""
    conf = run.scenario.breaker

    class ScenarioBreaker(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kw: Any) -> None:
            if conf is not None:
                threshold, cooldown = conf
                kw.setdefault("threshold", threshold)
                kw.setdefault("cooldown", cooldown * TICK)
                kw.setdefault("max_cooldown", 8 * cooldown * TICK)
            super().__init__(**kw)
            run.breakers.append(self)

        def failure(self, now: float) -> None:
            was = self.open_until
            super().failure(now)
            if self.open_until != was:
                note("cache", "breakers opened")

    ScenarioBreaker.__name__ = ScenarioBreaker.__qualname__ = f"Scenario{base.__name__}"
    return ScenarioBreaker


def _running(sc: CacheScenario) -> bool:
    return any(rule.running for rule in sc.models)


def _x(key: int) -> np.ndarray:
    return np.array([float(key)])


async def _play(run: CacheRun) -> None:
    sc = run.scenario
    before = {id(t) for t in _tasks()}
    left = len(sc.asks) + len(sc.invalidations)
    done = trio.Event()

    def finished() -> None:
        nonlocal left
        left -= 1
        if not left:
            done.set()

    async def caller(i: int, ask: Ask, rt: trioserve.Runtime, nursery: trio.Nursery) -> None:
        await trio.sleep_until(run.t0 + ask.at * TICK)
        run.check_statistics(rt, trio.current_time())
        ASK.set(i)
        inputs = [_x(k) for k in ask.keys]
        kw = {"tenant": f"t{ask.tenant}", "priority": f"c{ask.cls}"}
        result: Outcome | None = None
        with trio.CancelScope() as scope:
            if ask.cancel is not None:
                when = trio.current_time() + ask.cancel * TICK
                if ask.cancel_how == "deadline":
                    scope.deadline = when
                else:
                    nursery.start_soon(_cancel_at, scope, when)
            run.started[i] = (trio.current_time(), run.gen[ask.model])
            try:
                if ask.batch or len(inputs) > 1:
                    value: Any = await rt.infer_batch(f"m{ask.model}", inputs, **kw)
                else:
                    value = [await rt.infer(f"m{ask.model}", inputs[0], **kw)]
                result = Outcome("result", value, trio.current_time())
            except Exception as exc:
                result = Outcome("error", exc, trio.current_time())
        if scope.cancelled_caught:
            result = Outcome("cancelled", None, trio.current_time())
        assert result is not None
        if i in run.outcomes:
            run.violations.append(("duplicated", f"ask #{i} returned twice"))
        run.outcomes[i] = result
        finished()

    async def invalidator(inv: Invalidate, rt: trioserve.Runtime) -> None:
        await trio.sleep_until(run.t0 + inv.at * TICK)
        _invalidate(run, rt, inv)
        finished()

    async with trio.open_nursery() as callers:
        with product_installed(run):
            async with trioserve.open_runtime(config_of(sc, run)) as rt:
                if _running(sc):
                    note("cache", "scenarios with a model off the loop")
                    callers.start_soon(run.watchdog.drive)
                run.t0 = trio.current_time()
                for i, ask in enumerate(sc.asks):
                    callers.start_soon(caller, i, ask, rt, callers)
                for inv in sc.invalidations:
                    callers.start_soon(invalidator, inv, rt)
                last = max([a.at for a in sc.asks] + [v.at for v in sc.invalidations] + [0])
                with trio.move_on_at(run.t0 + last * TICK + HORIZON_S):
                    await done.wait()
                await trio.testing.wait_all_tasks_blocked()
                now = trio.current_time()
                run.check_statistics(rt, now)
                _check_flights(run, rt, now)
                run.charged = {
                    t: rt.credits_used.get(t, 0) + rt.credits_refunded.get(t, 0)
                    for t in rt.credits_used.keys() | rt.credits_refunded.keys()
                }
                run.closing, run.closed_at = True, trio.current_time()
            callers.cancel_scope.cancel("fuzz: the run is over")
    if (leak := leaked_since(before)) is not None:
        raise InvariantViolation("leak", leak)
    if run.watchdog is not None and run.watchdog.live():
        raise InvariantViolation(
            "leak",
            f"{run.watchdog.live()} deadline(s) stayed armed with the watchdog after the "
            "runtime closed: a batch's deadlines are disarmed as it leaves its replica",
        )


def _invalidate(run: CacheRun, rt: trioserve.Runtime, inv: Invalidate) -> None:
    """New weights for the model, and the cache told: every entry of the model goes."""
    name = f"m{inv.model}"
    now = trio.current_time()
    cache = run.caches[0] if run.caches else None
    resident = [k for k in cache.policy if k.model == name] if cache is not None else []
    before = cache.statistics().invalidations if cache is not None else 0
    run.gen[inv.model] += 1
    n = rt.invalidate_cache(name)
    if cache is None:
        return
    left = [k for k in cache.policy if k.model == name]
    counted = cache.statistics().invalidations - before
    if left or n != len(resident) or counted != n:
        run.violations.append(
            (
                "freshness" if left else "statistics",
                f"at {run.at(now)} invalidate_cache({name!r}) returned {n}, counted "
                f"{counted}; {len(resident)} entries of {name} were resident before it, "
                f"{len(left)} after",
            )
        )


def _check_flights(run: CacheRun, rt: trioserve.Runtime, now: float) -> None:
    """Every single request the cache did not answer went to a flight: it started one
    or joined one; none is left in flight once every caller is back."""
    s = rt.cache_statistics()
    if "computations" not in s:
        return
    run.flights = {
        k: s[k] for k in ("computations", "coalesced", "in_flight", "reruns", "late_answers")
    }
    flights = run.single_calls - run.single_hits
    if s["computations"] + s["coalesced"] != flights or s["in_flight"]:
        run.violations.append(
            (
                "statistics",
                f"at {run.at(now)}, every caller back: {s['computations']} computations "
                f"started and {s['coalesced']} joined, {s['in_flight']} still in flight; "
                f"{run.single_calls} single requests, {run.single_hits} of them hits, so "
                f"{flights} flight calls",
            )
        )


def run_cache_scenario(scenario: CacheScenario, product: Product = PRODUCT) -> None:
    """Play ``scenario`` against ``product``; raise InvariantViolation on the first
    broken invariant."""
    count_example("cache")
    run = play_cache(scenario, product)
    check_cache(run)


def play_cache(scenario: CacheScenario, product: Product = PRODUCT) -> CacheRun:
    """Play ``scenario`` and return what happened, unchecked. Deterministic (trio's
    scheduler seeded as in a hypothesis example)."""
    return replay(_play, CacheRun(scenario=scenario, product=product))
