"""Keeping what may hang a worker thread off a model's last ready replica: the part of
:class:`~trioserve.actors.SchedulerActor` that decides which of a queue's replicas can
be spared (``spare``), which replica runs a request that may hang (``risking``), and
remembers the inputs that hung a thread (``note_hang``) so that the same input sent
again is held or answered poison at once (docs/faults.md, "A hanging input and the
last thread replica"). Only thread replicas mark such requests: a worker process or a
Ray actor is killed at its deadline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trioserve import RequestState, TrioserveError

from ._hung_inputs import (
    HungInputs,
    hedged_hang_poison,
    hedged_twin_answered,
    hedged_twin_poison,
    hung_input_poison,
    same_input_poison,
    unloaded_hung_error,
)
from ._straggler import Hang, hung, may_hang

DISPATCHED = RequestState.DISPATCHED

if TYPE_CHECKING:
    import collections
    from collections.abc import Callable

    import trio
    from trioserve import Request


class Sparing:
    """The sparing methods of a scheduler (its attributes ``hung_inputs`` and
    ``metrics`` set up by ``_init_sparing``); not used on its own."""

    if TYPE_CHECKING:
        model: str
        policy: Any
        batchers: list[Any]
        replicas: int
        threads: bool
        twins: dict[Any, Any]
        _retries: collections.deque[list[Request]]
        _apart: collections.deque[Request]
        _idle: trio.lowlevel.ParkingLot
        _emptied: trio.lowlevel.ParkingLot
        _refuse_held: bool

        def _hold(self, requests: list[Request]) -> None: ...
        def _sweep_apart(self, done: Callable[[Request], bool]) -> bool: ...
        def heir(self) -> Any: ...

    def _init_sparing(self) -> None:
        #: the inputs whose batch hung a worker thread of this queue's replicas,
        #: while that call runs (:meth:`note_hang`); None until one hung: a queue
        #: whose replicas never hung a thread digests no input
        self.hung_inputs: HungInputs | None = None
        #: the model's metrics (set by the assembly; None: nothing is counted): the
        #: poison requests answered here count in its ``statuses``
        self.metrics: Any = None

    def thread_returned(self) -> None:
        """A model call cut off in a worker thread of one of this queue's replicas
        returned: the inputs of its batch are forgotten (:meth:`note_hang`), and a
        retry that waited for a replica to spare (see :meth:`spare`) may run now,
        on that replica or another one; idle replicas look again. Not a
        checkpoint."""
        if self.hung_inputs:
            self.hung_inputs.drop_returned()
        if (self._retries or self._apart) and self._idle:
            self._idle.unpark_all()

    def hedge_room(self) -> bool:
        """Whether a hedge copy may be sent: always for replicas that can be killed
        at their deadline (worker processes, Ray actors); for thread replicas
        (``threads``) only while three or more are ready, so that one is left that
        runs neither the original nor its copy should the input hang both (a
        thread cannot be stopped: with two, one hanging input would take the
        whole model). A count over the replicas, not the queue. Not a
        checkpoint."""
        return not self.threads or self._ready_besides(None) >= 3

    def spare(self, but: Any) -> int:
        """How many of this queue's replicas other than ``but`` are ready and not
        running a part that may hang their thread (``risking``): those that would
        go on serving should ``but`` hang. Not a checkpoint."""
        return sum(
            1 for b in self.batchers
            if b is not but and b.ready and not getattr(b, "risking", False)
        )

    @staticmethod
    def _risk(batch: list[Request], puller: Any) -> None:
        """``puller`` is given ``batch``: if it may hang its thread, the puller runs
        such a part from now (``risking``), not from when its pull returns: the
        checkpoint before that lets another idle replica look, and it must not count
        this one as a replica to spare. Not a checkpoint."""
        if puller is not None and may_hang(batch):
            puller.risking = True

    def _unspared(self, batch: list[Request], puller: Any) -> bool:
        """Whether ``batch`` holds a request that may hang ``puller``'s thread too
        (nothing stops a thread): one of a batch that hung a worker thread, until it
        runs to completion (:func:`may_hang`), and no other replica would go on
        serving should it: it waits for a replica to spare rather than take the
        model's last ready one, so that one replica at a time is put at risk. That
        the hung call returned changes nothing: another input of its batch may hang
        too. A lone replica's part waits only for its thread (the model is down
        until it returns anyway), then runs. Only thread replicas mark such
        requests: a worker process or a Ray actor is killed at its deadline."""
        if puller is None:
            return False
        if self.replicas < 2:
            return hung(batch)  # (no replica is ever spared)
        return may_hang(batch) and not self.spare(puller)

    def note_hang(
        self, batch: list[Request], hang: Hang, replica: Any = None,
        why: str = "its batch ran past its deadline",
    ) -> None:
        """``batch``, run by a thread replica of this queue (``replica``), ran past
        its deadline (``why``): its thread runs on (``hang``). Remember its inputs
        while it does, so that a new request with one of them (its client sending
        it again, a hedge copy) goes the way its retried part goes: it runs only
        where a replica can be spared, or is poison at once (:meth:`_recall`). A
        lone replica remembers nothing: its own retries wait for its thread, and so
        does all its traffic.

        A request and its hedge twin are one input, run on two replicas at most
        (docs/faults.md, "A hedged input that hangs"): a request of ``batch``
        whose twin already runs on another replica is not retried (that run is
        its input's last), nor is one whose twin hung and was answered; a twin
        still waiting is marked (``Reply.hung``) and never runs while this one is
        retried (:meth:`_next_apart`). Call it before the batch is handed back.
        Not a checkpoint."""
        if self.replicas < 2:
            return
        memory = self.hung_inputs
        if memory is None:
            memory = self.hung_inputs = HungInputs()
        for r in batch:
            memory.note(r.item, hang)
        twins = self.twins
        if twins:
            for r in batch:
                reply = r.reply
                twin = twins.get(reply)
                if twin is None or not reply.answerable:
                    continue
                if twin.answerable:
                    if self._running_elsewhere(twin, replica):
                        self._poison(r, hedged_hang_poison(self.model, why, first=True))
                    elif twin.hung is None:
                        twin.hung = (hang,)
                elif twin.hung is not None:
                    self._poison(r, hedged_hang_poison(self.model, why, first=False))

    def _running_elsewhere(self, reply: Any, but: Any) -> bool:
        """Whether the request of ``reply`` is in a batch in flight on a replica of
        this queue other than ``but``."""
        return reply.state is DISPATCHED and any(
            b is not but and b.holds(reply) for b in self.batchers
        )

    def _poison(self, request: Request, error: BaseException) -> None:
        """Answer ``request`` (dispatched) ``error``, counted as poison."""
        if request.reply.set_error(error):
            self._count_poison()

    def poisoned_alone(self, requests: list[Request]) -> None:
        """``requests``, each run alone, hung a thread of this queue's replicas and
        were answered poison (the batcher decides it): mark their inputs in what is
        remembered (:meth:`note_hang`), so that a retried part holding one of them
        (the same input twice in a hung batch) is answered poison too, rather than
        wait for a replica to spare: one held when it is marked (:meth:`after_hang`),
        and one handed back later, as a part of a batch that raised on another
        replica (:meth:`retry`). Nothing when nothing is remembered. Not a
        checkpoint."""
        memory = self.hung_inputs
        if memory:
            for r in requests:
                memory.poisoned(r.item)

    def _poison_retried(self, memory: HungInputs) -> None:
        """Answer each retried part's request whose input was answered poison after
        it ran alone (:meth:`poisoned_alone`) with :func:`same_input_poison`; the
        others stay held, in their order. One look through the retries."""
        retries = self._retries
        dropped = False
        for _ in range(len(retries)):
            batch = retries.popleft()
            kept = self._unpoisoned(batch, memory)
            if kept:
                retries.append(kept)
            dropped = dropped or len(kept) < len(batch)
        if dropped:
            self._drained_some()

    def _unpoisoned(self, batch: list[Request], memory: HungInputs) -> list[Request]:
        """``batch`` (a retried part) without its requests whose input was answered
        poison after it ran alone (:meth:`poisoned_alone`), each answered
        :func:`same_input_poison` (counted). One digest per request. Not a
        checkpoint."""
        kept = []
        for req in batch:
            if req.reply.state is DISPATCHED and memory.was_poisoned(req.item):
                self._poison(req, same_input_poison(self.model, ran=req.reply.ran))
            else:
                kept.append(req)
        return kept

    def _answer_held(self) -> None:
        """Answer each request held because it may hang a thread, kept apart or a
        retry (an unloaded model's: :meth:`hand_over`), as :meth:`_refuse_one`
        does. Not a checkpoint."""

        def done(req: Request) -> bool:
            if req.reply.hung is None:
                return False  # kept apart for another replica than its twin's
            self._refuse_one(req)
            return True

        self._sweep_apart(done)
        if self._retries:
            self._refuse_retries()
        self._drained_some()

    def _refuse_one(self, req: Request, *, kept_apart: bool = True) -> None:
        """Answer ``req`` (held because it may hang a thread, in an unloaded
        model's queue): one that never ran with the refusal a new request gets from
        the queue it is handed over to, not charged; one that ran (a failed
        batch's retry) with :func:`unloaded_hung_error`, charged. One whose caller
        left is dropped (told it never ran, unless it ran). ``kept_apart``: it
        leaves the devices' cost (a retry left it when its batch was handed
        back)."""
        reply = req.reply
        if reply.state is DISPATCHED:
            if reply.ran:
                reply.set_error(unloaded_hung_error(self.model))
            else:
                refusal = self.heir()._refusal()
                if isinstance(refusal, TrioserveError):
                    refusal.in_queue = True  # never ran: not charged
                reply.set_error(refusal)
        elif not reply.ran:
            reply.unrun()  # its caller left: it never ran
        if kept_apart:
            self.policy.left([req])

    def _refuse_retries(self) -> None:
        """Answer each request of the retries that may hang a thread (``Reply.hung``)
        as an unloaded model's queue does (:meth:`_refuse_one`: charged when it ran,
        as a failed batch's retry did); the others stay, in their order, for this
        queue's replicas. One look through the retries. Not a checkpoint."""
        retries = self._retries
        for _ in range(len(retries)):
            kept = []
            for req in retries.popleft():
                if req.reply.hung is None:
                    kept.append(req)
                else:
                    self._refuse_one(req, kept_apart=False)
            if kept:
                retries.append(kept)
        self._drained_some()

    def after_hang(self, hang: Hang | None = None, replica: Any = None) -> None:
        """A batch hung a thread of ``replica`` (``hang``) and was handed back
        (:meth:`note_hang` first). Re-decide every request held apart, and answer,
        rather than hold to its deadline, one that can no longer run: a hedge twin
        whose twin hung, ran again and was answered (:meth:`_held_twin_answered`), and,
        when fewer than two replicas other than ``replica`` are ready, one whose
        input hung a thread that still runs, this one or an earlier one: what a
        new request with that input gets (:meth:`_unrunnable`, as
        :meth:`replicas_changed` decides). The replica that ran it alone beside a
        spared one hung (on it, or on another input), and the spared one would
        otherwise be the last ready replica. An unloaded model's queue answers what
        this hang marked to be held (:meth:`note_hang`) at once
        (:meth:`hand_over`). A retried part whose input was answered poison after
        it ran alone (:meth:`poisoned_alone`: the same input twice in a hung batch)
        is answered poison too (:meth:`_poison_retried`). A drain
        (:meth:`wait_empty`) is woken when one was answered. One loop over what is
        held; nothing when nothing is. Not a checkpoint."""
        memory = self.hung_inputs
        if memory is not None and self._retries and memory.any_poisoned():
            self._poison_retried(memory)
        if not self._apart:
            return
        scarce = (
            hang is not None and memory is not None and self._ready_besides(replica) < 2
        )
        unloaded = self._refuse_held

        def done(req: Request) -> bool:
            if (self.twins and self._held_twin_answered(req)) or (
                scarce and self._unrunnable(req, memory)
            ):
                self.policy.left([req])
                return True
            if unloaded and req.reply.hung is not None:
                self._refuse_one(req)
                return True
            return False

        if self._sweep_apart(done):
            self._drained_some()

    def replicas_changed(self) -> None:
        """The set of this queue's ready replicas changed otherwise than by a hang
        (:meth:`after_hang`): a replica added, retired, lost, its breaker opened.
        Re-decide the requests held apart for their input as a new request with
        it is decided (:meth:`_recall`): with fewer than two replicas ready, each
        whose input hung a thread that still runs is answered its poison error
        now, not at its deadline; and idle replicas look again, so that one runs
        what can run now beside a spared one; a drain (:meth:`wait_empty`) is woken
        when one was answered. Only an empty check when nothing is held apart. Not
        a checkpoint."""
        apart = self._apart
        if not apart:
            return
        memory = self.hung_inputs
        if memory and self._ready_besides(None) < 2:

            def done(req: Request) -> bool:
                if not self._unrunnable(req, memory):
                    return False
                self.policy.left([req])
                return True

            if self._sweep_apart(done):
                self._drained_some()
        if apart and self._idle:
            self._idle.unpark_all()

    def _drained_some(self) -> None:
        """Requests held here were answered: wake a drain (``wait_empty``), which
        nothing else may wake (no batch need be taken or completed meanwhile). Not
        a checkpoint."""
        if self._emptied:
            self._emptied.unpark_all()

    def _unrunnable(self, req: Request, memory: Any) -> bool:
        """Whether ``req``, held apart for its input (``Reply.hung``; not a hedge
        twin waiting for its twin's retry), was answered poison because that input
        hung a thread that still runs and fewer than two replicas are ready (the
        caller's look). Not a checkpoint."""
        reply = req.reply
        if reply.hung is None or reply.state is not DISPATCHED:
            return False
        twin = self.twins.get(reply) if self.twins else None
        if twin is not None and twin.answerable and twin.hung is not None:
            return False  # its twin's retry is the input's next run: it decides
        if memory.match(req.item) is None:
            return False
        self._poison(req, hung_input_poison(self.model))
        return True

    def _held_twin_answered(self, req: Request) -> bool:
        """Whether ``req``, held apart because its hedge twin hung a thread
        (``Reply.hung``), was answered now that its twin, run again, was answered:
        it never runs (it would be the input's third run). Poison (counted) only
        when its twin was, after it ran alone (:meth:`poisoned_alone`: its input
        is marked so while its call runs); otherwise (the model raised on the twin,
        its deadline passed, it answered) it is answered
        :func:`hedged_twin_answered`, not counted: its hedged caller gets its
        twin's answer. ``in_queue`` either way: it never ran. Not a checkpoint."""
        reply = req.reply
        if reply.hung is None or reply.state is not DISPATCHED:
            return False
        twin = self.twins.get(reply)
        if twin is None or twin.answerable or twin.hung is None:
            return False
        memory = self.hung_inputs
        if memory is not None and memory.was_poisoned(req.item):
            self._poison(req, hedged_twin_poison(self.model))
        else:
            reply.set_error(hedged_twin_answered(self.model))
        return True

    def _recall(self, request: Request) -> None:
        """Mark ``request`` as one that may hang (``Reply.hung``) when its input hung
        a thread of this queue's replicas that still runs; raise its poison error
        (counted) when fewer than two replicas are ready: one to run it, and one to
        go on serving should it hang (one of them running such a request itself
        may be spared once it is done: until then it waits, see :meth:`_unspared`)."""
        hang = self.hung_inputs.match(request.item)  # type: ignore[union-attr]
        if hang is None:
            return
        if self._ready_besides(None) < 2:
            self._count_poison()
            raise hung_input_poison(self.model)
        request.reply.hung = (hang,)

    def _mark_recalled(self, requests: list[Request]) -> None:
        """Mark the requests of a call whose input hung a thread that still runs, as
        :meth:`_recall` does; whether one is poison is decided when it is pulled
        (:meth:`_set_aside`), not here: a call is queued all or none."""
        memory = self.hung_inputs
        for r in requests:
            hang = memory.match(r.item)  # type: ignore[union-attr]
            if hang is not None:
                r.reply.hung = (hang,)

    def _set_aside(self, batch: list[Request], puller: Any) -> list[Request]:
        """``batch`` (fresh work, just dispatched) without its requests marked as
        ones that may hang (:meth:`_recall`, :meth:`note_hang`): each is held apart
        to run alone where a replica can be spared (see :meth:`_next_apart`), or,
        when no other replica than ``puller`` is ready, is answered its poison error
        now; once the model is unloaded, it is answered the unload's refusal
        (:meth:`hand_over`). Not a checkpoint."""
        kept = []
        for req in batch:
            if req.reply.hung is None:
                kept.append(req)
            elif self._refuse_held:
                self._refuse_one(req)  # an unloaded model's: nothing is held
            elif puller is not None and not self._ready_besides(puller):
                req.reply.set_error(hung_input_poison(self.model))
                self.policy.left([req])
                self._count_poison()
            else:
                self._apart.append(req)
                self._hold([req])
        return kept

    def _ready_besides(self, but: Any) -> int:
        """How many of this queue's replicas other than ``but`` are ready."""
        return sum(1 for b in self.batchers if b is not but and b.ready)

    def _count_poison(self) -> None:
        if self.metrics is not None:
            self.metrics.statuses["poison"] += 1
