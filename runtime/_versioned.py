"""Models whose versions have weights of their own, or a rollout (``versions`` as a
table, ``[models.NAME.rollout]``): each version with an override is served by its
own backend, queue and replicas, the versions without one by the model's backend;
a request naming a version goes to the one serving it, and an unversioned one to the
version its ``Family`` routes it to (the rollout's stable or canary, else the latest).

An unversioned request is answered as a request naming the version it was routed
to, so its cached result is keyed by that version: a later change of routing never
serves one version's answer as another's.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import attrs
import trio

from ._builtin import resolve_backend
from ._config import ModelConfig
from ._config_checks import _key
from ._errors import (
    ActorBroken,
    ConfigError,
    DeadlineExceeded,
    ModelError,
    ModelLoadError,
    TrioserveError,
    without_model,
)
from ._messages import Reply, Request
from ._model import ModelBackend, TensorSpec, _unstack, item_list
from ._outcomes import _prepare_failed
from ._served import ServedModel
from ._statistics import replica_health
from ._versions_config import VersionList

log = logging.getLogger("trioserve")


def counts_against(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure of the model's own (it counts against a canary):
    the model raised, its batch was cut off or its worker lost, not the caller's bad
    input, shedding, a deadline that passed in the queue or the runtime's close."""
    if isinstance(exc, ModelError | ActorBroken):
        return True
    return isinstance(exc, DeadlineExceeded) and not exc.in_queue


def counts_late(exc: BaseException) -> bool:
    """Whether ``exc`` says the request's deadline passed while it was queued: not
    held against its version on its own (the client's timeout may be too short),
    but counted as late, and a canary late more often than the stable is rolled
    back (docs/rollout.md)."""
    return isinstance(exc, DeadlineExceeded) and exc.in_queue


@attrs.define(eq=False)
class Family:
    """The versions of one model as served: which ``ServedModel`` serves each, and
    which version an unversioned request goes to (``route``)."""

    model: str
    by_version: dict[str, ServedModel]
    #: each distinct ServedModel once: the model's backend's first, if it serves any
    groups: list[ServedModel]
    #: the version unversioned requests go to without a rollout (the latest), or
    #: the rollout's configured stable one (``Runtime.models[model]`` serves it);
    #: where they go now, a canary promoted or a trial started since, is ``target``
    default: str
    #: the versions with weights of their own (a backend, queue and replicas)
    own: frozenset[str] = frozenset()
    #: the rollout's controller (``RolloutController``, actors/_rollout_actor.py)
    controller: Any = None

    def route(self) -> str:
        """The version the next unversioned request goes to."""
        if self.controller is not None:
            return self.controller.route()
        return self.default

    def target(self) -> str:
        """The version unversioned requests go to when no split applies, which the
        model's unversioned probes and documents describe: the rollout's canary once
        promoted, else its stable (also while a canary is on trial and takes its
        share: the probes decide on the stable then); without a rollout, the latest
        (``default``). Not a checkpoint."""
        if self.controller is not None:
            return self.controller.rollout.target()
        return self.default

    def record(self, version: str, ok: bool, latency: float) -> None:
        """An unversioned request routed to ``version`` was answered (``ok``) or
        failed by the model (not ``ok``) after ``latency`` seconds."""
        if self.controller is not None:
            self.controller.record(version, ok, latency)

    def record_shared(self, version: str, n: int = 1) -> None:
        """``n`` unversioned requests routed to ``version`` were answered without the
        model running for them (a cache hit, a join of an identical request in
        flight): left out of the rollout's checks."""
        if self.controller is not None:
            for _ in range(n):
                self.controller.record_shared(version)

    def record_late(self, version: str) -> None:
        """An unversioned request routed to ``version`` passed its deadline while
        it was queued (never answered)."""
        if self.controller is not None:
            self.controller.record_late(version)

    def record_failure(self, version: str, exc: TrioserveError, latency: float, n: int = 1) -> None:
        """``n`` unversioned requests routed to ``version`` failed with ``exc`` after
        ``latency`` seconds: each an error of the model's, or late, or neither (the
        caller's bad input, shedding, the runtime's close)."""
        for _ in range(n):
            if counts_against(exc):
                self.record(version, False, latency)
            elif counts_late(exc):
                self.record_late(version)


def version_backends(m: ModelConfig, base: ModelBackend) -> dict[str, ModelBackend]:
    """The backend of each version with overrides (resolved, not loaded); the others
    are served by ``base``. ConfigError names the version's key."""
    out: dict[str, ModelBackend] = {}
    tables = m.versions.tables or {}
    for v, t in tables.items():
        if not t.overrides:
            continue
        cfg = _version_config(m, v)
        try:
            out[v] = resolve_backend(cfg)
        except ConfigError as exc:
            text, head = str(exc), f"{m._path()}."
            if text.startswith(head):
                raise ConfigError(
                    f"{m._path()}.versions.{_key(v)}.{text[len(head):]}"
                ) from None
            raise
    return out


def _version_config(m: ModelConfig, version: str | None) -> ModelConfig:
    """The config a group of ``m``'s versions is served with: ``version``'s backend
    and options (None: the model's own), every version's name, no rollout."""
    names = VersionList(tuple(m.versions))
    if version is None:
        return attrs.evolve(m, versions=names, rollout=None)
    t = m.versions.tables[version]
    return attrs.evolve(
        m,
        backend=t.backend if t.backend is not None else m.backend,
        options={**m.options, **(t.options or {})},
        versions=names,
        rollout=None,
    )


def _check_signatures(m: ModelConfig, backends: Mapping[str | None, ModelBackend]) -> None:
    """Every version's inputs and outputs are the same (a client sees one model)."""
    items = list(backends.items())
    first_v, first = items[0]
    for v, b in items[1:]:
        if (tuple(b.inputs), tuple(b.outputs)) != (tuple(first.inputs), tuple(first.outputs)):
            def shown(x: ModelBackend) -> str:
                return (f"inputs {TensorSpec.listed(x.inputs)}; "
                        f"outputs {TensorSpec.listed(x.outputs)}")

            where = f"{m._path()}.versions.{_key(v)}" if v is not None else m._path()
            other = f"version {first_v!r}" if first_v is not None else "the model's backend"
            raise ConfigError(
                f"{where}: its signature ({shown(b)}) differs from that of {other} "
                f"({shown(first)}); every version of a model must take and give the same"
            )


async def start_family(
    rt: Any,
    m: ModelConfig,
    base: ModelBackend,
    own: Mapping[str, ModelBackend],
    start_model: Callable[
        [ModelConfig, ModelBackend, Sequence[str], bool], Awaitable[ServedModel]
    ],
    *,
    install: bool = True,
) -> Family:
    """Start ``m``'s versions: the model's backend for those without overrides, and
    each of ``own`` (version -> backend) on its own queue and replicas, all at once.
    ``start_model(cfg, backend, versions, first)`` starts one and returns it once
    its replicas are loaded (``versions``: those it serves; ``first``: the model's
    backend's if it serves any, else the first version's). A checkpoint.

    All or nothing: once every start has ended, a version that failed to load fails
    the whole start, ModelLoadError naming it (each failing version with its reason,
    when several did); the caller stops the versions that did load (they run in its
    nursery). ``install``: serve the family at once (else the caller does: explicit
    model control)."""
    bare = [v for v in m.versions if v not in own]
    plan: dict[str | None, ModelBackend] = {}
    if bare:
        plan[None] = base
    plan.update(own)
    _check_signatures(m, plan)
    started: dict[str | None, ServedModel] = {}
    failed: dict[str | None, TrioserveError] = {}

    async def start(v: str | None, backend: ModelBackend, first: bool) -> None:
        try:
            started[v] = await start_model(
                _version_config(m, v), backend, bare if v is None else [v], first
            )
        except TrioserveError as exc:  # its own to report: the others load on
            failed[v] = exc

    # Models run inline load in turn: such a load is a callable's construction, so
    # loading at once gains nothing, and in turn keeps the order in which their
    # loads' threads end, and so the start, the same from run to run (a test clock
    # moves while the loop waits for a thread: the fuzz suites replay on it).
    at_once = any(
        (_version_config(m, v).execution or backend.default_execution) != "inline"
        for v, backend in plan.items()
    )
    async with trio.open_nursery() as nursery:
        for i, (v, backend) in enumerate(plan.items()):
            if at_once:
                nursery.start_soon(start, v, backend, i == 0)
            else:
                await start(v, backend, i == 0)
    if failed:
        for exc in failed.values():
            if not isinstance(exc, ModelLoadError):
                raise exc  # a configuration the load found wrong: as it is

        def which(v: str | None) -> str:
            if v is not None:
                return f"version {v!r} (weights of its own)"
            return (f"version{'s' if len(bare) > 1 else ''} "
                    f"{', '.join(map(repr, bare))} (the model's backend)")

        def why(v: str | None) -> str:  # (the model is named once, first)
            return without_model(m.name, str(failed[v]))

        order = [v for v in plan if v in failed]
        if len(order) == 1:
            (v,) = order
            raise ModelLoadError(f"model {m.name!r}, {which(v)}: {why(v)}") from failed[v]
        raise ModelLoadError(
            f"model {m.name!r}: {len(order)} versions' loads failed: "
            + "; ".join(f"{which(v)}: {why(v)}" for v in order)
        ) from failed[order[0]]
    by_version: dict[str, ServedModel] = {}
    groups: list[ServedModel] = []
    for v in plan:
        served = started[v]
        groups.append(served)
        for name in bare if v is None else [v]:
            by_version[name] = served
        if v is not None:
            log.info("model %r: version %r serves its own weights", m.name, v)
    default = m.rollout.stable if m.rollout is not None else m.versions[-1]
    family = Family(
        model=m.name, by_version=by_version, groups=groups, default=default,
        own=frozenset(own),
    )
    if install:
        rt.models[m.name] = by_version[default]
        rt._families[m.name] = family
    return family


class _Versioned:
    """The Runtime's routing of unversioned requests of a model with a ``Family``."""

    def _all_served(self) -> list[ServedModel]:
        """Every ServedModel of the runtime: each model's, and each of its versions'
        with weights of their own."""
        out: list[ServedModel] = []
        for name, served in self.models.items():
            family = self._families.get(name)
            out.extend(family.groups if family is not None else [served])
        return out

    def _routed(self, model: Any) -> bool:
        """Whether unversioned requests of ``model`` are routed by its Family (a
        name that is no string is no model's: refused as unknown further on)."""
        return isinstance(model, str) and model in self._families

    def _served_version(self, model: str, version: str) -> ServedModel:
        return self._families[model].by_version[version]

    def _probed(self, model: str, version: str | None) -> ServedModel:
        """What a probe or a document of ``model`` (``version``: that version's)
        describes: ``_known``'s, but for an unversioned one of a model with a Family
        the version its unversioned requests go to now (``Family.target``: a
        canary promoted, not the configured stable). Not for the request path (it
        looks the Family up). Raises as ``_known``."""
        served = self._known(model, version)
        if version is None:
            family = self._families.get(model)
            if family is not None:
                return family.by_version[family.target()]
        return served

    async def _infer_routed(
        self, model: str, inputs: Any, tenant: Any, priority: Any,
        answered: list[str] | None = None,
    ) -> dict[str, Any]:
        """:meth:`infer` of an unversioned request of a model with a Family: sent to
        the version it routes it to, its outcome recorded for the rollout. That
        version is appended to ``answered`` (when given: a v2 answer names it)."""
        family = self._families[model]
        version = family.route()
        if answered is not None:
            answered.append(version)
        t0 = trio.current_time()
        with self._counting_shared(model) as shared:
            try:
                result = await self.infer(
                    model, inputs, tenant=tenant, priority=priority, version=version
                )
            except TrioserveError as exc:
                if shared:  # a joined request's failure is the one it joined
                    family.record_shared(version)
                else:
                    family.record_failure(version, exc, trio.current_time() - t0)
                raise
        if shared:
            # The model did not run for it: no shadow copy either, or under a high
            # hit rate the shadow would run the few popular inputs over and over.
            family.record_shared(version)
            return result
        family.record(version, True, trio.current_time() - t0)
        if family.controller is not None:
            family.controller.shadow_copy(version, inputs, result, tenant)
        return result

    async def _batch_routed(
        self, model: str, items: Sequence[Any] | Mapping[str, Any], tenant: Any,
        priority: Any, answered: list[str] | None = None,
    ) -> list[dict[str, Any]]:
        """:meth:`infer_batch` of an unversioned call of a model with a Family: each
        item routed as a whole request would be, the items of each version submitted
        together. Once all are settled the failure of the part whose first item comes
        first is raised (each part fails as one call of that version would). The
        version of each item is appended to ``answered`` (when given)."""
        family = self._families[model]
        try:
            items = item_list(model, items, "infer_batch")
            rows = _unstack(model, items) if isinstance(items, Mapping) else list(items)
        except TrioserveError:
            # refused as the version's own call refuses it
            return await self.infer_batch(
                model, items, tenant=tenant, priority=priority, version=family.target()
            )
        if not rows:
            return await self.infer_batch(
                model, rows, tenant=tenant, priority=priority, version=family.target()
            )
        chosen = [family.route() for _ in rows]
        if answered is not None:
            answered.extend(chosen)
        parts: dict[str, list[int]] = {}
        for i, v in enumerate(chosen):
            parts.setdefault(v, []).append(i)
        out: list[Any] = [None] * len(rows)
        errors: dict[int, BaseException] = {}

        async def run(version: str, index: list[int]) -> None:
            t0 = trio.current_time()
            with self._counting_shared(model) as shared:
                try:
                    values = await self.infer_batch(
                        model, [rows[i] for i in index], tenant=tenant, priority=priority,
                        version=version,
                    )
                except TrioserveError as exc:
                    # the items the model ran for (not those from the cache or repeated)
                    ran = len(index) - len(shared)
                    family.record_shared(version, len(shared))
                    family.record_failure(version, exc, trio.current_time() - t0, ran)
                    errors[index[0]] = exc
                    return
            family.record_shared(version, len(shared))
            latency = trio.current_time() - t0
            for n, (i, value) in enumerate(zip(index, values, strict=True)):
                out[i] = value
                if n in shared:  # from the cache, or a repeat: no check, no copy
                    continue
                family.record(version, True, latency)  # the part's, once per item run
                if family.controller is not None:
                    family.controller.shadow_copy(version, rows[i], value, tenant)

        if len(parts) == 1:
            ((version, index),) = parts.items()
            await run(version, index)
        else:
            async with trio.open_nursery() as nursery:
                for version, index in parts.items():
                    nursery.start_soon(run, version, index)
        if errors:
            raise errors[min(errors)]
        return out

    async def _run_shadow(
        self, model: str, served: ServedModel, inputs: Any, tenant: str | None
    ) -> dict[str, Any]:
        """A shadow's copy of ``inputs`` run on ``served`` (the shadow version's,
        of the family whose controller sends it) at the lowest request
        class: not cached, not charged to the tenant's credits, not counted in the
        model's latencies; its deadline is the model's timeout. Cancelling it
        withdraws the copy if it has not been dispatched yet. ``tenant`` as the
        caller gave it (None: the default tenant, whose flow the copy joins)."""
        if tenant is None:
            tenant = self._default_tenant
        try:
            item, cost = served.backend.prepare(model, inputs)
        except TrioserveError:
            raise
        except Exception as exc:
            raise _prepare_failed(model, exc) from exc
        now = trio.current_time()
        reply = Reply()
        request = Request(
            model=model, item=item, cost=cost, tenant=tenant,
            priority=self._class_order[-1], arrival=now, deadline=now + served.timeout,
            answer_expiry=True, reply=reply,
        )
        served.scheduler_for(cost).submit_nowait(request)
        return await reply.wait()

    def _counting_shared(self, model: str) -> AbstractContextManager[set[int]]:
        """The positions among the items of the block's call of the answers that
        ``model`` did not run for (``CacheActor.counting_shared``; always none for a
        model not cached)."""
        if model in self._cached:
            return self.cache.counting_shared()
        return contextlib.nullcontext(set())

    def _groups_of(self, model: str) -> list[ServedModel]:
        """Every ServedModel serving ``model``: its own, or each of its versions'."""
        family = self._families.get(model)
        return list(family.groups) if family is not None else [self.models[model]]

    def _lanes_of(self, model: str) -> list[Any]:
        """Every scheduler serving ``model``: its lanes, and those of each of its
        versions with weights of their own."""
        return [lane for served in self._groups_of(model) for lane in served.schedulers]

    def health(self) -> dict[str, Any]:
        out = super().health()
        for name, family in self._families.items():
            if len(family.groups) > 1 and name in out:
                # every version's replicas: it listed one group's alone
                out[name]["replicas"] = {
                    b.name: replica_health(b) for g in family.groups for b in g.batchers
                }
        return out

    def readiness(self, model: str, version: str | None = None) -> dict[str, Any]:
        out = super().readiness(model, version)
        family = self._families.get(model)
        if family is not None and len(family.groups) > 1:
            # ``replicas`` are the asked version's (or the target's) alone, and
            # those of the versions sharing them: said (``replicas_of``), and the
            # others' labelled by version, so that the two never read as one
            asked = self._probed(model, version)
            out["replicas_of"] = [
                v for v, served in family.by_version.items() if served is asked
            ]
            out["other_versions"] = {
                v: dict(sorted(collections.Counter(
                    replica_health(b) for b in served.batchers
                ).items()))
                for v, served in family.by_version.items() if served is not asked
            }
        return out

    def statistics(self) -> dict[str, Any]:
        out = super().statistics()
        for name, family in self._families.items():
            if len(family.groups) > 1:
                # the model's queue figures are all its versions' together
                out[name]["queue_depth"] = sum(
                    q.queue_depth() for g in family.groups for q in g.schedulers
                )
                out[name].update(self._queue_statistics(
                    _MergedQueues([g.scheduler.policy for g in family.groups])
                ))
                slow = [g.slow_scheduler.policy for g in family.groups
                        if g.slow_scheduler is not None]
                out[name]["slow_lane"] = (
                    self._queue_statistics(_MergedQueues(slow)) if slow else None
                )
                # and so are its replicas, each with the versions it serves (the
                # name of one of a version with weights of its own says which)
                out[name]["replicas"] = [
                    {"name": b.name, "state": b.state.value, "health": replica_health(b),
                     "restarts": b.restarts,
                     "versions": [v for v, s in family.by_version.items() if s is g]}
                    for g in family.groups for b in g.batchers
                ]
                out[name]["replica_count"] = len(out[name]["replicas"])
                # and so is its autoscaling: each version's autoscaler (they are
                # all autoscaled or none is: the versions share the model's table)
                out[name]["autoscaler"] = merged_autoscalers([
                    ([v for v, s in family.by_version.items() if s is g], g.scaler.statistics())
                    for g in family.groups if g.scaler is not None
                ])
            out[name]["versions"] = {
                v: {
                    "own_weights": v in family.own,
                    "queue_depth": sum(q.queue_depth() for q in served.schedulers),
                    "replicas": [
                        {"name": b.name, "state": b.state.value,
                         "health": replica_health(b), "restarts": b.restarts}
                        for b in served.batchers
                    ],
                    "autoscaler": (
                        served.scaler.statistics() if served.scaler is not None else None
                    ),
                    "ready": self.model_ready(name, v),
                }
                for v, served in family.by_version.items()
            }
            if family.controller is not None:
                out[name]["rollout"] = family.controller.statistics()
        return out


def merged_autoscalers(
    parts: Sequence[tuple[list[str], dict[str, Any]]],
) -> dict[str, Any] | None:
    """The ``autoscaler`` statistics of a model whose versions have replicas of their
    own, from each group's (the versions it serves, its autoscaler's statistics):
    the counts added up (``desired`` None until every one looked), the model's
    target, and the latest decision of any, with the ``versions`` it scaled. None
    when the model is not autoscaled."""
    if not parts:
        return None
    stats = [s for _, s in parts]
    desired = [s["desired"] for s in stats]
    decided = [(s["last_decision"], vs) for vs, s in parts if s["last_decision"] is not None]
    last = None
    if decided:
        decision, versions = max(decided, key=lambda d: d[0]["at"])
        last = {**decision, "versions": versions}
    return {
        "replicas": sum(s["replicas"] for s in stats),
        "min_replicas": sum(s["min_replicas"] for s in stats),
        "max_replicas": sum(s["max_replicas"] for s in stats),
        "target_queued_per_replica": stats[0]["target_queued_per_replica"],
        "desired": None if None in desired else sum(desired),
        "last_decision": last,
        "decisions": {
            direction: sum(s["decisions"].get(direction, 0) for s in stats)
            for direction in stats[0]["decisions"]
        },
        "start_failures": sum(s["start_failures"] for s in stats),
    }


class _Limit:
    __slots__ = ("value",)

    def __init__(self, value: float) -> None:
        self.value = value


class _MergedQueues:
    """The flows of several queues (a model's versions') read as one queue's, for
    ``Runtime._queue_statistics``: counters summed, waits' histograms added, the
    admission limits and service rates summed."""

    def __init__(self, policies: Sequence[Any]) -> None:
        self.stats: dict[Any, Any] = {}
        self._live: dict[Any, int] = {}
        limits = [p.limit.value for p in policies if getattr(p, "limit", None) is not None]
        self.limit = _Limit(sum(limits)) if limits else None
        rates = [p.rate for p in policies if getattr(p, "rate", None) is not None]
        self.rate = sum(rates) if rates else None
        for p in policies:
            live = p.queued_by_flow() if hasattr(p, "queued_by_flow") else {}
            for flow, n in live.items():
                self._live[flow] = self._live.get(flow, 0) + n
            for flow, f in getattr(p, "stats", {}).items():
                into = self.stats.get(flow)
                if into is None:
                    into = self.stats[flow] = type(f)()
                for a in attrs.fields(type(f)):
                    if a.name != "wait":
                        setattr(into, a.name, getattr(into, a.name) + getattr(f, a.name))
                f.wait.fold()
                into.wait.hist.add(f.wait.hist)
                into.wait.overflow += f.wait.overflow
                into.wait.total_us += f.wait.total_us

    def queued_by_flow(self) -> dict[Any, int]:
        return self._live
