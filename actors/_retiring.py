"""Retiring a replica: the part of :class:`~trioserve.actors.BatcherActor` that lets
the autoscaler (``actors/_scaling.py``) take an autoscaled model's replica out of
service gracefully. A retired replica pulls no more, finishes the batches it holds,
releases its worker process or its model, and its ``run`` returns.

Only an autoscaled model's replicas wait for work inside a cancel scope that
``retire`` cancels; the others run exactly the loop they always did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from trioserve import Request, WorkerProcess

    from ._in_flight import InFlight
    from ._scheduler import SchedulerActor


class Retiring:
    """The retiring methods of a batcher (set up by ``_init_retiring``); not used on
    its own."""

    if TYPE_CHECKING:
        name: str
        _in_flight: InFlight
        _scheduler: SchedulerActor
        _replace_due: bool

        async def _wait_breaker(self) -> None: ...
        def _replace_broken(self, worker: WorkerProcess) -> Any: ...

    def _init_retiring(self, *, retirable: bool) -> None:
        self._retirable = retirable
        self._retire_asked = trio.Event()
        #: the scope of a wait for work that ``retire`` cancels (None: none yet)
        self._retire_scope: trio.CancelScope | None = None
        self._retired = trio.Event()

    @property
    def retiring(self) -> bool:
        """Whether the autoscaler retired it (it may still finish what it holds)."""
        return self._retire_asked.is_set()

    @property
    def idle(self) -> bool:
        """Whether it holds no batch (running, or staged for its worker process)."""
        return not self._in_flight

    def retire(self) -> None:
        """Retire this replica (an autoscaled model's): it pulls no more, finishes
        the batches it holds (each request answered, or handed back to the queue
        for another replica should its worker be lost meanwhile), releases its
        worker process or its model, and its ``run`` returns. Not a checkpoint;
        :meth:`wait_retired` waits for the end."""
        if not self._retirable:
            raise RuntimeError(
                f"{self.name}: only an autoscaled model's replica, or one under explicit "
                "model control, retires"
            )
        self._retire_asked.set()
        self._scheduler.replicas_changed()  # it is no longer ready
        if self._retire_scope is not None:
            self._retire_scope.cancel("replica retired")

    async def wait_retired(self) -> None:
        """Wait until a retired replica's ``run`` has returned, holding nothing.
        A checkpoint; cancelling it changes nothing."""
        await self._retired.wait()

    async def _pull_unless_retired(
        self, room: trio.Semaphore | None = None, worker: WorkerProcess | None = None
    ) -> list[Request] | None:
        """What the batcher's loops do before a batch (the breaker's cooldown, a
        broken worker replaced, room in a worker's pipeline) and ``pull``, or None
        once the replica is retired: ``retire`` cancels these waits. A batch that
        ``pull`` has taken is returned even then (cancelled, it takes nothing, and
        once it has taken a batch it returns it: no checkpoint follows here)."""
        if self._retire_asked.is_set():
            return None
        acquired = False
        with trio.CancelScope() as scope:
            self._retire_scope = scope
            await self._wait_breaker()
            if worker is not None and room is not None:
                if self._replace_due:
                    self._replace_broken(worker)
                await room.acquire()
                acquired = True
            return await self._scheduler.pull(self)
        self._retire_scope = None
        if acquired:
            room.release()  # type: ignore[union-attr]
        return None
