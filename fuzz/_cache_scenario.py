"""The cache suite's scenarios: the script a run plays, and its hypothesis strategies.

A :class:`CacheScenario` is the cache (capacity, policy, quota), one to three models
with their rules (:class:`ModelRule`), per-key model latencies and flaky keys, and the
callers (:class:`Ask`) and invalidations (:class:`Invalidate`), their times in ticks;
the models' and classes' timeouts, so that callers of one flight have deadlines of
their own (:func:`deadline_ticks`). For the models that run off the event loop, the
faults of real deployments: a batch cut-off (``cut_off``), keys whose first runs
straggle past it (``straggle``) or kill their worker (``dies``), workers that hold
several batches (``slots``), and each replica's circuit breaker, with a threshold and
a cooldown of the scenario's scale (``breaker``).
:func:`cache_scenarios` draws one; ``fuzz/_cache.py`` plays it.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
from hypothesis import strategies as st
from trioserve.actors._cache_actor import OVERHEAD

#: One tick of scenario time: a power of two, so every sum of ticks is exact.
TICK = 2.0**-10
#: How long after the last event a caller may take before it counts as lost.
HORIZON_S = 3600.0
#: The keys callers ask for: few, so that answers repeat.
KEYS = 4
#: How much longer (ticks) a straggling run of a key takes: past every cut-off drawn.
STRAGGLE = 48


# ---------------------------------------------------------------- the script
@attrs.frozen(kw_only=True)
class ModelRule:
    """One model's cache settings: ``cache`` (its results are kept), ``shared`` (one
    namespace for every tenant), ``ttl`` (ticks; None: no expiry), ``coalesce``
    (identical requests in flight are joined even when nothing is kept), its
    ``timeout`` (ticks, its ``timeout_ms``; None: none), and whether its replicas
    run their batches off the event loop (``running``: a worker process in trio
    time, the runtime's watchdog answering a request's deadline while its batch
    runs) or inline."""

    cache: bool = True
    shared: bool = False
    ttl: int | None = None
    coalesce: bool = False
    timeout: int | None = None
    running: bool = False


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


#: What the cache charges for one of the model's answers (five float64s and the
#: per-entry overhead): the capacities and quotas drawn hold one entry and up.
ENTRY = OVERHEAD + 5 * 8


@attrs.frozen(kw_only=True)
class CacheScenario:
    capacity: int = 4 * ENTRY
    policy: str = "tinylfu"
    quota: int | None = None
    replicas: int = 1
    max_batch_size: int = 2
    tenants: int = 2
    classes: int = 1
    models: tuple[ModelRule, ...] = (ModelRule(),)
    #: per class: its ``timeout_ms`` in ticks (None: none; the model's applies)
    class_timeouts: tuple[int | None, ...] = (None,)
    #: per key: the model's latency on it (ticks); a batch takes its slowest item's
    latency: tuple[int, ...] = (0,) * KEYS
    #: per key: how many of its first runs (per model) raise
    flaky: tuple[int, ...] = (0,) * KEYS
    #: A ``running`` model's batch cut-off in ticks (its ``batch_timeout_floor_ms``
    #: and ``_cap_ms``: a batch running longer is cut off, its worker killed and the
    #: batch handed back, split, its requests alone twice cut off poison); None: the
    #: product's (a second: never, at this scale)
    cut_off: int | None = None
    #: per key: how many of its first batches on a worker (per model) straggle: they
    #: take ``STRAGGLE`` ticks more
    straggle: tuple[int, ...] = (0,) * KEYS
    #: per key: how many of its first batches on a worker (per model) kill the worker
    #: at their end (it dies running them; the replica starts another)
    dies: tuple[int, ...] = (0,) * KEYS
    #: batches a ``running`` model's worker holds (running, or staged behind)
    slots: int = 1
    #: each replica's circuit breaker: (failures that open it, its first cooldown in
    #: ticks, doubling up to 8 times that); None: the product's (5, a second)
    breaker: tuple[int, int] | None = None
    asks: tuple[Ask, ...] = ()
    invalidations: tuple[Invalidate, ...] = ()


def deadline_ticks(sc: CacheScenario, ask: Ask) -> int | None:
    """The caller's own timeout in ticks from its arrival (its model's or class's,
    whichever is sooner; None: none), the deadline the runtime gives its request."""
    cls = sc.class_timeouts[ask.cls] if ask.cls < len(sc.class_timeouts) else None
    got = [t for t in (sc.models[ask.model].timeout, cls) if t is not None]
    return min(got) if got else None


# ---------------------------------------------------------------- strategies
# Built once, never inside a draw (as in fuzz/_scenario.py: a fresh strategy object is
# validated again on its first draw); the draws, and so a seed's examples, are the
# same either way.
_GAP = st.sampled_from([0, 0, 1, 1, 2, 3, 4, 4, 8, 32])
_KEY = st.sampled_from([0, 0, 0, 0, 1, 1, 2, 3])
_LATENCY = st.sampled_from([0, 0, 1, 2, 4, 8, 8, 16])
_FLAKY = st.sampled_from([0, 0, 0, 0, 1, 2])
_N_MODELS = st.sampled_from([1, 1, 2, 3])
_N_TENANTS = st.sampled_from([1, 2, 2, 3])
_N_CLASSES = st.sampled_from([1, 1, 2])
_CACHED = st.sampled_from([True, True, True, False])
_RUNNING = st.sampled_from([False, True])
_TTL = st.sampled_from([None, None, 1, 2, 4, 8, 32])
#: A model's or a class's timeout (ticks): short ones expire while a batch of a
#: slow key runs before them, or while their own runs (inline, it is waited for).
_TIMEOUT = st.sampled_from([None, 1, 2, 2, 3, 4, 4, 6, 8])
_CLASS_TIMEOUT = st.sampled_from([None, None, None, 2, 4, 8])
_KEYS = st.tuples(_KEY) | st.lists(_KEY, min_size=1, max_size=4).map(tuple)
_BATCH = st.sampled_from([False, False, True])
_CANCEL = st.none() | st.none() | st.sampled_from([0, 1, 2, 4, 16])
_CANCEL_HOW = st.sampled_from(["deadline", "cancel"])
_CAPACITY = st.sampled_from([ENTRY, 2 * ENTRY, 4 * ENTRY, 8 * ENTRY, 100_000])
_POLICY = st.sampled_from(["tinylfu", "lru"])
_QUOTA = st.sampled_from([None, None, None, ENTRY, 2 * ENTRY])
_LATENCIES = st.lists(_LATENCY, min_size=KEYS, max_size=KEYS)
_FLAKIES = st.lists(_FLAKY, min_size=KEYS, max_size=KEYS)
#: Faults of the models off the event loop: cut-offs shorter than the slow keys'
#: latencies, keys whose first batches straggle or kill their worker, breakers that
#: open after a few of those (and a model's raises) and close within a scenario.
_CUT_OFF = st.sampled_from([None, None, 4, 8, 8, 16])
_STRAGGLES = st.lists(st.sampled_from([0, 0, 0, 0, 1, 2, 3]), min_size=KEYS, max_size=KEYS)
_DIES = st.lists(st.sampled_from([0, 0, 0, 0, 0, 1, 2, 3]), min_size=KEYS, max_size=KEYS)
_SLOTS = st.sampled_from([1, 1, 2, 3])
_BREAKER = st.sampled_from([None, (1, 4), (2, 8), (2, 32), (3, 16)])


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
    # Callers of one key a tick or two apart: they join one flight with deadlines of
    # their own, so its reruns have several waiters to choose from.
    burst = st.builds(
        _Burst,
        ask=st.builds(
            Ask,
            at=_GAP,
            tenant=st.integers(0, n_tenants - 1),
            cls=st.integers(0, n_classes - 1),
            model=st.integers(0, n_models - 1),
            keys=st.tuples(_KEY),
            cancel=_CANCEL,
        ),
        n=st.integers(2, 4),
        every=st.sampled_from([1, 1, 2]),
    )
    return st.lists(ask | ask | ask | ask | invalidate | burst, min_size=10, max_size=30)


@attrs.frozen
class _Burst:
    """``n`` copies of ``ask``, ``every`` ticks apart (drawn as one event)."""

    ask: Ask
    n: int
    every: int


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
            timeout=draw(_TIMEOUT),
            running=draw(_RUNNING),
        )
        for _ in range(n_models)
    )
    class_timeouts = tuple(draw(_CLASS_TIMEOUT) for _ in range(n_classes))
    events = draw(_events(n_models, n_tenants, n_classes))
    at, asks, invalidations = 0, [], []
    for e in events:  # times accumulate the gaps
        if isinstance(e, _Burst):
            at += e.ask.at
            asks.extend(attrs.evolve(e.ask, at=at + j * e.every) for j in range(e.n))
            at += (e.n - 1) * e.every
            continue
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
        class_timeouts=class_timeouts,
        latency=tuple(draw(_LATENCIES)),
        flaky=tuple(draw(_FLAKIES)),
        cut_off=draw(_CUT_OFF),
        straggle=tuple(draw(_STRAGGLES)),
        dies=tuple(draw(_DIES)),
        slots=draw(_SLOTS),
        breaker=draw(_BREAKER),
        asks=tuple(asks),
        invalidations=tuple(invalidations),
    )
