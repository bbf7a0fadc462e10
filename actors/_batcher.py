"""The batcher actor: one per replica (device). When its device is free it pulls a
closed batch from the scheduler, runs the model off the event loop (a worker thread,
no lock held) or inline, and answers each request's reply slot."""

from __future__ import annotations

from typing import Any

import trio

from trioserve import Actor, ActorBroken, ActorClosed, ModelBackend, ModelError, Request

from ._metrics import ModelMetrics
from ._scheduler import SchedulerActor


class BatcherActor(Actor):
    def __init__(
        self,
        *,
        model: str,
        backend: ModelBackend,
        scheduler: SchedulerActor,
        metrics: ModelMetrics,
        device: str,
        index: int,
        execution: str,
        torch_threads: int = 1,
    ) -> None:
        super().__init__()
        self.name = f"batcher[{model}#{index}@{device}]"
        self.model = model
        self.device = device
        self.index = index
        self._backend = backend
        self._scheduler = scheduler
        self._metrics = metrics
        self._inline = execution == "inline"
        self._torch_threads = torch_threads
        self._limiter = trio.CapacityLimiter(1)
        self._runner: Any = None
        self._current: list[Request] | None = None
        self.busy_time = 0.0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        if self._runner is None:
            self._runner = await trio.to_thread.run_sync(
                lambda: self._backend.load(self.device, torch_threads=self._torch_threads),
                limiter=self._limiter,
            )
        task_status.started(self)
        pull = self._scheduler.pull
        while True:
            batch = await pull()
            self._current = batch
            await self._execute(batch)
            self._current = None

    async def _execute(self, batch: list[Request]) -> None:
        metrics = self._metrics
        t0 = trio.current_time()
        wait = metrics.queue_wait
        for req in batch:
            wait.record(t0 - req.arrival)
        items = [req.item for req in batch]
        try:
            if self._inline:
                outputs = self._runner(items)
            else:
                outputs = await trio.to_thread.run_sync(
                    self._runner, items, limiter=self._limiter, abandon_on_cancel=True
                )
            if len(outputs) != len(batch):
                raise RuntimeError(f"returned {len(outputs)} outputs for {len(batch)} items")
        except trio.Cancelled:
            raise
        except Exception as exc:
            msg = (
                f"model {self.model!r} failed on a batch of {len(batch)} on {self.device}: "
                f"{type(exc).__name__}: {exc}"
            )
            for req in batch:
                req.reply.set_error(ModelError(msg))
            metrics.statuses["model_error"] += len(batch)
            return
        t1 = trio.current_time()
        self.busy_time += t1 - t0
        metrics.record_batch(len(batch), t1 - t0)
        for req, out in zip(batch, outputs, strict=True):
            req.reply.set_result(out)

    def fail_current(self, error: BaseException) -> int:
        """Fail every still-unanswered request of the batch in flight."""
        batch, self._current = self._current, None
        return sum(req.reply.set_error(error) for req in batch or ())

    def on_crash(self, exc: BaseException) -> None:
        self.fail_current(ActorBroken(f"{self.name} crashed mid-batch: {exc!r}"))

    def close(self) -> int:
        return self.fail_current(ActorClosed(f"{self.name}: the runtime is shut down"))
