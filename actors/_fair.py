"""Sans-IO multi-tenant queueing: a model's queue of (tenant, class) flows, with
priority classes and aging, weighted fair share across tenants (virtual-time
counting), batches, expiry and the queue's memory bookkeeping.

This module holds :class:`FairQueue` itself and its dispatch side: flow picking
(priority, aging, fair share), batches and the service rate. Admission (push-out,
queue shares, estimated-wait shedding, hedge copies, calls all or none, the adaptive
limit) is the :class:`~._admission.Admission` half of ``FairQueue``, in
``_admission.py``; the flows' statistics (:class:`~._fair_books.FlowStats`), the
memory bookkeeping, expiry and ``drain`` are the :class:`~._fair_books.FlowBooks`
half, in ``_fair_books.py``; per-tenant credits are in ``_credits.py``.

Nothing here awaits or reads a clock: ``now`` is an argument. The scheduler actor
and the runtime's admission call these objects; tests and the fuzz suite drive
them directly. docs/scheduling.md explains the rules and the figures behind them.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Iterator, Mapping

from trioserve import Request, RequestState

from ._admission import Admission, AimdLimit
from ._batching import BatchBuilder, BatchLimits
from ._fair_books import ClassSpec, FlowBooks
from ._fair_books import FlowStats as FlowStats
from ._vtime import REBASE_AT, rebase

_QUEUED = RequestState.QUEUED


class FairQueue(FlowBooks, Admission):
    """A model's queue of (tenant, class) flows.

    - Between classes: strict priority, with aging. A request queued longer than its
      class's aging bound is *aged*. While aged requests and others (the top class,
      or lower ones not yet aged) both wait, the two groups share the service half
      and half by cost: a counter carried across batches holds the aged group's cost
      served less the others', counted only while both wait (0 again as soon as one
      is served alone, so neither banks credit); the aged group goes next when it is
      <= 0, earliest promotion first, the others otherwise, in strict priority. So
      no class starves, the top one included: under any backlog of aged requests
      the top class keeps half the service, and an aged request is served.
    - Within a class: the backlogged tenant with the least weighted service (cost
      served / weight) goes next; a tenant that becomes backlogged is lifted to the
      least counter among the backlogged ones (or to the most any counter reached), so an
      idle tenant banks no credit (virtual-time counting, VTC). A class's counters
      are rebased (all moved down by one amount, see ``_vtime.rebase``) once one of
      them reaches ``REBASE_AT``, so that they never grow past the precision of the
      increments; that changes no decision.
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
      before anyone is pushed out or refused; a request refused for its estimated
      wait takes no copy's room.
    - Expiry: a request still queued at its deadline is answered DeadlineExceeded (or
      dropped, when the deadline was its caller's) and never dispatched.
    - Memory: a request that leaves (dispatched, answered, withdrawn, pushed out) stays
      in its class's arrival order and the expiry heap (a withdrawn one in its flow
      too) until it reaches their head, or until a quarter of their entries are dead
      and they are compacted (the arrival orders and the heap after each departure, the
      flows at the next offer). So each holds at most 4/3 of the live requests, plus
      one (the flows: of those at the last offer), at amortised O(1) per request.
    """

    #: A class's fair-share counters are rebased once one of them reaches this.
    REBASE_AT: float = REBASE_AT

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
        # weighted service counters; the most service a counter reached; all of the class in
        # arrival order (for aging and the oldest request; dead entries skipped lazily,
        # or dropped by _compact_arrivals).
        self._flows: list[dict[str, collections.deque[Request]]] = [{} for _ in range(n)]
        self._active: list[dict[str, collections.deque[Request]]] = [{} for _ in range(n)]
        self._vt: list[dict[str, float]] = [{} for _ in range(n)]
        self._floor = [0.0] * n
        self._rebase_at = [self.REBASE_AT] * n  # per class: see _rebase
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
        #: the shortest run of a batch answered (seconds; 0: none yet): no request is
        #: answered sooner, whatever the rate says (it leaves out a batch's fixed time)
        self.batch_time = 0.0
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
        #: the aged requests' cost served less the other requests' while both groups
        #: waited (see _next_batch); reset to 0 by a request taken while one is empty
        self._aged_lead = 0

    # ------------------------------------------------------------ helpers
    def __len__(self) -> int:
        """Requests queued (live ones)."""
        return self._count - self._dead

    def __iter__(self) -> Iterator[Request]:
        for flows in self._flows:
            for q in flows.values():
                yield from q

    def _weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def capacity(self) -> int:
        """How many requests may be queued now (the bound, or the adaptive limit)."""
        return self._capacity

    def _update_capacity(self) -> None:
        lim = self.limit
        self._capacity = min(self.bound, lim.value) if lim is not None else self.bound

    def set_min_limit(self, minimum: int) -> None:
        """The adaptive limit's floor, as the replicas change (``AimdLimit``)."""
        if self.limit is not None:
            self.limit.set_minimum(minimum)
            self._update_capacity()

    def queued_cost(self) -> int:
        """Cost units queued (withdrawn requests included until they are skipped)."""
        return self._total_cost

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

    def _pick_rest(self, now: float) -> tuple[int, str, collections.deque[Request]] | None:
        """While aged requests wait: the flow whose head the other group serves next,
        (class, tenant, its deque), among the flows whose head has not aged (a flow
        whose head has aged is the aged group's, FIFO holding the rest of it behind
        that head): strict priority, then the least weighted service. None when no
        such flow waits."""
        aging = self._aging
        for c in range(len(self.classes)):
            active = self._active[c]
            if not active:
                continue
            vt = self._vt[c]
            best: str | None = None
            least = math.inf
            for tenant in list(active):  # _head deactivates a flow it finds empty
                head = self._head(tenant, c, now)
                if head is None or (c and head.arrival + aging[c] <= now):
                    continue
                v = vt[tenant]
                if best is None or v < least:
                    best, least = tenant, v
            if best is not None:
                return c, best, self._flows[c][best]
        return None

    def _take(self, req: Request, c: int, now: float) -> None:
        """Dispatch ``req``, the head of its flow."""
        tenant = req.tenant
        q = self._flows[c][tenant]
        q.popleft()
        self._forget(req, tenant, c)
        vt = self._vt[c]
        v = vt[tenant] = vt[tenant] + req.cost / self._weight(tenant)
        if v > self._floor[c]:
            self._floor[c] = v
        if v >= self._rebase_at[c]:
            self._rebase(c)
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
        # The most service any counter reached (never lowered: every counter stays at
        # or below it): a newcomer to an idle class starts here, so the least counter
        # never goes back (docs/scheduling.md, "Within a class").
        if v > self._floor[c]:
            self._floor[c] = v
        if v >= self._rebase_at[c]:
            self._rebase(c)
        self._count -= n
        self._tenant_count[tenant] -= n
        self._cost[c][tenant] -= cost_sum
        self._total_cost -= cost_sum
        if n:  # the waits of the n requests taken here, the last of ``taken``
            stats.wait.record_many([now - r.arrival for r in taken[len(taken) - n:]])
        stats.queued -= n
        stats.dispatched += n
        stats.served_cost += cost_sum
        if not q:
            self._active[c].pop(tenant, None)
        if congested:
            self._congested = True
        return closed

    def _rebase(self, c: int) -> None:
        """Move class ``c``'s fair-share counters down (``_vtime.rebase``): every
        comparison between them gives what it gave before."""
        self._floor[c], self._rebase_at[c] = rebase(
            self._vt[c], self._active[c], self._floor[c], self.REBASE_AT
        )

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
        # While aged requests and others both wait, each request taken is decided by
        # ``_aged_lead`` (the aged group's cost served less the others', carried
        # across batches): the aged group's turn when it is <= 0, the others'
        # otherwise. A request taken while one group is empty resets it to 0. It is
        # changed only by a request taken, never by a pick that closes the batch.
        while not closed:
            if aged:
                picked = self._peek_aged(now)
                if picked is None:
                    aged = False  # nothing more ages at this ``now``
                    continue
                rest = self._pick_rest(now)
                if rest is not None and self._aged_lead > 0:
                    n = len(taken)
                    closed = self._run(*rest, -math.inf, now, builder, taken)  # one request
                    if len(taken) > n:
                        self._aged_lead -= taken[-1].cost
                    continue
                req, c = picked
                alone = builder.count == 0 and lim.oversize_cost(req.cost)
                if not alone and not builder.fits(req.cost):
                    break
                self._take(req, c, now)
                builder.add(req.cost)
                taken.append(req)
                self._aged_lead = 0 if rest is None else self._aged_lead + req.cost
                if 2 * (now - req.arrival) > req.deadline - req.arrival:
                    self._congested = True
                closed = alone or builder.count >= lim.max_size
                continue
            flow = self._pick_flow(now)
            if flow is None:
                break
            n = len(taken)
            closed = self._run(*flow, now, builder, taken)
            if len(taken) > n:
                self._aged_lead = 0  # no aged request waits
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
        one's cost over the time since the first completed, or since the second
        started (its requests' ``reply.run``) when the device was idle in between,
        so that idle time between bursts is not counted as service time."""
        cost = sum(r.cost for r in batch)
        self.in_service = max(0, self.in_service - cost)
        if failed:
            self._prev_full = False
            return
        lim = self.limits
        full = len(batch) >= lim.max_size or (
            lim.max_tokens is not None and 2 * cost > lim.max_tokens
        )
        since = self._last_done
        run = batch[0].reply.run if batch else None
        if run is not None and run[1] > 0.0:
            self.batch_time = (
                run[1] if self.batch_time <= 0.0 else min(self.batch_time, run[1])
            )
        if run is not None and run[0] > since:
            since = run[0]  # it started on an idle device
        if full and self._prev_full and now > since:
            sample = cost / (now - since)
            self.rate = sample if self.rate <= 0.0 else 0.9 * self.rate + 0.1 * sample
        self._prev_full = full
        self._last_done = now

    def left(self, requests: list[Request]) -> None:
        """Dispatched ``requests`` left the devices without running as a batch (a
        hedge twin kept apart for another replica, dropped): their cost is no longer
        in service. Not a batch, so the service rate's measurement (the pair of full
        batches in a row) is left as it was."""
        self.in_service = max(0, self.in_service - sum(r.cost for r in requests))

    def next_close_time(self) -> float:
        """When the oldest queued request has waited ``max_wait`` (inf when empty)."""
        best = math.inf
        for c in range(len(self.classes)):
            for req in self._arrivals[c]:
                if req.reply.state is _QUEUED:
                    best = min(best, req.arrival + self.limits.max_wait)
                    break
        return best
