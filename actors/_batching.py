"""Sans-IO decisions: when a batch closes, and the FIFO queue that feeds it.

Nothing here awaits or reads a clock: ``now`` is an argument. The scheduler actor
and the batchers call these objects; tests and the fuzz suite drive them directly.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Iterator
from typing import Protocol

import attrs
from trioserve import DeadlineExceeded, Overloaded, Request, RequestState

_QUEUED = RequestState.QUEUED


@attrs.frozen(kw_only=True)
class BatchLimits:
    """How a batch closes: at ``max_size`` items, at ``max_tokens`` cost units (padding
    counted when ``padded``: cost = items × longest item), or when its oldest request
    has waited ``max_wait`` seconds. ``oversize`` is the policy for a request whose
    cost alone exceeds ``max_tokens``: "reject", "alone" or "split"."""

    max_size: int = attrs.field(validator=attrs.validators.ge(1))
    max_tokens: int | None = None
    max_wait: float = 0.0
    padded: bool = False
    oversize: str = "reject"

    def oversize_cost(self, cost: int) -> bool:
        return self.max_tokens is not None and cost > self.max_tokens


class BatchBuilder:
    """Accumulates items' costs and says whether one more would break the budget."""

    __slots__ = ("count", "limits", "longest", "total")

    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self.count = 0
        self.total = 0
        self.longest = 0

    def cost_with(self, cost: int) -> int:
        """The batch's cost if an item of ``cost`` joined it."""
        if self.limits.padded:
            return (self.count + 1) * max(self.longest, cost)
        return self.total + cost

    @property
    def cost(self) -> int:
        return self.count * self.longest if self.limits.padded else self.total

    def fits(self, cost: int) -> bool:
        lim = self.limits
        if self.count >= lim.max_size:
            return False
        return lim.max_tokens is None or self.cost_with(cost) <= lim.max_tokens

    def add(self, cost: int) -> None:
        self.count += 1
        self.total += cost
        if cost > self.longest:
            self.longest = cost


class SchedulingPolicy(Protocol):
    """What the scheduler actor needs of a queueing policy (FifoQueue, FairQueue)."""

    def offer(self, request: Request, now: float) -> None: ...
    def offer_spare(self, request: Request, now: float) -> bool: ...
    def next_batch(self, now: float) -> list[Request] | None: ...
    def next_close_time(self) -> float: ...
    def expire(self, now: float) -> int: ...
    def next_expiry(self) -> float: ...
    def drain(self) -> list[Request]: ...
    def completed(self, batch: list[Request], now: float, *, failed: bool = False) -> None: ...
    def left(self, requests: list[Request]) -> None: ...
    def __len__(self) -> int: ...


class FifoQueue:
    """One FIFO queue with a bound, batch closing and deadline expiry.

    ``next_batch`` returns a batch (every request in it moved to DISPATCHED) only when
    one has closed; otherwise None, and ``next_close_time()`` says when the oldest
    request's wait runs out. Withdrawn requests (their caller left) are skipped and
    never dispatched; expired ones are answered DeadlineExceeded (when the deadline was
    the model's) or dropped (when it was the caller's, whose own cancel scope fires).
    """

    def __init__(self, limits: BatchLimits, *, bound: int, model: str = "model") -> None:
        self.limits = limits
        self.bound = bound
        self.model = model
        self._queue: collections.deque[Request] = collections.deque()
        self._expiry: list[tuple[float, int, Request]] = []
        self._seq = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def offer(self, request: Request, now: float) -> None:
        """Queue a request. Raises Overloaded when the queue is at its bound."""
        if len(self._queue) >= self.bound:
            raise Overloaded(
                f"model {self.model!r}: queue full ({self.bound} requests waiting)",
                retry_after=max(self.limits.max_wait, 0.05),
            )
        self._queue.append(request)
        if request.answer_expiry and request.deadline < math.inf:
            self._seq += 1
            heapq.heappush(self._expiry, (request.deadline, self._seq, request))

    def offer_spare(self, request: Request, now: float) -> bool:
        """Queue a hedged request's copy if the queue is below its bound; return
        whether it was queued."""
        if len(self._queue) >= self.bound:
            return False
        self.offer(request, now)
        return True

    def _expired(self, request: Request) -> None:
        self.expired += 1
        if request.answer_expiry:
            request.reply.set_error(
                DeadlineExceeded(
                    f"model {self.model!r}: deadline passed after "
                    f"{request.deadline - request.arrival:.3f}s in the queue",
                    in_queue=True,
                )
            )

    def _trim_head(self, now: float) -> None:
        q = self._queue
        while q:
            head = q[0]
            if head.reply.state is not _QUEUED:
                q.popleft()
            elif head.deadline <= now:
                q.popleft()
                self._expired(head)
            else:
                return

    def next_batch(self, now: float) -> list[Request] | None:
        self._trim_head(now)
        q = self._queue
        if not q:
            return None
        lim = self.limits
        timed_out = now >= q[0].arrival + lim.max_wait
        if not timed_out and len(q) < lim.max_size and lim.max_tokens is None:
            return None  # fast path: cannot have closed yet
        builder = BatchBuilder(lim)
        taken: list[Request] = []
        closed = False
        popped = 0
        for req in q:
            if req.reply.state is not _QUEUED:
                popped += 1
                continue
            if req.deadline <= now:
                popped += 1
                self._expired(req)
                continue
            if builder.count == 0 and lim.oversize_cost(req.cost):
                popped += 1
                taken.append(req)
                closed = True  # an oversize request runs alone
                break
            if not builder.fits(req.cost):
                closed = True
                break
            builder.add(req.cost)
            taken.append(req)
            popped += 1
            if builder.count >= lim.max_size or (
                lim.max_tokens is not None and builder.cost >= lim.max_tokens
            ):
                closed = True  # full: no request costs nothing
                break
        if not closed and not (timed_out and taken):
            # Not closed: drop only the dead entries we walked over, keep the rest.
            if popped != len(taken):
                alive = [r for r in q if r.reply.state is _QUEUED and r.deadline > now]
                q.clear()
                q.extend(alive)
            return None
        for _ in range(popped):
            q.popleft()
        for req in taken:
            req.reply.dispatch()
        return taken

    def next_close_time(self) -> float:
        """When the oldest queued request has waited ``max_wait`` (inf when empty)."""
        for req in self._queue:
            if req.reply.state is _QUEUED:
                return req.arrival + self.limits.max_wait
        return math.inf

    def expire(self, now: float) -> int:
        """Answer every queued request whose model deadline has passed; return how many."""
        h = self._expiry
        n = 0
        while h and (h[0][2].reply.state is not _QUEUED or h[0][0] <= now):
            _, _, req = heapq.heappop(h)
            if req.reply.state is _QUEUED:
                self._expired(req)
                n += 1
        return n  # answered entries leave the deque lazily, at the head or in a walk

    def next_expiry(self) -> float:
        """The earliest model deadline among queued requests (inf when none)."""
        h = self._expiry
        while h and h[0][2].reply.state is not _QUEUED:
            heapq.heappop(h)
        return h[0][0] if h else math.inf

    def completed(self, batch: list[Request], now: float, *, failed: bool = False) -> None:
        """A dispatched batch finished (FIFO keeps no measurements)."""

    def left(self, requests: list[Request]) -> None:
        """Dispatched requests left the devices without running (FIFO keeps no
        measurements)."""

    def drain(self) -> list[Request]:
        """Remove and return every still-queued request (for shutdown)."""
        alive = [r for r in self._queue if r.reply.state is _QUEUED]
        self._queue.clear()
        self._expiry.clear()
        return alive
