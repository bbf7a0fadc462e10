"""``ServedModel``: one model as the runtime serves it (its config, backend, lanes'
schedulers, batchers and metrics), made by the assembly and read by the front door."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from ._config import ModelConfig
from ._model import ModelBackend


def label(model: str, version: str | None) -> str:
    """``model``, or ``model/version`` (a version with weights of its own): as a
    URL names it, so that each replica's name is its own."""
    return model if version is None else f"{model}/{version}"


@attrs.define(eq=False)
class ServedModel:
    """A model as served: its config, backend, scheduler, batchers and metrics."""

    config: ModelConfig
    backend: ModelBackend
    scheduler: Any
    batchers: list[Any]
    metrics: Any
    limits: Any
    timeout: float
    #: requests of at least this cost go to the slow lane's own queue and replicas
    slow_cost: int | None = None
    slow_scheduler: Any = None
    #: recent end-to-end latencies; their p95 is when a hedged request sends its copy
    hedge_timer: Any = None
    #: the model's service-level objective (an ``SloTracker``; None: none)
    slo: Any = None
    #: the controller scaling its replicas with its load (None: they are fixed); a
    #: model not loaded keeps its last copy's, stopped, for its counters
    scaler: Any = None
    #: False for a model known to the configuration and not loaded (explicit model
    #: control): it refuses every request and has no replica
    loaded: bool = True
    #: the version with weights of its own it serves (None: the model's backend,
    #: serving the versions without any)
    version: str | None = None
    #: the copy that replaced it at a reload (explicit model control), set at the
    #: swap: the one its new requests are handed over to (the same version's, for a
    #: version with weights of its own). None: it serves, or it was unloaded. Only
    #: forward: what holds a copy (a request that looked it up) holds the copies
    #: that may have run that request, and no longer than that
    successor: ServedModel | None = None
    #: set when it takes no more new requests (explicit model control): replaced by
    #: a reload (``successor`` then) or unloaded (no ``successor``); requests
    #: waiting for their tenant's credits wake on it
    retired: trio.Event = attrs.Factory(trio.Event)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def label(self) -> str:
        """Its name in its actors' names and the log: the model's, or
        ``model/version`` for a version with weights of its own."""
        return label(self.config.name, self.version)

    def scheduler_for(self, cost: int) -> Any:
        if self.slow_cost is not None and cost >= self.slow_cost:
            return self.slow_scheduler
        return self.scheduler

    def remove_replica(self, batcher: Any) -> None:
        """Unregister ``batcher`` (retired, or failed to start) from the model and
        its lane: it is no longer counted, asked for its health or closed."""
        self.batchers.remove(batcher)
        for lane in self.schedulers:
            if batcher in lane.batchers:
                lane.batchers.remove(batcher)
                lane.replicas -= 1

    @property
    def schedulers(self) -> list[Any]:
        return [s for s in (self.scheduler, self.slow_scheduler) if s is not None]
