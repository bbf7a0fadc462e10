"""The requests a scheduler holds outside its queue: the part of
:class:`~trioserve.actors.SchedulerActor` that keeps the batches handed back to run
again (``retry``: a straggler's, a dead worker's, a failed batch's parts) and the
requests kept apart from their hedge twin's replica (``keep_apart``), gives each to
a ``pull`` that may run it (``_next_retry``, ``_next_apart``), and answers those
whose deadline passes while held, at a pull or at the actor's timer
(``_expire_held``), or drops those whose caller left.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
from trioserve import DeadlineExceeded, ReplyRelay, Request, RequestState

if TYPE_CHECKING:
    import collections

    from trioserve import Reply

_DISPATCHED = RequestState.DISPATCHED


class Held:
    """The held-requests methods of a scheduler (its attributes ``_retries``,
    ``_apart`` and ``_held_at`` set up by ``SchedulerActor.__init__``); not used on
    its own."""

    if TYPE_CHECKING:
        model: str
        policy: Any
        batchers: list[Any]
        retried: int
        twins: dict[Reply, Reply]
        hung_inputs: Any
        _retries: collections.deque[list[Request]]
        _apart: collections.deque[Request]
        _held_at: float
        _wake_at: float
        _idle: trio.lowlevel.ParkingLot
        _timer: trio.lowlevel.ParkingLot
        _emptied: trio.lowlevel.ParkingLot
        _refuse_held: bool

        def _drained_some(self) -> None: ...
        def _refuse_one(self, req: Request, *, kept_apart: bool = True) -> None: ...
        def _refuse_retries(self) -> None: ...
        def _unpoisoned(self, batch: list[Request], memory: Any) -> list[Request]: ...
        def _unspared(self, batch: list[Request], puller: Any) -> bool: ...
        def _held_twin_answered(self, req: Request) -> bool: ...

    def retry(self, batches: list[list[Request]]) -> None:
        """Hand back batches to run again (their requests stay dispatched); the next
        ``pull`` of any batcher takes them before new work. A request whose deadline
        has passed is answered now (see :meth:`_settle`), and one that waits is
        answered at its deadline by the actor's timer, whether or not a replica
        pulls meanwhile (the only one may be stuck in a straggling thread). A part
        with an input found poison when run alone (:meth:`poisoned_alone`) is
        answered poison now, however it was handed back (a hang, or a model raise
        after that input hung a thread alone), and, once the model is unloaded,
        one that may hang a thread is answered at once (:meth:`hand_over`)."""
        now = trio.current_time()
        # Only the parts handed back now are looked at for a poison input: one held
        # already was looked at when it was handed back, and again by the hang
        # that marked an input poison (after_hang follows poisoned_alone), so one
        # digest per request handed back, not per request held.
        memory = self.hung_inputs
        if memory is not None and not memory.any_poisoned():
            memory = None
        for batch in batches:
            if batch:
                self.retried += 1
                alive = self._settle(batch, now)
                if alive and memory is not None:
                    alive = self._unpoisoned(alive, memory)
                if alive:
                    self._retries.append(alive)
                    self._hold(alive)
                    for req in alive:
                        relay = req.reply.group
                        if type(relay) is ReplyRelay:
                            # a request carrying an answered one's item: it has no
                            # deadline, and leaves when withdrawn, as a queued one
                            relay.on_withdraw = self._drop_withdrawn
        if self._refuse_held and self._retries:
            self._refuse_retries()  # an unloaded model's: nothing waits for a spare
        if self._retries and self._idle:
            self._idle.unpark_all()

    def _drop_withdrawn(self) -> None:
        """A request carrying an answered one's item into a retry was withdrawn
        (nobody waits for it any more: ``ReplyRelay.withdraw``): drop the retries'
        withdrawn requests now, as a withdrawn queued request leaves the queue,
        rather than at the next pull (nothing else would: it has no deadline), so
        that the queue's depth and load, and a drain (:meth:`wait_empty`), do not
        count it meanwhile. Its order in what is held is kept. Not a checkpoint."""
        retries = self._retries
        for _ in range(len(retries)):
            batch = retries.popleft()
            alive = [r for r in batch if r.reply.state is _DISPATCHED]
            if alive:
                retries.append(alive)
        if self._emptied:
            self._emptied.unpark_all()

    def _hold(self, requests: list[Request]) -> None:
        """``requests`` (dispatched) are held here: note the earliest deadline at
        which one is to be answered, and wake the actor's timer when that comes
        before its next wake."""
        first = min((r.deadline for r in requests if r.answer_expiry), default=math.inf)
        if first < self._held_at:
            self._held_at = first
            if first < self._wake_at:
                self._timer.unpark_all()

    def keep_apart(self, request: Request) -> None:
        """A batcher pulled ``request`` (dispatched) while it holds its hedge twin:
        another replica's next ``pull`` takes it, alone (see :meth:`pull`); one that
        may hang a thread is answered at once once the model is unloaded
        (:meth:`hand_over`)."""
        if self._refuse_held and request.reply.hung is not None:
            self._refuse_one(request)
            return
        self._apart.append(request)
        self._hold([request])
        if self._idle:
            self._idle.unpark_all()

    def _next_apart(self, puller: Any, now: float) -> list[Request] | None:
        """The first request kept apart that ``puller`` may run, alone (possibly
        none: [], or None when one waits only because it raised alone on ``puller``
        and another replica is ready); drops those whose hedge is over (withdrawn:
        the other answered, or the caller left) or whose deadline passed.

        A part of a failed batch that raised alone here and was then kept apart
        from its twin's replica still waits for a third (see :meth:`_elsewhere`):
        run again where it raised, it most likely got that replica's error
        although its twin could still answer it."""
        apart = self._apart
        elsewhere = False
        for _ in range(len(apart)):
            req = apart.popleft()
            if self._drop_apart(req, now):
                continue
            reply = req.reply
            twin = self.twins.get(reply)
            if twin is not None and reply.hung is not None and twin.hung is not None:
                # its twin hung a thread: the twin's retry is the input's next run,
                # and this one never runs beside it (a hedged input is run on two
                # replicas at most); once the twin was answered, nor after
                if twin.answerable:
                    apart.append(req)
                    continue
                if self._held_twin_answered(req):
                    self.policy.left([req])
                    continue
            if puller is not None and twin is not None and puller.holds(twin):
                apart.append(req)
                continue
            if self._elsewhere([req], puller):
                apart.append(req)
                elsewhere = True
                continue
            if self._unspared([req], puller):
                apart.append(req)  # looked at again as a retry is (see pull)
                continue
            if reply.hung is not None:
                # its input hung a thread (or was in a batch that did): it runs as
                # a retry, whose failure is its input's doing (``retried``)
                reply.suspect = True
            return [req]
        return None if elsewhere else []

    def _drop_apart(self, req: Request, now: float) -> bool:
        """Whether ``req``, kept apart, is done with: its hedge is over (withdrawn:
        the other answered, or the caller left) or its deadline passed (answered
        DeadlineExceeded, or dropped when its caller's own deadline it is)."""
        reply = req.reply
        if reply.state is _DISPATCHED and req.deadline > now:
            return False
        if reply.state is _DISPATCHED:
            if req.answer_expiry:
                reply.set_error(
                    DeadlineExceeded(
                        f"model {self.model!r}: deadline passed while it waited "
                        + (
                            "for a replica to spare: its input hung the model's "
                            "worker thread earlier" if reply.hung is not None
                            else "for a replica other than its hedge twin's"
                        ),
                        # never ran, unless it is the retry of a failed batch
                        in_queue=not reply.ran,
                    )
                )
            else:
                reply.withdraw()  # its caller leaves now
        if not reply.ran:
            # abandoned by its caller (now, or before), it never ran: its caller
            # is told (Reply.when_unrun; a no-op when it was answered)
            reply.unrun()
        # it left the devices, but not as a batch: the service rate's pair of full
        # batches goes on
        self.policy.left([req])
        return True

    def _sweep_apart(self, done: Callable[[Request], bool]) -> bool:
        """Re-decide each request held apart once, in order: ``done(req)`` answers
        or drops it and returns True (it leaves), or returns False (it stays, in its
        place). Returns whether one left: the caller then wakes a drain
        (``_drained_some``), which nothing else may wake. Not a checkpoint."""
        apart = self._apart
        held = len(apart)
        for _ in range(held):
            req = apart.popleft()
            if not done(req):
                apart.append(req)
        return len(apart) < held

    def _expire_held(self, now: float) -> float:
        """Answer the requests held here (retries, kept apart) whose deadline passed,
        as a pull would; drop those whose caller left. Returns the earliest deadline
        at which one still held is to be answered (inf: none)."""
        first = math.inf
        retries = self._retries
        apart = self._apart
        answered = False
        for _ in range(len(retries)):
            batch = retries.popleft()
            alive = self._settle(batch, now)
            answered = answered or len(alive) < len(batch)
            if alive:
                retries.append(alive)
                for r in alive:
                    if r.answer_expiry and r.deadline < first:
                        first = r.deadline
        dropped = self._sweep_apart(lambda req: self._drop_apart(req, now))
        for req in apart:
            if req.answer_expiry and req.deadline < first:
                first = req.deadline
        if answered or dropped:
            # (answered at their deadline with no batcher pulling, e.g. each degraded
            # by a hung thread: nothing else wakes a drain waiting for them)
            self._drained_some()
        return first

    def _elsewhere(self, batch: list[Request], puller: Any) -> bool:
        """Whether ``batch`` is a request that raised alone on ``puller`` and waits
        for another replica, one of which is ready to run it."""
        if len(batch) != 1 or puller is None:
            return False
        mark = batch[0].reply.raised_on
        return (
            mark is not None and mark[0] is puller
            and any(b is not puller and b.ready for b in self.batchers)
        )

    def _next_retry(self, puller: Any, now: float) -> list[Request] | None:
        """The next batch to retry that ``puller`` may run (its requests still
        waiting for an answer; possibly none: []), or None when each waits for
        another replica (a request that raised alone on ``puller``) or for a
        replica to spare (one whose batch hung a thread still running, while
        ``puller`` is the last ready replica: :meth:`_unspared`). One that waits
        so is answered at its deadline (dropped if its caller left) by the look of
        any puller, rather than only when another replica pulls it."""
        retries = self._retries
        for _ in range(len(retries)):
            head = retries[0]
            if not (self._elsewhere(head, puller) or self._unspared(head, puller)):
                break
            if self._settle(retries[0], now):
                retries.rotate(-1)
            else:
                retries.popleft()
        else:
            return None if retries else []
        alive = self._settle(retries.popleft(), now)
        if alive and hasattr(self.policy, "in_service"):
            # back on a device: its completion takes it off again (the failed run's
            # did, when it was handed back)
            self.policy.in_service += sum(r.cost for r in alive)
        return alive

    def _settle(self, batch: list[Request], now: float) -> list[Request]:
        """The requests of a retry ``batch`` still waiting for an answer; those whose
        deadline passed are answered DeadlineExceeded (or dropped, when their
        caller's own deadline it is), those whose caller left dropped."""
        alive = []
        for req in batch:
            if req.reply.state is not _DISPATCHED:
                if not req.reply.ran:  # staged behind a lost worker's batch
                    req.reply.unrun()  # its caller left, and it never ran
                continue  # the caller left, or it was answered
            if req.deadline <= now:
                if req.answer_expiry:
                    req.reply.set_error(
                        DeadlineExceeded(
                            f"model {self.model!r}: deadline passed while its batch was "
                            "being retried",
                            # a part of a failed batch ran; a batch staged behind it on
                            # a lost worker, handed back as it was, never did
                            in_queue=not req.reply.ran,
                        )
                    )
                else:
                    req.reply.withdraw()
                    if not req.reply.ran:
                        req.reply.unrun()  # its caller leaves now: it never ran
                continue
            alive.append(req)
        return alive
