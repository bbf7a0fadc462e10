"""Planted bugs of the faults a model off the event loop meets behind the cache (a
batch cut off, a worker dead mid-batch, a circuit breaker open), which the cache
suite sees: variants of the batcher. Listed in ``fuzz._mutants.MUTANTS``."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio
import trioserve.actors

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
