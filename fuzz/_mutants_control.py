"""Planted bugs of the runtime's controllers: model control (loads, unloads and
the hand-over of a model's queue), which the control suite sees, and autoscaling,
which the autoscale suite sees. Listed in ``fuzz._mutants.MUTANTS``."""

from __future__ import annotations

import math
from typing import Any

import trioserve._control
import trioserve.actors
from trioserve import Request

SchedulerActor = trioserve.actors.SchedulerActor
ModelControl = trioserve._control.ModelControl
Autoscaler = trioserve.actors.Autoscaler
ScalingController = trioserve.actors.ScalingController


class UnloadsBeforeTheReplacedCopyDrained(ModelControl):
    """An unload waits for the copy it unloads, not for one an earlier reload
    replaced that is still draining."""

    async def _unload(self, entry: Any, op: Any, turn: Any) -> None:
        entry.replaced.clear()
        await super()._unload(entry, op, turn)


class UnloadWaitsForAReload(ModelControl):
    """An unload asked while a reload is under way waits for it (and unloads the
    copy it loaded) instead of abandoning it, as the rule was before: the reload's
    callers are answered as if no unload had been asked."""

    def _abandon(self, entry: Any, op: Any) -> None:
        if op.scope is not None and entry.copy is not None:  # a reload under way
            return
        super()._abandon(entry, op)


class HandOverDropsTheQueued(SchedulerActor):
    """A hand-over (reload, unload) drops the batch queued at the swap: taken from
    the queue, never run nor answered."""

    def hand_over(self, successor: Any, check: Any = None, *, refuse_held: bool = False) -> None:
        super().hand_over(successor, check, refuse_held=refuse_held)
        self.policy.next_batch(math.inf)


class HandOverRefusesLateSubmits(SchedulerActor):
    """A queue handed over (reload, unload) refuses a request submitted after the
    swap (one that looked the model up before it, then waited for its credits) as
    if the runtime had shut down, instead of handing it to what replaced it."""

    def submit_nowait(self, request: Request) -> None:
        if self._closed and self.successor is not None:
            raise self._refusal()
        super().submit_nowait(request)

    def submit_all_nowait(self, requests: list[Request]) -> None:
        if self._closed and self.successor is not None:
            raise self._refusal()
        super().submit_all_nowait(requests)

    def plan_all_nowait(self, requests: list[Request]) -> Any:
        # a call split between a model's lanes is planned first, then submitted
        if self._closed and self.successor is not None:
            raise self._refusal()
        return super().plan_all_nowait(requests)


class StartingReplicasUncounted(ScalingController):
    """A replica still loading does not count as serving: a look while the replicas
    of an earlier decision load asks for them again, and the count overshoots."""

    def serving(self) -> list[Any]:
        return [b for b in super().serving() if b.health != "starting"]


class WindowOfTheLastSample(Autoscaler):
    """The look-back window is kept, but its mean is the latest sample alone."""

    def _average(self, now: float, load: float) -> float:
        super()._average(now, load)
        return load
