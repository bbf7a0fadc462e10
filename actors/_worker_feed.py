"""Feeding a replica's worker process: the part of
:class:`~trioserve.actors.BatcherActor` that runs its batches in a worker process
(``execution = "process"``). Several batches are in flight at once (staged in shared
memory while the worker runs the one before), each against the batch deadline; a
worker that dies or straggles is killed and replaced, its batches handed back (the
one it ran as a suspect), and a worker whose breaker opened while other replicas
succeeded is replaced by a fresh process. See docs/faults.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import outcome
import trio
from trioserve import InvalidInput, RayReplica, Request, WorkerProcess

from ._straggler import handed_back, retried, split, to_retry

if TYPE_CHECKING:
    from ._in_flight import InFlight
    from ._metrics import ModelMetrics
    from ._scheduler import SchedulerActor
    from ._straggler import BatchTimer, Breaker

log = logging.getLogger("trioserve")

#: A lost worker's successor that cannot start is tried again after this long,
#: doubling up to START_RETRY_MAX seconds.
START_RETRY_MIN = 0.1
START_RETRY_MAX = 10.0


def _refused(msg: str, *, ran: bool) -> InvalidInput:
    """InvalidInput(msg) for a request whose input was refused before it was sent:
    never run (``in_queue``), unless it ``ran`` before."""
    error = InvalidInput(msg)
    error.in_queue = not ran
    return error


class _WorkerLost(Exception):
    """The worker process died or was killed as a straggler (handled in the batcher)."""


class WorkerFeed:
    """The worker-process methods of a batcher; not used on its own."""

    if TYPE_CHECKING:
        name: str
        model: str
        device: str
        _worker: WorkerProcess | None
        _ray: bool
        _worker_seconds: float
        _replacing: bool
        _lost_why: str | None
        _replace_due: bool
        _replace_wake: trio.Event
        _retirable: bool
        _retire_asked: trio.Event
        _retire_scope: trio.CancelScope | None
        _in_flight: InFlight
        _never_started: list[list[Request]]
        _sending: list[Request] | None
        _scheduler: SchedulerActor
        _metrics: ModelMetrics
        _timer: BatchTimer
        _breaker: Breaker
        start_failures: int
        stragglers: int
        workers_lost: int
        workers_broken: int

        async def _start_worker(self) -> None: ...
        async def _wait_breaker(self) -> None: ...
        async def _pull_unless_retired(
            self, room: trio.Semaphore | None = None, worker: WorkerProcess | None = None
        ) -> list[Request] | None: ...
        def _keep_apart(self, batch: list[Request]) -> list[Request]: ...
        def _suspect(self, batch: list[Request], why: str) -> None: ...
        def _model_failed(self, batch: list[Request], exc: BaseException) -> bool: ...
        def _deliver(self, batch: list[Request], outputs: Any, t0: float) -> None: ...
        def _answer_error(
            self, batch: list[Request], alive: list[Request], msg: str
        ) -> None: ...
        def _arm(self, deadline: float, scope: trio.CancelScope) -> Any: ...
        def _disarm(self, armed: Any) -> None: ...

    @property
    def _worker_kind(self) -> str:
        """What the log calls this replica's worker: a worker process, a Ray actor."""
        return RayReplica.KIND if self._ray else WorkerProcess.KIND

    async def _loop_process(self) -> None:
        """Feed the worker, and replace it when it is lost, until the replica is
        retired (only then does it return)."""
        while True:
            try:
                await self._serve_worker()
                return  # retired: every batch it staged was answered
            except* _WorkerLost:
                pass
            if self._retire_asked.is_set():
                return  # lost while retiring: its batches went back to the queue
            # The lost worker's batches were handed back; start its successor. One
            # that cannot start is tried again, backing off, while the replica is not
            # ready: crashing the actor instead used up the supervisor's restarts in
            # milliseconds, and the escalation took every model down.
            self._replacing = True
            try:
                await self._close_worker()
            finally:
                self._replacing = False
            # Workers that keep dying on fresh work opened the breaker: its cooldown
            # spaces their successors (forked back to back, a dozen a second, before).
            # A retire cuts the wait short: no successor for a replica that goes.
            with trio.CancelScope() as scope:
                self._retire_scope = scope
                if not self._retire_asked.is_set():
                    await self._wait_breaker()
            self._retire_scope = None
            if self._retire_asked.is_set():
                return
            self._replacing = True
            try:
                delay = START_RETRY_MIN
                while True:
                    try:
                        await self._start_worker()
                        break
                    except Exception as exc:
                        self.start_failures += 1
                        log.warning(
                            "%s: its %s could not start (%s: %s); trying again in %.1fs",
                            self.name, self._worker_kind, type(exc).__name__, exc, delay,
                        )
                    with trio.move_on_after(delay):
                        await self._retire_asked.wait()
                    if self._retire_asked.is_set():
                        return
                    delay = min(delay * 2, START_RETRY_MAX)
            finally:
                self._replacing = False

    async def _serve_worker(self) -> None:
        """Feed the worker until it is lost (raises _WorkerLost) or the replica is
        retired (returns once the batches it staged are answered). Several batches
        are in flight: while it runs one, the next are already staged in shared
        memory, so the device never waits on the event loop. It still pulls only
        when its device has room."""
        worker = self._worker
        assert worker is not None
        slots = worker.SLOTS  # a WorkerProcess's, or a RayReplica's
        room = trio.Semaphore(slots)
        sent_send, sent_recv = trio.open_memory_channel[tuple[list[Request], float]](slots)
        pull = self._scheduler.pull
        twins = self._scheduler.twins
        retirable = self._retirable
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._collect, worker, sent_recv, room)
            nursery.start_soon(self._watch, worker)
            while True:
                if retirable:
                    taken = await self._pull_unless_retired(room, worker)
                    if taken is None:
                        # Retired: wait until every batch staged was collected (a
                        # worker lost meanwhile hands them back: _WorkerLost).
                        for _ in range(slots):
                            await room.acquire()
                        nursery.cancel_scope.cancel("replica retired")
                        return
                    batch = taken
                else:
                    await self._wait_breaker()
                    if self._replace_due:
                        self._replace_broken(worker)
                    await room.acquire()
                    batch = await pull(self)
                if not worker.alive:
                    # Lost while we waited (our cancellation comes at the next
                    # checkpoint): this batch never reached it; hand it back as it is.
                    self._scheduler.completed(batch, failed=True)
                    self._scheduler.retry([batch])
                    raise _WorkerLost("the worker was lost before this batch was sent")
                if twins:
                    # With room for more, this replica pulls while it runs a hedged
                    # request: its copy would be staged behind it.
                    batch = self._keep_apart(batch)
                    if not batch:
                        room.release()
                        continue
                t0 = trio.current_time()
                self._in_flight.append(batch, t0)
                self._metrics.queue_wait.record_many([t0 - req.arrival for req in batch])
                # In flight, not all sent yet: it has reached nothing. The worker reads
                # a batch whole before it runs it, so one whose sending did not end
                # never ran there, whatever ends it (see _lose).
                self._sending = batch
                try:
                    await worker.submit([req.item for req in batch])
                except trio.Cancelled:
                    worker.kill()
                    raise
                except WorkerProcess.Died:
                    self._lose(worker, self._died(worker), died=True)
                except WorkerProcess.TooLarge as exc:
                    for r in batch:
                        # never sent: one whose caller left since its dispatch (not
                        # one that reached a device before, Reply.ran) never ran; its
                        # caller is told, as the parts run again or answered leave
                        # it out
                        if not r.reply.ran:
                            r.reply.unrun()  # a no-op unless its caller left
                    self._too_large(batch, exc, sent=False)
                    self._in_flight.pop()  # never sent: the worker goes on
                    room.release()
                    continue
                finally:
                    self._sending = None
                await sent_send.send((batch, t0))
                if retried(batch) and self._scheduler.replicas > 1:
                    # A retry of a failed batch may hang or kill its worker again:
                    # stage nothing behind it (what was staged would wait out its
                    # deadline and go back, round after round, as innocent as it
                    # was), and pull again once it is done; other replicas take the
                    # new work meanwhile. (A lone replica has nowhere else to run it:
                    # what it stages goes back once, before the retry's next run.)
                    for _ in range(slots):
                        await room.acquire()
                    for _ in range(slots):
                        room.release()

    async def _collect(
        self, worker: WorkerProcess, sent: trio.MemoryReceiveChannel, room: trio.Semaphore
    ) -> None:
        async for batch, t0 in sent:
            # The worker starts it when the previous one is done (or when it arrives),
            # which is about when we start waiting for it.
            deadline = self._timer.deadline()
            with trio.CancelScope() as timer:
                armed = self._arm(deadline, timer)
                try:
                    outputs = await worker.result()
                except trio.Cancelled:
                    if not timer.cancel_called:
                        worker.kill()
                    raise
                except WorkerProcess.Failed as exc:
                    outputs = exc
                except WorkerProcess.Died:
                    self._lose(worker, self._died(worker), died=True)
                finally:
                    self._disarm(armed)
            if timer.cancelled_caught:
                # a straggler, unless its result came as it was killed (see _lose)
                self._lose(worker, f"it ran past its batch deadline of {deadline:.3f}s")
            broken = self._answered(batch, outputs, t0, worker.last_run_seconds)
            if self._in_flight and self._in_flight[0] is batch:
                self._in_flight.popleft()
            if broken or self._replace_due:
                self._replace_broken(worker)
            room.release()

    def _answered(
        self, batch: list[Request], outputs: Any, t0: float, seconds: float,
        *, success: bool = True,
    ) -> bool:
        """What the worker answered for ``batch`` (sent at ``t0``): its outputs (it ran
        ``seconds``; a ``success`` for the breaker), or the error its run raised
        (WorkerError, FrameTooLarge). Returns whether the model's error opened the
        breaker."""
        if isinstance(outputs, WorkerProcess.TooLarge):
            for r in batch:
                # it ran: only its outputs could not come back. Its halves run
                # again charged (not suspects: no fault of their inputs), and
                # one whose caller leaves meanwhile is not refunded.
                r.reply.ran = True
            self._too_large(batch, outputs)
            return False
        if isinstance(outputs, Exception):
            return self._model_failed(batch, outputs)
        self._timer.record(seconds)
        if success:
            self._breaker.success()
        self._deliver(batch, outputs, t0)
        return False

    def _answer_unread(self, results: list, *, success: bool = True) -> None:
        """Answer the oldest batches in flight with the results their lost worker
        wrote and nobody read (:meth:`WorkerProcess.unread_results`), as if read in
        time (their outputs a ``success`` for the breaker, as they would have been):
        they ran to their end, and running them again would only charge the work
        twice, and hand their callers another run's outputs (or its failure). Each
        batch's run is measured as a reply read in time is, from when it was sent
        (``InFlight.since``) to now, on the event loop's clock: not from ``now``
        less the seconds the worker measured on its own clock, a start the batch
        never had (it ran behind the batches before it, and the two clocks differ:
        under a MockClock, trio's does not move while the worker runs)."""
        held = self._in_flight
        sent = [(held[i], held.since(i)) for i in range(min(len(results), len(held)))]
        for (batch, t0), (outputs, seconds) in zip(sent, results, strict=False):
            self._worker_seconds += seconds
            self._answered(batch, outputs, t0, seconds, success=success)

    async def _watch(self, worker: WorkerProcess) -> None:
        # A worker can die while idle, with no batch to find out by: its replica would
        # be reported ready, and replaced only when the next request hit it.
        await worker.wait_exited()
        self._lose(worker, self._died(worker), died=True)

    def _died(self, worker: WorkerProcess) -> str:
        """The loss of a worker that died on its own, in one wording whichever path
        found it (a batch's sending or result, or the watch on its exit): ``its
        <kind> died (<what it said it died of; its pid and how it ended, those
        known>)`` (:meth:`WorkerProcess.died_of`, :meth:`RayReplica.died_of`). The
        three paths used to word one death three ways (``died (pipe broke (pid
        N))``, ``died (worker process exited (pid N; …))``, ``exited (pid N)``)."""
        return f"its {self._worker_kind} died ({worker.died_of()})"

    def _never_had(self, worker: WorkerProcess, batch: list[Request], newest: int) -> bool:
        """Whether the lost ``worker`` never had ``batch`` whole, so never ran it: it
        was being sent, or its pipe still held it (or its end) as the kill was sent
        (``WorkerProcess.never_read``); ``newest``: how many batches in flight, it
        included, are it and those sent after it. Not a checkpoint."""
        return batch is self._sending or newest <= worker.never_read

    def _lose(self, worker: WorkerProcess, why: str, *, died: bool = False) -> None:
        """The worker is gone (or must go): kill it, answer those of its batches it
        had finished, with the results it wrote and nobody read (in its pipe:
        :meth:`WorkerProcess.unread_results`), hand the others back — the one it was
        running as a suspect, split in ``retry_parts``; the staged ones, and one it
        was still being sent (it never had it whole), as they were — and raise
        _WorkerLost to stop feeding it. Killed as a straggler (not ``died``) just as
        it wrote the result of the batch that was late, that batch is answered, and
        the one after it, which it had just started, goes back as it was (no
        suspect), charged, unless its pipe says it never read that one whole
        (``never_read``: then never run, as the staged ones), and it is no straggler
        (not counted in ``stragglers``, nor logged as one). The loss is logged at
        once, or, when the worker ``died`` on its own, once it is closed, with how
        it ended."""
        if not worker.alive:
            raise _WorkerLost(why)  # already lost and handled (by the other task)
        worker.kill()
        self.workers_lost += 1
        self._metrics.statuses["worker_lost"] += 1
        if died:
            self._lost_why = why
        batches = list(self._in_flight)
        # A worker that died may have written results not read yet (its death found
        # by _watch, or by a send, before _collect read them): those batches ran to
        # their end, and the one after them is the one it died running. They used to
        # be run again (charged), their results dropped.
        results = worker.unread_results()
        done = len(results)
        if not died:
            self._log_cut_off(why, done)
        crashed = batches[done] if done < len(batches) else None
        if crashed is not None and self._never_had(worker, crashed, len(batches) - done):
            # It died as this batch was being sent (what it had of it, it was
            # reading), or before it read it whole (its pipe still held it, or its
            # end, as it was killed: WorkerProcess.never_read): it never had it
            # whole, so never ran it, and what it died of (or ran late on) is not
            # this batch. It goes back as it was, never run. It used to be made the
            # suspect: split, a poison attempt counted, and charged; or, after a
            # straggler's result written as it was cut off, charged as begun.
            crashed = None
        # Killed by us as a straggler, it was running the oldest, whose result did
        # not come in time; unless it wrote that result as its deadline passed (in
        # its pipe, unread: done). That batch is answered, no straggler after all,
        # and the one after it is the one it had just started, killed not for its
        # own lateness (its time had only begun): it goes back as it was, no
        # suspect (no split, no poison attempt), but charged, as it reached the
        # model (Reply.ran; as a replaced worker's running batch, _replace_broken).
        # The oldest used to go back as the suspect (split, a poison attempt
        # counted) to run again, its result dropped, and the one after it as never
        # started (refunded, had its caller left, though it had reached the model).
        # (Unless its pipe said it never read that one: see above.)
        if not died and done and crashed is not None:
            for r in crashed:
                r.reply.ran = True
            crashed = None
        # (before the breaker is told: their successes came before this failure)
        self._answer_unread(results)
        if (died or not done) and (crashed is None or not retried(crashed)):
            # A retry that crashes again is its requests' doing (it counts towards
            # their poison attempts): a few poison requests, bisected, would open
            # the breaker of a sound replica and hold every other request back.
            # (A straggler whose result came after all failed nothing.)
            self._breaker.failure(trio.current_time())
        back = batches[done + 1:] if crashed is not None else batches[done:]
        if back:
            # The staged ones first: they ran into nothing, and have waited already.
            for b in back:
                self._scheduler.completed(b, failed=True)
            self._scheduler.retry([handed_back(b) for b in back])
        if crashed is not None:
            self._suspect(crashed, f"its batch failed: {why}")
        # after the retries are made: an item answered meanwhile that others wait
        # for is carried into them, and its batch leaving must not settle it
        self._in_flight.clear()
        raise _WorkerLost(why)

    def _log_cut_off(self, why: str, done: int) -> None:
        """Log the kill of a straggler's worker (``why``: its batch ran past its
        deadline), and count the straggler; unless it had written that batch's
        result (``done``: results in its pipe, unread) as the deadline passed: then
        the batch was answered, no straggler. It was counted, and logged as one that
        "ran past its batch deadline", though its result was there."""
        if done:
            log.warning(
                "%s: %s killed as its batch deadline passed, just as it wrote that "
                "batch's result (answered, not run again); a new one is started",
                self.name, self._worker_kind,
            )
            return
        self.stragglers += 1
        self._metrics.statuses["straggler"] += 1
        log.warning("%s: %s lost: %s; a new one is started", self.name, self._worker_kind, why)

    async def _close_worker(self) -> None:
        """Close the replica's worker, if any (killed, and waited for: shielded), and
        log its loss if it died on its own (see :meth:`_log_death`)."""
        worker = self._worker
        if worker is None:
            return
        self._worker_seconds += worker.busy_seconds
        try:
            await worker.aclose()
        finally:
            self._worker = None
            self._log_death(worker)
            # The batches it is known never to have started (the newest ones): a
            # request of theirs that the runtime's close fails never ran, and is not
            # charged. One whose caller left meanwhile (abandoned: the close answers
            # it nothing) never ran either: its caller is told now (Reply.unrun).
            left = len(self._in_flight)
            self._never_started = [
                self._in_flight[i] for i in range(max(0, left - worker.never_started), left)
            ]
            for batch in self._never_started:
                for r in batch:
                    if not r.reply.ran:  # (a retry ran before: it stays charged)
                        r.reply.unrun()  # a no-op unless its caller left

    def _log_death(self, worker: WorkerProcess | None) -> None:
        """Log the loss of a worker that died on its own (see :meth:`_lose`), with how
        it ended (an exit status, a signal) when known: once it is closed, that is,
        for a forked worker's status comes from its zygote after the exit."""
        if self._lost_why is None:
            return
        why, self._lost_why = self._lost_why, None
        if worker is not None:
            why = self._died(worker)  # with what is known now (its exit status)
        log.warning(
            "%s: %s lost: %s; a new one is started%s", self.name, self._worker_kind, why,
            WorkerProcess.stderr_note(worker.stderr_tail if worker is not None else None),
        )

    def _too_large(self, batch: list[Request], exc: Exception, *, sent: bool = True) -> None:
        """The batch's inputs (not ``sent``: refused before sending) or outputs do
        not fit in one message to or from the worker (its 4-byte length: 4 GiB): run
        it again in halves. A request alone whose outputs do not fit (it ran) gets
        ModelError; one whose inputs do not fit (it never ran) is refused as the
        caller's InvalidInput, never run (``in_queue``: not charged), unless it ran
        before (a failed batch's retry). The one request left of a batch of several
        (the others' callers left) runs again alone, as a half: its own inputs or
        outputs may fit. An item answered while the batch ran (its deadline passed)
        that others wait for runs again in its place in the halves, carried
        (:func:`to_retry`). No fault of the model's or the worker's: the breaker is
        not told. Call it before the batch leaves the batches in flight: leaving, it
        settles the late hooks not carried."""
        alive = [r for r in batch if r.reply.answerable]
        # (a batch of one too large is its item's own: nothing to carry)
        parts = alive if len(alive) == len(batch) or len(batch) == 1 else to_retry(batch)
        if len(parts) > 1:
            self._scheduler.completed(batch, failed=True)
            self._metrics.statuses["retried"] += len(parts)
            self._scheduler.retry(split(parts, 2))
            return
        if parts and len(batch) > 1:
            # one request alone was left of the batch (the others' callers left),
            # or the carried item of one answered: run it alone, as a half. The
            # batch's size is not its own; it used to be refused by it (a request
            # whose own inputs or outputs fit answered InvalidInput or ModelError).
            self._scheduler.completed(batch, failed=True)
            self._metrics.statuses["retried"] += 1
            self._scheduler.retry([parts])
            return
        if not sent:
            self._refuse_input(batch, alive, (
                f"model {self.model!r}: {exc}; send a smaller request, or use "
                'execution = "thread"'
            ))
            return
        self._answer_error(batch, alive, (
            f"model {self.model!r} failed on {self.device}: {exc}; send a smaller "
            'request, or use execution = "thread"'
        ))

    def _refuse_input(self, batch: list[Request], alive: list[Request], msg: str) -> None:
        """Answer ``alive`` (the requests of ``batch``, a batch never sent, still
        waiting) InvalidInput(msg): their input is more than the worker's pipe
        carries. The model never saw it, so it is no model error (a 400 over HTTP,
        not a 500), and a request refused so never ran (``in_queue``: its caller is
        not charged), unless it had reached a device before (``Reply.ran``: a
        failed batch's retry stays charged). Those waiting for the item of one
        answered meanwhile (``Reply.late``) get the same refusal. Counted as the
        model's ``invalid_input`` outcome (``trioserve_batcher_outcomes_total``), not
        its ``model_error``: it used to be counted nowhere of the model's."""
        for req in batch:
            late = req.reply.late
            if (
                late is not None and late.expected and not late.carried
                and not req.reply.answerable
            ):
                late.settle(outcome.Error(_refused(msg, ran=False)))
        for req in alive:
            req.reply.set_error(_refused(msg, ran=req.reply.ran))
        self._metrics.statuses["invalid_input"] += len(alive)
        self._scheduler.completed(batch, failed=True)

    def _replace_broken(self, worker: WorkerProcess) -> None:
        """Its breaker opened because the model kept raising on this worker while
        other replicas succeeded: a sticky device error (CUDA's "an illegal memory
        access was encountered" fails every later call in its process) or a bad
        device. Kill the worker, so that its successor (a fresh process: a fresh CUDA
        context) runs the breaker's trial; its batches go back as they were (they ran
        into nothing of theirs, the one it was running included: see below), an item
        answered meanwhile (its deadline passed) that others wait for carried into
        them (:func:`to_retry`). The one it was running, and those it had finished
        (their results unread), reached the model: they are marked so
        (``Reply.ran``), and charged; those it never started are not. Raises
        _WorkerLost."""
        why = "its model kept raising there while other replicas succeeded"
        self._replace_due = False
        self._replace_wake = trio.Event()
        self._breaker.replaced(trio.current_time())
        if not worker.alive:
            raise _WorkerLost(why)  # lost meanwhile: replaced anyway
        worker.kill()
        self.workers_broken += 1
        self._metrics.statuses["worker_broken"] += 1
        log.warning("%s: its %s is replaced: %s", self.name, self._worker_kind, why)
        # Every batch goes back as it was, the one the worker was running included
        # (when the replacement fell due in the pull loop, on another replica's
        # evidence): unlike _lose's, that batch did not fail. It neither ran past
        # its deadline nor took its worker down: the runtime killed the worker for
        # what other inputs showed, at a moment that has nothing to do with this
        # batch. Made a suspect, it would be split for nothing, a request alone in
        # it would count a poison attempt it never failed (with poison_attempts = 2,
        # one real failure later would make an innocent request "poison"), and its
        # fresh requests would be retries, whose later failures no longer tell the
        # breaker. Its requests keep what they were (suspect, attempts), so a retry
        # stays a retry. (The one case it misjudges: a worker that died on its own
        # under that batch in the same scheduler step, before _watch or _collect
        # saw it: ``alive`` only says we have not killed it, and a worker (process or
        # Ray actor) tells its exit only to a wait. The batch then takes the next
        # worker down, and _lose splits it there, one round later.)
        batches = list(self._in_flight)
        # It runs its batches in order: those whose results wait unread, then the one
        # it was running (unless it was never sent), reached the model. Their callers
        # are charged, whatever happens to them after (ran = reached the model): one
        # who leaves before the run again is not refunded. They used to be, as if
        # never started. Those it finished are answered what it wrote (as _lose's),
        # which closes no breaker: its successor's trial is what does.
        results = worker.unread_results()
        done = len(results)
        self._answer_unread(results, success=False)
        batches = batches[done:]
        if batches and not self._never_had(worker, batches[0], len(batches)):
            for r in batches[0]:
                r.reply.ran = True
        for b in batches:
            self._scheduler.completed(b, failed=True)
        self._scheduler.retry([handed_back(b) for b in batches])
        # after the retries are made, as in _lose: an item answered meanwhile that
        # others wait for is carried into them, and its batch leaving must not
        # settle it
        self._in_flight.clear()
        raise _WorkerLost(why)
