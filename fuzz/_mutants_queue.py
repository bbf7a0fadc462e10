"""Planted bugs of the scheduler's queue (``FairQueue``), which the queue suite
and the runtime suite see, and of the credits (``TokenBucket``), which the
admission suite sees. Listed in ``fuzz._mutants.MUTANTS``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import attrs
import trioserve.actors
from trioserve import Overloaded, Request

FairQueue = trioserve.actors.FairQueue
TokenBucket = trioserve.actors.TokenBucket


class DropsOneRequest(FairQueue):
    """next_batch silently loses the last request of a batch of two or more (it is
    already DISPATCHED, so nobody will ever answer it)."""

    def next_batch(self, now: float) -> list[Request] | None:
        batch = super().next_batch(now)
        if batch and len(batch) >= 2:
            batch.pop()
        return batch


class IgnoresDeadlines(FairQueue):
    """The deadline check is skipped: the queue keeps every request as if it had none,
    so an expired one is dispatched (and a model timeout is never answered). On every
    way in: a request alone (``offer``), and a call's items, decided whole
    (``plan_all``) and queued one by one or in one pass (``_offer_call``, where a call
    that pushes nobody out goes)."""

    def offer(self, request: Request, now: float) -> None:
        super().offer(_deadline_less(request), now)

    def plan_all(self, requests: Sequence[Request], now: float) -> Any:
        # Decided as if the items had no deadline, planned for the items themselves
        # (``offer_planned`` queues them through the two methods here).
        plan = super().plan_all([_deadline_less(r) for r in requests], now)
        return attrs.evolve(plan, requests=requests)

    def _offer_call(self, requests: Sequence[Request], now: float) -> bool:
        return super()._offer_call([_deadline_less(r) for r in requests], now)


def _deadline_less(request: Request) -> Request:
    """``request`` as if it had no deadline (its reply, which its caller awaits, the
    same)."""
    return attrs.evolve(request, deadline=math.inf)


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
    """A new request (alone, or a call's item) that finds the queue full takes the
    room of the newest hedge copy still answerable, queued or already dispatched:
    ``_copies`` is pruned only at the next ``offer_spare``, so a copy running on a
    device is answered Overloaded (and its batch answers it again) while the queue
    counts room it never had."""

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

    def _newest_copy(self, tenant: str | None, gone: AbstractSet[int]) -> Request | None:
        # The copy a call's plan gives the room of (``offer_planned`` sheds it), by
        # the same rule: a call's items take a running copy's room too.
        copies = self._copies
        for i in range(len(copies) - 1, -1, -1):
            req = copies[i]
            if (
                req.reply.answerable
                and id(req) not in gone
                and (tenant is None or req.tenant == tenant)
            ):
                return req
        return None


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
