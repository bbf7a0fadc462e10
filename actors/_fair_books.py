"""The bookkeeping of a model's fair queue: the part of
:class:`~trioserve.actors.FairQueue` that counts what happens to each (tenant,
class) flow (:class:`FlowStats`), keeps the memory of departed requests bounded
(their entries in the flows, the arrival orders and the expiry heap, compacted once
a quarter of them are dead), answers the requests that expire queued, and empties
the queue when it closes (``drain``). The request classes as the queue sees them are
:class:`ClassSpec`. Dispatch (flow picking, batches) is in ``_fair.py``, admission
in ``_admission.py``.

Nothing here awaits or reads a clock: ``now`` is an argument.
"""

from __future__ import annotations

import collections
import heapq
import math
from typing import TYPE_CHECKING

import attrs
from trioserve import DeadlineExceeded, Request, RequestState

from ._metrics import Latency

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ._admission import AimdLimit

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

    ``admitted`` and ``shed`` count callers' requests only. ``shed`` counts the
    requests refused at admission (never admitted) and those pushed out of a full
    queue (admitted, then answered Overloaded); ``pushed_out`` is the part of ``shed``
    that had been admitted. ``hedged`` counts the copies of hedged requests the queue
    took (into free room only, see :meth:`FairQueue.offer_spare`), apart from
    ``admitted``; a copy refused is counted nowhere. Each admitted request and each
    copy taken is, at any time, still queued or counted once more: in ``dispatched``
    (a copy's device time is its tenant's service, in ``served_cost`` too),
    ``expired``, ``withdrawn``, ``closed``, ``pushed_out``, ``superseded`` or
    ``gave_way``. So ``admitted + hedged == dispatched + expired + withdrawn + closed
    + pushed_out + superseded + gave_way + queued`` (the live count,
    :meth:`FairQueue.queued_by_flow`); with no hedge, ``hedged``, ``superseded`` and
    ``gave_way`` are 0.
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
    #: Requests failed while queued, never run, because the queue closed: the runtime
    #: shut down, or every replica of the queue lost its device and it was retired
    #: (``SchedulerActor.close`` and ``retire``, through :meth:`FairQueue.drain`).
    closed: int = 0
    #: Admitted requests pushed out of a full queue to make room for another tenant's
    #: request or call (answered Overloaded, never run): the part of ``shed`` that
    #: had been admitted.
    pushed_out: int = 0
    #: Requests or hedge copies withdrawn while queued, never run, because their twin
    #: (the copy of a hedged request, or its original) answered first.
    superseded: int = 0
    #: Hedge copies that gave their room in a full queue to a new request (answered
    #: Overloaded, never run; the original still runs or waits).
    gave_way: int = 0
    #: Dispatched requests answered DeadlineExceeded (their model's or class's
    #: timeout) while their batch ran, by the replica running it: the part of
    #: ``dispatched`` that expired on a device (outside the balance above, as
    #: ``pushed_out`` is within ``shed``). A request that expires while held for a
    #: retry is not counted here.
    expired_running: int = 0
    #: Entries the flow holds: a withdrawn or expired request stays among them until
    #: passed (see FairQueue.queued_by_flow for the live count).
    queued: int = 0
    wait: Latency = attrs.Factory(Latency)


class FlowBooks:
    """The bookkeeping methods of :class:`~trioserve.actors.FairQueue`, over the
    queue's state (set up by ``FairQueue.__init__``); not used on its own."""

    if TYPE_CHECKING:
        model: str
        classes: tuple[ClassSpec, ...]
        stats: dict[tuple[str, str], FlowStats]
        limit: AimdLimit | None
        expired: int
        _rank: dict[str, int]
        _flows: list[dict[str, collections.deque[Request]]]
        _active: list[dict[str, collections.deque[Request]]]
        _arrivals: list[collections.deque[Request]]
        _cost: list[dict[str, int]]
        _count: int
        _dead: int
        _total_cost: int
        _tenant_count: collections.Counter[str]
        _expiry: list[tuple[float, int, Request]]
        _copies: list[Request]
        _aged_lead: int

        def __iter__(self) -> Iterator[Request]: ...
        def _update_capacity(self) -> None: ...

    # ------------------------------------------------------------ flows
    def _note_dead(self) -> None:
        self._dead += 1
        self._tidy()

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


    def withdrawn_by_caller(self, request: Request) -> None:
        """``request``'s caller withdrew it, queued, before its deadline: count it in
        its flow's ``withdrawn``."""
        c = self._rank.get(request.priority, len(self.classes) - 1)
        self._stats(request.tenant, self.classes[c].name).withdrawn += 1

    def note_superseded(self, request: Request) -> None:
        """``request``, a hedged request or its copy, was withdrawn queued because its
        twin answered first: count it in its flow's ``superseded``."""
        c = self._rank.get(request.priority, len(self.classes) - 1)
        self._stats(request.tenant, self.classes[c].name).superseded += 1

    def note_expired_running(self, request: Request) -> None:
        """``request``, dispatched, was answered DeadlineExceeded while its batch ran:
        count it in its flow's ``expired_running``. (Not a congestion signal for the
        adaptive limit: the queue did not keep it past its deadline, its device
        did.)"""
        c = self._rank.get(request.priority, len(self.classes) - 1)
        self._stats(request.tenant, self.classes[c].name).expired_running += 1

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
        """Remove and return every still-queued request, for the caller to fail (the
        queue closes: shutdown, or no replica can serve it any more). Each counts in
        its flow's ``closed``: it leaves the queue never run."""
        alive = [r for r in self if r.reply.state is _QUEUED]
        rank, classes = self._rank, self.classes
        for r in alive:
            c = rank.get(r.priority, len(classes) - 1)
            self._stats(r.tenant, classes[c].name).closed += 1
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
        self._aged_lead = 0
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
