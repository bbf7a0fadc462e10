"""The batcher actor: one per replica (device). When its device is free it pulls a
closed batch from the scheduler, runs the model off the event loop (a worker thread,
no lock held) or inline, and answers each request's reply slot."""

from __future__ import annotations

import collections
from typing import Any

import trio
from trioserve import (
    Actor,
    ActorBroken,
    ActorClosed,
    ModelBackend,
    ModelConfig,
    ModelError,
    Request,
    WorkerProcess,
)

from ._metrics import ModelMetrics
from ._scheduler import SchedulerActor


class BatcherActor(Actor):
    def __init__(
        self,
        *,
        config: ModelConfig,
        backend: ModelBackend,
        scheduler: SchedulerActor,
        metrics: ModelMetrics,
        device: str,
        index: int,
        execution: str,
        torch_threads: int = 1,
        zygote: Any = None,
    ) -> None:
        super().__init__()
        model = config.name
        self.name = f"batcher[{model}#{index}@{device}]"
        self.model = model
        self._config = config
        self.device = device
        self.index = index
        self._backend = backend
        self._scheduler = scheduler
        self._metrics = metrics
        self._inline = execution == "inline"
        self._process = execution == "process"
        self._worker: WorkerProcess | None = None
        self._torch_threads = torch_threads
        self._zygote = zygote
        self._limiter = trio.CapacityLimiter(1)
        self._runner: Any = None
        self._in_flight: collections.deque[list[Request]] = collections.deque()
        self.busy_time = 0.0
        self._worker_seconds = 0.0  # busy seconds of workers this batcher already replaced

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        if self._process:
            try:
                await self._start_worker()
                task_status.started(self)
                await self._loop_process()
            finally:
                if self._worker is not None:
                    self._worker_seconds += self._worker.busy_seconds
                    await self._worker.aclose()
                    self._worker = None
            return
        if self._runner is None:
            self._runner = await trio.to_thread.run_sync(
                lambda: self._backend.load(self.device, torch_threads=self._torch_threads),
                limiter=self._limiter,
            )
        task_status.started(self)
        pull = self._scheduler.pull
        while True:
            batch = await pull()
            self._in_flight.append(batch)
            await self._execute(batch)
            self._in_flight.clear()

    @property
    def device_seconds(self) -> float:
        """Seconds its device spent running batches: measured inside the worker process,
        or around the thread/inline call."""
        if self._process:
            w = self._worker
            return self._worker_seconds + (w.busy_seconds if w is not None else 0.0)
        return self.busy_time

    async def _start_worker(self) -> None:
        worker = WorkerProcess(
            self._config, self._backend, self.device, self._torch_threads, zygote=self._zygote
        )
        try:
            await worker.start()
        except BaseException:
            await worker.aclose()
            raise
        self._worker = worker

    async def _loop_process(self) -> None:
        """Several batches in flight per worker: while the worker runs one, the next are
        already staged in shared memory, so the device never waits on the event loop.
        The batcher still pulls only when its device has room (worker-pull)."""
        room = trio.Semaphore(WorkerProcess.SLOTS)
        slots = WorkerProcess.SLOTS
        sent_send, sent_recv = trio.open_memory_channel[tuple[list[Request], float]](slots)
        pull = self._scheduler.pull
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._collect, sent_recv, room)
            while True:
                await room.acquire()
                batch = await pull()
                self._in_flight.append(batch)
                t0 = trio.current_time()
                wait = self._metrics.queue_wait
                for req in batch:
                    wait.record(t0 - req.arrival)
                assert self._worker is not None
                try:
                    await self._worker.submit([req.item for req in batch])
                except trio.Cancelled:
                    self._worker.kill()
                    raise
                await sent_send.send((batch, t0))

    async def _collect(self, sent: trio.MemoryReceiveChannel, room: trio.Semaphore) -> None:
        async for batch, t0 in sent:
            assert self._worker is not None
            try:
                outputs = await self._worker.result()
            except trio.Cancelled:
                self._worker.kill()
                raise
            except WorkerProcess.Failed as exc:
                self._fail(batch, exc)
            else:
                self._deliver(batch, outputs, t0)
            if self._in_flight and self._in_flight[0] is batch:
                self._in_flight.popleft()
            room.release()

    async def _execute(self, batch: list[Request]) -> None:
        t0 = trio.current_time()
        wait = self._metrics.queue_wait
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
        except trio.Cancelled:
            raise
        except Exception as exc:
            self._fail(batch, exc)
            return
        self._deliver(batch, outputs, t0)

    def _fail(self, batch: list[Request], exc: BaseException) -> None:
        msg = (
            f"model {self.model!r} failed on a batch of {len(batch)} on {self.device}: "
            f"{type(exc).__name__}: {exc}"
        )
        for req in batch:
            req.reply.set_error(ModelError(msg))
        self._metrics.statuses["model_error"] += len(batch)
        self._scheduler.completed(batch)

    def _deliver(self, batch: list[Request], outputs: Any, t0: float) -> None:
        if len(outputs) != len(batch):
            self._fail(
                batch, RuntimeError(f"returned {len(outputs)} outputs for {len(batch)} items")
            )
            return
        t1 = trio.current_time()
        self.busy_time += t1 - t0
        self._metrics.record_batch(len(batch), t1 - t0)
        for req, out in zip(batch, outputs, strict=True):
            req.reply.set_result(out)
        self._scheduler.completed(batch)

    def fail_current(self, error: BaseException) -> int:
        """Fail every still-unanswered request of the batches in flight."""
        n = 0
        while self._in_flight:
            batch = self._in_flight.popleft()
            n += sum(req.reply.set_error(error) for req in batch)
            self._scheduler.completed(batch)
        return n

    def on_crash(self, exc: BaseException) -> None:
        self.fail_current(ActorBroken(f"{self.name} crashed mid-batch: {exc!r}"))

    def close(self) -> int:
        return self.fail_current(ActorClosed(f"{self.name}: the runtime is shut down"))
