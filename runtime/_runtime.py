"""The assembly: ``open_runtime`` wires a scheduler and batchers per model under one
supervising nursery, and yields the ``Runtime`` (``_front``) that is the in-process
front door. (``Runtime`` is looked up here when the runtime opens.)"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ._actor import RestartPolicy, supervise
from ._builtin import resolve_backend
from ._config import DEFAULT_SLO_TARGET, Config, ModelConfig
from ._config_file import given_config
from ._errors import ActorClosed, ConfigError, ModelLoadError
from ._front import Runtime
from ._model import ModelBackend
from ._not_loaded import not_loaded
from ._ray_config import RayReplicaConfig
from ._ray_connect import check_ray_installed, start_ray, stop_ray
from ._rollout_start import start_rollout
from ._rollout_state import open_state_file
from ._served import ServedModel, label
from ._versioned import Family, _MergedQueues, start_family, version_backends
from ._zygote import Zygote, ZygoteError

log = logging.getLogger("trioserve")


class _SwitchIntervals:
    """The process's ``sys.setswitchinterval`` while runtimes are open.

    The first runtime to open saves the process's interval, the last to close puts
    it back; meanwhile the smallest interval of the open runtimes applies (each runs
    its loop at least that responsively), whatever order they open and close in.
    Runtimes may run in different threads (``serve_in_thread``), hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[float] = []  # seconds, one per open runtime
        self._saved = 0.0

    def enter(self, seconds: float) -> None:
        with self._lock:
            if not self._open:
                self._saved = sys.getswitchinterval()
            self._open.append(seconds)
            sys.setswitchinterval(min(self._open))

    def exit(self, seconds: float) -> None:
        with self._lock:
            self._open.remove(seconds)
            sys.setswitchinterval(min(self._open) if self._open else self._saved)


_switch_intervals = _SwitchIntervals()


def _limits(cfg: ModelConfig, backend: ModelBackend) -> Any:
    from trioserve.actors import BatchLimits

    return BatchLimits(
        max_size=cfg.max_batch_size,
        max_tokens=cfg.max_batch_tokens,
        max_wait=cfg.max_wait_ms / 1e3,
        padded=backend.padded,
        oversize=cfg.oversize,
    )


def open_runtime(config: Config | None = None) -> _OpenRuntime:
    """Start the runtime: per model a scheduler and one batcher per replica, each
    supervised; models are loaded before this returns.

    On leaving the block normally, new requests are refused (ActorClosed), requests in
    flight get up to ``runtime.graceful_timeout_s`` to finish (or until
    ``rt.grace_deadline``, when the caller began the grace sooner), then every request
    still waiting is failed with ActorClosed: nothing hangs and nothing is lost. If the block
    raises, or an actor escalates, everything is cancelled at once.

    The object it returns is entered once (``async with``): entering it again, while
    it runs, after it closed or after its entry failed, is a RuntimeError (which says
    that entry failed, and with what type of error); call ``open_runtime`` again for
    another runtime.
    """
    return _OpenRuntime(config)


@attrs.define(eq=False)
class _OpenRuntime:
    """What :func:`open_runtime` returns: an async context manager entered once."""

    _config: Config | None
    _cm: Any = None
    #: the type name of the error its first entry raised (None: it did not fail)
    _failed: str | None = None

    async def __aenter__(self) -> Runtime:
        if self._failed is not None:
            raise RuntimeError(
                "this open_runtime(...) was entered already, and that entry failed "
                f"({self._failed}: see its error): it is entered once; call "
                "open_runtime(config) again for another runtime"
            )
        if self._cm is not None:
            raise RuntimeError(
                "this open_runtime(...) was entered already: it is entered once (its "
                "runtime runs for one `async with` block); call open_runtime(config) "
                "again for another runtime"
            )
        self._cm = _open_runtime(self._config)
        try:
            return await self._cm.__aenter__()
        except BaseException as exc:
            self._failed = type(exc).__name__
            raise

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._cm.__aexit__(*exc_info)


@asynccontextmanager
async def _open_runtime(config: Config | None) -> AsyncIterator[Runtime]:
    """:func:`open_runtime`'s block."""
    config = given_config(config, "open_runtime")
    limits_cfg = config.runtime
    _check_devices(config.models)
    backends = {m.name: resolve_backend(m) for m in config.models}
    on_ray = [
        m for m in config.models if (m.execution or backends[m.name].default_execution) == "ray"
    ]
    check_ray_installed(on_ray)
    # versions with weights of their own (runtime/_versioned.py)
    own = {m.name: version_backends(m, backends[m.name]) for m in config.models}
    policy = RestartPolicy(
        intensity=limits_cfg.restart_intensity, period=limits_cfg.restart_period_s
    )
    from trioserve.actors import REPLICA_HEALTH, Watchdog

    rt = Runtime(config)
    rt._replica_healths = REPLICA_HEALTH
    _make_buckets(rt, trio.current_time())
    # read before anything starts: a state file that cannot be read fails the start
    rt._rollout_state = await open_state_file(config)
    zygote: Zygote | None = None
    ray_started = False  # we connected this process to Ray: we disconnect it
    watchdog = Watchdog()
    watchdog.start()
    switch_interval = limits_cfg.switch_interval_us * 1e-6
    _switch_intervals.enter(switch_interval)
    # The body's own exception is re-raised unwrapped after the nursery closes; only an
    # actor's escalation comes out of the nursery itself.
    body_error: BaseException | None = None
    normal_exit = False  # the body returned: the grace deadline is set
    try:
        async with trio.open_nursery() as nursery:
            try:
                if any(
                    (m.execution or b.default_execution) == "process"
                    for m in config.models
                    for b in (backends[m.name], *own[m.name].values())
                ):
                    zygote = Zygote()
                    log.info("starting worker processes (their parent imports torch)")
                    try:
                        await zygote.start()
                    except ZygoteError as exc:
                        raise ModelLoadError(
                            f"worker processes cannot start: {exc}"
                        ) from exc
                if on_ray:
                    # once per runtime, before any replica's actor is created
                    ray_started = await start_ray(config.ray)
                await _start_cache(nursery, rt, policy)
                if rt._rollout_state is not None:
                    await nursery.start(rt._rollout_state.run)
                if config.server.model_control == "explicit":
                    await _start_control(
                        nursery, rt, backends, own, policy, zygote, watchdog
                    )
                else:
                    for m in config.models:
                        if own[m.name] or m.rollout is not None:
                            await _start_family(
                                nursery, rt, m, backends[m.name], own[m.name], policy,
                                zygote, watchdog,
                            )
                            continue
                        await _start_model(
                            nursery, rt, m, backends[m.name], policy, zygote, watchdog
                        )
                yield rt
                if rt._rollout_state is not None:
                    # each trial's progress, kept before the drain: written with the
                    # decisions of the last moments, in one write if none is under way
                    _keep_progress(rt)
                # The grace begins now, unless the caller began it already (a server
                # that drained its connections first): then they share it.
                rt.grace_deadline = min(
                    rt.grace_deadline, trio.current_time() + limits_cfg.graceful_timeout_s
                )
                normal_exit = True
                await rt._drain()
                if rt._rollout_state is not None:
                    # the decisions of the last moments are written before the close
                    with trio.move_on_at(rt.grace_deadline):
                        await rt._rollout_state.flush()
            except BaseException as exc:
                body_error = exc
                if rt._rollout_state is not None:
                    # (written as the runtime is cancelled: the state file's last write)
                    _keep_progress(rt)
            finally:
                rt._closed = True
                nursery.cancel_scope.cancel("runtime shutting down")
    except BaseExceptionGroup as group:
        leaves = [e for e in _leaves(group) if not isinstance(e, trio.Cancelled)]
        if len(leaves) == 1:
            # Unwrapped, but still chained to its own cause (an escalation's last crash).
            raise leaves[0] from leaves[0].__cause__
        raise
    finally:
        _switch_intervals.exit(switch_interval)
        closed = ActorClosed("the runtime shut down before this request was answered")
        for served in rt._all_served():
            for b in served.batchers:
                b.close()
            for scheduler in served.schedulers:
                scheduler.close(closed)
        # A model call cut off in a worker thread still runs (a thread cannot be
        # stopped): on a normal exit, give it what is left of the grace to return, so
        # that the process does not exit under it (torch aborts the process when such
        # a thread resumes during the interpreter's finalisation).
        if normal_exit:
            await rt._join_threads()
        watchdog.stop()
        if zygote is not None:
            await zygote.aclose()
        if ray_started:  # after the batchers killed their actors
            await stop_ray()
    if body_error is not None:
        raise body_error


def _keep_progress(rt: Runtime) -> None:
    """Hand each canary on trial's progress (its step, the time served in it) to the
    state file: the runtime is closing. Not a checkpoint."""
    for family in rt._families.values():
        if family.controller is not None:
            family.controller.keep_progress()


async def _start_cache(nursery: trio.Nursery, rt: Runtime, policy: RestartPolicy) -> None:
    """The cache actor, when the cache has a capacity or a model coalesces."""
    from trioserve.actors import Cache, CacheActor, CacheRule

    cfg = rt.config
    cache = None
    if cfg.cache.capacity_bytes > 0:
        cache = Cache(
            cfg.cache.capacity_bytes,
            policy=cfg.cache.policy,
            rules={
                m.name: CacheRule(
                    enabled=m.cache,
                    ttl=m.cache_ttl_s if m.cache_ttl_s is not None else math.inf,
                    shareable=m.cache_shared,
                )
                for m in cfg.models
            },
            default_quota=cfg.cache.tenant_quota_bytes,
        )
    actor = CacheActor(cache, coalesce={m.name: m.coalesce for m in cfg.models})
    cached = frozenset(m.name for m in cfg.models if actor.handles(m.name))
    if not cached:
        return
    rt.cache = actor
    rt._cached = cached
    await nursery.start(supervise, actor, policy)


def _make_buckets(rt: Runtime, now: float) -> None:
    from trioserve.actors import TokenBucket

    for t in rt.config.tenants:
        if t.credit_rate is not None:
            rt.buckets[t.name] = TokenBucket(t.credit_rate, t.burst, now)


def _check_devices(models: Sequence[ModelConfig]) -> None:
    # (a replica on Ray loads on the GPU Ray gives it, on whichever machine)
    wanted = {
        (m.name, d) for m in models if m.execution != "ray"
        for d in m.devices if d.startswith("cuda")
    }
    if not wanted:
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for model, device in sorted(wanted):
        index = int(device.partition(":")[2] or 0)
        if index >= n:
            raise ConfigError(
                f"models.{model}.devices: {device} is not available "
                f"(torch sees {n} CUDA device{'s' if n != 1 else ''})"
            )


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


async def _start_control(
    nursery: trio.Nursery, rt: Runtime, backends: dict[str, ModelBackend],
    own: dict[str, dict[str, ModelBackend]], policy: RestartPolicy,
    zygote: Zygote | None, watchdog: Any,
) -> None:
    """Explicit model control (docs/model-control.md): every model has a stand-in
    until it is loaded; those with ``load_at_start`` are loaded now, in order."""
    from ._control import ModelControl

    def prepare(m: ModelConfig) -> _Plan | Callable[[], _Plan]:
        """What a copy of ``m`` starts with: the backends resolved at the start for
        the configuration's table; for a load's config that changes the options, a
        function that makes new ones (it imports the backend's module and calls the
        user's factory: the load calls it in a worker thread, off the event loop).
        ConfigError when a copy of ``m`` cannot start (the function's too)."""
        table = rt.config.model(m.name)
        if m is table:
            return _Plan(config=m, backend=backends[m.name], own=own[m.name])
        _check_devices([m])
        _check_copy(m, len(m.replica_devices))
        if m.options == table.options:
            return _Plan(config=m, backend=backends[m.name], own=own[m.name])

        def make() -> _Plan:
            backend = resolve_backend(m)
            return _Plan(config=m, backend=backend, own=version_backends(m, backend))

        return make

    async def start_copy(
        copy_nursery: trio.Nursery, plan: _Plan, previous: ServedModel | Family
    ) -> ServedModel | Family:
        m = plan.config
        if plan.own or m.rollout is not None:
            return await _start_family(
                copy_nursery, rt, m, plan.backend, plan.own, policy, zygote,
                watchdog, previous=previous,
            )
        assert isinstance(previous, ServedModel)
        return await _start_model(
            copy_nursery, rt, m, plan.backend, policy, zygote, watchdog, previous
        )

    control = ModelControl(
        rt, prepare=prepare, start_copy=start_copy,
        unloaded=lambda m, previous: _unloaded(rt, m, backends[m.name], previous),
        watchdog=watchdog,
    )
    await nursery.start(control.run)
    rt._control = control
    for m in rt.config.models:
        if m.load_at_start:
            await control.load(m.name)


@attrs.frozen(kw_only=True)
class _Plan:
    """What a copy of a model starts with (explicit model control): its config and
    backends (``own``: the versions' with weights of their own)."""

    config: ModelConfig
    backend: ModelBackend
    own: dict[str, ModelBackend]


def _check_copy(m: ModelConfig, n_replicas: int) -> None:
    """Raise ConfigError for what a model's start refuses that its table's own
    checks cannot see (``n_replicas``: those it starts)."""
    if m.slow_lane_cost is not None and m.slow_lane_replicas >= n_replicas:
        raise ConfigError(
            f"models.{m.name}.slow_lane_replicas: the slow lane needs its own replicas "
            f"and the fast lane at least one: must be < replicas ({n_replicas}), "
            f"got {m.slow_lane_replicas}"
        )
    if m.batch_timeout_cap_ms < m.batch_timeout_floor_ms:
        raise ConfigError(
            f"models.{m.name}.batch_timeout_cap_ms: must be >= batch_timeout_floor_ms "
            f"({m.batch_timeout_floor_ms:g}), got {m.batch_timeout_cap_ms:g}"
        )


def _unloaded(
    rt: Runtime, m: ModelConfig, backend: ModelBackend,
    replaced: ServedModel | Family | None,
) -> ServedModel:
    """The stand-in of a model not loaded: a queue that refuses every request (never
    run: nothing pulls from it), no replica, and the metrics, objective and flows'
    counters of the copy it replaces (new ones for a model never loaded; a family's:
    its versions' flows' counters added up)."""
    from trioserve.actors import ClassSpec, FairQueue, ModelMetrics, SchedulerActor, SloTracker

    cfg = rt.config
    queue = FairQueue(
        _limits(m, backend), bound=cfg.runtime.queue_bound,
        classes=[ClassSpec(name=c.name, aging=c.max_queue_wait_ms / 1e3) for c in cfg.classes],
        model=m.name, adaptive=False,
    )
    previous = (
        replaced.by_version[replaced.default] if isinstance(replaced, Family) else replaced
    )
    if isinstance(replaced, Family) and len(replaced.groups) > 1:
        # the counters go on from all the versions' together
        queue.stats = _MergedQueues([g.scheduler.policy for g in replaced.groups]).stats
    elif previous is not None:
        queue.stats = previous.scheduler.policy.stats
    scheduler = SchedulerActor(m.name, queue)
    scheduler.retire(not_loaded(m.name))
    return ServedModel(
        config=m, backend=backend, scheduler=scheduler, batchers=[],
        metrics=(
            previous.metrics if previous is not None
            else ModelMetrics(model=m.name, max_batch_size=m.max_batch_size)
        ),
        limits=queue.limits, timeout=math.inf,
        slo=previous.slo if previous is not None else (SloTracker(
            m.slo_ms / 1e3, DEFAULT_SLO_TARGET if m.slo_target is None else m.slo_target
        ) if m.slo_ms is not None else None),
        # an autoscaled model's last controller, stopped: its counters carry on
        scaler=previous.scaler if previous is not None else None,
        loaded=False,
    )


async def _start_model(
    nursery: trio.Nursery,
    rt: Runtime,
    m: ModelConfig,
    backend: ModelBackend,
    policy: RestartPolicy,
    zygote: Zygote | None,
    watchdog: Any,
    previous: ServedModel | None = None,
    like: _Shared | None = None,
    *,
    controlled: bool = False,
    versions: Sequence[str] | None = None,
    version: str | None = None,
) -> ServedModel:
    """Start a model's queues and replicas in ``nursery``; return it once they are
    loaded. ``controlled`` (or a ``previous``): under explicit model control, the
    caller installs it, and its replicas can retire; ``previous`` is what it is to
    replace: it keeps that one's metrics, objective and flows' counters, and an
    autoscaled model starts as many replicas as that one serves (within the
    autoscaler's bounds). Otherwise it is installed in ``rt.models`` at once.
    ``like``: the metrics and objective (``.metrics``, ``.slo``) of the model
    whose versions have weights of their own that it is one of: it shares them;
    ``versions``: then, those this one serves (its log lines name them);
    ``version``: the version with weights of its own it serves (its actors' names
    say so), None: the model's backend."""
    from trioserve.actors import (
        BatcherActor,
        BatchTimer,
        Breaker,
        ClassSpec,
        FairQueue,
        ModelMetrics,
        RecentQuantile,
        SchedulerActor,
        SloTracker,
        StragglerPolicy,
    )

    limits = _limits(m, backend)
    cfg = rt.config
    controlled = controlled or previous is not None
    devices = _replica_devices(m, previous)
    n_replicas = len(devices)
    # The adaptive limit's floor is two full batches per replica that pulls from the
    # lane: with a slow lane, its replicas are not the fast lane's.
    fast_replicas = n_replicas - (m.slow_lane_replicas if m.slow_lane_cost is not None else 0)
    queue = FairQueue(
        limits,
        bound=cfg.runtime.queue_bound,
        classes=[ClassSpec(name=c.name, aging=c.max_queue_wait_ms / 1e3) for c in cfg.classes],
        weights={t.name: t.weight for t in cfg.tenants},
        shares={t.name: t.queue_share for t in cfg.tenants},
        model=m.name,
        adaptive=m.adaptive_limit,
        min_limit=2 * m.max_batch_size * max(fast_replicas, 1),
    )
    named = label(m.name, version)
    scheduler = SchedulerActor(m.name, queue)
    scheduler.name = f"scheduler[{named}]"
    _check_copy(m, n_replicas)
    slow = None
    if m.slow_lane_cost is not None:
        slow = SchedulerActor(m.name, FairQueue(
            limits,
            bound=cfg.runtime.queue_bound,
            classes=queue.classes,
            weights=queue.weights,
            shares=queue.shares,
            model=m.name,
            adaptive=m.adaptive_limit,
            min_limit=2 * m.max_batch_size * m.slow_lane_replicas,
        ))
        slow.name = f"scheduler[{named}:slow]"
        scheduler.lanes = slow.lanes = [scheduler, slow]
        scheduler.lane = f"fast lane (requests of cost below {m.slow_lane_cost})"
        slow.lane = f"slow lane (requests of cost {m.slow_lane_cost} or more)"
    metrics = (
        previous.metrics if previous is not None
        else like.metrics if like is not None
        else ModelMetrics(model=m.name, max_batch_size=m.max_batch_size)
    )
    # a load's config may change it: the fill is of the batches the copy closes
    metrics.max_batch_size = m.max_batch_size
    for lane in (scheduler, slow):
        if lane is not None:
            lane.metrics = metrics  # (the poison requests a queue answers itself)
    served = ServedModel(
        config=m,
        backend=backend,
        scheduler=scheduler,
        batchers=[],
        metrics=metrics,
        limits=limits,
        timeout=m.timeout_ms / 1e3 if m.timeout_ms is not None else math.inf,
        slow_cost=m.slow_lane_cost,
        slow_scheduler=slow,
        hedge_timer=RecentQuantile(0.95) if m.hedge else None,
        version=version,
        slo=like.slo if like is not None else SloTracker(
            m.slo_ms / 1e3, DEFAULT_SLO_TARGET if m.slo_target is None else m.slo_target
        ) if m.slo_ms is not None and previous is None else getattr(previous, "slo", None),
    )
    if not controlled:
        rt.models[m.name] = served
    elif previous is not None:  # the flows' counters carry on
        for lane, before in zip(served.schedulers, previous.schedulers, strict=False):
            lane.policy.stats = before.policy.stats
    timer = BatchTimer(
        StragglerPolicy(
            factor=m.batch_timeout_factor,
            floor=m.batch_timeout_floor_ms / 1e3,
            cap=m.batch_timeout_cap_ms / 1e3,
            poison_attempts=m.poison_attempts,
        )
    )
    await nursery.start(supervise, scheduler, policy)
    if slow is not None:
        await nursery.start(supervise, slow, policy)
    execution = m.execution or backend.default_execution
    for lane in (scheduler, slow):
        if lane is not None:
            lane.threads = execution == "thread"  # (a hedge needs a third replica)
    started = trio.current_time()
    # (a model whose versions have weights of their own loads each: say which)
    which = f"model {m.name!r}" + (
        "" if versions is None
        else f", version{'s' if len(versions) > 1 else ''} {', '.join(map(repr, versions))}"
    )
    # (on Ray, where each actor loads its model: devices only count the replicas)
    shown = [(m.ray or RayReplicaConfig()).device] if execution == "ray" else m.devices
    log.info(
        "%s: loading %s (%s)", which,
        _count(n_replicas, "replica"), f"{execution} on {', '.join(shown)}",
    )

    async def start_replica(index: int, device: str, lane: Any = scheduler) -> Any:
        """Start replica ``index`` on ``device``, registered with the model and its
        lane; returns it once its model is loaded (the autoscaler adds replicas so).
        On Ray, ``device`` only counts the replica: its actor loads where Ray puts it."""
        if execution == "ray":
            device = (m.ray or RayReplicaConfig()).device
        batcher = BatcherActor(
            config=m,
            backend=backend,
            scheduler=lane,
            metrics=metrics,
            device=device,
            index=index,
            execution=execution,
            torch_threads=m.torch_threads,
            zygote=zygote,
            timer=timer,
            breaker=Breaker(),
            watchdog=watchdog,
            retirable=controlled,
            label=named,
        )
        served.batchers.append(batcher)
        lane.replicas += 1
        lane.batchers.append(batcher)
        try:
            await nursery.start(supervise, batcher, policy)
        except BaseException:  # its load failed, or the start was cancelled
            served.remove_replica(batcher)  # it never took work
            raise
        lane.replicas_changed()  # one more ready: what is held apart may run now
        return batcher

    for i, device in enumerate(devices):
        lane = slow if slow is not None and i >= n_replicas - m.slow_lane_replicas else scheduler
        await start_replica(i, device, lane)
    log.info("%s: ready in %.2f s", which, trio.current_time() - started)
    if m.autoscaling is not None:
        await _start_autoscaler(nursery, rt, served, start_replica, policy, previous)
    return served


async def _start_family(
    nursery: trio.Nursery, rt: Runtime, m: ModelConfig, backend: ModelBackend,
    own: dict[str, ModelBackend], policy: RestartPolicy, zygote: Zygote | None,
    watchdog: Any, *, previous: ServedModel | Family | None = None,
) -> Family:
    """A model whose versions have weights of their own, or a rollout
    (runtime/_versioned.py), and its rollout's controller (afresh). ``previous``:
    under explicit model control, what it is to replace, a family (each version's
    group takes over its counterpart's counters) or the stand-in (the first group
    takes over its own); the caller installs it then."""
    from trioserve.actors import ModelMetrics, SloTracker

    controlled = previous is not None
    # The versions load at once, so what they share is made first: the model's
    # metrics and objective, those of the copy replaced (or the stand-in's) if any.
    base = previous.by_version[previous.default] if isinstance(previous, Family) else previous
    like = _Shared(
        metrics=(
            base.metrics if base is not None
            else ModelMetrics(model=m.name, max_batch_size=m.max_batch_size)
        ),
        slo=base.slo if base is not None else SloTracker(
            m.slo_ms / 1e3, DEFAULT_SLO_TARGET if m.slo_target is None else m.slo_target
        ) if m.slo_ms is not None else None,
    )

    async def start(
        cfg: ModelConfig, b: ModelBackend, versions: Sequence[str], first: bool
    ) -> ServedModel:
        # what each group takes over (its flows' counters; an autoscaled one, its
        # replica count): its counterpart in the family replaced, or the stand-in's
        # for the first
        before: ServedModel | None
        if isinstance(previous, Family):
            before = previous.by_version[versions[0]]
        else:
            before = previous if first else None
        return await _start_model(
            nursery, rt, cfg, b, policy, zygote, watchdog, before, like=like,
            controlled=controlled, versions=versions if own else None,
            version=versions[0] if versions[0] in own else None,
        )

    family = await start_family(rt, m, backend, own, start, install=not controlled)
    if m.rollout is not None:
        await start_rollout(nursery, rt, family, m, policy)
    return family


@attrs.frozen(kw_only=True)
class _Shared:
    """What every version of a family shares (``_start_model``'s ``like``)."""

    metrics: Any
    slo: Any


def _replica_devices(m: ModelConfig, previous: ServedModel | None) -> tuple[str, ...]:
    """The device of each replica to start: the configured ones; for a reload of an
    autoscaled model, as many as the copy replaced serves now, within the
    autoscaler's bounds, round-robin over the model's devices (unless the two
    copies' replicas or devices differ: a load's config, or the table after one,
    asked for the configured ones)."""
    configured = m.replica_devices
    a = m.autoscaling
    if a is None or previous is None or not previous.loaded or previous.scaler is None:
        return configured
    if previous.config.replica_devices != configured:
        return configured
    n = len(previous.scaler.serving())
    low = a.min_replicas if a.min_replicas is not None else len(configured)
    high = a.max_replicas if a.max_replicas is not None else len(configured)
    n = max(low, min(high, n))
    return tuple(m.devices[i % len(m.devices)] for i in range(n))


async def _start_autoscaler(
    nursery: trio.Nursery, rt: Runtime, served: ServedModel, start_replica: Any,
    policy: RestartPolicy, previous: ServedModel | None = None,
) -> None:
    """The controller that scales ``served``'s replicas with its load; its counters
    carry on from ``previous``'s (a model reloaded, or loaded again)."""
    from trioserve.actors import Autoscaler, ScalingController

    m = served.config
    a = m.autoscaling
    assert a is not None
    start = len(m.replica_devices)
    scaler = Autoscaler(
        minimum=a.min_replicas if a.min_replicas is not None else start,
        maximum=a.max_replicas if a.max_replicas is not None else start,
        target=(
            a.target_queued_per_replica if a.target_queued_per_replica is not None
            else m.max_batch_size
        ),
        upscale_delay=a.upscale_delay_s,
        downscale_delay=a.downscale_delay_s,
        interval=a.interval_s,
        look_back=a.look_back_s if a.look_back_s is not None else a.upscale_delay_s,
        now=trio.current_time() + a.interval_s,
    )
    served.scaler = ScalingController(
        served=served,
        scaler=scaler,
        start_replica=start_replica,
        closing=lambda: rt._closed,
        floor_per_replica=2 * m.max_batch_size,
    )
    before = previous.scaler if previous is not None else None
    if before is not None:
        scaler.decisions = before.scaler.decisions  # shared: the old copy's count too
        served.scaler.start_failures = before.start_failures
    await nursery.start(supervise, served.scaler, policy)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


__all__ = ["Runtime", "ServedModel", "open_runtime"]
