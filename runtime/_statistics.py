"""The runtime's statistics and health: per-model counters, latency summaries and
flows, the result cache's counters, and whether each model can serve now."""

from __future__ import annotations

import collections
from typing import Any

import trio


def replica_health(batcher: Any) -> str:
    """A replica's health (``BatcherActor.health``), or its actor's state for a
    replica that has none."""
    return getattr(batcher, "health", batcher.state.value)


class _Statistics:
    """The Runtime's statistics and health methods."""

    def statistics(self) -> dict[str, Any]:
        """Per-model counters and latency summaries (computed now; not for hot paths)."""
        out = {}
        now = trio.current_time()
        for name, s in self.models.items():
            m = s.metrics
            out[name] = {
                "queue_depth": sum(q.queue_depth() for q in s.schedulers),
                "batches": m.batches,
                "items": m.items,
                "fill_ratio": m.fill_ratio,
                "queue_wait": m.queue_wait.summary(),
                "batch_exec": m.batch_exec.summary(),
                "end_to_end": m.end_to_end.summary(),
                "statuses": dict(m.statuses),
                "replicas": [
                    {"name": b.name, "state": b.state.value, "health": replica_health(b),
                     "restarts": b.restarts}
                    for b in s.batchers
                ],
                "replica_count": len(s.batchers),
                # as the trioserve_replicas{model, health} gauge counts them
                "replica_health": self._replica_health(name),
                # (None: the replicas are fixed; docs/faults.md, Autoscaling)
                "autoscaler": s.scaler.statistics() if s.scaler is not None else None,
                "ready": self.model_ready(name),
                **self._queue_statistics(s.scheduler.policy),
                "slow_lane": (
                    self._queue_statistics(s.slow_scheduler.policy)
                    if s.slow_scheduler is not None else None
                ),
                "hedges_after_s": s.hedge_timer.value if s.hedge_timer is not None else None,
                "slo": s.slo.statistics(now) if s.slo is not None else None,
            }
        return out

    def _replica_health(self, model: str) -> dict[str, int]:
        """``model``'s replicas (all its versions') counted by health: every health
        a replica may have (``REPLICA_HEALTH``, as the assembly gave it), 0 when none
        has it."""
        every = self._replica_healths
        counts = collections.Counter(
            replica_health(b) for g in self._groups_of(model) for b in g.batchers
        )
        return {h: counts[h] for h in (*every, *sorted(set(counts) - set(every)))}

    @staticmethod
    def _queue_statistics(policy: Any) -> dict[str, Any]:
        limit = getattr(policy, "limit", None)
        live = policy.queued_by_flow() if hasattr(policy, "queued_by_flow") else {}
        flows = {
            f"{tenant}/{cls}": {
                "queued": live.get((tenant, cls), 0),
                "admitted": f.admitted,
                "shed": f.shed,
                "expired": f.expired,
                "expired_running": f.expired_running,
                "dispatched": f.dispatched,
                "served_cost": f.served_cost,
                "hedged": f.hedged,
                "withdrawn": f.withdrawn,
                "closed": f.closed,
                "pushed_out": f.pushed_out,
                "superseded": f.superseded,
                "gave_way": f.gave_way,
                "wait": f.wait.summary(),
            }
            for (tenant, cls), f in sorted(getattr(policy, "stats", {}).items())
        }
        return {
            "flows": flows,
            "admission_limit": limit.value if limit is not None else None,
            "service_rate": getattr(policy, "rate", None),
        }

    def cache_statistics(self) -> dict[str, Any]:
        """The result cache (hits, misses, hit rate, bytes, evictions, admissions
        rejected) and coalescing (``computations``: flights started; ``coalesced``:
        requests that joined one in flight; ``reruns``: a flight's computation run
        again for joined requests after another's deadline; ``late_answers``: joined
        requests answered instead by the batch still running when that deadline
        passed, one per batch answer; ``in_flight``). With the cache off: the
        coalescing counters alone when a model has ``coalesce = true``, else {}."""
        return self.cache.statistics() if self.cache is not None else {}

    def model_ready(self, model: str, version: str | None = None) -> bool:
        """Whether ``model`` can serve now: the runtime is open and at least one of its
        replicas is ready (running, not degraded by a straggler, not replacing its
        worker, its circuit breaker not open: closed, or half-open, its trial taking
        work). Without ``version``, for a model with versions served apart (a
        rollout): those of the version its unversioned requests go to (the latest,
        the rollout's stable, or its canary once promoted; while a canary is on
        trial, the stable); with ``version``: one of the replicas serving that
        version. UnknownModel for a model (or version) not served."""
        served = self._probed(model, version)
        return not self._closed and any(
            getattr(b, "ready", False) for b in served.batchers
        )

    def readiness(self, model: str, version: str | None = None) -> dict[str, Any]:
        """Whether ``model`` (``version``: that version's replicas) can serve now, and
        if not why: ``ready`` (:meth:`model_ready`), ``state`` and ``reason`` (as
        :meth:`model_state` gives them: READY and "" when ready; UNAVAILABLE, LOADING
        or UNLOADING and why when not: ``no replica ready``, ``loading``, ``not
        loaded``, ``the runtime is shut down``, ...) and ``replicas``, the replicas
        that :meth:`model_ready` looks at counted by health (those there are:
        ``{"open": 1}``): without ``version``, those of the version unversioned
        requests go to (the latest, or the rollout's stable, or its canary once
        promoted: as :meth:`model_ready`); with it, that version's. A model whose
        versions have replicas of their own also has ``replicas_of``, the versions
        those ``replicas`` serve (the one probed and those sharing its replicas),
        and ``other_versions``: each other version's replicas by health, those not
        counted in ``replicas`` (docs/rollout.md). UnknownModel for a model (or
        version) not served. Not a checkpoint."""
        served = self._probed(model, version)
        ready = self.model_ready(model, version)
        state, reason = self.model_state(model)
        if ready:
            state, reason = "READY", ""
        elif state == "READY":  # the model serves; this version's replicas do not
            state, reason = "UNAVAILABLE", f"no replica of version {version!r} ready"
        counts = collections.Counter(replica_health(b) for b in served.batchers)
        return {
            "ready": ready, "state": state, "reason": reason,
            "replicas": dict(sorted(counts.items())),
        }

    def health(self) -> dict[str, Any]:
        """Per model: ready or not, and each replica's health (``BatcherActor.health``:
        ``ready``, ``half_open``, ``open``, ... see docs/faults.md)."""
        return {
            name: {
                "ready": self.model_ready(name),
                "replicas": {b.name: replica_health(b) for b in s.batchers},
            }
            for name, s in self.models.items()
        }
