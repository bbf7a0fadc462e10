"""Admission to a model's queue (the :class:`Admission` half of ``FairQueue``):
single requests (``offer``), the items of one call all or none (``offer_all``), hedge
copies into free room only (``offer_spare``), push-out of the tenant most over its
share, queue shares, refusal on the estimated wait, and the adaptive limit on what
may be queued (:class:`AimdLimit`).

Every refusal is decided before any side effect: a request or call the queue refuses
pushes nobody out. Nothing here awaits or reads a clock: ``now`` is an argument.
docs/scheduling.md ("A request's way in") gives the rules.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

import attrs
from trioserve import Overloaded, QuotaExceeded, Request, RequestState

if TYPE_CHECKING:
    from ._batching import BatchLimits
    from ._fair_books import ClassSpec, FlowStats

_QUEUED = RequestState.QUEUED
#: No request left the queue (``gone`` for a look-up that plans nothing).
_NOBODY: frozenset[int] = frozenset()


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

    def set_minimum(self, minimum: int) -> None:
        """Move the floor (a model's replicas changed: two full batches each); the
        limit rises to a floor above it."""
        self.minimum = float(max(1, min(minimum, self.maximum)))
        self.limit = max(self.limit, self.minimum)

    @property
    def value(self) -> int:
        return int(self.limit)


@attrs.frozen(kw_only=True)
class CallPlan:
    """A call's admission to one queue, decided by ``FairQueue.plan_all`` for its
    ``offer_planned``: what must leave the queue for the items to go in, as (the
    item's index, the request that leaves, its class, whether it is a hedge copy),
    and the capacity the items are counted against (an idle queue's may exceed the
    adaptive limit)."""

    queue: Admission = attrs.field(eq=False, repr=False)
    requests: Sequence[Request] = attrs.field(eq=False)
    leaving: Sequence[tuple[int, Request, int, bool]] = attrs.field(eq=False)
    capacity: int


class Admission:
    """The admission methods of :class:`~trioserve.actors.FairQueue`, over the queue's
    state (set up by ``FairQueue.__init__``; the dispatch side, expiry and the memory
    bookkeeping are in ``_fair.py`` and ``_fair_books.py``). Not used on its own."""

    if TYPE_CHECKING:
        limits: BatchLimits
        bound: int
        model: str
        classes: tuple[ClassSpec, ...]
        shares: dict[str, float]
        rate: float
        in_service: int
        limit: AimdLimit | None
        _rank: dict[str, int]
        _flows: list[dict[str, collections.deque[Request]]]
        _active: list[dict[str, collections.deque[Request]]]
        _vt: list[dict[str, float]]
        _floor: list[float]
        _arrivals: list[collections.deque[Request]]
        _cost: list[dict[str, int]]
        _count: int
        _dead: int
        _total_cost: int
        _tenant_count: collections.Counter[str]
        _expiry: list[tuple[float, int, Request]]
        _seq: int
        _capacity: int
        _copies: list[Request]
        _on_cancel: object

        def _stats(self, tenant: str, cls: str) -> FlowStats: ...
        def _weight(self, tenant: str) -> float: ...
        def _update_capacity(self) -> None: ...
        def _forget(self, req: Request, tenant: str, c: int) -> None: ...
        def _compact(self) -> int: ...
        def _tidy(self) -> None: ...

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
        q = self._flow_in(c, tenant)
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
        its room back to any new request that needs it (see ``_drop_copy``; counted
        then in ``gave_way``).
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

    def _newest_copy(self, tenant: str | None, gone: AbstractSet[int]) -> Request | None:
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
        self._stats(req.tenant, self.classes[c].name).gave_way += 1
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
        (``plan_all``): item by item, as ``offer`` would decide each with the items
        before it queued. Only an admitted call then gives hedge copies' room away and
        pushes out other tenants' requests (exactly those ``offer`` would have, in the
        same order) and queues its items (``offer_planned``). A refused call sheds
        nobody and queues nothing: its replies are withdrawn, the whole call counts as
        shed, and the refusal of its first item refused is raised. The estimated wait
        of an item is ``offer``'s with the items before it queued: it counts them (in
        their class: below the top one, in the backlog that aging shares with the top
        class), not the requests they push out, and still the one the item itself
        pushes out.

        An idle queue takes a whole call whatever the adaptive limit. The call is
        within the bound (the runtime checks that), and a call larger than the limit
        would otherwise be refused for as long as nothing else is dispatched, since
        only dispatches raise the limit.
        """
        if not requests:
            return
        try:
            plan = self.plan_all(requests, now)
        except Overloaded:
            for request in requests:
                request.reply.withdraw()  # never queued: only its caller sees it
            first = requests[0]
            self.note_shed(first.tenant, first.priority, len(requests))
            raise
        self.offer_planned(plan, now)

    def plan_all(self, requests: Sequence[Request], now: float) -> CallPlan:
        """Decide the admission of the requests of one call (one tenant and class), as
        ``offer_all`` does, without queueing them: return the plan for
        ``offer_planned``, or raise the refusal of the first item refused
        (Overloaded, QuotaExceeded), having changed nothing and counted nothing (the
        caller withdraws the replies and counts the call shed, see ``note_shed``).
        ValueError for requests of several tenants or classes.

        The plan holds only while the queue is unchanged: apply it before anything
        else offers to, dispatches from or expires in this queue. So the items of one
        call split between several queues are admitted all or none, and only then
        push anyone out: plan in each queue, then apply every plan.
        """
        n = len(requests)
        if not n:
            return CallPlan(queue=self, requests=requests, leaving=(), capacity=self._capacity)
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
            leaving = self._plan_call(requests, tenant, c, now)
            return CallPlan(
                queue=self, requests=requests, leaving=leaving, capacity=self._capacity
            )
        finally:
            self._update_capacity()

    def offer_planned(self, plan: CallPlan, now: float) -> None:
        """Queue a call as ``plan_all`` planned it, with the queue unchanged since:
        give the hedge copies' room away and push out the requests the plan names,
        in its order, and queue the items. Never refuses."""
        if plan.queue is not self:
            raise ValueError(f"model {self.model!r}: a plan made for another queue")
        requests = plan.requests
        leaving = plan.leaving
        self._capacity = plan.capacity
        try:
            if not leaving:  # room for all: ``offer`` finds it
                if not self._offer_call(requests, now):
                    for request in requests:
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
                # ``offer`` finds the room made above: it neither refuses nor pushes
                # out. In a queue over its capacity (the adaptive limit lowered after
                # its requests were queued) one push-out leaves it as full as it was,
                # as ``offer`` leaves it too; finding it full, ``offer`` would push out
                # one more: the request the plan names for a later item.
                self._capacity = max(self._capacity, self._count - self._dead + 1)
                self.offer(request, now)
        finally:
            self._update_capacity()

    def _flow_in(self, c: int, tenant: str) -> collections.deque[Request]:
        """``tenant``'s flow in class ``c``, made backlogged: a tenant that was not
        is lifted to the least counter among those that are (or to where service
        last was), so an idle tenant banks no credit."""
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
        return q

    def _offer_call(self, requests: Sequence[Request], now: float) -> bool:
        """``offer`` for each of the requests of one call (one tenant and class, as
        ``plan_all`` checked), in order, in one pass: the same checks and effects,
        and the same refusal at the same item, with what is the same for every item
        (its flow, its class, its statistics, the share and the room) looked up
        once. Only where the queue has room for all of them and the tenant has no
        queue share: there ``_admit`` can refuse an item only for its estimated
        wait, a check that stays per item. Returns False, having done nothing,
        otherwise (the caller offers the items one by one)."""
        first = requests[0]
        tenant = first.tenant
        n = len(requests)
        if (
            self.shares.get(tenant, 1.0) < 1.0
            or self._count - self._dead + n > self._capacity
        ):
            return False
        # The room checked above holds for every item (``offer`` adds one live
        # request each, and nothing here makes one leave), so ``_admit`` would
        # neither push out, give a hedge copy's room away, nor refuse for room.
        c = self._rank.get(first.priority, len(self.classes) - 1)
        stats = self._stats(tenant, self.classes[c].name)
        rate = self.rate
        in_service = self.in_service
        batch_time = self.batch_time
        on_cancel = self._on_cancel
        arrivals = self._arrivals[c]
        cost = self._cost[c]
        done = 0
        try:
            for request in requests:
                rc = request.cost
                deadline = request.deadline
                if (
                    rate > 0.0
                    # cheap first, as in ``_admit``
                    and now + max((self._total_cost + in_service + rc) / rate, batch_time)
                    > deadline
                    and (wait := self._too_late(request, tenant, c, now)) is not None
                ):
                    stats.shed += 1
                    raise self._late_refusal(request, wait, now)
                if self._dead * 4 > self._count:
                    self._compact()
                if not done:
                    q = self._flow_in(c, tenant)
                    cost.setdefault(tenant, 0)
                q.append(request)
                request.reply.on_cancel = on_cancel
                arrivals.append(request)
                cost[tenant] += rc
                self._total_cost += rc
                self._count += 1
                done += 1
                if request.answer_expiry and deadline < math.inf:
                    self._seq += 1
                    heapq.heappush(self._expiry, (deadline, self._seq, request))
        finally:
            if done:
                stats.admitted += done
                stats.queued += done
                self._tenant_count[tenant] += done
        return True

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
            or now + max((ahead + sum(r.cost for r in requests)) / rate, self.batch_time)
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
        # The queued cost per class and tenant as ``offer`` finds it at each item:
        # the call's items before it queued, the requests they made leave gone (its
        # own leaver not yet: ``offer`` estimates before it sheds anyone). Copied
        # from the queue at the first estimate; until then the moves are kept.
        costs: list[dict[str, int]] | None = None
        moves: list[tuple[int, str, int]] = []
        own = 0  # the call's cost up to and including the item
        for i, request in enumerate(requests):
            mine = None  # the tenant's own hedge copy the item drops for its share
            if at_share and counts[tenant] >= quota:
                mine = self._newest_copy(tenant, gone) if self._copies else None
                if mine is None:
                    raise self._quota_refusal(tenant, share)
            rc = request.cost
            own += rc
            deadline = request.deadline
            if (
                rate > 0.0
                and deadline < math.inf
                # cheap first: everything queued or running ahead of it (an upper bound)
                and now + max((ahead + own) / rate, self.batch_time) > deadline
            ):
                if costs is None:
                    if self._dead:
                        self._compact()  # the estimate must count live requests only
                    costs = [dict(d) for d in self._cost]
                    for k, u, d in moves:
                        costs[k][u] = costs[k].get(u, 0) + d
                wait = self._estimate(costs, tenant, c, rc)
                if now + wait > deadline:
                    raise self._late_refusal(request, wait, now)
            if mine is not None:
                k = self._rank.get(mine.priority, len(self.classes) - 1)
                leaving.append((i, mine, k, True))
                gone.add(id(mine))
                counts[tenant] -= 1
                live -= 1
                if costs is None:
                    moves.append((k, tenant, -mine.cost))
                else:
                    costs[k][tenant] -= mine.cost
            if live >= cap:
                copy = self._newest_copy(None, gone) if self._copies else None
                if copy is not None:
                    k = self._rank.get(copy.priority, len(self.classes) - 1)
                    leaving.append((i, copy, k, True))
                    out = copy
                else:
                    victim = self._victim(counts, tenant)
                    found = None if victim is None else self._newest_of(victim, gone)
                    if found is None:
                        raise self._full_refusal(live)
                    out, k = found
                    leaving.append((i, out, k, False))
                gone.add(id(out))
                counts[out.tenant] -= 1
                live -= 1
                if costs is None:
                    moves.append((k, out.tenant, -out.cost))
                else:
                    costs[k][out.tenant] -= out.cost
            live += 1
            counts[tenant] += 1
            if costs is None:
                moves.append((c, tenant, rc))
            else:
                costs[c][tenant] = costs[c].get(tenant, 0) + rc
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
        at_share = (
            share < 1.0
            # cheap first: the count may still hold dead entries
            and self._tenant_count[tenant] >= max(1, int(share * self.bound))
            and self._over_share(tenant)
        )
        if at_share and (not self._copies or self._newest_copy(tenant, _NOBODY) is None):
            raise self._quota_refusal(tenant, share)
        # Every refusal before any side effect: a request refused for its deadline
        # must not have given a hedge copy's room away or shed another on its way (the
        # estimate counts the copy it would drop and the request it would push out,
        # which errs on the side of refusing).
        rate = self.rate
        if (
            rate > 0.0
            # cheap first: everything queued or running ahead of it (an upper bound)
            and now + max((self._total_cost + self.in_service + request.cost) / rate,
                          self.batch_time) > request.deadline
            and (wait := self._too_late(request, tenant, c, now)) is not None
        ):
            raise self._late_refusal(request, wait, now)
        if at_share:
            self._drop_copy(tenant)  # its own newest copy, found above
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
            deadline=request.deadline,
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
            and now + max((self._total_cost + self.in_service + request.cost) / rate,
                          self.batch_time) > deadline
        ):
            if self._dead:
                self._compact()  # the estimate must count live requests only
            wait = self.estimated_wait(tenant, c, request.cost)
            if now + wait > deadline:
                return wait
        return None

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
        stats = self._stats(req.tenant, self.classes[c].name)
        stats.shed += 1  # shed as ever, and apart: it had been admitted
        stats.pushed_out += 1
        self._tidy()

    def estimated_wait(self, tenant: str, c: int, cost: int) -> float:
        """Seconds until a new request of ``cost`` from ``tenant`` in class ``c``
        would be served: the cost served before it under strict priority and weighted
        fair share, what the devices hold, and its own cost, over the service rate.

        Below the top class, at most its aging bound plus the time to serve what the
        devices hold, the requests queued below the top class (aged before it, at
        most all of them), as much again of the top class's (the aged requests and
        the others share the service half and half while both wait; at most what the
        top class holds now) and its own cost: so a backlog of the top class does not
        refuse it for a deadline its aging meets. Like the rest of the estimate it
        counts no later arrival, so it errs on the side of admitting."""
        return self._estimate(self._cost, tenant, c, cost)

    def _estimate(self, costs: list[dict[str, int]], tenant: str, c: int, cost: int) -> float:
        """``estimated_wait`` were ``costs`` (per class, tenant -> live cost queued)
        what the queue holds: so a call's plan estimates each item as ``offer`` would
        with the items before it queued and the requests they shed gone."""
        rate = self.rate
        if rate <= 0.0:
            return 0.0
        ahead = float(self.in_service)
        for k in range(c):
            ahead += sum(costs[k].values())
        own = costs[c].get(tenant, 0) + cost
        ahead += own
        w = self._weight(tenant)
        for u, q in costs[c].items():
            if u != tenant and q:
                ahead += min(q, own * self._weight(u) / w)
        wait = ahead / rate
        aging = self.classes[c].aging
        if c and aging < wait:
            below = sum(sum(costs[k].values()) for k in range(1, len(self.classes)))
            top = sum(costs[0].values())
            wait = min(wait, aging + (self.in_service + below + min(below, top) + cost) / rate)
        # No answer comes sooner than one batch's run (the rate leaves its fixed time
        # out): a deadline shorter than the shortest batch measured cannot be met.
        return max(wait, self.batch_time)
