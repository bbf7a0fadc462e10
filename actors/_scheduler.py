"""The scheduler actor: one per model, the owner of that model's only queue.

Callers hand requests to ``submit_nowait``, which admits them into the queueing
policy at once, in the caller's task (a request that cannot be admitted is refused
with Overloaded / QuotaExceeded before it takes any memory), and wakes idle
batchers. Batchers ``pull`` closed batches when their device is free (worker-pull).
The actor's own task answers requests whose deadline passes while they wait.

A hedged request's copy (``submit_copy_nowait``) takes only the queue's free room and
is never run by the replica that holds its original: a batcher that pulls a request
whose twin it holds hands it back (``keep_apart``), and only another replica's
``pull`` takes it.

This module holds the actor's intake (the ``submit_*`` methods, hedge copies),
``pull``, its timer, and the hand-over, retirement and close of its queue. The
requests it holds outside the queue (retries, requests kept apart) are
:class:`~._held.Held`'s, in ``_held.py``; keeping what may hang a worker thread off
the last ready replica is :class:`~._sparing.Sparing`'s, in ``_sparing.py``.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import attrs
import trio
from trioserve import (
    Actor,
    ActorBroken,
    ActorClosed,
    Overloaded,
    Reply,
    Request,
    RequestState,
    TrioserveError,
)

from ._batching import SchedulingPolicy
from ._held import Held
from ._singleflight import own_error
from ._sparing import Sparing

_DISPATCHED = RequestState.DISPATCHED

#: How often (seconds) a replica that leaves a retry to another one looks again whether
#: that one is still ready (see ``SchedulerActor.pull``).
ELSEWHERE_RECHECK = 0.005


@attrs.frozen(kw_only=True)
class PlannedCall:
    """A call's admission decided by :meth:`SchedulerActor.plan_all_nowait`: its
    requests and the policy's plan (None: a policy that cannot plan decides when the
    call is submitted)."""

    requests: list[Request] = attrs.field(eq=False)
    plan: Any = attrs.field(eq=False)


class SchedulerActor(Held, Sparing, Actor):
    def __init__(self, model: str, policy: SchedulingPolicy) -> None:
        super().__init__()
        self.name = f"scheduler[{model}]"
        self.model = model
        self.policy = policy
        self._idle = trio.lowlevel.ParkingLot()  # batchers waiting for a batch
        self._timer = trio.lowlevel.ParkingLot()  # the actor's task, until the next expiry
        self._wake_at = math.inf
        self._max_size = getattr(getattr(policy, "limits", None), "max_size", 1)
        self._closed = False
        #: what new requests get once no replica can serve them (``retire``); None:
        #: ActorClosed, the runtime is shut down
        self._closed_error: BaseException | None = None
        #: makes that error anew for each request refused (``retire``'s ``refusal``:
        #: one that says what is true when it is refused); None: ``_closed_error``
        self._refuse: Callable[[], BaseException] | None = None
        #: batches handed back by batchers (a straggler's or a dead worker's), already
        #: dispatched; pulled before new work
        self._retries: collections.deque[list[Request]] = collections.deque()
        self.retried = 0  # batches handed back
        #: batchers pulling from this queue (set by the assembly): a hedge's copy
        #: needs another replica than its original's
        self.replicas = 0
        #: those batchers (set by the assembly; ``replicas`` of them when complete)
        self.batchers: list[Any] = []
        #: they run the model in worker threads, which cannot be stopped (set by the
        #: assembly): a hedge copy is sent only where a third replica is left to
        #: serve should the input hang both (:meth:`hedge_room`)
        self.threads = False
        #: the model's queues, this one among them (set by the assembly: a model with
        #: a slow lane has two), and which of its requests this one takes when there
        #: are several (None: all), as an error message names them
        self.lanes: list[SchedulerActor] = [self]
        self.lane: str | None = None
        #: hedged requests and their copies, each reply to the other's, while both
        #: may run; a batcher checks it only when it is not empty
        self.twins: dict[Reply, Reply] = {}
        #: dispatched requests handed back by a batcher holding their twin, for
        #: another replica's pull (after retries, before new work)
        self._apart: collections.deque[Request] = collections.deque()
        #: no request held here (a retry, or kept apart) is to be answered at its
        #: deadline before this (inf: none). Never late, possibly early: a request
        #: taken by a pull leaves it as it was, and the timer then finds none due.
        #: So the timer scans what is held only when one may be due, not at each wake
        self._held_at = math.inf
        #: the queue new requests go to instead once this one is handed over (a
        #: model reloaded or unloaded: ``hand_over``); None: none
        self.successor: SchedulerActor | None = None
        #: what checks each request handed over to ``successor`` (None: none is
        #: checked): set by ``hand_over`` when the successor's model takes other
        #: inputs than this queue's requests were checked against
        self.handed_check: Callable[[Request], None] | None = None
        #: handed over because its model was unloaded (``hand_over``'s
        #: ``refuse_held``): a request held apart for its input is answered at once
        #: with what a new one gets, not held for the drain to wait on
        self._refuse_held = False
        #: ``wait_empty`` callers, woken when a batch is taken or completed, a
        #: batcher idles, or requests held here are answered
        self._emptied = trio.lowlevel.ParkingLot()
        self._init_sparing()

    # ---- callers
    def submit_nowait(self, request: Request) -> None:
        """Admit a request into the queue without blocking.

        Raises Overloaded (or QuotaExceeded) when the policy refuses it, ActorClosed
        after shutdown, and ActorBroken if the policy itself fails.
        """
        if self._closed:
            if self.successor is not None:
                if self.handed_check is not None:
                    self.handed_check(request)
                return self._handed_to().submit_nowait(request)
            raise self._refusal()
        if self.hung_inputs:  # (a thread hung, on inputs still remembered)
            self._recall(request)
        policy = self.policy
        try:
            policy.offer(request, request.arrival)
        except Overloaded:
            raise
        except Exception as exc:
            raise ActorBroken(f"model {self.model!r}: the scheduler failed to queue it") from exc
        if request.deadline < self._wake_at and request.answer_expiry:
            self._timer.unpark_all()
        idle = self._idle
        if idle:
            n = len(policy)
            # Wake a waiting batcher only when this request can change its decision:
            # a first request sets the close time; a full one closes the batch.
            if n == 1 or n >= self._max_size or getattr(policy.limits, "max_tokens", None):
                idle.unpark_all()

    def submit_all_nowait(self, requests: list[Request]) -> None:
        """Admit the requests of one call (one tenant and class, one deadline), all or
        none, as :meth:`submit_nowait` admits one; wakes idle batchers once."""
        if self._closed:
            if self.successor is not None:
                self._check_handed(requests)
                return self._handed_to().submit_all_nowait(requests)
            raise self._refusal()
        if not requests:
            return
        if self.hung_inputs:
            self._mark_recalled(requests)
        policy = self.policy
        was = len(policy)
        offer_all = getattr(policy, "offer_all", None)
        try:
            if offer_all is not None:
                offer_all(requests, requests[0].arrival)
            else:
                for request in requests:
                    policy.offer(request, request.arrival)
        except Overloaded:
            raise
        except Exception as exc:
            raise ActorBroken(f"model {self.model!r}: the scheduler failed to queue it") from exc
        self._call_queued(requests[0], was)

    def plan_all_nowait(self, requests: list[Request]) -> PlannedCall:
        """Decide whether the requests of one call (one tenant and class, one
        deadline) would be admitted all together, without queueing anything, for
        :meth:`submit_planned_nowait`, which must follow before the queue changes
        (before the next checkpoint).

        Raises Overloaded (or QuotaExceeded) having queued nothing, pushed nobody out
        and counted nothing; ActorClosed and ActorBroken as :meth:`submit_nowait`. So
        a call whose items go to several schedulers (a model's two lanes) is planned
        in each and only then submitted to each: a refusal in one sheds nobody in
        another. A policy without ``plan_all`` decides only when the call is
        submitted.
        """
        if self._closed:
            if self.successor is not None:
                self._check_handed(requests)
                return self._handed_to().plan_all_nowait(requests)
            raise self._refusal()
        plan_all = getattr(self.policy, "plan_all", None)
        if plan_all is None or not requests:
            return PlannedCall(requests=requests, plan=None)
        try:
            plan = plan_all(requests, requests[0].arrival)
        except Overloaded:
            raise
        except Exception as exc:
            raise ActorBroken(f"model {self.model!r}: the scheduler failed to queue it") from exc
        return PlannedCall(requests=requests, plan=plan)

    def submit_planned_nowait(self, planned: PlannedCall) -> None:
        """Queue a call as :meth:`plan_all_nowait` decided it, the queue unchanged
        since: it pushes out exactly the requests the plan names and is never refused
        (unless the policy could not plan: then as :meth:`submit_all_nowait`). Wakes
        idle batchers once."""
        requests = planned.requests
        if planned.plan is None:
            self.submit_all_nowait(requests)
            return
        if self._closed:
            if self.successor is not None:
                # (planned by the successor: checked by ``plan_all_nowait`` then)
                return self.successor.submit_planned_nowait(planned)
            raise self._refusal()
        if self.hung_inputs:
            self._mark_recalled(requests)
        policy = self.policy
        was = len(policy)
        try:
            policy.offer_planned(planned.plan, requests[0].arrival)
        except Exception as exc:
            raise ActorBroken(f"model {self.model!r}: the scheduler failed to queue it") from exc
        self._call_queued(requests[0], was)

    def _call_queued(self, first: Request, was: int) -> None:
        """The requests of a call, ``first`` among them, went into a queue that held
        ``was``: wake the timer for their deadline, and idle batchers when they can
        change their decision."""
        if first.deadline < self._wake_at and first.answer_expiry:
            self._timer.unpark_all()
        idle = self._idle
        if idle:
            policy = self.policy
            n = len(policy)
            if not was or n >= self._max_size or getattr(policy.limits, "max_tokens", None):
                idle.unpark_all()

    def submit_copy_nowait(self, original: Request, copy: Request) -> bool:
        """Queue ``copy``, a hedge of ``original`` (which may be queued, running or
        retried), for a replica other than the one that runs ``original``.

        A copy is speculative: it takes only free room in the queue, pushing nobody
        out, and a new request takes its room back (``offer_spare``). Returns False,
        with nothing queued and nothing counted, when there is none (or the runtime
        is shut down), when its input hung a worker thread that still runs
        (:meth:`note_hang`), or when thread replicas would have none ready left to
        serve should the original and its copy both hang (:meth:`hedge_room`).
        Once the hedge is over, call :meth:`forget_copy`.
        """
        if self._closed:
            return False
        if self.hung_inputs and self.hung_inputs.match(copy.item) is not None:
            # Its input hung a thread, which still runs: its original is held for
            # a replica to spare (or poison), and a copy would put another at risk.
            return False
        if not self.hedge_room():
            return False
        try:
            if not self.policy.offer_spare(copy, copy.arrival):
                return False
        except Exception as exc:
            raise ActorBroken(f"model {self.model!r}: the scheduler failed to queue it") from exc
        self.twins[original.reply] = copy.reply
        self.twins[copy.reply] = original.reply
        if copy.deadline < self._wake_at and copy.answer_expiry:
            self._timer.unpark_all()
        if self._idle:
            self._idle.unpark_all()
        return True

    def forget_copy(self, original: Request, copy: Request) -> None:
        """The hedge of ``original`` by ``copy`` is over (one answered, or its caller
        left): batchers may take either anywhere again. One of them kept apart for
        another replica and withdrawn leaves now, not at the next pull: until then it
        would count in the queue depth and, as cost on the devices, in every
        newcomer's estimated wait."""
        self.twins.pop(original.reply, None)
        self.twins.pop(copy.reply, None)
        if self._apart:
            now = trio.current_time()
            if self._sweep_apart(
                lambda req: (req is original or req is copy) and self._drop_apart(req, now)
            ):
                self._drained_some()  # a drain may wait for it alone

    # ---- batchers
    async def pull(self, puller: Any = None) -> list[Request]:
        """Wait for the next closed batch (each request already DISPATCHED).
        ``puller``: the batcher asking, which is not given a request handed back by
        :meth:`keep_apart` while it holds that request's twin (None: any).

        A checkpoint. Cancelling it takes nothing from the queue.
        """
        policy = self.policy
        # Cancellation is checked before a batch is taken, never after: once
        # next_batch has dispatched its requests only the caller holds them, and
        # a cancel delivered at a later checkpoint would lose them unanswered.
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            recheck = math.inf
            if self._retries:
                batch = self._next_retry(puller, trio.current_time())
                if batch:
                    self._risk(batch, puller)
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return batch
                if batch is not None:
                    continue
                # None: no retry is for ``puller`` now. One that waits for another
                # replica than ``puller`` (it raised alone there): that one was ready
                # just now; should it stop being ready before it pulls (its breaker
                # opens, its worker is replaced), ``puller`` takes the retry at its
                # next look. One that waits for a replica to spare (it hung a
                # thread) is looked at again when a replica pulls, or a hung thread
                # returns (``thread_returned``).
                if any(self._elsewhere(b, puller) for b in self._retries):
                    recheck = trio.current_time() + ELSEWHERE_RECHECK
            if self._apart:
                batch = self._next_apart(puller, trio.current_time())
                if batch:
                    self._risk(batch, puller)
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return batch
                if batch is None:  # as for a retry, above
                    recheck = trio.current_time() + ELSEWHERE_RECHECK
            batch = policy.next_batch(trio.current_time())
            if batch and self.hung_inputs is not None:
                batch = self._set_aside(batch, puller)
                if not batch:
                    continue  # it was all held apart (or answered): look again
            if batch:
                if self._emptied:
                    self._emptied.unpark_all()
                await trio.lowlevel.cancel_shielded_checkpoint()
                return batch
            if self._emptied:
                self._emptied.unpark_all()
            with trio.move_on_at(min(policy.next_close_time(), recheck)):
                await self._idle.park()

    def completed(self, batch: list[Request], *, failed: bool = False) -> None:
        """A batcher finished a batch it pulled: answered, or ``failed`` (handed back
        or answered with errors; not a measure of service)."""
        self.policy.completed(batch, trio.current_time(), failed=failed)
        if not failed and self.hung_inputs:
            self.hung_inputs.ran(batch)
        if self._emptied:  # a drain waits for its replicas to hold nothing
            self._emptied.unpark_all()

    def expired_running(self, requests: list[Request]) -> None:
        """``requests``, dispatched from this queue, were answered DeadlineExceeded by
        the replica running their batch: their deadline passed while it ran. Count
        them in their flows (``expired_running``), where the queue counts its own
        expiries. Not a checkpoint."""
        note = getattr(self.policy, "note_expired_running", None)
        if note is not None:
            for r in requests:
                note(r)

    # ---- the actor
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        policy = self.policy
        while True:
            self._wake_at = min(policy.next_expiry(), self._held_at)
            with trio.move_on_at(self._wake_at):
                await self._timer.park()
            now = trio.current_time()
            if self._held_at <= now:
                self._held_at = self._expire_held(now)
            if policy.expire(now):
                if self._idle:
                    self._idle.unpark_all()  # the oldest request may have changed
                self._drained_some()  # (with no batcher to pull, nothing else would)

    def load(self) -> float:
        """Cost units queued, in service and held here for another run (retries,
        requests kept apart): what the autoscaler scales to. Not a checkpoint."""
        policy = self.policy
        queued = getattr(policy, "queued_cost", None)
        held = sum(r.cost for b in self._retries for r in b) + sum(r.cost for r in self._apart)
        if queued is None:  # a policy that does not count cost (FifoQueue): requests
            return len(policy) + held
        return queued() + getattr(policy, "in_service", 0) + held

    @property
    def closed(self) -> bool:
        """Whether it takes no more requests (shut down, or retired)."""
        return self._closed

    def hand_over(
        self, successor: SchedulerActor, check: Callable[[Request], None] | None = None,
        *, refuse_held: bool = False,
    ) -> None:
        """Take no more requests: each new one goes to ``successor`` instead (a
        reloaded model's new queue, or an unloaded model's, which refuses it). What
        is queued here stays, for this queue's batchers to pull (:meth:`wait_empty`),
        and so do the parts of a batch of theirs that fails.

        ``check``: called with each request handed over, before the successor takes
        it; it raises (InvalidInput) for one the successor's model cannot take (a
        reload whose model takes other inputs than those the request was checked
        against), and the request is refused with that. None: none is checked (the
        queue's new requests pay nothing for it).

        The successor may be handed over in turn (another reload): a request
        handed over with no check goes to it, which hands it on as one of its own
        (it takes the inputs this queue's requests were checked against); one
        checked goes straight to the queue at the end (:meth:`heir`), which is
        then the one ``check`` checks it against, not those between.

        ``refuse_held``: the model is unloaded (``successor`` refuses every
        request): each request held because it may hang a thread (``Reply.hung``:
        its batch, or its input, hung one earlier, and it waits for a replica to
        spare), kept apart or a failed batch's retry, is answered now, and so is
        one that would be held from now (:meth:`_set_aside`, :meth:`retry`), so that
        a drain (:meth:`wait_empty`) does not wait for them to their deadlines: one
        that never ran with what a new request gets (not charged), one that ran
        with :func:`unloaded_hung_error` (charged: it reached the model). A retry
        that may not hang (a part of a batch that raised) is left for this queue's
        replicas, which pull it at once. A reload does not: what is held here stays
        here, nothing of it handed to the new copy. Not a checkpoint."""
        self.successor = successor
        self.handed_check = check
        self._closed = True
        if refuse_held:
            self._refuse_held = True
            self._answer_held()

    def heir(self) -> SchedulerActor:
        """The queue a request handed over here goes to now: the last of its
        successors (each handed over in turn, one reload after the other), or
        itself when it is not handed over. Not a checkpoint."""
        queue = self
        while queue.successor is not None:
            queue = queue.successor
        return queue

    def _handed_to(self) -> SchedulerActor:
        """Where a request handed over goes on (:meth:`hand_over`)."""
        assert self.successor is not None
        return self.successor if self.handed_check is None else self.heir()

    def _check_handed(self, requests: list[Request]) -> None:
        """Check the requests of one call handed over to ``successor``, all or none."""
        check = self.handed_check
        if check is not None:
            for request in requests:
                check(request)

    async def wait_empty(self) -> None:
        """Wait until nothing waits here to be pulled (queued, handed back, kept
        apart) and this queue's replicas hold no batch: every request admitted is
        answered, a failed batch's parts (handed back to run again) included. A
        checkpoint; cancelling it changes nothing."""
        await trio.lowlevel.checkpoint()
        while self.queue_depth() or any(not getattr(b, "idle", True) for b in self.batchers):
            # woken when a batch is taken or completed, or a batcher finds none,
            # or requests held here are answered otherwise (a change of replicas,
            # a hang: see Sparing; a hedge ended, forget_copy; the timer answering
            # what expired, queued or held); a request withdrawn leaves at the
            # next pull or timer wake, which wakes the batchers
            await self._emptied.park()

    def queue_depth(self) -> int:
        return len(self.policy) + sum(len(b) for b in self._retries) + len(self._apart)

    def _refusal(self) -> BaseException:
        if self._refuse is not None:
            return self._refuse()
        if self._closed_error is not None:
            return own_error(self._closed_error)
        return ActorClosed(f"model {self.model!r}: the runtime is shut down")

    def retire(
        self, error: BaseException, *, refusal: Callable[[], BaseException] | None = None
    ) -> int:
        """No replica will ever pull from this queue again (each lost its device): fail
        everything waiting with ``error`` and refuse new requests with it, rather
        than hold them to their deadlines; return how many were failed. A retired
        queue may be retired again, to refuse with another error (the model's last
        lane was retired meanwhile). ``refusal``: called for each new request
        refused, to make its error then (a model loading: its Retry-After is the
        time its load has left when the request comes), instead of ``error``."""
        n = self.close(error)
        self._closed_error = error
        self._refuse = refusal
        return n

    def close(self, error: BaseException) -> int:
        """Stop taking requests and fail everything still waiting; return how many.
        The requests failed while queued count in their flow's ``closed``.

        Call it only after the actor's task has stopped (or from ``retire``).
        """
        self._closed = True
        self._closed_error = None
        self._refuse = None
        self._held_at = math.inf  # nothing is held once this returns
        n = 0
        while self._retries:
            n += sum(
                # a retry ran, unless it was staged behind a lost worker's batch
                req.reply.set_error(_unrun(own_error(error), not req.reply.ran))
                for req in self._retries.popleft()
            )
        while self._apart:
            req = self._apart.popleft()
            # a hedge twin held apart never ran, unless it is a failed batch's retry
            n += req.reply.set_error(_unrun(own_error(error), not req.reply.ran))
        for req in self.policy.drain():
            # never ran: not charged (a request refused by the closed queue is not)
            n += req.reply.set_error(_unrun(own_error(error)))
        self._idle.unpark_all()
        self._emptied.unpark_all()
        return n


def _unrun(error: BaseException, unrun: bool = True) -> BaseException:
    """``error`` (a copy for one caller), marked as answering a request that never
    reached a device (``in_queue``: its caller is not charged) when ``unrun``."""
    if unrun and isinstance(error, TrioserveError):
        error.in_queue = True
    return error
