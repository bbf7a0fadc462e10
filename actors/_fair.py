"""Sans-IO multi-tenant queueing: priority classes with aging, weighted fair share
across tenants (virtual-time counting), admission with push-out and estimated-wait
shedding, an AIMD concurrency limit, and per-tenant token buckets.

Nothing here awaits or reads a clock: ``now`` is an argument. The scheduler actor
and the runtime's admission call these objects; tests and the fuzz suite drive
them directly. docs/scheduling.md explains the rules and the figures behind them.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from trioserve import DeadlineExceeded, Overloaded, QuotaExceeded, Request, RequestState

from ._batching import BatchBuilder, BatchLimits
from ._metrics import Latency

_QUEUED = RequestState.QUEUED


@attrs.frozen(kw_only=True)
class ClassSpec:
    """A request class as the queue sees it: its name and aging bound (seconds; a
    request queued longer is served as if in the top class)."""

    name: str
    aging: float = math.inf


@attrs.define(eq=False)
class FlowStats:
    """What happened to one (tenant, class) flow at one model's queue.

    ``admitted`` and ``shed`` count callers' requests only. ``hedged`` counts the
    copies of hedged requests the queue took (into free room only, see
    :meth:`FairQueue.offer_spare`); a copy refused, or giving its room back to a new
    request, is counted nowhere else. A copy that runs counts in ``dispatched`` and
    ``served_cost`` (its device time is its tenant's service), and one that expires
    queued in ``expired``; one withdrawn because its original answered first is not
    counted again.
    """

    admitted: int = 0
    shed: int = 0
    expired: int = 0
    dispatched: int = 0
    served_cost: int = 0
    hedged: int = 0
    #: Requests whose caller left while they were queued (withdrawn: they never ran;
    #: an HTTP client that closed its connection, a cancelled in-process call). One
    #: that left at its own deadline counts in ``expired`` instead.
    withdrawn: int = 0
    #: Entries the flow holds: a withdrawn or expired request stays among them until
    #: passed (see FairQueue.queued_by_flow for the live count).
    queued: int = 0
    wait: Latency = attrs.Factory(Latency)


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
    nothing goes back.
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

    def refund(self, cost: float, *, since: int | None = None) -> None:
        """Give back credits taken for a request that never ran: a reservation whose
        caller left while waiting, or (``since``: the grant's ``seq``) a request the
        queue refused or pushed out after its start. All of them, less what the
        bucket's history since and the reservations still waiting leave no room for
        (see the class)."""
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


class AimdLimit:
    """An adaptive bound on a model's queued requests (additive increase,
    multiplicative decrease), in the spirit of Netflix's concurrency-limits.

    A dispatched request that waited more than half of its time budget, or one that
    expired in the queue, is a congestion signal: the limit shrinks by ``backoff``
    (at most once per ``interval`` s). Otherwise each dispatched request adds
    1/limit, so the limit grows by about one per limit's worth of requests.
    """

    __slots__ = ("_last_cut", "backoff", "interval", "limit", "maximum", "minimum")

    def __init__(
        self, *, minimum: int, maximum: int, backoff: float = 0.9, interval: float = 0.05
    ) -> None:
        self.minimum = float(max(1, min(minimum, maximum)))
        self.maximum = float(maximum)
        self.limit = float(maximum)
        self.backoff = backoff
        self.interval = interval
        self._last_cut = -math.inf

    def on_dispatch(self, n: int, congested: bool, now: float) -> None:
        if congested:
            self.on_congestion(now)
        elif self.limit < self.maximum:
            self.limit = min(self.maximum, self.limit + n / self.limit)

    def on_congestion(self, now: float) -> None:
        if now - self._last_cut >= self.interval:
            self._last_cut = now
            self.limit = max(self.minimum, self.limit * self.backoff)

    @property
    def value(self) -> int:
        return int(self.limit)


class FairQueue:
    """A model's queue of (tenant, class) flows.

    - Between classes: strict priority, except that a request queued longer than its
      class's aging bound is taken first (earliest promotion first), so no class
      starves.
    - Within a class: the backlogged tenant with the least weighted service (cost
      served / weight) goes next; a tenant that becomes backlogged is lifted to the
      least counter among the backlogged ones (or to where service last was), so an
      idle tenant banks no credit (virtual-time counting, VTC).
    - FIFO within a flow. Batches close as :class:`FifoQueue`'s do (size, tokens,
      the oldest request's wait), and may mix tenants.
    - Admission (``offer``): at most ``min(bound, adaptive limit)`` requests queued.
      When full, a tenant below its weighted share of the queue pushes out the newest
      request of the tenant most over its share; otherwise the newcomer is shed. A
      tenant holding ``queue_share`` of the bound is shed (QuotaExceeded) while others
      wait. A request whose estimated time to be served (the cost ahead of it under
      these rules, and its own, ÷ the measured service rate) runs past its deadline is
      shed at once: it could not be answered in time.
    - Hedges (``offer_spare``): a copy of a hedged request takes only free room, and
      a new request that finds the queue full (or its tenant at its share) takes the
      room of the newest copy queued (answered Overloaded: its original still runs)
      before anyone is pushed out or refused.
    - Expiry: a request still queued at its deadline is answered DeadlineExceeded (or
      dropped, when the deadline was its caller's) and never dispatched.
    - Memory: a request that leaves (dispatched, answered, withdrawn, pushed out) stays
      in its class's arrival order and the expiry heap (a withdrawn one in its flow
      too) until it reaches their head, or until a quarter of their entries are dead
      and they are compacted (the arrival orders and the heap after each departure, the
      flows at the next offer). So each holds at most 4/3 of the live requests, plus
      one (the flows: of those at the last offer), at amortised O(1) per request.
    """

    def __init__(
        self,
        limits: BatchLimits,
        *,
        bound: int,
        classes: Iterable[ClassSpec] = (ClassSpec(name="default"),),
        weights: Mapping[str, float] | None = None,
        shares: Mapping[str, float] | None = None,
        model: str = "model",
        adaptive: bool = True,
        min_limit: int | None = None,
    ) -> None:
        self.limits = limits
        self.bound = bound
        self.model = model
        self.classes = tuple(classes)
        if not self.classes:
            raise ValueError("at least one class")
        self._rank = {c.name: i for i, c in enumerate(self.classes)}
        self._aging = [c.aging for c in self.classes]
        self.weights = dict(weights or {})
        self.shares = dict(shares or {})
        n = len(self.classes)
        # per class: tenant -> its FIFO deque (kept while it exists); backlogged ones;
        # weighted service counters; where service last was; all of the class in
        # arrival order (for aging and the oldest request; dead entries skipped lazily,
        # or dropped by _compact_arrivals).
        self._flows: list[dict[str, collections.deque[Request]]] = [{} for _ in range(n)]
        self._active: list[dict[str, collections.deque[Request]]] = [{} for _ in range(n)]
        self._vt: list[dict[str, float]] = [{} for _ in range(n)]
        self._floor = [0.0] * n
        self._arrivals: list[collections.deque[Request]] = [
            collections.deque() for _ in range(n)
        ]
        self._cost: list[dict[str, int]] = [{} for _ in range(n)]
        self._count = 0  # entries held in flow deques (withdrawn ones until skipped)
        self._total_cost = 0
        self._tenant_count: collections.Counter[str] = collections.Counter()
        # (deadline, seq, request) of requests answered on expiry; dead entries are
        # popped at the head or dropped by _compact_expiry
        self._expiry: list[tuple[float, int, Request]] = []
        self._seq = 0
        self.stats: dict[tuple[str, str], FlowStats] = {}
        self.limit = (
            AimdLimit(minimum=min_limit or 2 * limits.max_size, maximum=bound)
            if adaptive
            else None
        )
        #: measured service rate (cost units per second) while backlogged; 0: unknown
        self.rate = 0.0
        self._last_done = -math.inf
        self._prev_full = False
        self.in_service = 0  # cost dispatched and not yet completed
        self._capacity = bound
        self._dead = 0  # entries in flow deques no longer queued (withdrawn, answered)
        self._on_cancel = self._note_dead
        self._congested = False
        self.expired = 0
        #: hedge copies taken by offer_spare, oldest first (those no longer queued
        #: are dropped at the next offer_spare)
        self._copies: list[Request] = []

    # ------------------------------------------------------------ helpers
    def __len__(self) -> int:
        """Requests queued (live ones)."""
        return self._count - self._dead

    def _note_dead(self) -> None:
        self._dead += 1
        self._tidy()

    def __iter__(self) -> Iterator[Request]:
        for flows in self._flows:
            for q in flows.values():
                yield from q

    def queued_by_flow(self) -> dict[tuple[str, str], int]:
        """Live queued requests per (tenant, class), counted now: a withdrawn or
        expired request leaves its flow's deque (and ``FlowStats.queued``, which
        counts entries held) only when the flow's head or a compaction passes it.
        O(queued); for statistics, not the hot path."""
        out: dict[tuple[str, str], int] = {}
        for c, flows in enumerate(self._flows):
            name = self.classes[c].name
            for tenant, q in flows.items():
                n = sum(1 for r in q if r.reply.state is _QUEUED)
                if n:
                    out[tenant, name] = n
        return out

    def _stats(self, tenant: str, cls: str) -> FlowStats:
        key = (tenant, cls)
        s = self.stats.get(key)
        if s is None:
            s = self.stats[key] = FlowStats()
        return s

    def _weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def capacity(self) -> int:
        """How many requests may be queued now (the bound, or the adaptive limit)."""
        return self._capacity

    def _update_capacity(self) -> None:
        lim = self.limit
        self._capacity = min(self.bound, lim.value) if lim is not None else self.bound

    # ------------------------------------------------------------ admission
    def offer(self, request: Request, now: float) -> None:
        """Queue a request, or raise Overloaded / QuotaExceeded (nothing queued).

        May answer another tenant's newest queued request Overloaded to make room.
        """
        tenant = request.tenant
        c = self._rank.get(request.priority, len(self.classes) - 1)
        cname = self.classes[c].name
        stats = self._stats(tenant, cname)
        try:
            self._admit(request, tenant, c, now)
        except Overloaded:
            stats.shed += 1
            raise
        stats.admitted += 1
        stats.queued += 1
        flows = self._flows[c]
        q = flows.get(tenant)
        if q is None:
            q = flows[tenant] = collections.deque()
        active = self._active[c]
        if tenant not in active:
            vt = self._vt[c]
            floor = min(vt[u] for u in active) if active else self._floor[c]
            vt[tenant] = max(vt.get(tenant, 0.0), floor)
            active[tenant] = q
        q.append(request)
        request.reply.on_cancel = self._on_cancel
        self._arrivals[c].append(request)
        cost = self._cost[c]
        cost[tenant] = cost.get(tenant, 0) + request.cost
        self._total_cost += request.cost
        self._count += 1
        self._tenant_count[tenant] += 1
        if request.answer_expiry and request.deadline < math.inf:
            self._seq += 1
            heapq.heappush(self._expiry, (request.deadline, self._seq, request))

    def offer_spare(self, request: Request, now: float) -> bool:
        """Queue ``request``, a hedged request's copy, only if there is free room:
        the queue below its capacity, the tenant below its queue share, and the
        copy's estimated wait within its deadline. Returns False otherwise, having
        pushed nobody out and counted nothing (the caller simply does not hedge).

        A copy taken counts in its flow's ``hedged`` (not ``admitted``), and gives
        its room back to any new request that needs it (see ``_drop_copy``).
        """
        tenant = request.tenant
        c = self._rank.get(request.priority, len(self.classes) - 1)
        if self._count - self._dead >= self._capacity:
            return False
        if self._over_share(tenant) or self._too_late(request, tenant, c, now) is not None:
            return False
        # Queued as any request (``offer`` finds the room checked above: it neither
        # refuses nor pushes out), then counted apart.
        self.offer(request, now)
        stats = self._stats(tenant, self.classes[c].name)
        stats.admitted -= 1
        stats.hedged += 1
        copies = self._copies
        if copies:
            copies[:] = [r for r in copies if r.reply.state is _QUEUED]
        copies.append(request)
        return True

    def _drop_copy(self, tenant: str | None) -> bool:
        """Give the room of the newest queued hedge copy (of ``tenant``, or anyone's)
        to a new request: the copy leaves the queue, answered Overloaded (its
        original still runs or waits, so its caller waits on). False when none."""
        copies = self._copies
        for i in range(len(copies) - 1, -1, -1):
            req = copies[i]
            if req.reply.state is not _QUEUED or (tenant is not None and req.tenant != tenant):
                continue
            del copies[i]
            self._shed_copy(req)
            return True
        return False

    def _newest_copy(self, tenant: str | None, gone: set[int]) -> Request | None:
        """The copy ``_drop_copy(tenant)`` would drop were the requests in ``gone``
        (their ``id``) already out of the queue; takes nothing."""
        copies = self._copies
        for i in range(len(copies) - 1, -1, -1):
            req = copies[i]
            if (
                req.reply.state is _QUEUED
                and id(req) not in gone
                and (tenant is None or req.tenant == tenant)
            ):
                return req
        return None

    def _shed_copy(self, req: Request) -> None:
        """Take the queued hedge copy ``req`` (already out of ``_copies``) out of its
        flow and answer it Overloaded."""
        c = self._rank.get(req.priority, len(self.classes) - 1)
        q = self._flows[c][req.tenant]
        for j, r in enumerate(q):
            if r is req:
                del q[j]
                break
        self._forget(req, req.tenant, c)
        if not q:
            self._active[c].pop(req.tenant, None)
        req.reply.set_error(
            Overloaded(
                f"model {self.model!r}: a hedge copy gave its room in the queue to a "
                "new request",
                retry_after=self._retry_after(),
            )
        )
        self._tidy()

    def offer_all(self, requests: Sequence[Request], now: float) -> None:
        """Queue the requests of one call (one tenant and class), in order, or none of
        them.

        The whole call's admission is decided first, without touching the queue
        (``_plan_call``): item by item, as ``offer`` would decide each with the items
        before it queued. Only an admitted call then gives hedge copies' room away and
        pushes out other tenants' requests (exactly those ``offer`` would have, in the
        same order) and queues its items. A refused call sheds nobody and queues
        nothing: its replies are withdrawn, the whole call counts as shed, and the
        refusal of its first item refused is raised. The estimated wait of an item
        counts everything queued now, so also what the items before it (and it) would
        push out: like ``offer``'s, it errs on the side of refusing.

        An idle queue takes a whole call whatever the adaptive limit. The call is
        within the bound (the runtime checks that), and a call larger than the limit
        would otherwise be refused for as long as nothing else is dispatched, since
        only dispatches raise the limit.
        """
        n = len(requests)
        if not n:
            return
        first = requests[0]
        tenant, priority = first.tenant, first.priority
        c = self._rank.get(priority, len(self.classes) - 1)
        for r in requests:
            if r.tenant != tenant or (
                r.priority != priority and self._rank.get(r.priority, len(self.classes) - 1) != c
            ):
                raise ValueError(
                    f"model {self.model!r}: one call's requests are of one tenant and "
                    f"class; got {tenant!r}/{priority!r} and "
                    f"{r.tenant!r}/{r.priority!r}"
                )
        if n > self._capacity and self._count == self._dead:
            self._capacity = min(n, self.bound)
        try:
            try:
                leaving = self._plan_call(requests, tenant, c, now)
            except Overloaded:
                for request in requests:
                    request.reply.withdraw()  # never queued: only its caller sees it
                self._stats(tenant, self.classes[c].name).shed += n
                raise
            if not leaving:
                for request in requests:  # room for all: ``offer`` finds it
                    self.offer(request, now)
                return
            j = 0
            for i, request in enumerate(requests):
                while j < len(leaving) and leaving[j][0] == i:
                    _, req, k, copy = leaving[j]
                    j += 1
                    if copy:
                        self._copies[:] = [r for r in self._copies if r is not req]
                        self._shed_copy(req)
                    else:
                        self._push_out_request(req, k)
                # ``offer`` finds the room made above: it neither refuses nor pushes out
                self.offer(request, now)
        finally:
            self._update_capacity()

    def _plan_call(
        self, requests: Sequence[Request], tenant: str, c: int, now: float
    ) -> list[tuple[int, Request, int, bool]]:
        """What must leave the queue for the items of a call of ``tenant`` in class
        ``c`` to go in, as (the item's index, the request that leaves, its class,
        whether it is a hedge copy), in the order ``offer`` would shed them item by
        item; or the refusal ``offer`` would raise for the first item it refuses.
        Changes nothing but compacting dead entries."""
        n = len(requests)
        cap = self._capacity
        live = self._count - self._dead
        share = self.shares.get(tenant, 1.0)
        quota = max(1, int(share * self.bound)) if share < 1.0 else 0
        full = live + n > cap  # some item finds the queue full
        at_share = quota > 0 and self._tenant_count[tenant] + n > quota
        rate = self.rate
        ahead = self._total_cost + self.in_service  # for the cheap bound below
        if not (full or at_share) and (
            rate <= 0.0
            # cheap first: every item in time with the whole call and all queued ahead
            or now + (ahead + sum(r.cost for r in requests)) / rate
            <= min(r.deadline for r in requests)
        ):
            return []  # nothing leaves, no item is refused
        counts: collections.Counter[str] = collections.Counter()
        if full or at_share:
            if self._dead:
                self._compact()  # the share and push-out weigh live requests
            counts = collections.Counter(self._tenant_count)  # updated as items go in
        leaving: list[tuple[int, Request, int, bool]] = []
        gone: set[int] = set()  # id() of the requests in ``leaving``
        own = 0  # the call's cost up to and including the item
        for i, request in enumerate(requests):
            if at_share and counts[tenant] >= quota:
                copy = self._newest_copy(tenant, gone) if self._copies else None
                if copy is None:
                    raise self._quota_refusal(tenant, share)
                k = self._rank.get(copy.priority, len(self.classes) - 1)
                leaving.append((i, copy, k, True))
                gone.add(id(copy))
                counts[tenant] -= 1
                live -= 1
            own += request.cost
            deadline = request.deadline
            if (
                rate > 0.0
                and deadline < math.inf
                # cheap first: everything queued or running ahead of it (an upper bound)
                and now + (ahead + own) / rate > deadline
            ):
                if self._dead:
                    self._compact()  # the estimate must count live requests only
                wait = self.estimated_wait(tenant, c, own)
                if now + wait > deadline:
                    raise self._late_refusal(request, wait, now)
            if live >= cap:
                copy = self._newest_copy(None, gone) if self._copies else None
                if copy is not None:
                    k = self._rank.get(copy.priority, len(self.classes) - 1)
                    leaving.append((i, copy, k, True))
                    gone.add(id(copy))
                    counts[copy.tenant] -= 1
                else:
                    victim = self._victim(counts, tenant)
                    found = None if victim is None else self._newest_of(victim, gone)
                    if found is None:
                        raise self._full_refusal(live)
                    req, k = found
                    leaving.append((i, req, k, False))
                    gone.add(id(req))
                    counts[req.tenant] -= 1
                live -= 1
            live += 1
            counts[tenant] += 1
        return leaving

    def _newest_of(self, victim: str, gone: set[int]) -> tuple[Request, int] | None:
        """The request of ``victim`` that ``_push_out`` would take (its newest, from
        its lowest class that has one) were those in ``gone`` already out, with its
        class; takes nothing."""
        for c in range(len(self.classes) - 1, -1, -1):
            q = self._flows[c].get(victim)
            if q:
                for req in reversed(q):
                    if req.reply.state is _QUEUED and id(req) not in gone:
                        return req, c
        return None

    def _push_out_request(self, req: Request, c: int) -> None:
        """Push out ``req`` (queued in class ``c``), as ``_push_out`` does its pick."""
        q = self._flows[c][req.tenant]
        for j in range(len(q) - 1, -1, -1):
            if q[j] is req:
                del q[j]
                break
        self._forget(req, req.tenant, c)
        self._pushed_out(req, c)

    def note_shed(self, tenant: str, priority: str, n: int = 1) -> None:
        """Count ``n`` requests refused before they reached the queue (over the
        tenant's credits) as shed for their flow."""
        c = self._rank.get(priority, len(self.classes) - 1)
        self._stats(tenant, self.classes[c].name).shed += n

    def most_queued(self, tenant: str) -> int:
        """The most requests ``tenant`` may ever have queued here (its share of the
        bound)."""
        share = self.shares.get(tenant, 1.0)
        return self.bound if share >= 1.0 else max(1, int(share * self.bound))

    def _over_share(self, tenant: str) -> bool:
        """Whether ``tenant`` holds its ``queue_share`` of the bound (live requests)."""
        share = self.shares.get(tenant, 1.0)
        if share < 1.0 and self._tenant_count[tenant] >= max(1, int(share * self.bound)):
            if self._dead:
                self._compact()  # the tenant's count must be of live requests
            return self._tenant_count[tenant] >= max(1, int(share * self.bound))
        return False

    def _admit(self, request: Request, tenant: str, c: int, now: float) -> None:
        share = self.shares.get(tenant, 1.0)
        if (
            share < 1.0
            # cheap first: the count may still hold dead entries
            and self._tenant_count[tenant] >= max(1, int(share * self.bound))
            and self._over_share(tenant)
            and not (self._copies and self._drop_copy(tenant))
        ):
            raise self._quota_refusal(tenant, share)
        # Before any push-out: a request refused for its deadline must not have
        # shed another on its way (the estimate counts the one it would push out,
        # which errs on the side of refusing).
        rate = self.rate
        if (
            rate > 0.0
            # cheap first: everything queued or running ahead of it (an upper bound)
            and now + (self._total_cost + self.in_service + request.cost) / rate
            > request.deadline
            and (wait := self._too_late(request, tenant, c, now)) is not None
        ):
            raise self._late_refusal(request, wait, now)
        if self._dead * 4 > self._count:
            self._compact()
        if self._count - self._dead >= self._capacity and not (
            self._copies and self._drop_copy(None)
        ):
            if self._dead:
                self._compact()  # push-out weighs tenants' counts of live requests
            if not self._push_out(tenant):
                raise self._full_refusal(self._count - self._dead)

    def _quota_refusal(self, tenant: str, share: float) -> QuotaExceeded:
        return QuotaExceeded(
            f"model {self.model!r}: tenant {tenant!r} holds its queue share "
            f"({share:g} of {self.bound})",
            retry_after=self._retry_after(),
        )

    def _late_refusal(self, request: Request, wait: float, now: float) -> Overloaded:
        return Overloaded(
            f"model {self.model!r}: estimated time to serve it {wait * 1e3:.0f} ms "
            f"exceeds the request's deadline "
            f"({max(0.0, request.deadline - now) * 1e3:.0f} ms left)",
            retry_after=max(wait, 0.05),
        )

    def _full_refusal(self, waiting: int) -> Overloaded:
        return Overloaded(
            f"model {self.model!r}: queue full ({waiting} requests waiting)",
            retry_after=self._retry_after(),
        )

    def _too_late(self, request: Request, tenant: str, c: int, now: float) -> float | None:
        """The estimated wait of ``request`` if it runs past its deadline, else None."""
        rate = self.rate
        deadline = request.deadline
        if (
            rate > 0.0
            and deadline < math.inf
            # cheap first: everything queued or running ahead of it (an upper bound)
            and now + (self._total_cost + self.in_service + request.cost) / rate > deadline
        ):
            if self._dead:
                self._compact()  # the estimate must count live requests only
            wait = self.estimated_wait(tenant, c, request.cost)
            if now + wait > deadline:
                return wait
        return None

    def _compact(self) -> int:
        """Drop withdrawn and answered entries from every flow (otherwise they stay
        until their flow's head passes them); return how many. Runs when they are a
        quarter of the entries, so memory stays within 4/3 of the bound."""
        dropped = 0
        for c, flows in enumerate(self._flows):
            for tenant, q in list(flows.items()):
                if all(r.reply.state is _QUEUED for r in q):
                    continue
                alive = [r for r in q if r.reply.state is _QUEUED]
                for r in q:
                    if r.reply.state is not _QUEUED:
                        self._forget(r, tenant, c)
                        dropped += 1
                q.clear()
                q.extend(alive)
                if not q:
                    self._active[c].pop(tenant, None)
        self._compact_arrivals()
        return dropped

    def _tidy(self) -> None:
        """Called after requests leave (dispatched, pushed out, withdrawn, expired):
        they stay in the arrival orders and the expiry heap until they reach the head,
        so compact either once a quarter of its entries are dead. Each then holds at
        most 4/3 of the live requests, plus one, and a compaction of n entries follows
        at least n/4 departures (amortised O(1) each)."""
        live = self._count - self._dead
        held = sum(map(len, self._arrivals))
        if 4 * (held - live) > held:
            self._compact_arrivals()
        h = self._expiry
        # Requests mostly leave in deadline order (one timeout, first come first
        # served): their entries are at the top, and popping them costs less than
        # the compaction they would otherwise bring about.
        while h and h[0][2].reply.state is not _QUEUED:
            heapq.heappop(h)
        held = len(h)
        if 4 * (held - live) > held:  # its live entries are at most ``live``
            self._compact_expiry()

    def _compact_arrivals(self) -> None:
        """Drop the entries of requests no longer queued from the arrival orders."""
        for arrivals in self._arrivals:
            alive = [r for r in arrivals if r.reply.state is _QUEUED]
            arrivals.clear()
            arrivals.extend(alive)

    def _compact_expiry(self) -> None:
        """Drop the entries of requests no longer queued from the expiry heap."""
        h = self._expiry = [e for e in self._expiry if e[2].reply.state is _QUEUED]
        heapq.heapify(h)

    def _retry_after(self) -> float:
        if self.rate > 0.0:
            return max(0.05, (self._total_cost + self.in_service) / self.rate)
        return max(self.limits.max_wait, 0.05)

    def _push_out(self, tenant: str) -> bool:
        """Make room for ``tenant`` by shedding the newest request of the tenant most
        over its weighted share of the queue; False when ``tenant`` is itself at or
        over its share (or nobody is over theirs)."""
        victim = self._victim(self._tenant_count, tenant)
        if victim is None:
            return False
        # Its newest request, from its lowest class that has one.
        for c in range(len(self.classes) - 1, -1, -1):
            q = self._flows[c].get(victim)
            while q:
                req = q.pop()
                self._forget(req, victim, c)
                if req.reply.state is _QUEUED:
                    self._pushed_out(req, c)
                    return True
        return False

    def _victim(self, counts: collections.Counter[str], tenant: str) -> str | None:
        """The tenant whose newest request makes room for ``tenant`` when the queue
        holds ``counts`` (live requests per tenant): the one most over its weighted
        share; None when ``tenant`` is itself at or over its share, or nobody is over
        theirs. Takes nothing."""
        holders = [t for t, n in counts.items() if n > 0]
        if tenant not in holders:
            holders.append(tenant)
        total_w = sum(self._weight(t) for t in holders)
        cap = self._capacity

        def over(t: str) -> float:
            return counts[t] - cap * self._weight(t) / total_w

        if over(tenant) >= 0:
            return None
        victim = max(holders, key=over)
        if victim == tenant or over(victim) <= 0:
            return None
        return victim

    def _pushed_out(self, req: Request, c: int) -> None:
        """Answer ``req`` (class ``c``, out of its flow now) as pushed out."""
        req.reply.set_error(
            Overloaded(
                f"model {self.model!r}: pushed out of a full queue by another "
                "tenant's request (this tenant is over its share)",
                retry_after=self._retry_after(),
            )
        )
        self._stats(req.tenant, self.classes[c].name).shed += 1
        self._tidy()

    def estimated_wait(self, tenant: str, c: int, cost: int) -> float:
        """Seconds until a new request of ``cost`` from ``tenant`` in class ``c``
        would be served: the cost served before it under strict priority and weighted
        fair share, what the devices hold, and its own cost, over the service rate."""
        if self.rate <= 0.0:
            return 0.0
        ahead = float(self.in_service)
        for k in range(c):
            ahead += sum(self._cost[k].values())
        own = self._cost[c].get(tenant, 0) + cost
        ahead += own
        w = self._weight(tenant)
        for u, q in self._cost[c].items():
            if u != tenant and q:
                ahead += min(q, own * self._weight(u) / w)
        return ahead / self.rate

    def queued_cost(self) -> int:
        """Cost units queued (withdrawn requests included until they are skipped)."""
        return self._total_cost

    # ------------------------------------------------------------ bookkeeping
    def _forget(self, req: Request, tenant: str, c: int) -> None:
        """``req`` has left its flow deque."""
        if req.reply.state is not _QUEUED:
            self._dead -= 1
        self._count -= 1
        self._tenant_count[tenant] -= 1
        self._cost[c][tenant] -= req.cost
        self._total_cost -= req.cost
        self._stats(tenant, self.classes[c].name).queued -= 1

    def withdrawn_by_caller(self, request: Request) -> None:
        """``request``'s caller withdrew it, queued, before its deadline: count it in
        its flow's ``withdrawn``."""
        c = self._rank.get(request.priority, len(self.classes) - 1)
        self._stats(request.tenant, self.classes[c].name).withdrawn += 1

    def withdrawn_at_deadline(self, request: Request, now: float) -> None:
        """``request``'s caller withdrew it, queued, because its own deadline passed
        (its cancel scope fired before the queue passed it): count it expired, a
        congestion signal, as the queue's own expiries are."""
        c = self._rank.get(request.priority, len(self.classes) - 1)
        self.expired += 1
        self._stats(request.tenant, self.classes[c].name).expired += 1
        if self.limit is not None:
            self.limit.on_congestion(now)
            self._update_capacity()

    def _expired(self, request: Request, c: int, now: float, *, in_flow: bool = False) -> None:
        """Answer (or, for a caller's deadline, withdraw) an expired request;
        ``in_flow`` when it is still in its flow's deque (it becomes a dead entry)."""
        request.reply.on_cancel = None
        if in_flow:
            self._dead += 1
        self.expired += 1
        self._stats(request.tenant, self.classes[c].name).expired += 1
        if self.limit is not None:
            self.limit.on_congestion(now)
            self._update_capacity()
        if request.answer_expiry:
            request.reply.set_error(
                DeadlineExceeded(
                    f"model {self.model!r}: deadline passed after "
                    f"{request.deadline - request.arrival:.3f}s in the queue",
                    in_queue=True,
                )
            )
        else:
            # The caller's own deadline: its cancel scope fires now; the request is
            # withdrawn here so that no copy of it counts as queued.
            request.reply.withdraw()

    def _head(self, tenant: str, c: int, now: float) -> Request | None:
        """The first live request of a flow, dropping dead and expired ones before it;
        deactivates the flow when it empties."""
        q = self._flows[c][tenant]
        while q:
            req = q[0]
            if req.reply.state is not _QUEUED:
                q.popleft()
                self._forget(req, tenant, c)
            elif req.deadline <= now:
                q.popleft()
                self._forget(req, tenant, c)
                self._expired(req, c, now)
            else:
                return req
        self._active[c].pop(tenant, None)
        return None

    def _oldest_in(self, c: int, now: float) -> Request | None:
        arrivals = self._arrivals[c]
        while arrivals:
            req = arrivals[0]
            if req.reply.state is _QUEUED:
                if req.deadline > now:
                    return req
                self._expired(req, c, now, in_flow=True)  # its flow drops it lazily
            arrivals.popleft()
        return None

    def _peek_aged(self, now: float) -> tuple[Request, int] | None:
        """The aged request to take next (earliest promotion first), if any."""
        best: tuple[float, Request, int] | None = None
        aging = self._aging
        for c in range(1, len(self.classes)):
            if not self._active[c]:
                continue
            req = self._oldest_in(c, now)
            if req is not None:
                at = req.arrival + aging[c]
                if at <= now and (best is None or at < best[0]):
                    best = (at, req, c)
        if best is None:
            return None
        _, req, c = best
        # The oldest live request of a class heads its flow once the dead entries
        # before it are dropped, which _head does.
        if self._head(req.tenant, c, now) is not req:  # pragma: no cover - invariant
            raise AssertionError("the oldest request of a class is not its flow's head")
        return req, c

    def _pick_flow(self, now: float) -> tuple[int, str, collections.deque[Request], float] | None:
        """The flow served next by priority and fair share: (class, tenant, its deque,
        the least counter among the other backlogged tenants of that class)."""
        for c in range(len(self.classes)):
            active = self._active[c]
            while active:
                if len(active) == 1:
                    tenant = next(iter(active))
                    bound = math.inf
                else:
                    vt = self._vt[c]
                    tenant, bound = "", math.inf
                    best = math.inf
                    for t in active:
                        v = vt[t]
                        if v < best:
                            tenant, bound, best = t, best, v
                        elif v < bound:
                            bound = v
                if self._head(tenant, c, now) is not None:
                    return c, tenant, self._flows[c][tenant], bound
        return None

    def _take(self, req: Request, c: int, now: float) -> None:
        """Dispatch ``req``, the head of its flow."""
        tenant = req.tenant
        q = self._flows[c][tenant]
        q.popleft()
        self._forget(req, tenant, c)
        vt = self._vt[c]
        vt[tenant] += req.cost / self._weight(tenant)
        self._floor[c] = vt[tenant]
        if not q:
            self._active[c].pop(tenant, None)
        s = self._stats(tenant, self.classes[c].name)
        s.dispatched += 1
        s.served_cost += req.cost
        s.wait.record(now - req.arrival)
        req.reply.dispatch()

    def _run(
        self,
        c: int,
        tenant: str,
        q: collections.deque[Request],
        bound: float,
        now: float,
        builder: BatchBuilder,
        taken: list[Request],
    ) -> bool:
        """Take from one flow while it stays the least served (its counter below
        ``bound``) and the batch has room; return True when the batch closed."""
        lim = self.limits
        vt = self._vt[c]
        v = vt[tenant]
        w = self._weight(tenant)
        stats = self._stats(tenant, self.classes[c].name)
        record = stats.wait.record
        n = cost_sum = 0
        closed = False
        congested = False
        while q:
            req = q[0]
            if req.reply.state is not _QUEUED:
                q.popleft()
                self._forget(req, tenant, c)
                continue
            if req.deadline <= now:
                q.popleft()
                self._forget(req, tenant, c)
                self._expired(req, c, now)
                continue
            cost = req.cost
            if builder.count == 0 and lim.oversize_cost(cost):
                closed = True  # an oversize request runs alone
            elif not builder.fits(cost):
                closed = True
                break
            q.popleft()
            builder.add(cost)
            taken.append(req)
            req.reply.dispatch()
            record(now - req.arrival)
            n += 1
            cost_sum += cost
            v += cost / w
            if 2 * (now - req.arrival) > req.deadline - req.arrival:
                congested = True
            if closed or builder.count >= lim.max_size:
                closed = True
                break
            if v >= bound:
                break
        vt[tenant] = v
        self._floor[c] = v  # where service is now: a newcomer to an idle class starts here
        self._count -= n
        self._tenant_count[tenant] -= n
        self._cost[c][tenant] -= cost_sum
        self._total_cost -= cost_sum
        stats.queued -= n
        stats.dispatched += n
        stats.served_cost += cost_sum
        if not q:
            self._active[c].pop(tenant, None)
        if congested:
            self._congested = True
        return closed

    # ------------------------------------------------------------ batches
    def _oldest(self, now: float) -> Request | None:
        best = None
        for c in range(len(self.classes)):
            if self._active[c]:
                req = self._oldest_in(c, now)
                if req is not None and (best is None or req.arrival < best.arrival):
                    best = req
        return best

    def next_batch(self, now: float) -> list[Request] | None:
        """A closed batch (each request moved to DISPATCHED), or None when none has
        closed yet; see ``next_close_time``."""
        batch = self._next_batch(now)
        self._tidy()  # what it dispatched or found expired left the queue
        return batch

    def _next_batch(self, now: float) -> list[Request] | None:
        oldest = self._oldest(now)
        if oldest is None:
            return None
        lim = self.limits
        timed_out = now >= oldest.arrival + lim.max_wait
        if not timed_out and not self._can_close():
            return None
        builder = BatchBuilder(lim)
        taken: list[Request] = []
        self._congested = False
        aged = len(self.classes) > 1
        closed = False
        while not closed:
            if aged:
                picked = self._peek_aged(now)
                if picked is None:
                    aged = False  # nothing more ages at this ``now``
                    continue
                req, c = picked
                alone = builder.count == 0 and lim.oversize_cost(req.cost)
                if not alone and not builder.fits(req.cost):
                    break
                self._take(req, c, now)
                builder.add(req.cost)
                taken.append(req)
                if 2 * (now - req.arrival) > req.deadline - req.arrival:
                    self._congested = True
                closed = alone or builder.count >= lim.max_size
                continue
            flow = self._pick_flow(now)
            if flow is None:
                break
            closed = self._run(*flow, now, builder, taken)
        if not taken:
            return None
        self.in_service += sum(r.cost for r in taken)
        if self.limit is not None:
            self.limit.on_dispatch(len(taken), self._congested, now)
            self._update_capacity()
        return taken

    def _can_close(self) -> bool:
        """Whether the live queued requests would fill a batch (on size or tokens:
        a batch whose cost reaches the budget exactly is full, as no request costs
        nothing) before any timeout: then the greedy pick in fair order closes it.
        Walks at most ``max_size`` live entries."""
        lim = self.limits
        if self._count < lim.max_size and lim.max_tokens is None:
            return False
        budget = lim.max_tokens
        padded = lim.padded
        n = total = longest = 0
        for flows in self._flows:
            for q in flows.values():
                for req in q:
                    if req.reply.state is not _QUEUED:
                        continue
                    n += 1
                    if n >= lim.max_size:
                        return True
                    if budget is not None:
                        total += req.cost
                        longest = max(longest, req.cost)
                        if (n * longest if padded else total) >= budget:
                            return True
        return False

    def completed(self, batch: list[Request], now: float, *, failed: bool = False) -> None:
        """A dispatched batch finished: answered, or ``failed`` (handed back for retry,
        or answered with errors). Two full batches answered in a row (closed on size
        or tokens: the queue was backlogged) make a service-rate sample: the second
        one's cost over the time between their completions."""
        cost = sum(r.cost for r in batch)
        self.in_service = max(0, self.in_service - cost)
        if failed:
            self._prev_full = False
            return
        lim = self.limits
        full = len(batch) >= lim.max_size or (
            lim.max_tokens is not None and 2 * cost > lim.max_tokens
        )
        if full and self._prev_full and now > self._last_done:
            sample = cost / (now - self._last_done)
            self.rate = sample if self.rate <= 0.0 else 0.9 * self.rate + 0.1 * sample
        self._prev_full = full
        self._last_done = now

    def next_close_time(self) -> float:
        """When the oldest queued request has waited ``max_wait`` (inf when empty)."""
        best = math.inf
        for c in range(len(self.classes)):
            for req in self._arrivals[c]:
                if req.reply.state is _QUEUED:
                    best = min(best, req.arrival + self.limits.max_wait)
                    break
        return best

    # ------------------------------------------------------------ expiry, shutdown
    def expire(self, now: float) -> int:
        """Answer every queued request whose model deadline has passed; return how many."""
        h = self._expiry
        n = 0
        while h and (h[0][2].reply.state is not _QUEUED or h[0][0] <= now):
            _, _, req = heapq.heappop(h)
            if req.reply.state is _QUEUED:
                c = self._rank.get(req.priority, len(self.classes) - 1)
                self._expired(req, c, now, in_flow=True)
                n += 1
        if n:
            self._tidy()
        return n  # answered entries leave their deques lazily

    def next_expiry(self) -> float:
        h = self._expiry
        while h and h[0][2].reply.state is not _QUEUED:
            heapq.heappop(h)
        return h[0][0] if h else math.inf

    def drain(self) -> list[Request]:
        """Remove and return every still-queued request (for shutdown)."""
        alive = [r for r in self if r.reply.state is _QUEUED]
        n = len(self.classes)
        self._flows = [{} for _ in range(n)]
        self._active = [{} for _ in range(n)]
        self._arrivals = [collections.deque() for _ in range(n)]
        self._cost = [{} for _ in range(n)]
        self._count = 0
        self._dead = 0
        self._total_cost = 0
        self._tenant_count.clear()
        self._expiry.clear()
        self._copies = []
        for s in self.stats.values():
            s.queued = 0
        return alive

    # ------------------------------------------------------------ observation
    def service(self, cls: str | None = None) -> dict[str, int]:
        """Cost served per tenant (in one class, or all)."""
        out: collections.Counter[str] = collections.Counter()
        for (tenant, c), s in self.stats.items():
            if cls is None or c == cls:
                out[tenant] += s.served_cost
        return dict(out)
