"""Tenant accounting: credits taken from a tenant's token bucket when a request is
admitted (waiting for a refill where its class allows), given back for requests that
never ran, and the per-tenant statistics of both."""

from __future__ import annotations

from typing import Any

import trio

from ._errors import QuotaExceeded
from ._messages import Request
from ._served import ServedModel


class _Credits:
    """The Runtime's credit methods, over its ``buckets`` and credit counters (made in
    ``Runtime.__init__``; the buckets by the assembly, at start)."""

    async def _pay(
        self, tenant: str, priority: str, cost: int, now: float, deadline: float,
        served: ServedModel, n: int = 1,
    ) -> tuple[float, int]:
        """Take ``cost`` from the tenant's credits for ``n`` requests to ``served``,
        waiting for them when its class allows (at most until ``deadline``); return the
        time the requests reach the queue and the take's number (for ``_refund``).
        Raises QuotaExceeded (429) with the refill time as retry_after (for a cost
        above the burst: until the bucket is full); the requests count as shed for
        their flow."""
        bucket = self.buckets.get(tenant)
        if bucket is None:
            self.credits_used[tenant] += cost
            return now, 0
        if self._classes[priority].over_quota == "reject":
            wait = bucket.try_take(cost, now)
            if wait > 0.0:
                served.scheduler.policy.note_shed(tenant, priority, n)
                await trio.lowlevel.checkpoint()  # a refusal still yields
                if cost > bucket.burst:  # the bucket never holds it: a full one will do
                    when = (
                        f"a full bucket ({bucket.burst:g}) available in {_seconds(wait)}; "
                        f"a request costing {cost} > {bucket.burst:g} drains it below zero"
                    )
                else:
                    when = f"{cost} more available in {_seconds(wait)}"
                raise QuotaExceeded(
                    f"tenant {tenant!r} is over its credit rate "
                    f"({bucket.rate:g}/s, burst {bucket.burst:g}); {when}",
                    retry_after=wait,
                )
            self.credits_used[tenant] += cost
            return now, bucket.seq
        at = bucket.reserve(cost, now, deadline)
        if at is None:
            served.scheduler.policy.note_shed(tenant, priority, n)
            await trio.lowlevel.checkpoint()
            raise QuotaExceeded(
                f"tenant {tenant!r} is over its credit rate ({bucket.rate:g}/s) and its "
                "credits refill only after the request's deadline",
                retry_after=bucket.wait_time(cost, now),
                deadline=deadline,
            )
        self.credits_used[tenant] += cost
        taken = bucket.seq
        if at > now:
            self.credit_waits[tenant] += 1
            try:
                unloaded = await _until_or_unloaded(at, served)
            except trio.Cancelled:
                bucket.refund(  # never used: give them back
                    cost, reservation=taken, now=trio.current_time()
                )
                self.credits_used[tenant] -= cost
                self.credits_refunded[tenant] += cost
                raise
            finally:
                self.credit_wait_seconds[tenant] += trio.current_time() - now
            if unloaded:  # refused now, not when its credits come; never used
                bucket.refund(cost, reservation=taken, now=trio.current_time())
                self.credits_used[tenant] -= cost
                self.credits_refunded[tenant] += cost
                raise self._not_loaded(served.config.name)  # type: ignore[attr-defined]
            now = trio.current_time()
        return now, taken

    def _refund(self, tenant: str, cost: int, since: int) -> None:
        """Give back the credits of a request that never ran (the queue refused it,
        pushed it out, or held it past its deadline, or its caller withdrew it while
        queued); ``since`` is the bucket's ``seq`` of its take (see
        TokenBucket.refund)."""
        self.credits_used[tenant] -= cost
        self.credits_refunded[tenant] += cost
        bucket = self.buckets.get(tenant)
        if bucket is not None:
            bucket.refund(cost, since=since)

    def _refund_unrun(self, tenant: str, unrun: list[Request], since: int) -> None:
        """``_refund`` for the items of one take that never ran, at once."""
        if unrun:
            self._refund(tenant, sum(r.cost for r in unrun), since)

    def tenant_statistics(self) -> dict[str, dict[str, Any]]:
        """Per tenant: cost units admitted (credits used), refunded, and, for tenants
        with a credit rate, the credits available now and the waits for a refill
        (how many takes waited, and for how many seconds in all)."""
        now = trio.current_time()
        out: dict[str, dict[str, Any]] = {}
        for t in self.config.tenants:
            bucket = self.buckets.get(t.name)
            avail = None
            if bucket is not None:
                # (the level is below 0 while waiters' reservations are owed: none
                # is available then)
                avail = max(0.0, min(
                    bucket.burst, bucket.level + max(0.0, now - bucket.stamp) * bucket.rate
                ))
            out[t.name] = {
                "weight": t.weight,
                "credits_used": self.credits_used.get(t.name, 0),
                "credits_refunded": self.credits_refunded.get(t.name, 0),
                "credits_available": avail,
                "credit_waits": self.credit_waits.get(t.name, 0),
                "credit_wait_seconds": self.credit_wait_seconds.get(t.name, 0.0),
            }
        return out


async def _until_or_unloaded(at: float, served: ServedModel) -> bool:
    """Sleep until ``at``, the start of a reservation of credits for requests to
    ``served`` (the copy they looked up), or until the model is unloaded (explicit
    model control); return whether it was. A reload keeps them waiting: they go to
    the copy that replaced it (``ServedModel.successor``), and so on, one reload
    after the other. A checkpoint; cancelling it leaves the reservation to the
    caller."""
    with trio.move_on_at(at):
        while True:
            while served.retired.is_set() and served.successor is not None:
                served = served.successor
            if served.retired.is_set():  # unloaded: no copy takes them
                await trio.lowlevel.checkpoint()
                return True
            await served.retired.wait()
    return False


def _seconds(s: float) -> str:
    """A wait as it reads in a message: ``0.500s``; ``1e+300s`` past a year, whose
    digits say nothing more."""
    return f"{s:.3f}s" if s < 365 * 86_400 else f"{s:.3g}s"
