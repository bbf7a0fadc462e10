"""What follows a batch that fails or hangs: the part of
:class:`~trioserve.actors.BatcherActor` that hands a failed batch back in parts,
answers what cannot be retried, and tells the replica's breaker.

A batch past its deadline is a straggler: a worker process is killed and replaced
(forked from the zygote, ~0.1 s; ``actors/_worker_feed.py``); a worker thread cannot be
killed, so the replica is degraded — it pulls nothing — until the thread returns. Either
way the batch goes back to the scheduler split in ``retry_parts`` (each request alone
when it held no more), so retries narrow down to the request at fault while the rest
succeed; a request that fails alone ``poison_attempts`` times is answered with a
poison-request error and never retried. A hung thread's parts run only where a replica
can be spared (``SchedulerActor.spare``), and a request that hung a thread alone is
poison at once when running it again would take the model's last ready replica: one
hanging input cannot degrade every thread replica. A batch whose model raised is split
the same way, so only the input that raises gets the error. A worker process runs such a
retry with nothing staged behind it: were it to hang or kill its worker again, what was
staged would wait out its deadline and go back too.

A model that raises counts towards the replica's breaker only on evidence that the
replica, not its inputs, is at fault (:class:`Breaker`): a part of a failed batch that
raised alone here is run once on another replica, and a result there counts; a request
alone on fresh work counts once other replicas of the model succeed meanwhile. A
replica broken while the others are fine (a sticky CUDA error) is isolated, and its
worker process replaced when the breaker opens; a model raising everywhere, or on
some inputs everywhere (poison inputs), opens none. A thread or inline replica whose
model left its device unusable serves no more, and a queue none of whose replicas
can serve is retired (:func:`retire_if_lost`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import outcome
import trio
from trioserve import ModelError, Request, exception_text

from ._straggler import Hang, mark_hung, retried, split, split_failed, to_retry

if TYPE_CHECKING:
    from ._in_flight import InFlight
    from ._metrics import ModelMetrics
    from ._scheduler import SchedulerActor
    from ._straggler import BatchTimer, Breaker, LogThrottle

log = logging.getLogger("trioserve")


class _Escaped(Exception):
    """A model's StopIteration or SystemExit, carried as an ordinary error: out of a
    worker thread the first reached the batcher as "RuntimeError: coroutine raised
    StopIteration" (PEP 479), and the second ended the batcher, and with it the
    runtime. The model's own exception is ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc


#: What a model may raise that is not an ordinary error in the batcher's loop. Any
#: other BaseException (GeneratorExit, a class of the model's own) is carried so
#: too; only a KeyboardInterrupt inline is left alone: there it is the process's
#: Ctrl-C. In a worker thread it is the model's own raise (a signal's
#: KeyboardInterrupt is only ever raised in the main thread), and it used to end
#: the runtime, its request unanswered.
_ESCAPES = (StopIteration, StopAsyncIteration, SystemExit)


def _text(exc: BaseException) -> str:
    """``Type: message`` of an exception a model raised. One whose ``str()`` raises
    too is said so: formatting it crashed the replica that was answering with it
    (ActorBroken for its batch, a restart spent)."""
    return exception_text(exc.exc if type(exc) is _Escaped else exc)


def _all_lost(scheduler: SchedulerActor) -> bool:
    """Whether every replica of ``scheduler``'s queue (all of them started) lost its
    device: none will ever pull from it again."""
    return len(scheduler.batchers) == scheduler.replicas and all(
        b.lost is not None for b in scheduler.batchers
    )


def retire_if_lost(scheduler: SchedulerActor, text: str) -> None:
    """Retire ``scheduler``'s queue, and with it the model's other lanes when none
    of them serves either, once every replica of it lost its device (the last one:
    ``text``; see :meth:`BatcherActor._lose_device`). Called when a replica loses its
    device, and when an autoscaled model's retired replica leaves the replicas that
    all lost theirs. Not a checkpoint."""
    model = scheduler.model
    if not _all_lost(scheduler):
        return
    # Nothing will ever serve its queue: answer what waits, and what comes, at once
    # (not at its deadline). While another lane of the model serves, the model is
    # ready and the error names the lane; once none does, every lane refuses with
    # the model's error (a lane retired before is retired again with it).
    if any(not _all_lost(lane) for lane in scheduler.lanes):
        scheduler.retire(ModelError(
            f"model {model!r}: no replica can serve its {scheduler.lane} any "
            f"more: each left its device unusable (here: {text}); its other "
            "requests are still served; restart the server to recover the lane"
        ))
        return
    error = ModelError(
        f"model {model!r}: no replica can serve it any more: each left its "
        f"device unusable (here: {text}); restart the server"
    )
    for lane in scheduler.lanes:
        lane.retire(error)


class BatchFailures:
    """The failure methods of a batcher; not used on its own."""

    if TYPE_CHECKING:
        name: str
        model: str
        device: str
        lost: str | None
        stragglers: int
        _process: bool
        _degraded: bool
        _limiter: trio.CapacityLimiter
        _replace_due: bool
        _replace_wake: trio.Event
        _in_flight: InFlight
        _scheduler: SchedulerActor
        _metrics: ModelMetrics
        _timer: BatchTimer
        _breaker: Breaker
        _errors_logged: LogThrottle

    async def _thread_hung(self, batch: list[Request], deadline: float) -> None:
        """``batch`` ran past its ``deadline`` in this replica's worker thread: hand
        it back in parts, and hold the replica degraded until the thread returns.
        A checkpoint: it waits for the thread (the holder of the replica's limiter);
        cancelled, it stops waiting and counts the thread as returned."""
        # A thread cannot be killed: hand the batch back and pull nothing until
        # the thread returns (it holds the replica's limiter until then). Its
        # parts run again only where a replica can be spared (SchedulerActor.
        # _unspared), and a request that hung it alone is not run again where
        # that would take the model's last ready replica.
        self.stragglers += 1
        self._metrics.statuses["straggler"] += 1
        if not retried(batch):  # a retry's failure is its requests' (see _lose)
            self._breaker.failure(trio.current_time())
        hang = Hang()
        mark_hung(batch, hang)
        scheduler = self._scheduler
        why = f"its batch ran past its deadline of {deadline:.3f}s"
        # its inputs, should they come again; its hedge twins
        scheduler.note_hang(batch, hang, self, why)
        self._suspect(
            batch, why,
            # it ran alone (not a batch-mate left after the others' answers),
            # and other replicas serve: a lone replica's retry waits for its
            # thread, as before (the model is down until it returns anyway)
            last=len(batch) == 1 and scheduler.replicas > 1 and scheduler.spare(self) < 2,
        )
        self._in_flight.clear()  # handed back: no longer this replica's to answer
        scheduler.after_hang(hang, self)
        self._degraded = True
        try:
            async with self._limiter:
                pass
        finally:
            self._degraded = False
            hang.returned = True
            self._scheduler.thread_returned()

    def _lose_device(self, batch: list[Request], exc: BaseException) -> None:
        """The model raised and left this replica's device unusable for the rest of
        the process (a CUDA device-side assert, an illegal memory access): every
        later call here would fail, and nothing can replace a thread's or the event
        loop's device context. The batch's callers get the error (not retried: each
        run of the input that did this would take one more device), and the replica
        serves no more; the model is ready while another replica is."""
        text = _text(exc)
        self.lost = text
        self._scheduler.replicas_changed()  # it is no longer ready
        self._metrics.statuses["device_lost"] += 1
        log.error(
            "%s: the model left its device unusable (%s); this replica serves no more. "
            "Restart the server to recover it; with execution = \"process\" its worker "
            "would be replaced", self.name, text,
        )
        msg = (
            f"model {self.model!r} failed on {self.device} and left it unusable: {text}"
        )
        self._answer_error(batch, [r for r in batch if r.reply.answerable], msg)
        retire_if_lost(self._scheduler, text)

    def _suspect(self, batch: list[Request], why: str, *, last: bool = False) -> None:
        """A batch timed out or lost its worker: retry it in parts; a request that
        fails alone too often is poison. ``last``: the batch, one request, hung
        this replica's thread, and of the model's other replicas fewer than two are
        ready to serve, so that request is poison at once: run again, it would
        hang the model's last ready replica (or wait for one to spare, while none
        may ever come back)."""
        self._scheduler.completed(batch, failed=True)
        policy = self._timer.policy
        retry, poison = split_failed(
            to_retry(batch), poison_attempts=1 if last else policy.poison_attempts,
            parts=policy.retry_parts,
        )
        for req in poison:
            if req.reply.attempts < policy.poison_attempts:
                msg = (
                    f"model {self.model!r}: poison request, not retried: {why} when "
                    "it ran alone, its worker thread still runs, and no other "
                    "replica can be spared to run it again (it would hang the "
                    "model's last ready replica)"
                )
            else:
                msg = (
                    f"model {self.model!r}: poison request, not retried: {why} each of "
                    f"the {req.reply.attempts} times it ran alone"
                )
            req.reply.set_error(ModelError(msg))
            self._metrics.statuses["poison"] += 1
        if poison:
            # its input may be in another part of a hung batch (see after_hang)
            self._scheduler.poisoned_alone(poison)
        self._metrics.statuses["retried"] += sum(len(b) for b in retry)
        self._scheduler.retry(retry)

    def _model_failed(self, batch: list[Request], exc: BaseException) -> bool:
        """The model raised. Alone, the request gets the error; in a batch, the batch
        is retried in parts (each request alone when it held no more than
        ``retry_parts``), so that only the input that raises gets it, and each part
        that succeeds is answered at once.

        On fresh work (not a retry) it is also told to the replica's breaker, which
        counts it only when other replicas succeeded since this one began failing
        (:meth:`Breaker.raised`). Returns whether that opened the breaker."""
        opened = not retried(batch) and self._breaker.raised(
            trio.current_time(), self._metrics.successes, alone=len(batch) == 1
        )
        if opened:
            log.warning(
                "%s: circuit breaker open: the model keeps raising here (%s) while "
                "other replicas succeed", self.name, _text(exc),
            )
            self._scheduler.replicas_changed()  # it is no longer ready
        alive = [r for r in batch if r.reply.answerable]
        if len(batch) > 1:  # not alone: any one of them may be the cause
            parts = alive if len(alive) == len(batch) else to_retry(batch)
            if parts:
                self._scheduler.completed(batch, failed=True)
                for r in parts:
                    r.reply.suspect = r.reply.ran = True
                self._metrics.statuses["retried"] += len(parts)
                self._scheduler.retry(split(parts, self._timer.policy.retry_parts))
                return opened
        if len(batch) == 1 and self._elsewhere(batch[0]):
            # A part of a failed batch raised alone here: run it once on another
            # replica. An input bad for the model raises there too (and gets the
            # error); a result there says this replica fails on sound input. An
            # item answered while it ran (its deadline passed) that others wait
            # for goes there too, carried (to_retry), as its request would have.
            part = alive or to_retry(batch)
            if part:
                self._scheduler.completed(batch, failed=True)
                part[0].reply.raised_on = (self, self._breaker.run)
                self._metrics.statuses["retried"] += 1
                self._scheduler.retry([part])
                return opened
        msg = f"model {self.model!r} failed on {self.device}: {_text(exc)}"
        self._answer_error(batch, alive, msg)
        self._log_model_error(msg, len(alive))
        return opened

    def _log_model_error(self, msg: str, answered: int) -> None:
        """Say in the log that callers were answered with the model's error (a 500
        over HTTP): without it, a model that raised left no trace on the server.
        Throttled (:class:`LogThrottle`): at most a line every 10 s a replica."""
        if not answered:
            return
        unlogged = self._errors_logged.admit(trio.current_time())
        if unlogged is None:
            return
        log.error(
            "%s: %s (%d %s answered with it%s)", self.name, msg, answered,
            "request" if answered == 1 else "requests",
            f"; {unlogged} more such failures since the last line" if unlogged else "",
        )

    def _answer_error(self, batch: list[Request], alive: list[Request], msg: str) -> None:
        """Answer ``alive`` (the batch's requests still waiting) with ModelError(msg):
        the batch is done, failed. A request of the batch answered while it ran (its
        deadline passed) whose item others wait for (``Reply.late``, not carried
        into a retry) hands them the same error: the model's for that item, which
        its own caller would have got, and which running the item again would
        only repeat (the model raised on it alone, it is poison, too large, or it
        left its device unusable)."""
        for req in batch:
            reply = req.reply
            late = reply.late
            if (
                late is not None and late.expected and not late.carried
                and not reply.answerable
            ):
                late.settle(outcome.Error(ModelError(msg)))
        for req in alive:
            req.reply.set_error(ModelError(msg))
        self._metrics.statuses["model_error"] += len(alive)
        self._scheduler.completed(batch, failed=True)

    def _elsewhere(self, req: Request) -> bool:
        """Whether ``req``, which raised alone here, is to run once on another
        replica: it is a retry (a part of a batch that failed) that has not raised
        alone elsewhere yet, and another replica is ready."""
        reply = req.reply
        return (
            reply.suspect and reply.raised_on is None and self._scheduler.replicas > 1
            and any(b is not self and b.ready for b in self._scheduler.batchers)
        )

    def _failed_here(self, run: int) -> None:
        """A request that raised alone here during the breaker's run ``run`` was
        answered with a result by another replica (see :meth:`Breaker.confirmed`).
        A worker process whose breaker this opens is replaced before it pulls
        again. A replica whose device is lost takes no more evidence: it serves no
        more anyway."""
        if self.lost is not None or not self._breaker.confirmed(trio.current_time(), run):
            return
        log.warning(
            "%s: circuit breaker open: the model raised here on inputs that other "
            "replicas answered", self.name,
        )
        if self._process:
            self._replace_due = True
            self._replace_wake.set()
