"""The runtime's watchdog on trio's clock, and no zygote: what a suite whose
replicas run batches off the event loop on a simulated worker (the runtime suite's
running scenarios, the cache suite) puts in the runtime's place."""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Any

import trio
import trioserve.actors

if TYPE_CHECKING:
    from ._runtime import Run


class DrivenWatchdog(trioserve.actors.Watchdog):
    """The watchdog on trio's clock (``Scenario.running``): no thread; the
    scenario's task :meth:`drive` fires each deadline at its trio time, in that
    task. Bound to its run by :func:`watchdog_class`."""

    run: Run

    def __init__(self) -> None:
        super().__init__(clock=trio.current_time)
        self.wake = trio.Event()
        self.run.watchdog = self

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def arm_call(self, seconds: float, fn: Any) -> Any:
        armed = super().arm_call(seconds, fn)
        self.wake.set()
        return armed

    def live(self) -> int:
        """How many deadlines are armed (neither fired nor disarmed)."""
        return self._live

    async def drive(self) -> None:
        """Fire every deadline at its time, for good (cancelled at the run's end)."""
        heap = self._heap
        while True:
            while heap and not heap[0][2].live:
                heapq.heappop(heap)
            with trio.move_on_at(heap[0][0] if heap else math.inf):
                await self.wake.wait()
            self.wake = trio.Event()
            now = trio.current_time()
            while heap and (heap[0][0] <= now or not heap[0][2].live):
                _, _, entry = heapq.heappop(heap)
                if entry.live:
                    entry.live = False
                    self._live -= 1
                    self.fired += 1
                    entry.fn()


def watchdog_class(run: Run) -> type:
    return type("DrivenWatchdog", (DrivenWatchdog,), {"run": run})


class NoZygote:
    """The zygote a runtime with worker processes starts: none is needed for
    :class:`SimWorker`."""

    async def start(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
