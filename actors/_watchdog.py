"""The straggler watchdog: cancels a batch's cancel scope when the batch has run on
its device for longer than its deadline, in wall-clock time.

A batch's running time is the device's (a worker thread's or process's), which is
real time whatever clock the event loop runs on. Timing it with a trio timer would,
under ``MockClock(autojump_threshold=0)``, fire at once whenever the loop waits for a
thread or a pipe — every batch would look like a straggler in tests. So one helper
thread keeps the deadlines (``time.monotonic``) and calls back into trio
(``TrioToken.run_sync_soon``) when one passes.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import trio


class Watchdog:
    """Wall-clock deadlines for cancel scopes. :meth:`arm` / :meth:`disarm` from trio;
    :meth:`start` and :meth:`stop` around its use."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, list[Any]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.fired = 0

    def start(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._run, name="trioserve-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def arm(self, seconds: float, scope: trio.CancelScope) -> list[Any]:
        """Cancel ``scope`` ``seconds`` of wall time from now unless disarmed first."""
        entry = [scope, True]
        at = self._clock() + seconds
        with self._cond:
            first = not self._heap or at < self._heap[0][0]
            heapq.heappush(self._heap, (at, next(self._seq), entry))
            if first:
                self._cond.notify()
        return entry

    @staticmethod
    def disarm(entry: list[Any]) -> None:
        entry[1] = False  # the thread drops it when its time comes

    def _run(self) -> None:
        cond, heap = self._cond, self._heap
        with cond:
            while not self._stopping:
                now = self._clock()
                while heap and (heap[0][0] <= now or not heap[0][2][1]):
                    _, _, entry = heapq.heappop(heap)
                    if entry[1]:
                        entry[1] = False
                        self.fired += 1
                        self._fire(entry[0])
                cond.wait(timeout=(heap[0][0] - now) if heap else None)

    def _fire(self, scope: trio.CancelScope) -> None:
        try:
            assert self._token is not None
            self._token.run_sync_soon(scope.cancel)
        except trio.RunFinishedError:
            self._stopping = True
