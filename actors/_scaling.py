"""The autoscaler's actor: one per autoscaled model (``[models.NAME.autoscaling]``),
supervised in the runtime's root nursery like the model's scheduler and batchers.

Every ``interval_s`` it tells its :class:`Autoscaler` (the sans-IO decision) the
model's load (``SchedulerActor.load``: cost queued, in service and held for a
retry) and how many replicas serve, and carries out what it decides:

- **up**: a new replica per replica wanted, all started at once, each in its own
  task of the controller's nursery, as the runtime starts one (the assembly's
  ``start_replica``: registered with the model and its queue, supervised in the
  root nursery; it pulls only once its model is loaded), on the model's device
  with the fewest serving replicas (round-robin as they grow), never on one where
  a replica lost its device. A replica loading counts as serving, so the next
  look sees it. One that fails to load is logged and the next try waits the
  upscale delay again.
- **down**: the replicas to go are retired (``BatcherActor.retire``), idle ones
  first, then the newest: each pulls no more, finishes what it holds, releases
  its worker process or model, and is unregistered once its ``run`` returned.

A replica that lost its device, a broken or stopped one, and one retiring, do not
count as serving. The queue's adaptive limit keeps its floor of two full batches
per replica that pulls. Nothing is decided once the runtime is closing or the
model's queue is retired (every replica lost its device).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from trioserve import Actor, ActorState

from ._autoscale import Autoscaler
from ._batcher import retire_if_lost

log = logging.getLogger("trioserve")

_GONE = (ActorState.STOPPED, ActorState.BROKEN)


def serves(batcher: Any) -> bool:
    """Whether ``batcher`` counts as a serving replica: not lost, retiring, broken
    or stopped (one starting, restarting, degraded, replacing its worker or with
    its breaker open serves again without the autoscaler)."""
    return batcher.lost is None and not batcher.retiring and batcher.state not in _GONE


class ScalingController(Actor):
    """Scales one model's replicas with its load (see the module's docstring).

    ``served``: the model as served (its ``batchers``, ``scheduler``, ``config``,
    ``remove_replica``); ``start_replica(index, device)``: starts and registers a
    replica, returning it once its model is loaded; ``closing()``: whether the
    runtime is shutting down; ``floor_per_replica``: the adaptive limit's floor
    per replica.
    """

    def __init__(
        self,
        *,
        served: Any,
        scaler: Autoscaler,
        start_replica: Callable[[int, str], Awaitable[Any]],
        closing: Callable[[], bool],
        floor_per_replica: int,
    ) -> None:
        super().__init__()
        self.model = served.config.name
        self.name = f"autoscaler[{served.label}]"
        self.scaler = scaler
        self._served = served
        self._start_replica = start_replica
        self._closing = closing
        self._floor = floor_per_replica
        self._next_index = 1 + max((b.index for b in served.batchers), default=-1)
        self.start_failures = 0  # replicas that failed to load when scaling up

    def serving(self) -> list[Any]:
        """The model's replicas that count as serving (:func:`serves`)."""
        return [b for b in self._served.batchers if serves(b)]

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            # (after a restart: replicas it retired before are still to unregister)
            for b in self._served.batchers:
                if b.retiring:
                    nursery.start_soon(self._unregister, b)
            task_status.started(self)
            while True:
                await trio.sleep_until(self.scaler.next_look())
                if self._closing() or self._served.scheduler.closed:
                    break
                await self._look(nursery)
            await trio.sleep_forever()  # the retirements under way still end

    async def _look(self, nursery: trio.Nursery) -> None:
        serving = self.serving()
        current = len(serving)
        load = self._served.scheduler.load()
        want = self.scaler.decide(trio.current_time(), load=load, current=current)
        if want == current:
            return
        decision = self.scaler.last_decision  # its load: the look-back window's mean
        assert decision is not None
        log.info(
            "model %r: scaling %s from %d to %d replicas (load %g cost units, %g per "
            "replica wanted)", self.model, "up" if want > current else "down",
            current, want, decision.load, self.scaler.target,
        )
        if want > current:
            await self._scale_up(want - current, nursery)
        else:
            self._scale_down(serving, current - want, nursery)

    def _place(self) -> str | None:
        """The device for a new replica: of the model's devices where no replica
        lost its device, the one with the fewest serving replicas (the first of
        those in the config's order); None when there is none."""
        batchers = self._served.batchers
        lost = {b.device for b in batchers if b.lost is not None}
        usable = [d for d in dict.fromkeys(self._served.config.devices) if d not in lost]
        if not usable:
            return None
        count = collections.Counter(b.device for b in batchers if serves(b))
        return min(usable, key=lambda d: count[d])

    async def _scale_up(self, n: int, nursery: trio.Nursery) -> None:
        """Start ``n`` replicas in ``nursery``, loading side by side; returns once
        each is registered (not loaded). A checkpoint."""
        for _ in range(n):
            if self._closing() or self._served.scheduler.closed:
                return  # shutdown began: no more
            if not await nursery.start(self._add_replica):
                return  # no device to place it on

    async def _add_replica(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Place a replica, start it and wait for its model to load. Reports
        ``started(True)`` once it is registered (``started(False)``: no device to
        place it on, or shutdown began since the decision), so the next one's
        placement counts it."""
        if self._closing() or self._served.scheduler.closed:
            # (this task runs a checkpoint after ``_scale_up`` looked: shutdown may
            # have begun meanwhile, and no replica is started once it began)
            task_status.started(False)
            return
        device = self._place()
        if device is None:
            log.warning(
                "model %r: no replica added: each of its devices lost a replica's "
                "device context", self.model,
            )
            self.scaler.failed()
            task_status.started(False)
            return
        index = self._next_index
        self._next_index += 1
        # No checkpoint between this and ``start_replica`` registering the replica
        # (before its first checkpoint): the starter resumes only after it.
        task_status.started(True)
        try:
            batcher = await self._start_replica(index, device)
        except Exception as exc:
            self.start_failures += 1
            self.scaler.failed()
            self._retire_if_lost()
            log.warning(
                "model %r: a new replica on %s failed to start (%s); the next try "
                "waits the upscale delay", self.model, device, exc,
            )
            return
        self._set_floor()
        log.info("model %r: replica %s serving", self.model, batcher.name)

    def _scale_down(self, serving: list[Any], n: int, nursery: trio.Nursery) -> None:
        # Idle ones first (nothing to finish), then the newest.
        for b in sorted(serving, key=lambda b: (not b.idle, -b.index))[:n]:
            log.info(
                "model %r: retiring replica %s%s", self.model, b.name,
                "" if b.idle else " (it finishes the batches it holds)",
            )
            b.retire()
            nursery.start_soon(self._unregister, b)
        self._set_floor()

    async def _unregister(self, batcher: Any) -> None:
        await batcher.wait_retired()
        self._served.remove_replica(batcher)
        log.info("model %r: replica %s retired", self.model, batcher.name)
        self._retire_if_lost()

    def _retire_if_lost(self) -> None:
        """A replica left (retired, or failed to start): it may have been the last
        one that could serve the queue. Should every one left have lost its device,
        nothing will pull from it again (no replica is placed on a lost device), so
        it refuses at once, as when the last replica loses its device."""
        scheduler = self._served.scheduler
        lost = [b.lost for b in scheduler.batchers if b.lost is not None]
        if lost:
            retire_if_lost(scheduler, lost[-1])

    def _set_floor(self) -> None:
        """The adaptive limit's floor: two full batches per replica that pulls (one
        that lost its device, is broken or stopped, or retires, pulls nothing)."""
        pulling = sum(1 for b in self._served.batchers if serves(b))
        set_min_limit = getattr(self._served.scheduler.policy, "set_min_limit", None)
        if set_min_limit is not None:
            set_min_limit(self._floor * max(1, pulling))

    def statistics(self) -> dict[str, Any]:
        """The replicas serving and the autoscaler's state (``rt.statistics()``)."""
        s = self.scaler.statistics()
        last = s.last_decision
        return {
            "replicas": len(self.serving()),
            "min_replicas": s.min_replicas,
            "max_replicas": s.max_replicas,
            "target_queued_per_replica": s.target,
            "desired": s.desired,
            "last_decision": None if last is None else {
                "direction": last.direction, "from": last.before, "to": last.after,
                "at": last.at, "load": last.load,
            },
            "decisions": s.decisions,
            "start_failures": self.start_failures,
        }
