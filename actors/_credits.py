"""Per-tenant credits: a token bucket in cost units whose reservations start in the
order they were made, and whose refunds never move a start already handed out.

Nothing here awaits or reads a clock: ``now`` is an argument. The runtime's
admission pays a request's cost here before the queue sees it; docs/scheduling.md
("Credits") gives the rules.
"""

from __future__ import annotations

import collections
import itertools
import math
from typing import Any

#: Reservations a bucket keeps apart; more are merged into the latest (see TokenBucket).
_MERGE_AT = 16
#: Takes whose level a bucket remembers, for refunds of grants that had started.
_LOG = 64


class TokenBucket:
    """Credits in cost units: ``rate`` per second up to ``burst``.

    A take may leave the level negative (a debt the refill pays back first), so a cost
    larger than the burst is still served once the bucket is full, and waiters are
    served in the order they reserved: a reservation never starts before one made
    earlier (a refunded one included).

    A refund never moves a start time already handed out (the callers sleep until
    theirs), so it gives back only what the bucket could have kept with those starts
    unchanged: the credits would have stayed in it from the refunded reservation's
    start on, and whatever would have filled it past ``burst`` before a later waiter's
    start is lost. For a grant that had started (a request the queue refused or pushed
    out after it paid) the caller passes ``since``, the grant's number (``seq`` read
    right after the take): the credits would have stayed in the bucket from then on,
    so at most ``burst`` less the highest level the bucket held since (just before each
    later take, or for a later reservation that waited, just before its start; and now)
    and less the highest level a waiter meets at its start goes back, and those levels
    all rise by what goes back; past the last _LOG takes that history is gone and
    nothing goes back. A grant the bucket still counts as waiting (no call has
    refilled it since its start) goes back as a waiter: the same as by this rule
    once a call has refilled it.
    Otherwise (a waiting caller left) the bucket cannot tell which reservation it was,
    so it assumes the earliest still waiting: with at most one reservation waiting the
    credits all go back; otherwise at most ``burst`` less the highest level a later
    waiter meets at its start.
    """

    __slots__ = ("_log", "_tail", "_waiting", "burst", "level", "rate", "seq", "stamp", "used")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.stamp = now
        self.used = 0.0
        self._tail = -math.inf  # the latest start handed out
        # The reservations that start after ``stamp``, in start order, each as [start,
        # peak, n, records]: the peak is the level just before its debit at its start,
        # so a refund before it may add at most ``burst - peak``. Past _MERGE_AT
        # entries, a new one is merged into the latest (n of them; its start, the higher
        # peak), which only makes refunds more cautious. ``records``: their entries in
        # the log, which get the final peak when they start.
        self._waiting: collections.deque[list[Any]] = collections.deque()
        #: takes so far; [number, the level just before it] of the last _LOG of them (for
        #: a reservation that waits: the level just before its start, its peak)
        self.seq = 0
        self._log: collections.deque[list[float]] = collections.deque(maxlen=_LOG)

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
            self.stamp = now
            waiting = self._waiting
            while waiting and waiting[0][0] <= now:
                _, peak, _, records = waiting.popleft()
                for record in records:  # started: the level it met is history now
                    record[1] = peak

    def try_take(self, cost: float, now: float) -> float:
        """Take ``cost`` if the credits are there and return 0.0; otherwise take
        nothing and return the seconds until they will be."""
        self._refill(now)
        need = min(cost, self.burst)
        if self.level >= need:
            self.seq += 1
            self._log.append([self.seq, self.level])
            self.level -= cost
            self.used += cost
            return 0.0
        return (need - self.level) / self.rate

    def refund(
        self, cost: float, *, since: int | None = None, reservation: int | None = None,
        now: float | None = None,
    ) -> None:
        """Give back credits taken for a request that never ran: a reservation whose
        caller left while waiting, or (``since``: the grant's ``seq``) a request the
        queue refused or pushed out after its start. All of them, less what the
        bucket's history since and the reservations still waiting leave no room for
        (see the class).

        ``reservation``: the waiting caller's ``seq`` (read right after its
        ``reserve``): that reservation is the one given back, and leaves the
        waiting ones (its start, and theirs, unchanged), so that the next refund of
        a waiter does not take it for one still waiting (the credits of the second
        of two waiters who left were lost); one that has started is refunded as a
        grant (``since``). Either way, a reservation the bucket still counts as
        waiting (its start passed with no call since) is refunded as a waiter, so
        the two agree, and agree with the same refund after any call that refilled
        the bucket (a grant refused at its start used to get nothing back).
        ``now`` (with ``reservation``): the refund's time, so that a reservation whose
        start has passed counts as started, as after a refill; without it, one still
        listed as waiting counts as withdrawn before its start."""
        if reservation is not None:
            since = reservation  # unless it still waits: then a grant that started
        if since is not None and self._waiting and self._refund_waiting(
            cost, since, withdrawn=reservation is not None, now=now
        ):
            # Its reservation is still on the books as waiting: no call has refilled
            # the bucket since its start (then nothing was taken since, and a waiter's
            # refund is exact), or it was merged with a later one (whose peak bounds
            # the levels since). As a grant, the level it met at its own start would
            # count as a later waiter's and keep its credits from it.
            return
        self.used -= cost
        give = cost
        top = -math.inf
        if since is not None:
            top = self.level
            log = self._log
            if since < self.seq:
                if not log or log[0][0] > since + 1:
                    top = self.burst  # the takes since are forgotten: keep it all
                else:
                    for n, before in log:
                        if n > since and before > top:
                            top = before
        waiting = self._waiting
        if waiting:
            first = waiting[0]
            if since is not None or first[2] > 1:
                top = max(top, first[1])
            for i in range(1, len(waiting)):
                top = max(top, waiting[i][1])
        if top > -math.inf:
            give = max(0.0, min(cost, self.burst - top))
        if give:
            for entry in waiting:  # the levels they meet rise by what stays
                entry[1] += give
            if since is not None:  # and so did every level since the grant
                for record in self._log:
                    if record[0] > since:
                        record[1] += give
        self.level = min(self.burst, self.level + give)

    def _refund_waiting(
        self, cost: float, reservation: int, *, withdrawn: bool, now: float | None
    ) -> bool:
        """:meth:`refund` of the waiting reservation numbered ``reservation``: at most
        ``burst`` less the highest level a later waiter meets at its start (or one
        merged with it), and it leaves the waiting ones. False, refunding nothing,
        when it waits no more (it started)."""
        waiting = self._waiting
        for i, entry in enumerate(waiting):
            records = entry[3]
            for record in records:
                if record[0] == reservation:
                    break
            else:
                continue
            self.used -= cost
            top = entry[1] if entry[2] > 1 else -math.inf
            for later in itertools.islice(waiting, i + 1, None):
                top = max(top, later[1])
            give = cost if top == -math.inf else max(0.0, min(cost, self.burst - top))
            records.remove(record)
            if withdrawn and (now is None or entry[0] > now):
                # its caller left before its start: the level it would have met then
                # is no level the bucket held (a later grant's refund must not count
                # it); one that started (``since``, or a start at or before ``now``)
                # met it, and it stays
                record[1] = -math.inf
            entry[2] -= 1
            if not entry[2]:
                del waiting[i]
            if give:
                for later in itertools.islice(waiting, i, None):
                    later[1] += give  # the levels they meet rise by what stays
            self.level = min(self.burst, self.level + give)
            return True
        return False

    def _start(self, cost: float, now: float) -> float:
        # When a reservation of ``cost`` made now would start (the bucket refilled to now).
        need = min(cost, self.burst)
        level = self.level
        at = now if level >= need else now + (need - level) / self.rate
        if at < self._tail:
            at = self._tail  # behind the reservations made before (only after a refund)
        return at

    def wait_time(self, cost: float, now: float) -> float:
        """Seconds until a reservation of ``cost`` made now would start; takes nothing."""
        self._refill(now)
        return self._start(cost, now) - now

    def reserve(self, cost: float, now: float, latest: float) -> float | None:
        """Reserve ``cost`` and return when the caller may go (``now`` or later, and
        no earlier than any reservation made before), or None, taking nothing, when
        that would be after ``latest``."""
        self._refill(now)
        level = self.level
        at = self._start(cost, now)
        if at > latest:
            return None
        self.seq += 1
        record = [self.seq, self.level]
        if at > now:
            ahead = (at - now) * self.rate
            peak = level + ahead
            if peak > self.burst:  # pushed back by a refund: the overflow is lost
                level = self.burst - ahead
                peak = self.burst
            record[1] = peak
            waiting = self._waiting
            if len(waiting) >= _MERGE_AT:
                last = waiting[-1]
                last[0] = at
                last[1] = max(last[1], peak)
                last[2] += 1
                last[3].append(record)
            else:
                waiting.append([at, peak, 1, [record]])
            self._tail = at
        self._log.append(record)
        self.level = level - cost
        self.used += cost
        return at
