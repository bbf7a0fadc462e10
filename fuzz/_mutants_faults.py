"""Planted bugs of the faults a model off the event loop meets (a batch cut off, a
worker dead mid-batch, after writing results nobody read yet, or while a batch was
sent to it, a worker cut off as it wrote the late batch's result, a circuit breaker
open), which the cache suite, or the runtime suite's running scenarios, see:
variants of the batcher. Listed in ``fuzz._mutants.MUTANTS``."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio
import trioserve.actors
from trioserve.actors._straggler import handed_back

BatcherActor = trioserve.actors.BatcherActor


class CutOffLeavesFollowersWaiting(BatcherActor):
    """A batch cut off at its deadline is handed back, but the late hooks of its
    requests already answered are neither carried into its retry nor settled: the
    callers of a flight waiting for its driver's batch wait in vain (until their own
    deadline, or for ever) instead of getting the retry's answer or the flight
    running again."""

    def _lose(self, worker: Any, why: str, *, died: bool = False) -> None:
        if not died:
            for deadlines in self._in_flight._deadlines:
                if deadlines is not None:
                    deadlines._late = None
            for batch in self._in_flight:
                for r in batch:
                    if not r.reply.answerable:
                        r.reply.late = None
        super()._lose(worker, why, died=died)


class DeathFailsTheBatch(BatcherActor):
    """A batch whose worker died is answered with the death's error, as if the model
    had raised, instead of being retried in parts: its innocent requests get a
    ModelError, and none of it is a poison request's."""

    def _suspect(self, batch: list[Any], why: str) -> None:
        if "died" not in why:
            super()._suspect(batch, why)
            return
        alive = [r for r in batch if r.reply.answerable]
        self._answer_error(batch, alive, f"model {self.model!r} failed on {self.device}: {why}")


class FallbackWhileOpen(BatcherActor):
    """While its circuit breaker is open, a replica does not wait out the cooldown:
    it answers what it pulls with an empty fallback answer (a refusal as a value),
    which the cache keeps and serves as the model's."""

    async def _wait_breaker(self) -> None:
        while self._breaker.is_open(trio.current_time()) and not self._replace_due:
            batch = await self._scheduler.pull(self)
            for req in batch:
                if req.reply.answerable:
                    req.reply.set_result({"y": np.zeros(0)})
            self._scheduler.completed(batch)


class UnreadResultsRunAgain(BatcherActor):
    """The results a lost worker wrote and nobody read (``unread_results``) are
    dropped: those batches go back as they were, marked as having run, and run
    again on its successor (charged twice, their callers answered another run's
    outputs) instead of being answered what the worker wrote."""

    def _answer_unread(self, results: list, *, success: bool = True) -> None:
        back = [self._in_flight[i] for i in range(min(len(results), len(self._in_flight)))]
        for b in back:
            for r in b:
                r.reply.ran = True
            self._scheduler.completed(b, failed=True)
        if back:
            self._scheduler.retry([handed_back(b) for b in back])


class SendingBatchBlamed(BatcherActor):
    """A batch whose sending its worker died in is taken for the one the worker died
    running, when it had finished those before: split as a suspect, a poison
    attempt counted, marked as having run (its caller, leaving, not refunded)."""

    def _lose(self, worker: Any, why: str, *, died: bool = False) -> None:
        self._sending = None  # (so _lose cannot tell it was never sent whole)
        super()._lose(worker, why, died=died)


class CutOffIgnoresUnreadResults(BatcherActor):
    """A worker killed as a straggler is not asked for the results it wrote and
    nobody read (the rule before the kill path read ``unread_results``): the late
    batch whose result it wrote as its deadline passed goes back as the suspect
    (split, a poison attempt counted) to run again, its result dropped; the batch
    after it, which it had just begun, as never started (refunded, had its caller
    left); and its breaker is told a failure."""

    def _lose(self, worker: Any, why: str, *, died: bool = False) -> None:
        if not died and worker.alive:
            worker.unread_results = list  # (read nothing: an empty list)
        super()._lose(worker, why, died=died)


class NeverReadCharged(BatcherActor):
    """A worker lost just as it wrote a result is taken to have begun the batch
    after it, though its pipe said it never read that one whole
    (``WorkerProcess.never_read`` ignored, as before the batcher asked): the batch
    is charged (marked as having run: its caller, leaving, not refunded) behind a
    straggler cut off as it wrote, or split as the suspect of a worker that died
    after writing (a poison attempt counted)."""

    def _lose(self, worker: Any, why: str, *, died: bool = False) -> None:
        if worker.alive:
            kill = worker.kill

            def kill_not_asking() -> None:
                kill()
                worker.never_read = 0  # (what its pipe said is not asked)

            worker.kill = kill_not_asking
        super()._lose(worker, why, died=died)
