"""Planted bugs of the runtime's actors (the batcher, the scheduler actor, the
breakers, the runtime's split of a call between lanes, a running batch's deadlines),
which the runtime suite sees. Listed in ``fuzz._mutants.MUTANTS``."""

from __future__ import annotations

from typing import Any

import trioserve.actors
from trioserve import Request, RequestState
from trioserve.actors._in_flight import InFlight

BatcherActor = trioserve.actors.BatcherActor
SchedulerActor = trioserve.actors.SchedulerActor
Breaker = trioserve.actors.Breaker
Runtime = trioserve.Runtime


class SwapsTwoReplies(BatcherActor):
    """The batcher answers the first two requests of a batch with each other's output."""

    def _deliver(self, batch: list[Request], outputs: Any, t0: float) -> None:
        if len(batch) >= 2 and len(outputs) == len(batch):
            outputs = [outputs[1], outputs[0], *outputs[2:]]
        super()._deliver(batch, outputs, t0)


class SubmitsSplitCallsItemByItem(Runtime):
    """A call whose items go to both of a model's lanes is queued item by item
    (``Runtime._submit_all`` before its fix): an item admitted in one lane may push out
    another tenant's request before a later item is refused in the other lane, and
    the call, withdrawn whole, leaves that request shed for nothing."""

    def _submit_split(
        self, served: Any, requests: list[Request], tenant: str, priority: str
    ) -> None:
        for req in requests:
            served.scheduler_for(req.cost).submit_nowait(req)


class KeepsAnsweredTwins(BatcherActor):
    """A replica that answers a hedged request (or its copy) leaves the other
    queued or running: it is withdrawn only when its caller wakes, after this
    replica, or another, may already have pulled it."""

    def _deliver(self, batch: list[Request], outputs: Any, t0: float) -> None:
        scheduler = self._scheduler
        twins, scheduler.twins = scheduler.twins, {}
        try:
            super()._deliver(batch, outputs, t0)
        finally:
            scheduler.twins = twins


class RunsCopiesBesideOriginals(BatcherActor):
    """A batcher keeps a hedge copy it pulls with its original (``keep_apart``
    never called): both run in one batch on one replica, which hedges nothing."""

    def _keep_apart(self, batch: list[Request]) -> list[Request]:
        return batch


class DropsPartsForElsewhere(BatcherActor):
    """A part of a failed batch that raised alone here is marked to run elsewhere,
    but never handed back to the scheduler: nobody answers it."""

    def _model_failed(self, batch: list[Request], exc: BaseException) -> bool:
        unmarked = [r for r in batch if r.reply.raised_on is None]
        opened = super()._model_failed(batch, exc)
        retries = self._scheduler._retries
        for r in unmarked:
            if r.reply.raised_on is not None:
                for b in [b for b in retries if len(b) == 1 and b[0] is r]:
                    retries.remove(b)
        return opened


class RetriesWhereTheyRaised(SchedulerActor):
    """The scheduler ignores where a part raised alone: whoever pulls first takes
    it, most often the replica it just raised on (the batcher then answers it that
    replica's error)."""

    def _elsewhere(self, batch: list[Request], puller: Any) -> bool:
        return False


class KeepsApartWhereTheyRaised(SchedulerActor):
    """A request kept apart from its hedge twin's replica goes to the first other
    replica that pulls, even the one it raised alone on as a part of a failed batch:
    ``_next_apart`` forgets the elsewhere rule (``_next_retry`` keeps it)."""

    def _next_apart(self, puller: Any, now: float) -> list[Request] | None:
        apart = self._apart
        for _ in range(len(apart)):
            req = apart.popleft()
            if self._drop_apart(req, now):
                continue
            twin = self.twins.get(req.reply)
            if puller is not None and twin is not None and puller.holds(twin):
                apart.append(req)
                continue
            return [req]
        return []


class ConfirmsAcrossRuns(Breaker):
    """A part answered elsewhere counts against the replica it raised on whenever
    it comes in: after that replica succeeded since (a later run: the evidence is
    stale), or while its breaker is open already (evidence of the failures that
    opened it, counted again)."""

    def confirmed(self, now: float, run: int) -> bool:
        self.failure(now)
        return self.failures >= self.threshold


class AnswersExpiredRequestsLate(BatcherActor):
    """A batch's late answer goes to each of its requests, also to one its replica
    answered DeadlineExceeded while the batch ran (the delivery guard,
    ``Reply.answerable``, dropped): a second answer to one reply, which raises and
    crashes the replica; the batch's other callers get ActorBroken."""

    def _deliver(self, batch: list[Request], outputs: Any, t0: float) -> None:
        if len(outputs) == len(batch):
            for req, out in zip(batch, outputs, strict=True):
                if req.reply.state is RequestState.DONE:
                    req.reply.set_result(out)
        super()._deliver(batch, outputs, t0)


class _NeverDisarms(InFlight):
    """Batches leave without their deadlines being disarmed."""

    def popleft(self) -> list[Request]:
        self._deadlines.popleft()
        return self._batches.popleft()

    def pop(self) -> list[Request]:
        self._deadlines.pop()
        return self._batches.pop()

    def clear(self) -> None:
        self._deadlines.clear()
        self._batches.clear()


class _ExpiresTheWholeBatch(InFlight):
    """At a batch's first deadline, every request of it still waiting is answered."""

    def expired(self, requests: list[Request]) -> None:
        batch = next(b for b in self._batches if any(r is requests[0] for r in b))
        super().expired([
            r for r in batch if r.answer_expiry and r.reply.state is RequestState.DISPATCHED
        ])


def _in_flight_of(cls: type[InFlight]) -> type:
    class HoldsBatchesIn(BatcherActor):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            held = self._in_flight
            self._in_flight = cls(model=held.model, watchdog=held.watchdog, noted=held._noted)

    HoldsBatchesIn.__name__ = HoldsBatchesIn.__qualname__ = f"HoldsBatchesIn{cls.__name__}"
    return HoldsBatchesIn
