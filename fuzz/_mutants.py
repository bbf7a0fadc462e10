"""Planted bugs for ``python -m fuzz --self-test``: subclasses of the product's classes,
each breaking one promise. They exist only here; the product code is never changed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import attrs
import trioserve._control
import trioserve.actors
from trioserve import Overloaded, Request, RequestState
from trioserve.actors import SHARED_NAMESPACE, cache_key
from trioserve.actors._in_flight import InFlight

from ._mutants_flights import FLIGHT_MUTANTS
from ._product import PRODUCT, Product

FairQueue = trioserve.actors.FairQueue
BatcherActor = trioserve.actors.BatcherActor
SchedulerActor = trioserve.actors.SchedulerActor
Breaker = trioserve.actors.Breaker
TokenBucket = trioserve.actors.TokenBucket
Runtime = trioserve.Runtime
Cache = trioserve.actors.Cache
CacheActor = trioserve.actors.CacheActor
Rollout = trioserve.actors.Rollout
ModelControl = trioserve._control.ModelControl
RolloutController = trioserve.actors.RolloutController
Autoscaler = trioserve.actors.Autoscaler
ScalingController = trioserve.actors.ScalingController


class DropsOneRequest(FairQueue):
    """next_batch silently loses the last request of a batch of two or more (it is
    already DISPATCHED, so nobody will ever answer it)."""

    def next_batch(self, now: float) -> list[Request] | None:
        batch = super().next_batch(now)
        if batch and len(batch) >= 2:
            batch.pop()
        return batch


class SwapsTwoReplies(BatcherActor):
    """The batcher answers the first two requests of a batch with each other's output."""

    def _deliver(self, batch: list[Request], outputs: Any, t0: float) -> None:
        if len(batch) >= 2 and len(outputs) == len(batch):
            outputs = [outputs[1], outputs[0], *outputs[2:]]
        super()._deliver(batch, outputs, t0)


class IgnoresDeadlines(FairQueue):
    """The deadline check is skipped: the queue keeps every request as if it had none,
    so an expired one is dispatched (and a model timeout is never answered)."""

    def offer(self, request: Request, now: float) -> None:
        super().offer(attrs.evolve(request, deadline=math.inf), now)


class ExceedsBudget(FairQueue):
    """Batches close one item (and one token unit) past the configured limits."""

    def __init__(self, limits: Any, **kw: Any) -> None:
        max_tokens = None if limits.max_tokens is None else limits.max_tokens + 1
        super().__init__(
            attrs.evolve(limits, max_size=limits.max_size + 1, max_tokens=max_tokens), **kw
        )


class NoAging(FairQueue):
    """Aging is disabled: lower classes wait for as long as a higher one has work."""

    def __init__(self, limits: Any, **kw: Any) -> None:
        classes = [attrs.evolve(c, aging=math.inf) for c in kw.get("classes", ())]
        if classes:
            kw["classes"] = classes
        super().__init__(limits, **kw)


class AgedFirst(FairQueue):
    """The aging rule as it was: aged requests go before everything else (the others
    are never picked while one waits), so a backlog of them starves the top class."""

    def _pick_rest(self, now: float) -> Any:
        return None


class IgnoresWeights(FairQueue):
    """Fair share treats every tenant as weight 1."""

    def __init__(self, limits: Any, **kw: Any) -> None:
        kw["weights"] = {}
        super().__init__(limits, **kw)


class ReversesBatches(FairQueue):
    """A batch is handed out newest first."""

    def next_batch(self, now: float) -> list[Request] | None:
        batch = super().next_batch(now)
        return batch[::-1] if batch else batch


class QueuesCallsItemByItem(FairQueue):
    """``offer_all`` as it was: the items of a call are offered one by one and, on a
    refusal, those already queued are withdrawn; the requests of other tenants they
    pushed out on their way stay shed for a call that was refused."""

    def offer_all(self, requests: Sequence[Request], now: float) -> None:
        n = len(requests)
        if n > self._capacity and self._count == self._dead:
            self._capacity = min(n, self.bound)
        done = 0
        try:
            for request in requests:
                self.offer(request, now)
                done += 1
        except Overloaded:
            for request in requests[:done]:
                request.reply.withdraw()
            first = requests[0]
            c = self._rank.get(first.priority, len(self.classes) - 1)
            stats = self._stats(first.tenant, self.classes[c].name)
            stats.admitted -= done
            stats.shed += n - 1
            raise
        finally:
            self._update_capacity()


class DropsRunningCopies(FairQueue):
    """A new request that finds the queue full takes the room of the newest hedge
    copy still answerable, queued or already dispatched: ``_copies`` is pruned only
    at the next ``offer_spare``, so a copy running on a device is answered
    Overloaded (and its batch answers it again) while the queue counts room it never
    had."""

    def _drop_copy(self, tenant: str | None) -> bool:
        copies = self._copies
        for i in range(len(copies) - 1, -1, -1):
            req = copies[i]
            if not req.reply.answerable or (tenant is not None and req.tenant != tenant):
                continue
            del copies[i]
            self._shed_copy(req)
            return True
        return False


class DeadlineWithdrawalAsCallers(FairQueue):
    """A request withdrawn at its caller's own deadline counts as withdrawn by its
    caller: neither expired nor a congestion signal for the adaptive limit."""

    def withdrawn_at_deadline(self, request: Request, now: float) -> None:
        self.withdrawn_by_caller(request)


class FailedBatchesStayInService(FairQueue):
    """A failed batch's cost is never taken off what the devices hold: the estimated
    waits grow with every failure, until every request with a deadline is refused."""

    def completed(self, batch: list[Request], now: float, *, failed: bool = False) -> None:
        if failed:
            self._prev_full = False
            return
        super().completed(batch, now)


class PushOutsOnlyShed(FairQueue):
    """A request pushed out of a full queue counts in its flow's ``shed`` only, as
    before ``pushed_out`` was counted: the flow's admitted requests no longer add up."""

    def _pushed_out(self, req: Request, c: int) -> None:
        stats = self._stats(req.tenant, self.classes[c].name)
        before = stats.pushed_out
        super()._pushed_out(req, c)
        stats.pushed_out = before


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


class RefundsToTheLevel(TokenBucket):
    """A refund puts all the credits back into the level, whatever waits behind the
    refunded reservation (the bucket's rule before its fix): the next reservation can
    start before earlier ones, and grants can pile up past the burst envelope."""

    def refund(self, cost: float, *, since: int | None = None) -> None:
        self.used -= cost
        self.level = min(self.burst, self.level + cost)


class GrantsOnAnyCredit(TokenBucket):
    """``try_take`` grants whenever the level is positive, whatever the cost."""

    def try_take(self, cost: float, now: float) -> float:
        self._refill(now)
        if self.level > 0:
            self.level -= cost
            self.used += cost
            return 0.0
        return super().try_take(cost, now)


class _FlightsWithoutGeneration:
    """A SingleFlight table whose keys lose their last part, the generation."""

    def __init__(self, flights: Any) -> None:
        self._flights = flights

    async def call(self, key: Any, fn: Any, *args: Any, **kw: Any) -> Any:
        return await self._flights.call(key[:-1], fn, *args, **kw)

    def __contains__(self, key: Any) -> bool:
        return key[:-1] in self._flights

    def statistics(self) -> Any:
        return self._flights.statistics()


class JoinsOlderFlights(CacheActor):
    """The flight key leaves out the generation (the cache actor before its fix): a
    request after an invalidation joins an identical one in flight from before it and
    gets the old weights' answer."""

    @property
    def _flights(self) -> Any:
        return self.__dict__.get("_flights_")

    @_flights.setter
    def _flights(self, flights: Any) -> None:
        self.__dict__["_flights_"] = None if flights is None else _FlightsWithoutGeneration(
            flights
        )


class OneNamespace(Cache):
    """Every tenant's key is in the shared namespace, whatever the model's rule: one
    tenant's answer from a model that is not shareable is served to another."""

    def key(self, model: str, version: str, tenant: str, inputs: Any, params: Any = None) -> Any:
        if not self.rule(model).enabled:
            return None
        return cache_key(model, version, SHARED_NAMESPACE, inputs, params)


class TtlIgnoredOnGet(Cache):
    """A lookup never finds an entry expired: one past its TTL is served until the
    cache actor's sweep drops it."""

    def __init__(self, capacity: int, **kw: Any) -> None:
        super().__init__(capacity, **kw)
        get = self.policy.get
        self.get = lambda key, now, default=None: get(key, -math.inf, default)


class RoutesByThePreviousShare(Rollout):
    """The split counts a new step's requests by the share of the step before it."""

    def route(self) -> str:
        if self.state is not trioserve.actors.RolloutState.CANARY or self.step == 0:
            return super().route()
        previous = Fraction(repr(self.rules.steps[self.step - 1]))
        self._routed += 1
        if math.floor(self._routed * previous) > self._to_canary:
            self._to_canary += 1
            assert self.canary is not None
            return self.canary
        return self.stable


class ResumesAfterARollback(Rollout):
    """A rolled-back canary goes back on trial, at its step's share, at the next tick."""

    def tick(self, now: float) -> list[Any]:
        if self.state is trioserve.actors.RolloutState.ROLLED_BACK:
            self.state = trioserve.actors.RolloutState.CANARY
            self._begin_step(now, Fraction(repr(self.rules.steps[self.step])))
        return super().tick(now)


class PauseStillAdvancesSteps(Rollout):
    """A pause holds the share, but the step still ends on time (and the last one
    promotes the canary), as if not paused."""

    def next_deadline(self) -> float:
        if self.state is trioserve.actors.RolloutState.PAUSED:
            return self.step_started + self.rules.step_s
        return super().next_deadline()

    def _check(self, now: float) -> list[Any]:
        paused = trioserve.actors.RolloutState.PAUSED
        if self.state is not paused:
            return super()._check(now)
        self.state = trioserve.actors.RolloutState.CANARY
        try:
            return super()._check(now)
        finally:
            if self.state is trioserve.actors.RolloutState.CANARY:
                self.state = paused


class ResumeCountsThePause(Rollout):
    """A resume leaves the step's start where it was: the pause counts in its
    ``step_s``."""

    def resume(self, now: float) -> list[Any]:
        self.paused_at = now
        return super().resume(now)


class PromotesARolledBackCanary(Rollout):
    """The operator may promote a canary already rolled back."""

    def refusal(self, action: str) -> str | None:
        if action == "promote" and self.state is trioserve.actors.RolloutState.ROLLED_BACK:
            return None
        return super().refusal(action)

    def promote(self, now: float) -> list[Any]:
        if self.state is trioserve.actors.RolloutState.ROLLED_BACK:
            self.state = trioserve.actors.RolloutState.CANARY
        return super().promote(now)


class StartKeepsTheOldStable(Rollout):
    """A trial the operator starts after a promotion runs against the last trial's
    stable, not its promoted canary (which took every unversioned request)."""

    def start(self, canary: str, rules: Any, now: float, *, operator: bool = True) -> list[Any]:
        if self.state is trioserve.actors.RolloutState.PROMOTED and canary != self.stable:
            self.state = trioserve.actors.RolloutState.ROLLED_BACK
        return super().start(canary, rules, now, operator=operator)


class PauseHoldsTheChecks(Rollout):
    """Paused, the outcomes are counted but no rule is checked: a breach waits for
    the resume."""

    def _check(self, now: float) -> list[Any]:
        if self.state is trioserve.actors.RolloutState.PAUSED:
            return []
        return super()._check(now)


class ResumeWaitsForAnAnswer(RolloutController):
    """A resume does not wake the controller: a step that lasted long enough ends
    only at the canary's next answer, not at once."""

    def _apply(self, events: list[Any]) -> None:
        if [e.kind for e in events] == ["resumed"]:
            self.events["resumed"] += 1
            return
        super()._apply(events)


class ShadowQueuePastItsBound(RolloutController):
    """The shadow's channel holds two copies more than ``shadow_queue``."""

    def __init__(self, *, shadow_queue: int = 64, **kw: Any) -> None:
        super().__init__(shadow_queue=shadow_queue + 2, **kw)


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

    def hand_over(self, successor: Any, check: Any = None) -> None:
        super().hand_over(successor, check)
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


#: name -> (what it breaks, the broken product, the suites that can see it)
MUTANTS: dict[str, tuple[str, Product, tuple[str, ...]]] = {
    "drop-request": (
        "next_batch drops one request of a batch",
        attrs.evolve(PRODUCT, name="drop-request", queue_class=DropsOneRequest),
        ("queue", "runtime"),
    ),
    "swap-replies": (
        "the batcher answers two requests with each other's output",
        attrs.evolve(PRODUCT, name="swap-replies", batcher_class=SwapsTwoReplies),
        ("runtime",),
    ),
    "dispatch-expired": (
        "the queue skips the deadline check",
        attrs.evolve(PRODUCT, name="dispatch-expired", queue_class=IgnoresDeadlines),
        ("queue", "runtime"),
    ),
    "over-budget": (
        "batches close at max_batch_size + 1 (and max_batch_tokens + 1)",
        attrs.evolve(PRODUCT, name="over-budget", queue_class=ExceedsBudget),
        ("queue", "runtime"),
    ),
    "no-aging": (
        "aging is disabled",
        attrs.evolve(PRODUCT, name="no-aging", queue_class=NoAging),
        ("queue", "runtime"),
    ),
    "aged-first": (
        "aged requests go before everything else: a backlog of them starves the top class",
        attrs.evolve(PRODUCT, name="aged-first", queue_class=AgedFirst),
        ("queue", "runtime"),
    ),
    # Beyond the five of the issue: the FIFO and fair-share checks need teeth too.
    "reversed-batch": (
        "a batch is handed out newest first (FIFO within a flow broken)",
        attrs.evolve(PRODUCT, name="reversed-batch", queue_class=ReversesBatches),
        ("queue", "runtime"),
    ),
    "ignore-weights": (
        "fair share ignores the tenants' weights",
        attrs.evolve(PRODUCT, name="ignore-weights", queue_class=IgnoresWeights),
        ("queue", "runtime"),
    ),
    "push-out-for-refused-call": (
        "a call's items are queued one by one: those before a refused item push out "
        "other tenants' requests for a call then refused whole",
        attrs.evolve(PRODUCT, name="push-out-for-refused-call", queue_class=QueuesCallsItemByItem),
        ("queue",),
    ),
    "split-call-item-by-item": (
        "a call split between a model's lanes is queued item by item: an item queued "
        "in one lane pushes out others for a call the other lane then refuses",
        attrs.evolve(
            PRODUCT, name="split-call-item-by-item", runtime_class=SubmitsSplitCallsItemByItem
        ),
        ("runtime",),
    ),
    # The queue suite's own: hedge copies, withdrawal at a caller's deadline, failed
    # batches.
    "copy-dropped-while-running": (
        "a new request takes the room of a hedge copy already dispatched: the copy is "
        "answered twice",
        attrs.evolve(PRODUCT, name="copy-dropped-while-running", queue_class=DropsRunningCopies),
        ("queue",),
    ),
    "deadline-withdrawal-uncounted": (
        "a request withdrawn at its caller's deadline counts as withdrawn by its caller, "
        "not expired",
        attrs.evolve(
            PRODUCT, name="deadline-withdrawal-uncounted", queue_class=DeadlineWithdrawalAsCallers
        ),
        ("queue",),
    ),
    "failed-batch-in-service": (
        "a failed batch's cost stays counted in service",
        attrs.evolve(
            PRODUCT, name="failed-batch-in-service", queue_class=FailedBatchesStayInService
        ),
        ("queue",),
    ),
    "push-out-uncounted": (
        "a request pushed out of a full queue counts in shed only, not in pushed_out",
        attrs.evolve(PRODUCT, name="push-out-uncounted", queue_class=PushOutsOnlyShed),
        ("queue",),
    ),
    # The runtime suite's own: hedges on several replicas, parts run elsewhere after
    # they raised alone on a replica, and the breakers' evidence.
    "twin-not-withdrawn": (
        "a replica that answers one of a hedged request's two copies leaves the other "
        "queued or running",
        attrs.evolve(PRODUCT, name="twin-not-withdrawn", batcher_class=KeepsAnsweredTwins),
        ("runtime",),
    ),
    "copy-beside-original": (
        "a batcher runs a hedge copy in one batch with its original",
        attrs.evolve(
            PRODUCT, name="copy-beside-original", batcher_class=RunsCopiesBesideOriginals
        ),
        ("runtime",),
    ),
    "elsewhere-dropped": (
        "a part marked to run on another replica is never handed back",
        attrs.evolve(PRODUCT, name="elsewhere-dropped", batcher_class=DropsPartsForElsewhere),
        ("runtime",),
    ),
    "elsewhere-same-replica": (
        "a part marked to run on another replica is taken by the replica it raised on",
        attrs.evolve(
            PRODUCT, name="elsewhere-same-replica", scheduler_class=RetriesWhereTheyRaised
        ),
        ("runtime",),
    ),
    "apart-same-replica": (
        "a part kept apart from its hedge twin's replica is taken by the replica it "
        "raised alone on",
        attrs.evolve(
            PRODUCT, name="apart-same-replica", scheduler_class=KeepsApartWhereTheyRaised
        ),
        ("runtime",),
    ),
    "confirmed-across-runs": (
        "a part answered elsewhere counts against its replica after that replica "
        "succeeded, or while its breaker is open",
        attrs.evolve(PRODUCT, name="confirmed-across-runs", breaker_class=ConfirmsAcrossRuns),
        ("runtime",),
    ),
    # The runtime suite's running batches (Scenario.running): the runtime's deadlines
    # of requests whose batch runs on a worker.
    "late-answer-unguarded": (
        "a running batch's late answer goes to a request already answered "
        "DeadlineExceeded too",
        attrs.evolve(
            PRODUCT, name="late-answer-unguarded", batcher_class=AnswersExpiredRequestsLate
        ),
        ("runtime",),
    ),
    "expiry-not-disarmed": (
        "a batch's deadlines stay armed with the watchdog after it leaves its replica",
        attrs.evolve(
            PRODUCT, name="expiry-not-disarmed", batcher_class=_in_flight_of(_NeverDisarms)
        ),
        ("runtime",),
    ),
    "expiry-whole-batch": (
        "at a running batch's first deadline, all its requests still waiting are "
        "answered DeadlineExceeded",
        attrs.evolve(
            PRODUCT, name="expiry-whole-batch",
            batcher_class=_in_flight_of(_ExpiresTheWholeBatch),
        ),
        ("runtime",),
    ),
    # The admission suite's own: the credits.
    "refund-to-level": (
        "a refund goes back to the level whatever waits behind it",
        attrs.evolve(PRODUCT, name="refund-to-level", bucket_class=RefundsToTheLevel),
        ("admission",),
    ),
    "overdraw": (
        "try_take grants whenever the level is positive",
        attrs.evolve(PRODUCT, name="overdraw", bucket_class=GrantsOnAnyCredit),
        ("admission",),
    ),
    # The cache suite's own.
    "flight-without-generation": (
        "a flight's key leaves out the generation: a caller after an invalidation joins "
        "an older flight",
        attrs.evolve(
            PRODUCT, name="flight-without-generation", cache_actor_class=JoinsOlderFlights
        ),
        ("cache",),
    ),
    "one-namespace": (
        "the cache key's namespace ignores the tenant",
        attrs.evolve(PRODUCT, name="one-namespace", cache_class=OneNamespace),
        ("cache",),
    ),
    "ttl-ignored-on-get": (
        "a lookup ignores the entry's expiry",
        attrs.evolve(PRODUCT, name="ttl-ignored-on-get", cache_class=TtlIgnoredOnGet),
        ("cache",),
    ),
    **FLIGHT_MUTANTS,  # a flight and its callers' deadlines
    # The rollout suite's own.
    "split-previous-share": (
        "the split counts a new step's requests by the previous step's share",
        attrs.evolve(PRODUCT, name="split-previous-share", rollout_class=RoutesByThePreviousShare),
        ("rollout",),
    ),
    "rollback-not-final": (
        "a rolled-back canary goes back on trial at the next tick",
        attrs.evolve(PRODUCT, name="rollback-not-final", rollout_class=ResumesAfterARollback),
        ("rollout",),
    ),
    "pause-advances-steps": (
        "a paused canary's step still ends on time (the last promotes it)",
        attrs.evolve(PRODUCT, name="pause-advances-steps", rollout_class=PauseStillAdvancesSteps),
        ("rollout",),
    ),
    "resume-counts-pause": (
        "a resume counts the pause in the step's step_s",
        attrs.evolve(PRODUCT, name="resume-counts-pause", rollout_class=ResumeCountsThePause),
        ("rollout",),
    ),
    "promote-after-rollback": (
        "the operator may promote a rolled-back canary",
        attrs.evolve(
            PRODUCT, name="promote-after-rollback", rollout_class=PromotesARolledBackCanary
        ),
        ("rollout",),
    ),
    "start-keeps-old-stable": (
        "a trial started after a promotion runs against the old stable, not the promoted "
        "canary",
        attrs.evolve(PRODUCT, name="start-keeps-old-stable", rollout_class=StartKeepsTheOldStable),
        ("rollout",),
    ),
    "pause-holds-checks": (
        "a paused canary's outcomes are counted but not checked (no rollback while paused)",
        attrs.evolve(PRODUCT, name="pause-holds-checks", rollout_class=PauseHoldsTheChecks),
        ("rollout",),
    ),
    "resume-not-at-once": (
        "a step due at a resume ends only at the canary's next answer",
        attrs.evolve(
            PRODUCT, name="resume-not-at-once", rollout_controller_class=ResumeWaitsForAnAnswer
        ),
        ("rollout",),
    ),
    "shadow-past-its-bound": (
        "the shadow's channel holds two copies more than shadow_queue",
        attrs.evolve(
            PRODUCT, name="shadow-past-its-bound", rollout_controller_class=ShadowQueuePastItsBound
        ),
        ("rollout",),
    ),
    # The control suite's own.
    "unload-before-drained": (
        "an unload returns before a copy an earlier reload replaced has drained",
        attrs.evolve(
            PRODUCT, name="unload-before-drained",
            control_class=UnloadsBeforeTheReplacedCopyDrained,
        ),
        ("control",),
    ),
    "unload-waits-for-reload": (
        "an unload waits for a reload under way instead of abandoning it",
        attrs.evolve(
            PRODUCT, name="unload-waits-for-reload", control_class=UnloadWaitsForAReload,
        ),
        ("control",),
    ),
    "hand-over-drops-queued": (
        "a hand-over drops the batch queued at the swap",
        attrs.evolve(
            PRODUCT, name="hand-over-drops-queued", scheduler_class=HandOverDropsTheQueued
        ),
        ("control",),
    ),
    "hand-over-refuses-late": (
        "a queue handed over refuses a request submitted after the swap (ActorClosed)",
        attrs.evolve(
            PRODUCT, name="hand-over-refuses-late", scheduler_class=HandOverRefusesLateSubmits
        ),
        ("control",),
    ),
    # The autoscale suite's own.
    "starts-uncounted": (
        "replicas still loading are not counted: concurrent starts overshoot max_replicas",
        attrs.evolve(
            PRODUCT, name="starts-uncounted", scaling_controller_class=StartingReplicasUncounted
        ),
        ("autoscale",),
    ),
    "window-last-sample": (
        "the look-back window's mean is its latest sample alone",
        attrs.evolve(PRODUCT, name="window-last-sample", autoscaler_class=WindowOfTheLastSample),
        ("autoscale",),
    ),
}
