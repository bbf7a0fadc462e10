"""The queue suite's reference model of the callers above a queue: what the runtime
(``Runtime._submit``, ``Runtime._hedged``, ``_note_hedge_over``, ``_note_withdrawal``)
does with a request's reply, without trio. Each caller pays its cost once when its
request is admitted, may be hedged (a copy through ``offer_spare``), takes the first
answer of its original or its copy (a "never ran" error, Overloaded or one answered in
the queue, ``in_queue``, is no answer while the other may still run, nor is the model's
error, ``ModelError``, while the other may still answer), withdraws the
other, and leaves at its deadline or when cancelled. It gets its credits back exactly
when none of its requests ran.

The model never trusts the queue's word for "ran": the credit check compares what the
replies say (the runtime's rule for refunds) with what the observer saw dispatched.
"""

from __future__ import annotations

import collections

import attrs
from trioserve import ModelError, Overloaded, Request, RequestState, TrioserveError

from ._checker import InvariantViolation, QueueObserver

QUEUED = RequestState.QUEUED
DISPATCHED = RequestState.DISPATCHED
DONE = RequestState.DONE
CANCELLED = RequestState.CANCELLED


def never_ran(request: Request) -> bool:
    """Whether ``request``'s reply says it never reached a device (the runtime's
    ``_never_ran``, plus a reply withdrawn while queued)."""
    reply = request.reply
    if reply.state is CANCELLED:
        return True
    if reply.state is not DONE:
        return False
    error = reply.error
    return isinstance(error, Overloaded) or (
        isinstance(error, TrioserveError) and error.in_queue
    )


@attrs.define(eq=False)
class Caller:
    """One caller's request (alone, or an item of a call), its hedge copy if any, and
    its credits: ``charged`` when admitted, ``refunded`` when none of it ran."""

    no: int
    original: Request
    single: bool
    copy: Request | None = None
    charged: int = 0
    refunded: int = 0
    #: how it ended: None (waiting), "answered", "never ran" (answered an error of
    #: the queue's), "left" (cancelled, or its own deadline), "drained"
    end: str | None = None
    answered_by: Request | None = None

    @property
    def requests(self) -> list[Request]:
        return [self.original] if self.copy is None else [self.original, self.copy]


class Callers:
    """The callers of one queue, and the flow statistics the queue should report
    (``expected``: (tenant, class) -> admitted / hedged / expired / withdrawn /
    closed / pushed_out / superseded / gave_way / shed)."""

    def __init__(self, observer: QueueObserver, cancelled: set[int]) -> None:
        self.observer = observer
        #: id(reply) of every reply the model withdrew (the queue did not)
        self.cancelled = cancelled
        self.of: dict[int, Caller] = {}  # id(reply) -> its caller (original and copy)
        self.waiting: list[Caller] = []
        self.copies: list[Request] = []  # every copy the queue took, oldest first
        self.copy_ids: set[int] = set()
        self.expected: dict[tuple[str, str], collections.Counter[str]] = (
            collections.defaultdict(collections.Counter)
        )
        self.n = 0

    # ------------------------------------------------------------ events
    def admitted(self, request: Request, *, single: bool) -> Caller:
        self.n += 1
        caller = Caller(no=self.n, original=request, single=single, charged=request.cost)
        self.of[id(request.reply)] = caller
        self.waiting.append(caller)
        self.expected[request.tenant, request.priority]["admitted"] += 1
        return caller

    def hedged(self, caller: Caller, copy: Request) -> None:
        caller.copy = copy
        self.of[id(copy.reply)] = caller
        self.copies.append(copy)
        self.copy_ids.add(id(copy.reply))
        self.expected[copy.tenant, copy.priority]["hedged"] += 1

    def is_copy(self, request: Request) -> bool:
        return id(request.reply) in self.copy_ids

    def describe(self, request: Request) -> str:
        t = self.observer.track_of(request)
        what = "request" if t is None else self.observer.describe(t)
        return f"hedge copy {what}" if self.is_copy(request) else what

    # ------------------------------------------------------------ the callers
    def _withdraw(self, request: Request) -> None:
        reply = request.reply
        if reply.state is QUEUED or reply.state is DISPATCHED:
            self.cancelled.add(id(reply))
            reply.withdraw()

    def leave(self, caller: Caller, now: float) -> None:
        """The caller left (cancelled, or its cancel scope fired at its deadline):
        withdraw its requests, refund it if none ran, and note the withdrawal to
        the queue as the runtime does (``_note_withdrawal``, through
        ``_note_hedge_over`` for a hedged one: the original and its copy, each only if
        the withdrawal found it queued and the queue still owns it)."""
        for r in caller.requests:
            self._withdraw(r)
        if all(never_ran(r) for r in caller.requests):
            caller.refunded += caller.charged
        for r in caller.requests:
            if r.reply.state is not CANCELLED:
                continue
            queue = getattr(r.reply.on_cancel, "__self__", None)
            flow = self.expected[r.tenant, r.priority]
            if queue is not None and now >= r.deadline:
                queue.withdrawn_at_deadline(r, now)
                flow["expired"] += 1
                self.observer.exercised["withdrawals at the caller's deadline noted"] += 1
            elif queue is not None:
                queue.withdrawn_by_caller(r)
                flow["withdrawn"] += 1
                if r is caller.copy:
                    self.observer.exercised["hedge copies withdrawn by their caller"] += 1
        self._end(caller, "left", now)

    def settle(self, now: float) -> None:
        """Let every waiting caller take what its replies say (see the module
        docstring); withdraw the twin of one answered."""
        still: list[Caller] = []
        for caller in self.waiting:
            if not self._settle(caller, now):
                still.append(caller)
        self.waiting = still

    def _settle(self, caller: Caller, now: float) -> bool:
        reqs = caller.requests
        for r in reqs:
            if r.reply.state is DONE and not never_ran(r) and (
                # the model's error is no answer while the twin may still answer
                not isinstance(r.reply.error, ModelError)
                or all(o.reply.state is DONE for o in reqs)
            ):
                caller.answered_by = r
                for other in reqs:
                    if other is not r:
                        self._withdraw(other)
                        if caller.copy is not None:
                            self.observer.exercised["hedges: one answered, its twin withdrawn"] += 1
                        # the runtime's ``_note_hedge_over``: the twin withdrawn queued
                        # (and still the queue's) is superseded
                        queue = getattr(other.reply.on_cancel, "__self__", None)
                        if other.reply.state is CANCELLED and queue is not None:
                            queue.note_superseded(other)
                            self.expected[other.tenant, other.priority]["superseded"] += 1
                            self.observer.exercised["hedges: twin superseded queued"] += 1
                self._end(caller, "answered", now)
                return True
        if any(r.reply.state is CANCELLED and id(r.reply) not in self.cancelled for r in reqs):
            # The queue withdrew one at its caller's deadline (its cancel scope fires now).
            self.leave(caller, now)
            return True
        if all(r.reply.state is DONE for r in reqs):  # none ran: the original's error
            caller.refunded += caller.charged
            caller.answered_by = caller.original
            self._end(caller, "never ran", now)
            return True
        return False

    def _end(self, caller: Caller, end: str, now: float) -> None:
        if caller.end is not None:
            raise InvariantViolation(
                "duplicated",
                f"caller #{caller.no} ({self.describe(caller.original)}) ended twice: "
                f"{caller.end}, then {end} at t={now:.6g}",
            )
        caller.end = end
        self._check_credits(caller, now)

    def _check_credits(self, caller: Caller, now: float) -> None:
        """Charged once, refunded at most once, and kept exactly when one of its
        requests was dispatched (what the observer saw, not what the replies say)."""
        obs = self.observer
        ran = [
            r for r in caller.requests
            if (t := obs.track_of(r)) is not None and t.dispatched_at is not None
        ]
        kept = caller.charged - caller.refunded
        expected = caller.original.cost if ran else 0
        if kept == expected and 0 <= caller.refunded <= caller.charged:
            return
        replies = ", ".join(
            f"{self.describe(r)}: {r.reply.state.value}"
            + (f" {r.reply.error!r}" if r.reply.error is not None else "")
            for r in caller.requests
        )
        if ran:
            why = f"{self.describe(ran[0])} ran, yet its credits were given back"
        else:
            why = "none of its requests ran, yet its credits were kept"
        raise InvariantViolation(
            "credits",
            f"caller #{caller.no} ended ({caller.end}) at t={now:.6g}: {why} "
            f"(charged {caller.charged}, refunded {caller.refunded}); its replies: {replies}",
        )
