"""Messages between actors: a request with its one-shot reply slot.

A request is an immutable value; what changes over its life (queued, dispatched,
answered) lives in its :class:`Reply`, whose state moves only through
:meth:`Reply._transition`, so it can never be answered twice.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import attrs
import outcome
import trio

from ._errors import ActorBroken, _never_ran


class RequestState(enum.Enum):
    QUEUED = "queued"  # waiting in a scheduler queue
    DISPATCHED = "dispatched"  # taken into a batch; the model may be running it
    DONE = "done"  # answered (result or error)
    CANCELLED = "cancelled"  # the caller left before dispatch: never dispatched
    ABANDONED = "abandoned"  # the caller left after dispatch: the answer is dropped

    # Members are singletons that compare by identity, so identity hashing agrees
    # with equality; Enum's own __hash__ is Python code, paid on every transition's
    # lookup in _ALLOWED.
    __hash__ = object.__hash__


_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    RequestState.QUEUED: frozenset(
        {RequestState.DISPATCHED, RequestState.DONE, RequestState.CANCELLED}
    ),
    RequestState.DISPATCHED: frozenset({RequestState.DONE, RequestState.ABANDONED}),
    RequestState.DONE: frozenset(),
    RequestState.CANCELLED: frozenset(),
    RequestState.ABANDONED: frozenset(),
}
_ANSWERABLE = frozenset({RequestState.QUEUED, RequestState.DISPATCHED})

QUEUED = RequestState.QUEUED
DISPATCHED = RequestState.DISPATCHED
DONE = RequestState.DONE
CANCELLED = RequestState.CANCELLED
ABANDONED = RequestState.ABANDONED


@attrs.define(eq=False, slots=True)
class Reply:
    """A one-shot reply slot. The batcher fills it once; the caller awaits it.

    It parks the waiting task directly (``wait_task_rescheduled``): cheaper than an
    Event, and cancelling the waiter withdraws the request when it is still queued.
    """

    state: RequestState = RequestState.QUEUED
    _outcome: outcome.Outcome | None = None
    _task: Any = None
    #: Called (no arguments) when the request is withdrawn while queued; the queue
    #: holding it sets this to keep its count of dead entries exact.
    on_cancel: Any = None
    #: Times the request failed when run alone (retries of a straggler or crash).
    attempts: int = 0
    #: It was in a batch that failed (ran past its deadline, lost its worker, or
    #: raised) and is being retried: a failure of its batch now is the requests' own
    #: doing, not its replica's (it counts towards poison, not the circuit breaker).
    suspect: bool = False
    #: It reached a device: a model call was made with it (a failed batch's retry,
    #: a half of a batch whose outputs were too large for its worker's pipe, a
    #: batch its worker had finished or was running when the worker was lost or
    #: replaced), so its caller is charged whatever happens to it after: it is
    #: never answered, nor dropped, as never run. Unlike ``suspect`` it says
    #: nothing against its input: its failures still count for its replica's
    #: breaker, not towards poison.
    ran: bool = False
    #: (replica, its breaker's run) where it raised alone as a retry while other
    #: replicas could run it: it is run once more elsewhere, and a result there is
    #: evidence against that replica (``Breaker.confirmed``). None: it has not.
    raised_on: Any = None
    #: The model calls in worker threads its batches hung (ran past their deadline:
    #: ``Hang``, one per cut-off), while it is retried: until it runs to completion,
    #: a part holding it runs on a thread replica only while another replica can
    #: serve meanwhile (with a lone replica: once its hung call returned). None: it
    #: hung none.
    hung: Any = None
    #: The ReplyGroup awaiting this reply with others, or the ReplyRelay its answer
    #: is handed to (None: awaited by ``wait``).
    group: ReplyGroup | ReplyRelay | None = None
    #: (start, seconds) in trio time of the model execution (batch) that answered it;
    #: one tuple object per execution, shared by every request it answered. None
    #: until a result is delivered.
    run: tuple[float, float] | None = None
    #: Someone else waits for what its batch computes (a coalesced flight's other
    #: callers), should it be answered before the batch ends (its deadline passed
    #: while the batch ran): the replica calls ``late.expect(call_at)`` as it answers
    #: it so (``call_at``: its clock for their deadlines), then
    #: ``late.settle(outcome)`` once the batch is done with it (the batch's
    #: ``outcome.Value`` or ``outcome.Error`` for its item; None: none came, the
    #: batch failed or was handed back). Read only for a request already answered:
    #: it costs the others nothing. None: nobody waits. A batch split for a retry
    #: after such an answer carries the item into its part with a request of its own
    #: (``late.carry(reply)``: see ``ReplyRelay``), unless nobody wants it any more;
    #: the batch that left then settles nothing (``late.carried``).
    late: Any = None
    #: For a request whose caller left after its dispatch (abandoned), should it
    #: never run after all: whom to tell (``when_unrun``: called once, no arguments;
    #: its caller's refund), or True once it is known never to have run (told, or
    #: kept for a caller still to ask: it left in the same moment). None: neither.
    on_unrun: Any = None

    def _transition(self, new: RequestState) -> None:
        if new not in _ALLOWED[self.state]:
            raise ActorBroken(f"request state cannot go from {self.state.value} to {new.value}")
        self.state = new

    @property
    def answerable(self) -> bool:
        """True while nobody has answered and the caller still waits (or may)."""
        return self.state in _ANSWERABLE

    def dispatch(self) -> bool:
        """Queued → dispatched. Returns False when the request was withdrawn or answered."""
        if self.state is QUEUED:
            self.state = DISPATCHED
            return True
        return False

    def set_result(self, value: Any) -> bool:
        """Answer with a value. Returns False when the answer was dropped (caller gone)."""
        return self._answer(outcome.Value(value))

    def set_error(self, error: BaseException) -> bool:
        """Answer with an error. Returns False when the answer was dropped (caller gone)."""
        return self._answer(outcome.Error(error))

    def _answer(self, result: outcome.Outcome) -> bool:
        if self.state is ABANDONED or self.state is CANCELLED:
            if (
                self.state is ABANDONED and isinstance(result, outcome.Error)
                and _never_ran(result.error)
            ):
                self.unrun()  # its caller left, and it never ran after all
            return False
        self._transition(DONE)
        group = self.group
        if group is not None:
            self._outcome = result
            group._settled()
            return True
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task, result)
        else:
            self._outcome = result
        return True

    @property
    def error(self) -> BaseException | None:
        """The error this reply was answered with and still holds (None: none, or
        not answered, or already taken)."""
        held = self._outcome
        return held.error if isinstance(held, outcome.Error) else None

    def withdraw(self) -> None:
        """The caller no longer wants the answer: queued → cancelled (never dispatched),
        dispatched → abandoned (the answer is dropped). No-op once answered."""
        if self.state is QUEUED:
            self._transition(CANCELLED)
            if self.on_cancel is not None:
                self.on_cancel()
        elif self.state is DISPATCHED:
            self._transition(ABANDONED)
        self._outcome = None

    def unrun(self) -> None:
        """The request, abandoned (its caller left after its dispatch), leaves without
        having run: dropped from those held for a retry or kept apart, handed back
        from a worker it never reached, or answered an error saying so (which is
        dropped). Tells ``on_unrun``, once, or keeps the fact for a caller that has
        not asked yet (:meth:`when_unrun`). A no-op in any other state. Not a
        checkpoint."""
        if self.state is ABANDONED and self.on_unrun is not True:
            tell, self.on_unrun = self.on_unrun, True
            if tell is not None:
                tell()

    def when_unrun(self, tell: Any) -> None:
        """Its caller, which abandoned it, asks to be told if it never runs
        (:meth:`unrun`): ``tell()`` is called once then, or at once if that is
        already known. Ask once. Not a checkpoint."""
        if self.on_unrun is True:
            tell()
        else:
            self.on_unrun = tell

    async def wait(self) -> Any:
        """Wait for the answer; return the value or raise the error.

        A checkpoint. Cancelling it withdraws a queued request (it will never be
        dispatched) and makes the batcher drop the answer of a dispatched one.
        """
        if self._outcome is not None:
            await trio.lowlevel.checkpoint()
            result, self._outcome = self._outcome, None
            return result.unwrap()
        self._task = trio.lowlevel.current_task()
        return await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _raise_cancel: Any) -> trio.lowlevel.Abort:
        """``wait``'s abort function: the waiter was cancelled, and withdraws (it holds
        no answer: one would have woken it)."""
        self._task = None
        self.withdraw()
        return trio.lowlevel.Abort.SUCCEEDED


class ReplyGroup:
    """The replies of one caller's items, awaited together: the caller wakes once,
    when the last is answered, instead of once per item."""

    __slots__ = ("_pending", "_task", "replies")

    def __init__(self, n: int) -> None:
        self.replies = [Reply(group=self) for _ in range(n)]
        self._pending = n
        self._task: Any = None

    def _settled(self) -> None:
        self._pending -= 1
        if not self._pending and self._task is not None:
            task, self._task = self._task, None
            trio.lowlevel.reschedule(task)

    async def wait(self) -> list[outcome.Outcome]:
        """Wait until every reply is answered; return their outcomes in order.

        A checkpoint. Cancelling it withdraws every reply not yet answered: a queued
        one is never dispatched, a dispatched one's answer is dropped. The answered
        ones keep their outcomes (``Reply.error``) until withdrawn.
        """
        if self._pending:
            self._task = trio.lowlevel.current_task()

            def abort(_raise_cancel: Any) -> trio.lowlevel.Abort:
                self._task = None
                for reply in self.replies:
                    if reply.state is not DONE:
                        reply.withdraw()
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            await trio.lowlevel.checkpoint()
        out = []
        for reply in self.replies:
            result, reply._outcome = reply._outcome, None
            out.append(result)
        return out


class ReplyRelay:
    """A dispatched reply awaited by no task: its answer, when it comes, is handed to
    ``to(outcome)`` (from the batcher's task, as it answers). For the request that
    carries an answered request's item into a part of its failed batch (others wait
    for that item's outcome: ``Reply.late``). ``on_withdraw``: called (no
    arguments) when it is withdrawn (:meth:`withdraw`); the queue holding its request
    for a retry sets it, to drop the request at once."""

    __slots__ = ("_to", "on_withdraw", "reply")

    def __init__(self, to: Any) -> None:
        self._to = to
        self.on_withdraw: Any = None
        self.reply = Reply(state=DISPATCHED, group=self)

    def withdraw(self) -> None:
        """Nobody wants its answer any more: its reply is withdrawn (an answer that
        comes is dropped), and ``on_withdraw`` told. Not a checkpoint."""
        self.reply.withdraw()
        if self.on_withdraw is not None:
            self.on_withdraw()

    @staticmethod
    def withdraw_reply(reply: Reply) -> None:
        """Withdraw ``reply``: through its ReplyRelay when it is a relay's (so that
        ``on_withdraw`` is told: the queue holding its request drops it at once),
        else as any reply. Not a checkpoint."""
        group = reply.group
        if type(group) is ReplyRelay:
            group.withdraw()
        else:
            reply.withdraw()

    def _settled(self) -> None:
        reply = self.reply
        result, reply._outcome = reply._outcome, None
        self._to(result)


@attrs.frozen(kw_only=True, slots=True)
class Request:
    """One item for one model, from one caller.

    ``deadline`` is absolute trio time; ``answer_expiry`` says whether the runtime
    answers an expired request with DeadlineExceeded (the deadline came from the
    model's timeout) or just drops it (it came from the caller's own cancel scope,
    which fires at the same moment).
    """

    # A new field goes into ``for_items`` (and ``_FIELDS``) too.
    model: str
    item: Any = attrs.field(eq=False, repr=False)
    cost: int = 1
    tenant: str = "default"
    priority: str = "default"
    arrival: float = 0.0
    deadline: float = float("inf")
    answer_expiry: bool = False
    reply: Reply = attrs.field(factory=Reply, eq=False, repr=False)

    @classmethod
    def for_items(
        cls,
        prepared: Sequence[tuple[Any, int]],
        replies: Sequence[Reply],
        *,
        model: str,
        tenant: str,
        priority: str,
        arrival: float,
        deadline: float,
        answer_expiry: bool,
    ) -> list[Request]:
        """The requests of one call's items: for each (item, cost) of ``prepared``
        and the reply in the same place of ``replies``, what ``Request(model=model,
        item=item, cost=cost, ..., reply=reply)`` builds, the other fields shared.
        Each field is set through its slot, as attrs' ``__init__`` sets it, without
        that call's keywords and its call per field (about half of the cost of a row
        of a batched request's admission). Not a checkpoint."""
        if cls is not Request:
            raise TypeError("Request.for_items builds Requests only")
        new = object.__new__
        s_model, s_item, s_cost, s_tenant, s_priority, s_arrival, s_deadline, s_expiry, s_reply = (
            _SLOTS
        )
        out = []
        for (item, cost), reply in zip(prepared, replies, strict=True):
            r = new(Request)
            s_model(r, model)
            s_item(r, item)
            s_cost(r, cost)
            s_tenant(r, tenant)
            s_priority(r, priority)
            s_arrival(r, arrival)
            s_deadline(r, deadline)
            s_expiry(r, answer_expiry)
            s_reply(r, reply)
            out.append(r)
        return out


#: Request's fields in order, as ``Request.for_items`` sets them.
_FIELDS = (
    "model", "item", "cost", "tenant", "priority", "arrival", "deadline", "answer_expiry",
    "reply",
)
#: Their slots' setters (the member descriptors' ``__set__``).
_SLOTS = tuple(Request.__dict__[name].__set__ for name in _FIELDS)
