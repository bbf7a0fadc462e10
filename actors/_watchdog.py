"""The wall-clock watchdog: cancels a batch's cancel scope when the batch has run on
its device for longer than its deadline, and calls back into trio when a deadline of
a request in a running batch passes, in wall-clock time.

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

import trio


class Armed:
    """One deadline armed with a :class:`Watchdog`: what it calls when it passes, and
    whether it still will (until it fires or is disarmed)."""

    __slots__ = ("fn", "live", "owner")

    def __init__(self, fn: Callable[[], object], owner: Watchdog) -> None:
        self.fn = fn
        self.owner = owner
        self.live = True


class Watchdog:
    """Wall-clock deadlines for cancel scopes (:meth:`arm`) and callbacks
    (:meth:`arm_call`), disarmed with :meth:`disarm`; all from trio. :meth:`start` and
    :meth:`stop` around its use."""

    #: A disarmed deadline stays in the heap until its time comes, unless the heap holds
    #: more than twice the live ones and this many more: then it is compacted.
    SLACK = 64

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, Armed]] = []
        self._live = 0  # the entries armed and neither fired nor disarmed
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

    def now(self) -> float:
        """The wall clock its deadlines are kept in (seconds, arbitrary origin): what a
        caller converting a trio deadline into wall time reads. Not a checkpoint."""
        return self._clock()

    def arm(self, seconds: float, scope: trio.CancelScope) -> Armed:
        """Cancel ``scope`` ``seconds`` of wall time from now unless disarmed first."""
        return self.arm_call(seconds, scope.cancel)

    def arm_call(self, seconds: float, fn: Callable[[], object]) -> Armed:
        """Call ``fn()`` ``seconds`` of wall time from now unless disarmed first. It is
        called in the event loop's thread, between tasks (``run_sync_soon``): it must
        not block and must not raise (an exception there ends the event loop), and it
        may come in just after a disarm that raced with its firing (it must then find
        nothing to do). Not a checkpoint."""
        entry = Armed(fn, self)
        at = self._clock() + seconds
        with self._cond:
            heap = self._heap
            if len(heap) > 2 * self._live + self.SLACK:
                # Each compaction of n entries follows at least n/2 disarms: amortised
                # O(1) a deadline, and the heap holds at most twice the live ones (a
                # batch's deadlines disarmed when it ends would otherwise stay until
                # their time came: a minute of batches for a 60 s timeout).
                heap[:] = [e for e in heap if e[2].live]
                heapq.heapify(heap)
            first = not heap or at < heap[0][0]
            heapq.heappush(heap, (at, next(self._seq), entry))
            self._live += 1
            if first:
                self._cond.notify()
        return entry

    @staticmethod
    def disarm(entry: Armed) -> None:
        """Drop ``entry`` unless it fired already. Not a checkpoint."""
        owner = entry.owner
        with owner._cond:
            if entry.live:
                entry.live = False  # the thread drops it when its time comes
                owner._live -= 1

    def _run(self) -> None:
        cond, heap = self._cond, self._heap
        with cond:
            while not self._stopping:
                now = self._clock()
                while heap and (heap[0][0] <= now or not heap[0][2].live):
                    _, _, entry = heapq.heappop(heap)
                    if entry.live:
                        entry.live = False
                        self._live -= 1
                        self.fired += 1
                        self._fire(entry.fn)
                cond.wait(timeout=(heap[0][0] - now) if heap else None)

    def _fire(self, fn: Callable[[], object]) -> None:
        try:
            assert self._token is not None
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            self._stopping = True
