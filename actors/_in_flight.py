"""The batches a replica holds in flight, and the runtime's deadlines of their
requests while they run.

A request's deadline from its model's (or its class's) ``timeout_ms`` is enforced by
the scheduler while the request is queued or held for a retry. Once its batch is in
flight — running in a worker thread, a worker process or a Ray actor, or staged for
one — the replica holds it: :class:`InFlight` arms, for each batch it holds, a
wall-clock deadline with the watchdog for the earliest such deadline among the
batch's requests, converted when the batch comes in (its trio deadline less trio's
now, in wall seconds). When it passes, the requests due are answered
``DeadlineExceeded`` (not ``in_queue``: they were dispatched), the next deadline is
armed, and the batch goes on for the others; the batch's answer later skips those
already answered (``Reply.answerable``).

A request answered so may have others waiting for what its batch computes (the
other callers of a coalesced flight: ``Reply.late``). It is told when its request
is answered (``late.expect()``), the batch's answer hands it the item's outcome, and
a batch that leaves without one (it failed, was cut off or handed back, its worker
lost) settles it with None as it leaves, so that those waiting run it again instead;
unless the batch was split for a retry and the item carried into a part
(``late.carry()``, see ``to_retry``): that part's answer settles it.

Wall time, not a trio timer: under ``MockClock(autojump_threshold=0)`` a trio timer
fires at once whenever the loop waits for a thread or a pipe, and every request in a
running batch would expire at once in tests.

A batch that leaves (answered, cut off and handed back, its worker lost, failed at
shutdown) is disarmed as it leaves, by whichever path takes it out, so no deadline of
a batch outlives it; a callback that was already on its way finds the batch gone and
does nothing. An inline replica arms nothing: its model runs on the event loop, which
no callback can interrupt.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import trio
from trioserve import DeadlineExceeded, Request, RequestState

if TYPE_CHECKING:
    from ._watchdog import Armed, Watchdog

log = logging.getLogger("trioserve")

_DISPATCHED = RequestState.DISPATCHED


def _first_deadline(batch: list[Request]) -> float:
    """The earliest deadline the runtime answers among ``batch``'s requests still
    waiting (inf: none)."""
    first = math.inf
    for r in batch:
        if r.answer_expiry and r.deadline < first and r.reply.state is _DISPATCHED:
            first = r.deadline
    return first


class _BatchDeadlines:
    """The runtime's deadlines of one batch in flight, one armed at a time (the
    earliest of those still waiting)."""

    __slots__ = ("_armed", "_at", "_batch", "_calls", "_late", "_offset", "_owner")

    def __init__(self, owner: InFlight, batch: list[Request], first: float) -> None:
        self._owner = owner
        self._batch = batch
        watchdog = owner.watchdog
        assert watchdog is not None
        # wall = trio + offset, for this batch: under a MockClock the two clocks drift
        # apart while the loop waits, so the offset is taken when the batch comes in
        self._offset = watchdog.now() - trio.current_time()
        self._armed: Armed | None = None
        self._at = first  # the trio deadline armed
        #: the late hooks of its requests answered while it runs (None: none)
        self._late: list[Any] | None = None
        #: what :meth:`call_at` armed (None: nothing)
        self._calls: list[Armed] | None = None
        self._arm(first)

    def _arm(self, deadline: float) -> None:
        watchdog = self._owner.watchdog
        assert watchdog is not None
        self._at = deadline
        self._armed = watchdog.arm_call(
            max(0.0, deadline + self._offset - watchdog.now()), self._due
        )

    def close(self) -> None:
        """The batch left: disarm its deadline (a callback on its way does nothing),
        and settle the late hooks its answer did not (with None: no outcome came).
        The batch is let go: a disarmed callback stays in the watchdog's heap until
        its time or the heap's next compaction, and must not keep the batch's
        requests (their items and answers) alive till then."""
        armed, self._armed = self._armed, None
        self._batch = []
        if armed is not None:
            armed.owner.disarm(armed)
        late, self._late = self._late, None
        if late is not None:
            for hook in late:
                if not hook.carried:  # one carried into a retry is settled by its part
                    hook.settle(None)
        calls, self._calls = self._calls, None
        if calls is not None:
            for call in calls:
                call.owner.disarm(call)

    def call_at(self, deadline: float, fn: Callable[[], object]) -> Callable[[], None]:
        """Call ``fn()`` when the trio ``deadline`` passes on this batch's clock (the
        watchdog's, as its requests' deadlines), unless disarmed first: by the
        returned function, or when the batch leaves. For those waiting for a late
        outcome of the batch (see the module). Not a checkpoint."""
        watchdog = self._owner.watchdog
        assert watchdog is not None
        armed = watchdog.arm_call(max(0.0, deadline + self._offset - watchdog.now()), fn)
        if self._calls is None:
            self._calls = []
        self._calls.append(armed)
        return lambda: armed.owner.disarm(armed)

    def _due(self) -> None:
        """The watchdog's callback (in the event loop, between tasks): answer the
        requests whose deadline passed, and arm the next one."""
        if self._armed is None:
            return  # the batch left as this was on its way
        self._armed = None
        try:
            watchdog = self._owner.watchdog
            assert watchdog is not None
            # the wall clock's now, in trio time; the deadline armed passed whatever
            # the rounding of the conversion says
            now = max(self._at, watchdog.now() - self._offset)
            due = [
                r for r in self._batch
                if r.answer_expiry and r.deadline <= now and r.reply.state is _DISPATCHED
            ]
            if due:
                self._owner.expired(due)
                for r in due:
                    hook = r.reply.late
                    if hook is not None:  # others wait for what the batch computes
                        hook.expect(self.call_at)
                        if self._late is None:
                            self._late = []
                        self._late.append(hook)
            first = _first_deadline(self._batch)
            if first < math.inf:
                self._arm(first)
        except Exception:  # raised here, it would end the event loop
            log.exception(
                "model %r: answering the requests whose deadline passed in a running "
                "batch failed", self._owner.model,
            )


class InFlight:
    """The batches a replica holds in flight, oldest first: a deque of batches
    (``append``, ``pop``, ``popleft``, ``clear``, iteration, ``[i]``) that keeps the
    runtime's deadlines of each batch's requests while it holds it (see the module's
    docstring). ``watchdog`` None: it keeps none (an inline replica, or batches run
    without a watchdog). ``noted`` is told of the requests it answered."""

    __slots__ = ("_batches", "_deadlines", "_noted", "_since", "model", "watchdog")

    def __init__(
        self, *, model: str, watchdog: Watchdog | None,
        noted: Callable[[list[Request]], None] | None = None,
    ) -> None:
        self.model = model
        self.watchdog = watchdog
        self._noted = noted
        self._batches: collections.deque[list[Request]] = collections.deque()
        #: each batch's deadlines (None: it has none the runtime answers), in step
        #: with ``_batches``
        self._deadlines: collections.deque[_BatchDeadlines | None] = collections.deque()
        #: when each came in (trio time), in step with ``_batches``
        self._since: collections.deque[float] = collections.deque()

    def __len__(self) -> int:
        return len(self._batches)

    def __bool__(self) -> bool:
        return bool(self._batches)

    def __iter__(self) -> Iterator[list[Request]]:
        return iter(self._batches)

    def __getitem__(self, i: int) -> list[Request]:
        return self._batches[i]

    def append(self, batch: list[Request], since: float | None = None) -> None:
        """``batch`` is in flight from now on (it runs, or is staged): arm the earliest
        deadline the runtime answers among its requests. ``since``: when it came in
        (trio time; None: now), what :meth:`since` tells."""
        self._batches.append(batch)
        self._since.append(trio.current_time() if since is None else since)
        deadlines = None
        if self.watchdog is not None:
            first = _first_deadline(batch)
            if first < math.inf:
                deadlines = _BatchDeadlines(self, batch, first)
        self._deadlines.append(deadlines)

    def since(self, i: int) -> float:
        """When batch ``i`` came in (trio time): a batch sent to a worker, when it was
        sent, from which its run is measured (``BatcherActor._deliver``'s ``t0``)."""
        return self._since[i]

    def popleft(self) -> list[Request]:
        """Take the oldest batch out (disarmed)."""
        self._since.popleft()
        deadlines = self._deadlines.popleft()
        if deadlines is not None:
            deadlines.close()
        return self._batches.popleft()

    def pop(self) -> list[Request]:
        """Take the newest batch out (disarmed)."""
        self._since.pop()
        deadlines = self._deadlines.pop()
        if deadlines is not None:
            deadlines.close()
        return self._batches.pop()

    def clear(self) -> None:
        """Take every batch out (disarmed)."""
        for deadlines in self._deadlines:
            if deadlines is not None:
                deadlines.close()
        self._deadlines.clear()
        self._batches.clear()
        self._since.clear()

    def expired(self, requests: list[Request]) -> None:
        """Answer ``requests`` (dispatched, in a batch in flight) ``DeadlineExceeded``:
        their deadline passed while their batch ran."""
        for r in requests:
            r.reply.set_error(
                DeadlineExceeded(
                    f"model {self.model!r}: deadline passed while its batch was "
                    f"running (limit {r.deadline - r.arrival:.3f}s: the model's or "
                    "its class's timeout_ms)",
                    in_queue=False,  # it was dispatched: it ran, and is charged
                )
            )
        if self._noted is not None:
            self._noted(requests)
