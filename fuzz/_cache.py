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
says where it came from. :func:`run_cache_scenario` plays the script and checks:

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
  cancels nothing others wait for (``outcome``, ``lost``);
- bytes used never exceed the capacity nor a tenant its quota, and the resident
  entries add up to them (``memory``); the counters agree with what the cache was
  asked (``statistics``);
- no task outlives the runtime (``leak``).

Time is counted in ticks of 2**-10 s: sums of ticks are exact in binary floating point,
so an entry kept at t with a TTL of n ticks expires at the very instant a caller
arriving n ticks later looks it up (a TTL compared at the wrong instant shows).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing
import trioserve
import trioserve.actors
from hypothesis import strategies as st
from hypothesis.internal.entropy import deterministic_PRNG
from trioserve import ModelBackend, ModelError, Overloaded, TensorSpec

from ._checker import InvariantViolation
from ._product import PRODUCT, Product
from ._runtime import Outcome, _tasks
from ._stats import count_example, note

#: One tick of scenario time: a power of two, so every sum of ticks is exact.
TICK = 2.0**-10
#: How long after the last event a caller may take before it counts as lost.
HORIZON_S = 3600.0
#: The keys callers ask for: few, so that answers repeat.
KEYS = 4
#: The fields of an answer ``y``.
MODEL, KEY, GEN, TENANT, RUN = range(5)


# ---------------------------------------------------------------- the script
@attrs.frozen(kw_only=True)
class ModelRule:
    """One model's cache settings: ``cache`` (its results are kept), ``shared`` (one
    namespace for every tenant), ``ttl`` (ticks; None: no expiry), ``coalesce``
    (identical requests in flight are joined even when nothing is kept)."""

    cache: bool = True
    shared: bool = False
    ttl: int | None = None
    coalesce: bool = False


@attrs.frozen(kw_only=True)
class Ask:
    """A caller arriving at ``at`` (ticks): ``keys`` of model ``model``, by ``infer``
    (one key, ``batch`` False) or ``infer_batch``. ``cancel`` (ticks after arrival):
    "deadline" sets its cancel scope's deadline, "cancel" calls ``scope.cancel()``."""

    at: int = 0
    tenant: int = 0
    cls: int = 0
    model: int = 0
    keys: tuple[int, ...] = (0,)
    batch: bool = False
    cancel: int | None = None
    cancel_how: str = "deadline"


@attrs.frozen(kw_only=True)
class Invalidate:
    """``rt.invalidate_cache(model)`` at ``at`` (ticks): the model's weights change."""

    at: int = 0
    model: int = 0


@attrs.frozen(kw_only=True)
class CacheScenario:
    capacity: int = 1200
    policy: str = "tinylfu"
    quota: int | None = None
    replicas: int = 1
    max_batch_size: int = 2
    tenants: int = 2
    classes: int = 1
    models: tuple[ModelRule, ...] = (ModelRule(),)
    #: per key: the model's latency on it (ticks); a batch takes its slowest item's
    latency: tuple[int, ...] = (0,) * KEYS
    #: per key: how many of its first runs (per model) raise
    flaky: tuple[int, ...] = (0,) * KEYS
    asks: tuple[Ask, ...] = ()
    invalidations: tuple[Invalidate, ...] = ()


# ---------------------------------------------------------------- strategies
# Built once, never inside a draw (as in fuzz/_runtime.py: a fresh strategy object is
# validated again on its first draw); the draws, and so a seed's examples, are the
# same either way.
_GAP = st.sampled_from([0, 0, 1, 1, 2, 3, 4, 4, 8, 32])
_KEY = st.sampled_from([0, 0, 0, 0, 1, 1, 2, 3])
_LATENCY = st.sampled_from([0, 0, 1, 2, 4, 8])
_FLAKY = st.sampled_from([0, 0, 0, 0, 1, 2])
_N_MODELS = st.sampled_from([1, 1, 2, 3])
_N_TENANTS = st.sampled_from([1, 2, 2, 3])
_N_CLASSES = st.sampled_from([1, 1, 2])
_CACHED = st.sampled_from([True, True, True, False])
_TTL = st.sampled_from([None, None, 1, 2, 4, 8, 32])
_KEYS = st.tuples(_KEY) | st.lists(_KEY, min_size=1, max_size=4).map(tuple)
_BATCH = st.sampled_from([False, False, True])
_CANCEL = st.none() | st.none() | st.sampled_from([0, 1, 2, 4, 16])
_CANCEL_HOW = st.sampled_from(["deadline", "cancel"])
_CAPACITY = st.sampled_from([300, 600, 1200, 2400, 100_000])
_POLICY = st.sampled_from(["tinylfu", "lru"])
_QUOTA = st.sampled_from([None, None, None, 300, 600])
_LATENCIES = st.lists(_LATENCY, min_size=KEYS, max_size=KEYS)
_FLAKIES = st.lists(_FLAKY, min_size=KEYS, max_size=KEYS)


@functools.cache
def _events(n_models: int, n_tenants: int, n_classes: int) -> st.SearchStrategy[list[Any]]:
    """A scenario's asks and invalidations, their ``at`` the gap after the previous."""
    ask = st.builds(
        Ask,
        at=_GAP,
        tenant=st.integers(0, n_tenants - 1),
        cls=st.integers(0, n_classes - 1),
        model=st.integers(0, n_models - 1),
        keys=_KEYS,
        batch=_BATCH,
        cancel=_CANCEL,
        cancel_how=_CANCEL_HOW,
    )
    invalidate = st.builds(Invalidate, at=_GAP, model=st.integers(0, n_models - 1))
    return st.lists(ask | ask | ask | ask | invalidate, min_size=10, max_size=30)


@st.composite
def cache_scenarios(draw: st.DrawFn) -> CacheScenario:
    n_models = draw(_N_MODELS)
    n_tenants = draw(_N_TENANTS)
    n_classes = draw(_N_CLASSES)
    models = tuple(
        ModelRule(
            cache=draw(_CACHED),
            shared=draw(st.booleans()),
            ttl=draw(_TTL),
            coalesce=draw(st.booleans()),
        )
        for _ in range(n_models)
    )
    events = draw(_events(n_models, n_tenants, n_classes))
    at, asks, invalidations = 0, [], []
    for e in events:  # times accumulate the gaps
        at += e.at
        (asks if isinstance(e, Ask) else invalidations).append(attrs.evolve(e, at=at))
    return CacheScenario(
        capacity=draw(_CAPACITY),
        policy=draw(_POLICY),
        quota=draw(_QUOTA),
        replicas=draw(st.integers(1, 2)),
        max_batch_size=draw(st.integers(1, 4)),
        tenants=n_tenants,
        classes=n_classes,
        models=models,
        latency=tuple(draw(_LATENCIES)),
        flaky=tuple(draw(_FLAKIES)),
        asks=tuple(asks),
        invalidations=tuple(invalidations),
    )


# ---------------------------------------------------------------- the model
X = TensorSpec(name="x", datatype="FP64", shape=(-1,))
Y = TensorSpec(name="y", datatype="FP64", shape=(-1,))


@attrs.define(eq=False)
class ModelRun:
    """One batch a model ran: when it started (and read its weights) and ended, which
    items ((key, tenant, class) each), the generation of its weights, and how it ended
    ("ok" or "error")."""

    number: int
    model: int
    at: float
    end: float
    gen: int
    items: list[tuple[int, int, str]]
    status: str = "ok"


class KeyModel(ModelBackend):
    """Answers ``[model, key, generation, tenant, run]`` per item; raises on a batch
    holding a key within its first ``flaky[key]`` runs. Runs inline."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "inline"

    def __init__(self, run: CacheRun, index: int) -> None:
        self._run = run
        self._index = index

    def load(self, device: str, *, torch_threads: int = 1) -> Any:
        run, m = self._run, self._index

        def forward(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
            started = run.current
            run.current = None
            keys = [int(it["x"][0]) for it in items]
            if started is None or len(started[2]) != len(keys):
                run.violations.append(
                    ("duplicated", f"model m{m} ran keys {keys} outside a batch a replica started")
                )
                started = (trio.current_time(), run.gen[m], [(0, "?")] * len(keys))
            at, gen, who = started
            ex = ModelRun(
                number=len(run.runs),
                model=m,
                at=at,
                end=trio.current_time(),
                gen=gen,
                items=[(k, t, c) for k, (t, c) in zip(keys, who, strict=True)],
            )
            run.runs.append(ex)
            bad = []
            for k in keys:
                n = run.tries[m, k] = run.tries.get((m, k), 0) + 1
                if n <= run.scenario.flaky[k]:
                    bad.append(k)
            if bad:
                ex.status = "error"
                raise ValueError(f"planted model error on key {bad[0]} (run {ex.number})")
            return [
                {"y": np.array([m, k, ex.gen, t, ex.number], dtype=np.float64)}
                for k, (t, _) in zip(keys, who, strict=True)
            ]

        return forward


def device_class(base: type, run: CacheRun) -> type:
    """The product's batcher on a simulated device: a batch first takes its slowest
    key's latency in trio time; the model then learns whose requests it runs."""

    class SimulatedDevice(base):  # type: ignore[misc, valid-type]
        async def _execute(self, batch: list[Any]) -> None:
            keys = [int(req.item["x"][0]) for req in batch]
            at, gen = trio.current_time(), run.gen[self._m]
            latency = max(run.scenario.latency[k] for k in keys)
            if latency:
                await trio.sleep(latency * TICK)
            run.current = (at, gen, [(int(req.tenant[1:]), req.priority) for req in batch])
            await super()._execute(batch)

        @property
        def _m(self) -> int:
            return int(self.model[1:])

    return SimulatedDevice


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
    lookup comes from a single request (which may go on to a flight) or a batch."""

    class ObservedCacheActor(base):  # type: ignore[misc, valid-type]
        async def answer(self, *args: Any, **kw: Any) -> Any:
            # The lookup happens before the first checkpoint of ``answer``, so no
            # other task changes ``mode`` in between.
            run.mode = "single"
            run.single_calls += 1
            return await super().answer(*args, **kw)

        async def answer_many(self, *args: Any, **kw: Any) -> Any:
            run.mode = "batch"
            return await super().answer_many(*args, **kw)

    return ObservedCacheActor


# ---------------------------------------------------------------- one run
@attrs.define(eq=False)
class CacheRun:
    scenario: CacheScenario
    product: Product
    gen: list[int] = attrs.Factory(list)
    runs: list[ModelRun] = attrs.Factory(list)
    tries: dict[tuple[int, int], int] = attrs.Factory(dict)
    current: tuple[float, int, list[tuple[int, str]]] | None = None
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
    flights: dict[str, int] = attrs.Factory(dict)  # the final flight statistics
    t0: float = 0.0

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
            timeout_ms=None,
            execution="inline",
            adaptive_limit=False,
            cache=rule.cache,
            cache_ttl_s=None if rule.ttl is None else rule.ttl * TICK,
            cache_shared=rule.shared,
            coalesce=rule.coalesce,
        )
        for j, rule in enumerate(sc.models)
    )
    return trioserve.Config(
        models=models,
        tenants=tuple(
            trioserve.TenantConfig(name=f"t{i}", default=i == 0) for i in range(sc.tenants)
        ),
        classes=tuple(trioserve.ClassConfig(name=f"c{i}") for i in range(sc.classes)),
        runtime=trioserve.RuntimeLimits(queue_bound=256, graceful_timeout_s=1.0),
        cache=trioserve.CacheConfig(
            capacity_bytes=sc.capacity, policy=sc.policy, tenant_quota_bytes=sc.quota
        ),
    )


@contextlib.contextmanager
def product_installed(run: CacheRun) -> Iterator[None]:
    """open_runtime builds its batchers, cache and cache actor from ``trioserve.actors``:
    point those names at the simulated and observed classes while it starts."""
    actors = trioserve.actors
    saved = actors.BatcherActor, actors.Cache, actors.CacheActor
    actors.BatcherActor = device_class(run.product.batcher_class, run)
    actors.Cache = observed_cache_class(run.product.cache_class, run)
    actors.CacheActor = observed_actor_class(run.product.cache_actor_class, run)
    try:
        yield
    finally:
        actors.BatcherActor, actors.Cache, actors.CacheActor = saved


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
    run.flights = {k: s[k] for k in ("computations", "coalesced", "in_flight")}
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
    run = CacheRun(scenario=scenario, product=product)
    clock = trio.testing.MockClock(autojump_threshold=0)
    with deterministic_PRNG(0):
        trio.run(_play, run, clock=clock)
    return run


# ---------------------------------------------------------------- the checks
def check_cache(run: CacheRun) -> None:
    sc = run.scenario
    if not run.caches:
        raise RuntimeError(
            "fuzz: open_runtime did not build its cache from trioserve.actors.Cache; "
            "update fuzz/_cache.py:product_installed"
        )
    s = run.caches[0].statistics()
    note("cache", "hits", s.hits)
    note("cache", "misses", s.misses)
    note("cache", "evictions", s.evictions)
    note("cache", "expirations", s.expirations)
    note("cache", "invalidations", s.invalidations)
    note("cache", "joined flights", run.flights.get("coalesced", 0))
    note("cache", "model runs", len(run.runs))
    for out in run.outcomes.values():
        kind = type(out.value).__name__ if out.kind == "error" else out.kind
        note("cache", f"outcome: {kind}")
    if run.violations:
        raise InvariantViolation(*run.violations[0])
    for i, ask in enumerate(sc.asks):
        _check_ask(run, i, ask)


def _describe(i: int, ask: Ask) -> str:
    how = "infer_batch" if ask.batch or len(ask.keys) > 1 else "infer"
    return (
        f"ask #{i} (tick {ask.at}, tenant t{ask.tenant}, class c{ask.cls}, {how} of m"
        f"{ask.model} keys {list(ask.keys)})"
    )


_RUN_OF_ERROR = re.compile(r"planted model error on key (\d+) \(run (\d+)\)")


def _check_ask(run: CacheRun, i: int, ask: Ask) -> None:
    sc = run.scenario
    who = _describe(i, ask)
    out = run.outcomes.get(i)
    if out is None:
        raise InvariantViolation(
            "lost", f"{who} never got an answer ({HORIZON_S:g} s of trio time after the last event)"
        )
    start, gen0 = run.started[i]
    cancel_at = None if ask.cancel is None else start + ask.cancel * TICK
    if cancel_at is not None and out.at > cancel_at:
        raise InvariantViolation(
            "outcome", f"{who} returned at {run.at(out.at)}, after its cancel time "
            f"{run.at(cancel_at)}"
        )
    if out.kind == "cancelled":
        if cancel_at is None or out.at != cancel_at:
            raise InvariantViolation(
                "outcome", f"{who} was cancelled at {run.at(out.at)} but nobody cancelled it then"
            )
        return
    rule = sc.models[ask.model]
    if out.kind == "result":
        values = list(out.value)
        if len(values) != len(ask.keys):
            raise InvariantViolation(
                "misrouted", f"{who} got {len(values)} answers for {len(ask.keys)} keys"
            )
        for j, (value, k) in enumerate(zip(values, ask.keys, strict=True)):
            _check_answer(run, who, ask, j, k, np.asarray(value["y"]), start, gen0, rule)
        return
    exc = out.value
    if isinstance(exc, Overloaded) and _sheddable(ask, rule):
        return
    m = _RUN_OF_ERROR.search(str(exc)) if isinstance(exc, ModelError) else None
    if m is None:
        left = [
            j for j, a in enumerate(sc.asks)
            if j != i and a.cancel is not None and a.model == ask.model
            and run.outcomes.get(j) is not None and run.outcomes[j].kind == "cancelled"
            and set(a.keys) & set(ask.keys)
        ]
        hint = (
            f" (callers of the same keys that left: {', '.join(f'#{j}' for j in left)}: "
            "a caller that left must not cancel what others wait for)" if left else ""
        )
        raise InvariantViolation(
            "outcome",
            f"{who} raised {type(exc).__name__}: {exc} — not an outcome its situation "
            f"allows{hint}",
        )
    key, number = int(m.group(1)), int(m.group(2))
    r = run.runs[number] if number < len(run.runs) else None
    mine = r is not None and r.model == ask.model and any(
        k == key and t == ask.tenant for k, t, _ in r.items
    )
    if r is None or r.status != "error" or not mine or key not in ask.keys:
        raise InvariantViolation(
            "misrouted",
            f"{who} got the ModelError of run {number} on key {key}, which is not a failed "
            f"run of its own model, tenant and keys",
        )
    if r.end < start:
        raise InvariantViolation(
            "cached-error",
            f"{who} got the ModelError of run {number} (key {key}), which raised at "
            f"{run.at(r.end)}, before the call started at {run.at(start)}: an error was "
            "kept and served again",
        )


def _sheddable(ask: Ask, rule: ModelRule) -> bool:
    """Whether the runtime may shed the call (Overloaded: it could not be served
    before its deadline). Only a caller whose deadline it sees, and not through a
    flight: a flight runs in the cache actor's nursery, without its callers' deadlines
    (the queue holds far more than a scenario asks)."""
    flight = (rule.cache or rule.coalesce) and len(ask.keys) == 1  # infer_batch of one too
    return ask.cancel is not None and ask.cancel_how == "deadline" and not flight


def _check_answer(
    run: CacheRun, who: str, ask: Ask, j: int, k: int, y: np.ndarray, start: float,
    gen0: int, rule: ModelRule,
) -> None:
    if y.shape != (5,) or int(y[MODEL]) != ask.model or int(y[KEY]) != k:
        raise InvariantViolation(
            "misrouted",
            f"{who}: answer {j} is not its own (expected m{ask.model}'s answer for key {k}, "
            f"got {y.tolist()})",
        )
    number, gen, tenant = int(y[RUN]), int(y[GEN]), int(y[TENANT])
    r = run.runs[number] if 0 <= number < len(run.runs) else None
    if (
        r is None
        or r.status != "ok"
        or r.model != ask.model
        or r.gen != gen
        or not any(rk == k and rt == tenant for rk, rt, _ in r.items)
    ):
        raise InvariantViolation(
            "misrouted",
            f"{who}: answer {j} ({y.tolist()}) is not what run {number} of the model answered",
        )
    if tenant != ask.tenant and not (rule.cache and rule.shared):
        raise InvariantViolation(
            "isolation",
            f"{who}: answer {j} was computed for tenant t{tenant} (run {number} at "
            f"{run.at(r.at)}), but m{ask.model} is not shareable",
        )
    if gen < gen0:
        raise InvariantViolation(
            "freshness",
            f"{who}: answer {j} was computed by run {number} at {run.at(r.at)} with "
            f"generation {gen} of the weights, but the call started at {run.at(start)}, "
            f"after m{ask.model}'s invalidation to generation {gen0}",
        )
