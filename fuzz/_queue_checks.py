"""The queue suite's checks of the queue after every step: nothing on a device
touched (:meth:`QueueChecks._check_devices`), its accounting and each flow's balance
against the reference of the callers (``fuzz/_callers.py``), its footprint, and
whether a request that left it undispatched was allowed to (``_check_gone``).

:class:`QueueChecks` is a base of ``fuzz/_queue.py``'s ``QueueMachine``, whose
``holds`` invariant calls them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trioserve import DeadlineExceeded, Request, RequestState

from ._callers import Callers
from ._checker import InvariantViolation, QueueObserver, Tracked, footprint

if TYPE_CHECKING:
    from ._queue import QueueSetup


class QueueChecks:
    """The checks of ``QueueMachine``, on the state it keeps (see its ``__init__``)."""

    queue: Any
    observer: QueueObserver | None
    callers: Callers | None
    cfg: QueueSetup
    in_service: list[list[Request]]
    retries: list[list[Request]]
    cancelled: set[int]
    peak: dict[str, int]
    step: str
    step_tenant: str
    step_offer: str
    step_refusal: str
    step_copies: list[Request]
    ref_rate: float
    if TYPE_CHECKING:

        @property
        def now(self) -> float: ...

    def _check_devices(self) -> None:
        """The queue never touches a request once it handed it out: only its batch
        answers it (or its caller drops it)."""
        for batch in (*self.in_service, *self.retries):
            for r in batch:
                state = r.reply.state
                if state is RequestState.DISPATCHED or state is RequestState.ABANDONED:
                    continue
                t = self.observer.track_of(r)
                raise InvariantViolation(
                    "outcome",
                    f"{self.callers.describe(r)}, dispatched in batch "
                    f"{None if t is None else t.batch_no} and running, is {state.value} "
                    f"at t={self.now:.6g} after a {self.step!r} step "
                    f"({r.reply.error!r}): the queue answered a request on a device, "
                    "which its batch will answer again",
                )

    def _check_accounting(self) -> None:
        """The queue's counts against the reference: live requests, the cost in
        service, the service rate, each flow's admitted / hedged / expired /
        withdrawn / closed (drained at the end) / pushed_out / superseded / gave_way /
        shed (refused, or pushed out), and each flow's balance: every admitted request
        and hedge copy still queued or counted once in dispatched, expired, withdrawn,
        closed, pushed_out, superseded or gave_way."""
        queue = self.queue
        live = len(self.observer.pending)
        if len(queue) != live:
            raise InvariantViolation(
                "accounting",
                f"after a {self.step!r} step at t={self.now:.6g} the queue counts "
                f"{len(queue)} live requests, but {live} are queued",
            )
        running = sum(r.cost for b in self.in_service for r in b)
        if queue.in_service != running:
            raise InvariantViolation(
                "accounting",
                f"after a {self.step!r} step at t={self.now:.6g} the queue counts cost "
                f"{queue.in_service} in service, but the batches on the devices cost "
                f"{running} ({len(self.in_service)} batches, {len(self.retries)} handed "
                "back to run again)",
            )
        if queue.rate != self.ref_rate:
            raise InvariantViolation(
                "accounting",
                f"after a {self.step!r} step at t={self.now:.6g} the queue's service "
                f"rate is {queue.rate!r}, the reference {self.ref_rate!r} (only two "
                "full batches answered in a row make a sample; a failed batch none)",
            )
        expected = self.callers.expected
        total = 0
        for key in set(expected) | set(queue.stats):
            want = expected.get(key)
            got = queue.stats.get(key)
            for field in (
                "admitted", "hedged", "expired", "withdrawn", "closed", "pushed_out",
                "superseded", "gave_way", "shed",
            ):
                w = 0 if want is None else want[field]
                g = 0 if got is None else getattr(got, field)
                if field == "expired":
                    total += w
                if w != g:
                    raise InvariantViolation(
                        "accounting",
                        f"after a {self.step!r} step at t={self.now:.6g} flow {key} "
                        f"counts {g} {field}, the reference {w}",
                    )
        self._check_balance()
        if queue.expired != total:
            raise InvariantViolation(
                "accounting",
                f"at t={self.now:.6g} the queue counts {queue.expired} expired, its "
                f"flows {total}",
            )

    def _check_balance(self) -> None:
        """``admitted + hedged == dispatched + expired + withdrawn + closed +
        pushed_out + superseded + gave_way + queued`` for each flow (its live
        requests, ``queued_by_flow``): every request admitted and every hedge copy
        taken is still queued or counted once, a copy or an original withdrawn queued
        because its twin answered first in ``superseded``, a copy that gave its room
        to a new request in ``gave_way``."""
        queue = self.queue
        live = queue.queued_by_flow()
        for key, s in queue.stats.items():
            accounted = (
                s.dispatched + s.expired + s.withdrawn + s.closed + s.pushed_out
                + s.superseded + s.gave_way + live.get(key, 0)
            )
            if s.admitted + s.hedged != accounted:
                raise InvariantViolation(
                    "accounting",
                    f"after a {self.step!r} step at t={self.now:.6g} flow {key} does not "
                    f"balance: admitted {s.admitted} + hedged {s.hedged}, but dispatched "
                    f"{s.dispatched} + expired {s.expired} + withdrawn {s.withdrawn} + "
                    f"closed {s.closed} + pushed_out {s.pushed_out} + superseded "
                    f"{s.superseded} + gave_way {s.gave_way} + queued "
                    f"{live.get(key, 0)} = {accounted}",
                )

    def _check_footprint(self) -> None:
        """Memory bounded by configuration and by what is queued: each of the queue's
        containers, dead entries included, holds at most 4/3 of the bound, plus one
        (FairQueue compacts one when a quarter of its entries are dead); the arrival
        orders and the expiry heap, compacted after every departure, also at most 4/3
        of the live requests, plus one (the flows are compacted at the next offer)."""
        limit = (4 * self.cfg.bound) // 3 + 1
        live = len(self.queue)
        for name, n in footprint(self.queue).items():
            self.peak[name] = max(self.peak.get(name, 0), n)
            if n > limit:
                raise InvariantViolation(
                    "memory",
                    f"at t={self.now:.6g} the queue's {name} container holds {n} entries, "
                    f"over 4/3 of its bound {self.cfg.bound} (+1); live requests: {live}",
                )
            if name != "flows" and n > (4 * live) // 3 + 1:
                raise InvariantViolation(
                    "memory",
                    f"at t={self.now:.6g} (after {self.step}) the queue's {name} container "
                    f"holds {n} entries, over 4/3 of its {live} live requests (+1): dead "
                    "entries are not compacted",
                )

    def _check_gone(self, t: Tracked) -> None:
        """``t`` left the queue without being dispatched: was that allowed?"""
        r = t.request
        state = r.reply.state
        expired = r.deadline <= self.now
        callers = self.callers
        flow = callers.expected[r.tenant, r.priority]
        if state is RequestState.CANCELLED:
            if id(r.reply) in self.cancelled:
                return
            if expired and not r.answer_expiry:
                flow["expired"] += 1  # the queue's expiry withdrew it
                return
            raise InvariantViolation(
                "lost",
                f"{self.observer.describe(t)} was withdrawn by the queue at t={self.now:.6g}, "
                "before its deadline, and never answered: its caller waits forever",
            )
        if state is RequestState.DONE:
            error = r.reply.error
            if isinstance(error, DeadlineExceeded):
                if expired and r.answer_expiry and error.in_queue:
                    flow["expired"] += 1
                    return
                raise InvariantViolation(
                    "deadline",
                    f"{callers.describe(r)} was answered {error!r} by the queue at "
                    f"t={self.now:.6g} (its expiry {'is' if r.answer_expiry else 'is not'} "
                    "answered)",
                )
            copy = callers.is_copy(r)
            if self.step == "arrive" and (copy or self.step_tenant != r.tenant):
                # pushed out of a full queue by another tenant's request, or a hedge
                # copy giving its room to a new request
                if not self.step_refusal:
                    if copy:
                        self.observer.exercised["hedge copies giving their room"] += 1
                        flow["gave_way"] += 1
                        return
                    held = [c for c in self.step_copies if c.reply.state is RequestState.QUEUED]
                    if held:
                        raise InvariantViolation(
                            "push-out",
                            f"{self.observer.describe(t)} was pushed out of the queue at "
                            f"t={self.now:.6g} for {self.step_offer} of tenant "
                            f"{self.step_tenant!r} while {callers.describe(held[-1])} "
                            "held room: a hedge copy gives its room first",
                        )
                    self.observer.exercised["push-outs"] += 1
                    flow["pushed_out"] += 1  # admitted, now shed: counted in both
                    flow["shed"] += 1
                    return
                raise InvariantViolation(
                    "push-out",
                    f"{callers.describe(r)} was pushed out of the queue at "
                    f"t={self.now:.6g} (answered {r.reply.error!r}) for "
                    f"{self.step_offer} of tenant {self.step_tenant!r}, which the queue "
                    f"then refused ({self.step_refusal}): it was shed for nothing",
                )
            raise InvariantViolation(
                "outcome",
                f"{callers.describe(r)} was answered by the queue at t={self.now:.6g} "
                f"during a {self.step!r} step without being dispatched, expired or pushed out",
            )
