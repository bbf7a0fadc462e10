"""In-flight coalescing ("singleflight"): concurrent identical requests share one
computation.

The first caller of a key starts the computation as a task in the owner's nursery
(not in its own task), so that it outlives any one caller: cancelling a waiter,
the first one included, only withdraws that waiter. When the last waiter leaves,
nobody wants the result any more and the computation is cancelled. Every waiter gets
the same value, or its own copy of the same exception; a failed computation leaves
nothing behind, so the next call computes afresh (errors are never cached).

A computation runs with the deadline of the caller it runs for (its *driver*: the
first caller, to begin with), while the callers who joined later may have later
ones. An error that belongs to that deadline rather than to the computation (the
owner's ``deadline_bound`` says which, and by what deadline) is not the answer of a
waiter whose own deadline is later: the flight runs again for those, driven by the
one of them with the earliest deadline (so no one waits past their own), with that
waiter's own function and deadline. The others get the error. Each waiter drives at
most once, so a flight runs at most once per waiter.

When the error came while the driver's work went on (a request answered
DeadlineExceeded while its batch ran, the batch still running for others), the
waiters with time left first wait for that work's outcome (a :class:`LateOutcome`
the computation hands on: ``Reply.late``): a value answers them all, as the round's
own would have, and runs nothing again; so does an error that is the input's own
doing (the owner's ``input_error`` says which: the model's error for that input,
which running it again would only repeat); a waiter whose own deadline passes first
gets its own error then (below); and if the work fails otherwise (no outcome came,
or an error of the work or its replica), the flight runs again for those still
waiting, as above.

A waiter answered so by an error of another's deadline (the driver's, passed in the
queue or while its work ran), or whose own deadline passes while it waits for a late
outcome, gets that error in its own terms when its call says how (``as_own``): the
driver's figures (its time in the queue, its limit) are not the waiter's.
"""

from __future__ import annotations

import collections
import copy
import math
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import attrs
import outcome
import trio
from trioserve import ActorClosed, ReplyRelay


def own_error(exc: BaseException) -> BaseException:
    """A copy of ``exc`` for one of the several callers it answers, with its cause,
    context and traceback so far. Raised as it is in every caller, one exception
    object gathered every caller's frames into one traceback (2,000 entries after
    1,000 callers of two frames each), and with them those frames' locals, until the
    last caller dropped it. ``exc`` itself when it cannot be copied."""
    try:
        own = copy.copy(exc)
    except Exception:
        return exc
    if type(own) is not type(exc):
        return exc
    own.__cause__ = exc.__cause__
    own.__context__ = exc.__context__
    own.__suppress_context__ = exc.__suppress_context__
    return own.with_traceback(exc.__traceback__)


@attrs.frozen(kw_only=True)
class SingleFlightStatistics:
    """``started``: flights started (by the first call of a key); ``coalesced``: calls
    that joined one already in flight (so ``started + coalesced`` is every call);
    ``abandoned``: flights cancelled because every waiter left; ``reruns``: a
    flight's computation run again, for waiters whose own deadline was later than
    the one its error belonged to; ``late_answers``: a flight's waiters answered
    instead by the late outcome of the work of a driver whose deadline passed, a
    value or the input's own error (one per such outcome, however many waiters it
    answered)."""

    in_flight: int
    started: int
    coalesced: int
    abandoned: int
    reruns: int = 0
    late_answers: int = 0


class LateOutcome:
    """Where the outcome of a round's work goes when it outlives the error the round
    was answered with: the request of a flight's computation answered
    DeadlineExceeded while its batch ran, the batch going on for others. The
    computation hangs it on its request (``Reply.late``); the replica calls
    :meth:`expect` when it answers the request so, then :meth:`settle` once with
    the batch's outcome for the item (None: none came). If that batch fails and is
    split for a retry, the item runs again in its part, carried by a request of its
    own (:meth:`carry`), whose answer settles this. ``keep``: what the computation
    does with a value it returns (the cache actor keeps it in the cache), done to a
    late value too. None of its methods is a checkpoint."""

    __slots__ = (
        "_carriers", "_done", "_watches", "abandoned", "call_at", "carried", "expected",
        "keep", "result",
    )

    def __init__(self) -> None:
        #: the work goes on after its request was answered: :meth:`settle` will come
        self.expected = False
        #: its item runs again in a part of its failed batch (:meth:`carry`)
        self.carried = False
        #: nobody waits for its outcome any more (:meth:`abandon`)
        self.abandoned = False
        self.result: outcome.Outcome | None = None
        self.keep: Callable[[Any], Any] | None = None
        #: see :meth:`expect`
        self.call_at: Callable[[float, Callable[[], object]], Callable[[], None]] | None = None
        self._done = trio.Event()
        #: the waits kept on its clock (:meth:`watch`): [deadline, scope, disarm]
        self._watches: list[list[Any]] | None = None
        #: the replies of the requests carrying its item (:meth:`hold`)
        self._carriers: list[Any] | None = None

    def expect(
        self,
        call_at: Callable[[float, Callable[[], object]], Callable[[], None]] | None = None,
    ) -> None:
        """The request was answered while its work goes on; its outcome will come.
        ``call_at(deadline, fn)``: calls ``fn()`` when the trio ``deadline`` passes
        on the clock the work's own deadlines are kept on (a replica's wall clock:
        trio's would pass at once under an autojumping MockClock while a thread
        runs), until the work is done at the latest, and returns what disarms it;
        the waiters' own deadlines are kept with it (:meth:`watch`). None: trio's.
        Called again, the waits move to the new clock."""
        self.expected = True
        self._move(call_at)

    def watch(self, deadline: float, scope: trio.CancelScope) -> Callable[[], None]:
        """Cancel ``scope`` when the trio ``deadline`` passes on the work's clock (see
        :meth:`expect`; trio's, as the scope's own deadline, when it has none), the
        wait moving with the work to another clock (:meth:`carry`). Returns what
        disarms it."""
        entry: list[Any] = [deadline, scope, None]
        self._arm(entry)
        if self._watches is None:
            self._watches = []
        self._watches.append(entry)

        def unwatch() -> None:
            disarm, entry[2] = entry[2], None
            if disarm is not None:
                disarm()
            if self._watches is not None and entry in self._watches:
                self._watches.remove(entry)

        return unwatch

    def _arm(self, entry: list[Any]) -> None:
        deadline, scope, _ = entry
        if self.call_at is None:
            scope.deadline = deadline
        else:
            scope.deadline = math.inf
            entry[2] = self.call_at(deadline, scope.cancel)

    def _move(
        self, call_at: Callable[[float, Callable[[], object]], Callable[[], None]] | None
    ) -> None:
        self.call_at = call_at
        for entry in self._watches or ():
            disarm, entry[2] = entry[2], None
            if disarm is not None:
                disarm()
            self._arm(entry)

    def carry(self, reply: Any) -> bool:
        """The batch of its request failed and is split for a retry: its item runs
        again in a part, carried by a request whose reply is ``reply`` and whose
        answer settles this. Returns whether it is carried so; not when no outcome
        was expected, one came already, or nobody wants it any more. The waits
        move to trio's clock until then (the batch that kept them left), and the
        batch that left does not settle it."""
        if not self.expected or self.abandoned or self._done.is_set():
            return False
        self.carried = True
        self._move(None)
        self.hold(reply)
        return True

    def hold(self, reply: Any) -> None:
        """``reply``'s request carries (a part of) its item (:meth:`carry`): it is
        withdrawn should nobody want the outcome any more (:meth:`abandon`)."""
        if self._carriers is None:
            self._carriers = []
        self._carriers.append(reply)

    def abandon(self) -> None:
        """Nobody waits for its outcome (any more): the requests carrying its item
        are withdrawn (one held for a retry leaves its queue at once: see
        ``ReplyRelay.withdraw``), and none is carried from now on."""
        self.abandoned = True
        carriers, self._carriers = self._carriers, None
        for reply in carriers or ():
            ReplyRelay.withdraw_reply(reply)

    def settle(self, result: outcome.Outcome | None) -> None:
        """The work's outcome for the request (None: none came); only the first
        counts. The work is done: its clock (:meth:`expect`'s ``call_at``) is
        dropped, which would keep the work (a replica's batch, its requests, whose
        own reply holds this) alive, as are its carriers."""
        self.call_at = None
        self._carriers = None
        if not self._done.is_set():
            self.result = result
            self._done.set()

    @property
    def settled(self) -> bool:
        """Whether :meth:`settle` came."""
        return self._done.is_set()

    async def wait(self) -> outcome.Outcome | None:
        """Wait for :meth:`settle` and return its outcome. A checkpoint."""
        await self._done.wait()
        return self.result


@attrs.define(eq=False)
class _Waiter:
    """One call waiting on a flight: its deadline, and what it would compute."""

    deadline: float
    fn: Callable[..., Awaitable[Any]]
    args: tuple
    #: a round has answered it (it may not have resumed yet): it drives no other
    answered: bool = False


@attrs.define(eq=False)
class _Round:
    """One run of a flight's computation, for ``driver``. ``bound``: set when its
    error belonged to the driver's deadline, that deadline (a waiter with a later
    one waits for the next round, ``next``). ``late``: a round that runs nothing but
    waits for the late outcome of the round before it (same driver), whose error
    was ``error``: a waiter whose own deadline passes first gets that error."""

    driver: _Waiter
    done: trio.Event = attrs.Factory(trio.Event)
    result: outcome.Outcome | None = None
    bound: float | None = None
    next: _Round | None = None
    late: LateOutcome | None = None
    error: BaseException | None = None

    def answers(self, waiter: _Waiter) -> bool:
        """Whether this round's result is ``waiter``'s answer (else it waits for the
        next round)."""
        return self.bound is None or waiter is self.driver or waiter.deadline <= self.bound


@attrs.define(eq=False)
class _Flight:
    round: _Round
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    #: the calls waiting, in the order they came (a dict as an ordered set)
    waiters: dict[_Waiter, None] = attrs.Factory(dict)
    finished: bool = False


def _never_bound(exc: BaseException, deadline: float) -> float | None:
    return None


def _never_input(exc: BaseException) -> bool:
    return False


class SingleFlight:
    """A table of computations in flight, by key; they run in ``nursery``.

    The nursery must outlive the callers' interest in results (the cache actor's own
    nursery). When it is cancelled, computations still running end and their waiters
    get :class:`~trioserve.ActorClosed`.

    ``deadline_bound(exc, deadline)``: for an exception a computation run with
    ``deadline`` (its driver's) raised, the deadline the error belongs to, or None
    when it belongs to the computation itself (every waiter gets it). A waiter whose
    own deadline is later than the one returned is not answered with it: the flight
    runs again for it. By default no error belongs to a deadline.

    ``late_outcomes``: each computation is called with ``late=``, a
    :class:`LateOutcome` of its own; if it raises such an error after the hook was
    told to expect an outcome, the waiters with a later deadline wait for that
    outcome (each until its own deadline) before the flight runs again.

    ``input_error(exc)``: for an error that late outcome brought, whether it is the
    input's own doing (the same input would fail again): it is then every waiter's
    answer (each its own copy) and the flight ends; otherwise (the error of the work
    or of its replica) the flight runs again, as when no outcome came. By default
    no error is the input's.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        deadline_bound: Callable[[BaseException, float], float | None] = _never_bound,
        late_outcomes: bool = False,
        input_error: Callable[[BaseException], bool] = _never_input,
    ) -> None:
        self._nursery = nursery
        self._deadline_bound = deadline_bound
        self._input_error = input_error
        self._late_outcomes = late_outcomes
        self._late_answers = 0
        self._flights: dict[Hashable, _Flight] = {}
        #: flights whose task is spawned and not yet begun, oldest first: each task
        #: takes the oldest (see :meth:`_compute`), so computations begin in the
        #: order their flights were started (trio runs new tasks in no set order)
        self._spawned: collections.deque[tuple[Hashable, _Flight]] = collections.deque()
        self._started = 0
        self._coalesced = 0
        self._abandoned = 0
        self._reruns = 0

    def __len__(self) -> int:
        return len(self._flights)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._flights

    async def call(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[Any]],
        *args: Any,
        deadline: float = math.inf,
        as_own: Callable[[BaseException], BaseException] | None = None,
    ) -> Any:
        """Return ``await fn(*args)``, computed once for every concurrent call of ``key``.

        The first call starts the computation; later calls made before it finishes
        join it (``fn`` is then not called, unless the flight runs again for this
        call: see the class). ``deadline``: this caller's, in trio time (the one
        ``fn`` runs with). A checkpoint. Cancelling this call withdraws only this
        caller; the computation goes on for the others, and is cancelled when no
        caller is left. Raises whatever the computation raised (the waiter's own
        copy of it), or ActorClosed if the owner's nursery was cancelled first. While
        it waits for a late outcome (see the class), its own ``deadline`` passing
        raises its own copy of the error the driver got (``as_own``'s, when given).

        ``as_own(exc)``: this caller's own error for ``exc``, an error of another
        caller's deadline (its driver's, by ``deadline_bound``) that answers this one
        (its own deadline passed too, or passes while it waits for a late outcome).
        None: its own copy of ``exc``. Not called for an error of its own run.
        """
        waiter = _Waiter(deadline, fn, args)
        flight = self._flights.get(key)
        if flight is None:
            flight = _Flight(_Round(waiter))
            try:
                self._nursery.start_soon(self._compute)
            except RuntimeError:  # "Nursery is closed to new arrivals"
                raise ActorClosed("singleflight: its owner's nursery is closed") from None
            self._spawned.append((key, flight))
            self._flights[key] = flight
            self._started += 1
        else:
            self._coalesced += 1
        flight.waiters[waiter] = None
        round_ = flight.round
        expired: BaseException | None = None
        try:
            while True:
                if round_.late is not None:
                    # A late outcome may never come in time: wait for it until this
                    # waiter's own deadline, no later.
                    if not await self._wait_until(round_, deadline):
                        expired = round_.error
                        break
                else:
                    await round_.done.wait()
                if round_.answers(waiter):
                    break
                # The next round, not the flight's current one: rounds that end at
                # once (a refusal) may have followed before this waiter woke, and
                # one of them may be its own.
                assert round_.next is not None
                round_ = round_.next
        finally:
            del flight.waiters[waiter]
            if not flight.waiters and not flight.finished:
                # The last one out: nobody wants the result. Forget it now, so that a
                # new call starts afresh instead of joining a cancelled computation.
                if self._flights.get(key) is flight:
                    del self._flights[key]
                self._abandoned += 1
                flight.scope.cancel(reason="singleflight: every waiter left")
        result = round_.result
        if expired is None:
            assert result is not None
            if not isinstance(result, outcome.Error):
                return result.value
            expired = result.error
        if (
            as_own is not None
            and waiter is not round_.driver
            and self._deadline_bound(expired, round_.driver.deadline) is not None
        ):
            raise as_own(expired)
        raise own_error(expired)

    @staticmethod
    async def _wait_until(round_: _Round, deadline: float) -> bool:
        """Wait for the late ``round_`` to end, until ``deadline`` at most (on the
        late work's clock); return whether it ended. A checkpoint."""
        late = round_.late
        with trio.CancelScope() as scope:
            disarm = None
            if deadline < math.inf:
                if late is None:
                    scope.deadline = deadline
                else:
                    disarm = late.watch(deadline, scope)
            try:
                await round_.done.wait()
            finally:
                if disarm is not None:
                    disarm()
        return round_.done.is_set()

    async def _compute(self) -> None:
        # The oldest flight spawned, not necessarily the one this task was spawned
        # for: a request is submitted (credits, the queue) before the computation's
        # first checkpoint, so flights started in order are queued in order.
        key, flight = self._spawned.popleft()
        try:
            with flight.scope:
                while True:
                    round_ = flight.round
                    driver = round_.driver
                    late = LateOutcome() if self._late_outcomes else None
                    try:
                        if late is None:
                            value = await driver.fn(*driver.args)
                        else:
                            value = await driver.fn(*driver.args, late=late)
                    except trio.Cancelled:
                        raise
                    except Exception as exc:
                        if late is not None and late.expected and await self._wait_late(
                            flight, exc, late
                        ):
                            break
                        if self._run_again(flight, exc):
                            continue
                        # this round's, or the late round's that followed it
                        flight.round.result = outcome.Error(exc)
                    else:
                        round_.result = outcome.Value(value)
                    break
        finally:
            if self._flights.get(key) is flight:
                del self._flights[key]
            round_ = flight.round
            if round_.result is None:  # cancelled: the nursery is closing, or nobody waits
                round_.result = outcome.Error(
                    ActorClosed(f"the computation of {key!r} was cancelled before it finished")
                )
            flight.finished = True
            round_.done.set()

    async def _wait_late(self, flight: _Flight, exc: Exception, late: LateOutcome) -> bool:
        """The driver was answered ``exc`` while its work goes on, to end with an
        outcome for it (``late``). If ``exc`` belongs to the driver's deadline and a
        waiter's own is later (and not passed), end the round with it (answering
        the others, as :meth:`_run_again`) and wait, in a round that runs nothing,
        for that outcome: a value (kept as the computation keeps its own,
        ``late.keep``), or an error that is the input's own (``input_error``),
        answers every waiter left, and this returns True. Otherwise (no such
        waiter; no outcome came; the work failed otherwise) it returns False, the
        late round being the flight's, for :meth:`_run_again` to end. A checkpoint
        when it waits."""
        try:
            return await self._wait_late_outcome(flight, exc, late)
        finally:
            if not late.settled:  # nobody waits for it (any more)
                late.abandon()

    async def _wait_late_outcome(
        self, flight: _Flight, exc: Exception, late: LateOutcome
    ) -> bool:
        round_ = flight.round
        driver = round_.driver
        bound = self._deadline_bound(exc, driver.deadline)
        if bound is None:
            return False
        bound = max(bound, trio.current_time())
        if not any(
            not w.answered and w is not driver and w.deadline > bound for w in flight.waiters
        ):
            return False
        for w in flight.waiters:
            if not w.answered and (w is driver or w.deadline <= bound):
                w.answered = True
        waiting = flight.round = round_.next = _Round(driver, late=late, error=exc)
        round_.bound = bound
        round_.result = outcome.Error(exc)
        round_.done.set()
        result = await late.wait()
        if isinstance(result, outcome.Error):
            if not self._input_error(result.error):
                return False  # the work's or its replica's: run it again
            # The model's error for the input: running it again would repeat it,
            # and charge for it again.
            waiting.result = result
            self._late_answers += 1
            return True
        if not isinstance(result, outcome.Value):  # none came
            return False
        keep = late.keep
        waiting.result = result if keep is None else outcome.capture(keep, result.value)
        if isinstance(waiting.result, outcome.Value):
            self._late_answers += 1
        return True

    def _run_again(self, flight: _Flight, exc: Exception) -> bool:
        """If ``exc`` belongs to the driver's deadline and a waiter's own deadline is
        later (and not passed), end the round with it (answering the others) and
        begin the next one, driven by the earliest such waiter; return whether it
        did. A waiter an earlier round answered, not resumed yet, is none of them:
        each drives at most once. Not a checkpoint: no waiter comes or goes in
        between."""
        round_ = flight.round
        bound = self._deadline_bound(exc, round_.driver.deadline)
        if bound is None:
            return False
        # A waiter whose own deadline has passed too (a batch that failed past it,
        # run again in parts) would run, and pay, for an answer it cannot use.
        bound = max(bound, trio.current_time())
        later = [
            w for w in flight.waiters
            if not w.answered and w is not round_.driver and w.deadline > bound
        ]
        if not later:
            return False
        for w in flight.waiters:
            if not w.answered and (w is round_.driver or w.deadline <= bound):
                w.answered = True
        flight.round = round_.next = _Round(min(later, key=lambda w: w.deadline))
        round_.bound = bound
        round_.result = outcome.Error(exc)
        round_.done.set()
        self._reruns += 1
        return True

    def statistics(self) -> SingleFlightStatistics:
        return SingleFlightStatistics(
            in_flight=len(self._flights),
            started=self._started,
            coalesced=self._coalesced,
            abandoned=self._abandoned,
            reruns=self._reruns,
            late_answers=self._late_answers,
        )
