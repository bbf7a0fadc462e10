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
    DeadlineExceeded,
    Overloaded,
    Reply,
    ReplyRelay,
    Request,
    RequestState,
    TrioserveError,
)

from ._batching import SchedulingPolicy
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


class SchedulerActor(Sparing, Actor):
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
        apart = self._apart
        if apart:
            now = trio.current_time()
            held = len(apart)
            for _ in range(held):
                req = apart.popleft()
                if (req is not original and req is not copy) or not self._drop_apart(req, now):
                    apart.append(req)
            if len(apart) < held:
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
        held = len(apart)
        for _ in range(held):
            req = apart.popleft()
            if not self._drop_apart(req, now):
                apart.append(req)
                if req.answer_expiry and req.deadline < first:
                    first = req.deadline
        if answered or len(apart) < held:
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
