"""The invariants of DESIGN.md as a sans-IO observer of one model's queue.

A :class:`QueueObserver` is told what a queue admitted (``offered``), what it handed out
(``dispatched``) and, after every step, asked to ``sweep``. It checks, with exact
arithmetic on the requests' own times:

- nothing lost: a request the queue moved to DISPATCHED is in a batch it handed out;
- nothing duplicated: no request is handed out twice, nor one it never admitted,
  nor one whose caller had withdrawn it;
- FIFO within a (tenant, class) flow;
- batch budgets: ``max_size`` items and ``max_tokens`` cost units (padding counted),
  except an oversize request alone;
- deadlines: nothing is dispatched at or after its deadline;
- aging (no class starves): while requests past their class's aging bound and others
  both wait, the two groups share the service half and half by cost, aged requests
  earliest promotion first, the others in strict priority;
- the fair-share lag bound within a class (see :meth:`QueueObserver._check_lag`);
- bounded memory: the queue never holds more than its bound.

The observer never raises inside the system under test (an exception in a queue call
would crash an actor, not fail the run): it collects :class:`Violation` values, and the
suites raise the first one as :class:`InvariantViolation` after each step.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
from trioserve import Request, RequestState

QUEUED = RequestState.QUEUED
DISPATCHED = RequestState.DISPATCHED
ABANDONED = RequestState.ABANDONED

#: The invariants, by the short name a violation message starts with.
INVARIANTS: dict[str, str] = {
    "split": "an unversioned request goes to the version the rollout's counter rule "
    "routes it to, and is answered by it; a versioned one by the version it names",
    "rollout": "a rollout's steps, promotion and rollback follow its rules at once, its "
    "shares are its steps', final states stay final, each routed outcome recorded once",
    "control": "under explicit model control, a request runs on the copy that admitted "
    "it, the model's states follow the lifecycle and the ops in the order asked, and "
    "nothing of the model runs once an unload ends",
    "scaling": "an autoscaled model's replicas serving (starting ones counted) stay "
    "within its bounds, each look decides as the documented rule, no replica starts "
    "once shutdown began nor runs once the runtime closed",
    "shadow": "a shadow gets a share of stable's answers, never more waiting than its "
    "bound, each copy counted once, none reaching or counting as a caller",
    "lost": "every admitted request is answered exactly once unless its caller cancelled it",
    "duplicated": "no request is dispatched twice, nor one never admitted or withdrawn",
    "misrouted": "each answer reaches its own caller, in the order that caller submitted",
    "fifo": "within one (tenant, class) flow, dispatch order is arrival order",
    "batch-budget": "no batch exceeds max_batch_size or max_batch_tokens "
    "(except an oversize request run alone)",
    "deadline": "no request is dispatched at or after its deadline, and none is answered "
    "DeadlineExceeded before it",
    "aging": "while requests queued past their class's aging bound (aged) and others both "
    "wait, the two groups share the service half and half by cost (the aged group's turn "
    "while the aged cost taken less the others' is <= 0); aged requests go earliest "
    "promotion first, the others in strict priority",
    "fair-share": "two continuously backlogged tenants of a class receive weighted service "
    "within a bounded lag of each other",
    "memory": "a queue never holds more requests than its bound; the cache never more "
    "bytes than its capacity, a tenant than its quota",
    "outcome": "every caller gets one outcome, and only one its situation allows",
    "push-out": "a request is pushed out of a full queue only to make room for a request, "
    "or a whole call, that is then queued",
    "lane": "a request waits in and runs from the lane of its cost: a model's slow lane "
    "(its own queue and replicas) for cost >= slow_lane_cost, the other lane below it",
    "leak": "no task outlives the runtime",
    "crash": "no actor of the runtime crashes (to be restarted by its supervisor), nor does "
    "the runtime log another traceback, unless a fault the scenario planted made it",
    "hedge": "a hedge copy never runs in one batch with its original, and when one of "
    "the two is answered with a result the other is withdrawn at once",
    "elsewhere": "a part of a failed batch that raised alone on a replica while another "
    "was ready runs once on another replica: it is not taken back while one is ready",
    "breaker": "a replica's circuit breaker counts exactly the evidence against it: a "
    "lone fresh request raising after other replicas succeeded, a part that raised alone "
    "there answered elsewhere in the same run while the breaker was closed",
    "credits": "a tenant's admitted cost stays within its credit envelope; a caller "
    "pays once, and gets it back exactly when none of its requests ran",
    "accounting": "a queue's counts (live requests, cost in service, service rate, "
    "fair-share counters, flow statistics) agree with what it was told and did",
    "isolation": "a model that is not shareable never answers a tenant with an answer "
    "computed for another",
    "freshness": "an answer computed before an invalidation never reaches a caller that "
    "started after it, and is never kept after it",
    "ttl": "no cached answer is served at or after its entry's expiry",
    "cached-error": "a model error is never kept: it reaches only callers waiting when "
    "the model raised",
    "statistics": "the cache's counters agree with the lookups, flights and invalidations "
    "it was asked for",
}


class InvariantViolation(AssertionError):
    """An invariant did not hold. ``str()`` is ``"<invariant>: <what happened>"``."""

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant


@attrs.frozen
class Violation:
    invariant: str
    message: str

    def error(self) -> InvariantViolation:
        return InvariantViolation(self.invariant, self.message)


@attrs.frozen(kw_only=True)
class ClassBound:
    """A class as the observer sees it: its name and aging bound (seconds)."""

    name: str
    aging: float = math.inf


@attrs.define(eq=False)
class Tracked:
    """One admitted request and what became of it."""

    request: Request
    seq: int
    cls: int
    dispatched_at: float | None = None
    batch_no: int | None = None
    fifo_done: bool = False  # passed the FIFO check (its flow's queue moved past it)

    @property
    def flow(self) -> tuple[str, int]:
        return (self.request.tenant, self.cls)

    def describe(self, classes: Sequence[ClassBound]) -> str:
        r = self.request
        deadline = "none" if math.isinf(r.deadline) else f"{r.deadline:.6g}"
        return (
            f"request #{self.seq} (tenant {r.tenant!r}, class {classes[self.cls].name!r}, "
            f"cost {r.cost}, arrived {r.arrival:.6g}, deadline {deadline})"
        )


@attrs.frozen
class Waiting:
    """What waited as a request of a batch was taken: the aged request of the
    earliest promotion (None: none aged), the highest class among the flows not aged
    (None: none), and the classes with a flow whose first live request had aged."""

    first: Tracked | None
    top: int | None
    aged_classes: frozenset[int]


_NONE_WAITING = Waiting(first=None, top=None, aged_classes=frozenset())


def batch_cost(costs: Sequence[int], padded: bool) -> int:
    """A batch's cost in token units: the sum, or items × longest when padded."""
    if not costs:
        return 0
    return len(costs) * max(costs) if padded else sum(costs)


class QueueObserver:
    """Watches one queue; see the module docstring for what it checks.

    Args:
        max_size, max_tokens, padded: the batch limits the queue was configured with.
        bound: the queue's configured bound (requests).
        classes: the configured classes, highest first, with their aging bounds.
        weights: tenant -> weight (1.0 when absent).
        lag_slack: extra allowance of the fair-share check, in weighted cost units
            (see ``_check_lag``).
    """

    def __init__(
        self,
        *,
        max_size: int,
        max_tokens: int | None,
        padded: bool,
        bound: int,
        classes: Sequence[ClassBound],
        weights: Mapping[str, float] | None = None,
        lag_slack: float = 0.0,
    ) -> None:
        self.max_size = max_size
        self.max_tokens = max_tokens
        self.padded = padded
        self.bound = bound
        self.classes = tuple(classes)
        self._rank = {c.name: i for i, c in enumerate(self.classes)}
        self.weights = dict(weights or {})
        self.lag_slack = lag_slack
        self.violations: list[Violation] = []
        self.tracked: dict[int, Tracked] = {}  # id(reply) -> its request
        self.pending: dict[int, Tracked] = {}  # admitted, neither dispatched nor gone
        self._flows: dict[tuple[str, int], collections.deque[Tracked]] = {}
        self.batches: list[tuple[float, list[Tracked]]] = []
        self._seq = 0
        n = len(self.classes)
        self.served: list[collections.Counter[str]] = [collections.Counter() for _ in range(n)]
        #: per class: tenant -> (sweep, time) its backlog began, and everyone's weighted
        #: service then with how far past the least counter it may have been
        self._lag_start: list[dict[str, tuple[int, float, dict[str, tuple[float, float]]]]] = [
            {} for _ in range(n)
        ]
        #: per class: tenant -> the cost / weight of the last request of it taken in
        #: fair-share order there, and its weighted service taken out of that order
        #: (an aged request of it, or one taken while an aged request of the class
        #: waited) since then (see ``_note_order`` and ``_check_lag``)
        self._lag_last: list[dict[str, float]] = [{} for _ in range(n)]
        self._lag_excess: list[dict[str, float]] = [{} for _ in range(n)]
        #: the aged requests' cost taken less the others', over the requests taken
        #: while both groups waited (see ``_check_aging``)
        self._aged_lead = 0
        self._sweeps = 0
        self.max_len = 0
        #: when set, every request a sweep finds gone is also kept in ``gone`` until
        #: ``take_gone``: a suite that judges departures sees those found by the
        #: sweeps inside the queue's own calls too
        self.keep_gone = False
        self.gone: list[Tracked] = []
        #: id(reply) of the hedge copies the queue took (``offer_spare``): a copy is
        #: served as any request, but it is no backlog of its tenant's in the lag
        #: check (the queue re-lifts a tenant's counter when its copy gives its room
        #: back and a new request of it comes: its flow was empty in between)
        self.spare: set[int] = set()
        #: how often each check had something to check (for coverage notes)
        self.exercised: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------ helpers
    def _fail(self, invariant: str, message: str) -> None:
        self.violations.append(Violation(invariant, message))

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def class_of(self, request: Request) -> int:
        return self._rank.get(request.priority, len(self.classes) - 1)

    def track_of(self, request: Request) -> Tracked | None:
        return self.tracked.get(id(request.reply))

    def describe(self, t: Tracked) -> str:
        return t.describe(self.classes)

    def _live(self, t: Tracked, now: float) -> bool:
        """Whether ``t`` is a backlog of its tenant's at ``now`` in the lag check: a
        queued request, its deadline to come, not a hedge copy."""
        req = t.request
        return (
            req.reply.state is QUEUED and req.deadline > now and id(req.reply) not in self.spare
        )

    # ------------------------------------------------------------ events
    def offered(self, request: Request, now: float) -> Tracked:
        """``request`` was admitted into the queue at ``now``."""
        self._seq += 1
        c = self.class_of(request)
        t = Tracked(request=request, seq=self._seq, cls=c)
        key = id(request.reply)
        if key in self.tracked:
            self._fail("duplicated", f"{self.describe(t)} was admitted twice")
        self.tracked[key] = t
        self.pending[key] = t
        flow = self._flows.setdefault(t.flow, collections.deque())
        if not any(self._live(x, now) for x in flow):
            # Its backlog, if it had one, ended before this arrival (its last request
            # withdrawn at its caller's deadline, say) even when no sweep ran in the
            # gap: the queue lifts the tenant's counter now, and the lag interval
            # starts again at the next sweep.
            self._lag_start[c].pop(request.tenant, None)
        flow.append(t)
        return t

    def dispatched(self, batch: Sequence[Request], now: float) -> None:
        """The queue handed out ``batch`` at ``now``."""
        if not batch:
            return
        no = len(self.batches) + 1
        taken: list[Tracked] = []
        for req in batch:
            t = self.tracked.get(id(req.reply))
            if t is None:
                self._fail(
                    "duplicated",
                    f"batch {no} at t={now:.6g} holds a request the queue never admitted "
                    f"(tenant {req.tenant!r}, cost {req.cost})",
                )
                continue
            if t.dispatched_at is not None:
                self._fail(
                    "duplicated",
                    f"{self.describe(t)} was dispatched twice: in batch {t.batch_no} at "
                    f"t={t.dispatched_at:.6g} and in batch {no} at t={now:.6g}",
                )
                continue
            if req.reply.state is not DISPATCHED:
                self._fail(
                    "duplicated",
                    f"{self.describe(t)} was handed out in batch {no} at t={now:.6g} while "
                    f"its reply is {req.reply.state.value} (withdrawn or answered before)",
                )
            if t.request.deadline <= now:
                self._fail(
                    "deadline",
                    f"{self.describe(t)} was dispatched in batch {no} at t={now:.6g}, "
                    f"{now - t.request.deadline:.6g}s after its deadline",
                )
            t.dispatched_at = now
            t.batch_no = no
            self.pending.pop(id(req.reply), None)
            taken.append(t)
        self.batches.append((now, taken))
        self.exercised[f"batches of {min(len(taken), 3)}{'+' if len(taken) >= 3 else ''}"] += 1
        self._check_budget(no, now, taken)
        self._check_fifo(no, now, taken)
        before = self._waiting_before(now, taken)
        self._note_order(now, taken, before)
        self._check_aging(no, now, taken, before)
        for t in taken:
            self.served[t.cls][t.request.tenant] += t.request.cost

    def sweep(self, now: float, queue_len: int | None = None) -> list[Tracked]:
        """After a step: check loss, memory and the fair-share lag; return the requests
        that left the queue since the last sweep without being dispatched (answered,
        withdrawn or expired by the queue, or cancelled by their caller)."""
        self._sweeps += 1
        gone: list[Tracked] = []
        for key, t in list(self.pending.items()):
            state = t.request.reply.state
            if state is QUEUED:
                continue
            del self.pending[key]
            if state is DISPATCHED or state is ABANDONED:
                self._fail(
                    "lost",
                    f"{self.describe(t)} was taken by the queue (its reply is "
                    f"{state.value}) at or before t={now:.6g} but is in no batch it handed "
                    "out: nobody will ever answer it",
                )
            else:
                gone.append(t)
        if self.keep_gone:
            self.gone.extend(gone)
        if queue_len is not None:
            self.max_len = max(self.max_len, queue_len)
            if queue_len > self.bound:
                self._fail(
                    "memory",
                    f"the queue holds {queue_len} requests at t={now:.6g}, over its bound "
                    f"of {self.bound}",
                )
        self._check_lag(now)
        return gone

    def take_gone(self) -> list[Tracked]:
        """The requests sweeps found gone since the last call (with ``keep_gone``)."""
        gone, self.gone = self.gone, []
        return gone

    def live(self, now: float) -> list[Tracked]:
        """Admitted requests still waiting (queued, deadline not passed), oldest first."""
        return [
            t
            for t in self.pending.values()
            if t.request.reply.state is QUEUED and t.request.deadline > now
        ]

    # ------------------------------------------------------------ the checks
    def _check_budget(self, no: int, now: float, taken: list[Tracked]) -> None:
        if len(taken) > self.max_size:
            self._fail(
                "batch-budget",
                f"batch {no} at t={now:.6g} has {len(taken)} requests, over max_batch_size "
                f"{self.max_size}: {', '.join('#%d' % t.seq for t in taken)}",
            )
        if self.max_tokens is None:
            return
        costs = [t.request.cost for t in taken]
        cost = batch_cost(costs, self.padded)
        if cost > self.max_tokens and not (len(taken) == 1):
            self._fail(
                "batch-budget",
                f"batch {no} at t={now:.6g} costs {cost} token units "
                f"({'padded ' if self.padded else ''}costs {costs}), over max_batch_tokens "
                f"{self.max_tokens}; only an oversize request may exceed it, alone",
            )

    def _check_fifo(self, no: int, now: float, taken: list[Tracked]) -> None:
        """In batch order: everything its flow admitted before a dispatched request has
        been dispatched before it (in an earlier batch or earlier in this one), or has
        left the queue (withdrawn, answered, expired)."""
        in_batch = {id(t) for t in taken}
        for t in taken:
            q = self._flows[t.flow]
            while q:
                head = q[0]
                if head is t:
                    q.popleft()
                    t.fifo_done = True
                    break
                if head.fifo_done:
                    q.popleft()
                    continue
                later_here = id(head) in in_batch
                waiting = head.request.reply.state is QUEUED and head.request.deadline > now
                if not later_here and not waiting:
                    q.popleft()  # gone, or expired: no longer ahead of anyone
                    continue
                where = "later in the same batch" if later_here else "still queued"
                self._fail(
                    "fifo",
                    f"{self.describe(t)} was dispatched in batch {no} at t={now:.6g} ahead "
                    f"of {self.describe(head)} of the same flow, which arrived before it "
                    f"and is {where}",
                )
                t.fifo_done = True
                if t in q:
                    q.remove(t)
                break

    def _promotion(self, t: Tracked) -> float:
        """When ``t`` ages (arrival + its class's aging bound; never in the top class)."""
        return t.request.arrival + self.classes[t.cls].aging if t.cls > 0 else math.inf

    def _waiting_before(self, now: float, taken: list[Tracked]) -> list[Waiting]:
        """What waited before each request of a batch pulled at ``now`` was taken,
        worked out flow by flow from the requests live then (those still queued after
        the batch, and those taken from it on): a flow whose first live request has
        aged is the aged group's, any other the rest's."""
        if len(self.classes) < 2:  # nothing ages
            return [_NONE_WAITING] * len(taken)
        promotion = self._promotion
        heads: dict[tuple[str, int], Tracked] = {}
        for t in self.live(now):
            h = heads.get(t.flow)
            if h is None or t.seq < h.seq:
                heads[t.flow] = t
        # (from the last request taken back to the first)
        before: list[Waiting] = []
        for t in reversed(taken):
            h = heads.get(t.flow)
            if h is None or t.seq < h.seq:
                heads[t.flow] = t
            first: Tracked | None = None
            top: int | None = None
            aged_classes: set[int] = set()
            for h in heads.values():
                p = promotion(h)
                if p <= now:
                    aged_classes.add(h.cls)
                    if first is None or p < promotion(first):
                        first = h
                elif top is None or h.cls < top:
                    top = h.cls
            before.append(Waiting(first=first, top=top, aged_classes=frozenset(aged_classes)))
        before.reverse()
        return before

    def _note_order(self, now: float, taken: list[Tracked], before: list[Waiting]) -> None:
        """Note, per tenant and class, the requests taken in fair-share order and the
        weighted service taken out of it. Out of it: a request aged when taken (served
        by promotion), or one taken while a flow of its class had an aged head (that
        flow was out of the share then, the others shared among themselves). In it,
        any other: its tenant's counter was then the least of its class's backlogged
        tenants (or its run's, below the next one), so the request took it at most its
        own cost / weight past the least; the service taken out of order counts from
        0 again."""
        for t, w in zip(taken, before, strict=True):
            c = t.cls
            tenant = t.request.tenant
            unit = t.request.cost / self.weight(tenant)
            excess = self._lag_excess[c]
            if self._promotion(t) <= now or c in w.aged_classes:
                excess[tenant] = excess.get(tenant, 0.0) + unit
                self.exercised["fair-share: a request taken out of share order (aging)"] += 1
            else:
                self._lag_last[c][tenant] = unit
                excess.pop(tenant, None)

    def _check_aging(
        self, no: int, now: float, taken: list[Tracked], before: list[Waiting]
    ) -> None:
        """The aging rule, request by request in batch order.

        A request below the top class is aged once it has waited its class's aging
        bound. Before each request taken, the groups waiting are worked out flow by
        flow (``_waiting_before``): a flow whose first live request has aged is the
        aged group's, any other the rest's. While both wait, the request taken is the
        aged group's when the lead (the aged cost taken less the rest's, over the
        requests taken while both waited, carried across batches) is <= 0, the rest's
        otherwise; a request taken while one group is empty sets the lead to 0. From
        the aged group, one of the earliest promotion; from the rest, one of its
        highest class (strict priority). So the aged group and the rest share the
        service half and half while both wait, and within the aged group the order is
        earliest promotion first: nothing aged waits forever while the rest is served.
        """
        classes = self.classes
        if len(classes) < 2:
            return
        promotion = self._promotion
        if before[0].first is not None:
            self.exercised["aging: batch pulled with a promoted request waiting"] += 1
        for t, waiting in zip(taken, before, strict=True):
            first, top = waiting.first, waiting.top
            aged = promotion(t) <= now
            cost = t.request.cost
            if first is not None and top is not None:
                self.exercised["aging: a request taken with aged ones and others waiting"] += 1
                lead = self._aged_lead
                if aged != (lead <= 0):
                    turn = "the aged requests'" if lead <= 0 else "the others'"
                    other = (
                        f"{self.describe(first)}, aged {now - promotion(first):.6g}s ago"
                        if lead <= 0
                        else f"a request of class {classes[top].name!r} not aged"
                    )
                    self._fail(
                        "aging",
                        f"batch {no} at t={now:.6g} took {self.describe(t)}"
                        f"{' (aged)' if aged else ' (not aged)'} while aged requests and "
                        f"others both waited and it was {turn} turn (the aged cost taken "
                        f"less the others' while both waited: {lead:g}); {other} was "
                        "left queued",
                    )
                    return
                self._aged_lead = lead + cost if aged else lead - cost
            else:
                self._aged_lead = 0
            if aged and first is not None and promotion(t) > promotion(first):
                self._fail(
                    "aging",
                    f"batch {no} at t={now:.6g} took {self.describe(t)}, promoted at "
                    f"t={promotion(t):.6g}, while {self.describe(first)}, promoted at "
                    f"t={promotion(first):.6g}, had waited {now - first.request.arrival:.6g}s, "
                    f"past its class's aging bound of {classes[first.cls].aging:.6g}s, "
                    "and was left queued: aged requests go earliest promotion first",
                )
                return
            if not aged and top is not None and t.cls > top:
                self._fail(
                    "aging",
                    f"batch {no} at t={now:.6g} took {self.describe(t)} (not aged) while a "
                    f"request of the higher class {classes[top].name!r}, not aged either, "
                    "was left queued (strict priority among requests not aged)",
                )
                return

    def _check_lag(self, now: float) -> None:
        """The fair-share lag bound (virtual-time counting, VTC).

        The queue keeps a counter per tenant of a class (its weighted service, cost /
        weight, summed), serves the least, and lifts a tenant that becomes backlogged
        to the least counter among the backlogged ones (or to where service last
        was); so the least counter m of the backlogged tenants only grows. A request
        taken in fair-share order (``_note_order``) leaves its tenant's counter at most
        its own cost / weight past the least counter (a run stops once it passes the
        next one), and a counter moves only by its tenant's service: so a backlogged
        tenant k's counter stays within [m, m + l_k + x_k], ``l_k`` the cost / weight
        of its last request taken in order, ``x_k`` the weighted service it took out
        of order since (aging: an aged request is served by promotion, and while a
        flow of the class has an aged head its other flows share among themselves).

        For two tenants i, j of class c continuously backlogged (a live request queued
        at every sweep) since the later of their backlog starts s, the weighted service
        they received in that interval is the change of their counters, so i leads j
        by at most ``l_i + x_i`` now plus ``l_j + x_j`` at s (``+ lag_slack``), and the
        other way round. Without aging x is 0; with it, the check keeps its teeth
        between the aged requests' turns and after them: a lead that the service taken
        out of order does not explain fails.
        """
        backlogged: list[set[str]] = [set() for _ in self.classes]
        spare = self.spare
        for key, t in self.pending.items():
            if key in spare:
                continue
            if t.request.reply.state is QUEUED and t.request.deadline > now:
                backlogged[t.cls].add(t.request.tenant)
        for c, tenants in enumerate(backlogged):
            starts = self._lag_start[c]
            for gone in [u for u in starts if u not in tenants]:
                del starts[gone]
            served = self.served[c]
            last = self._lag_last[c]
            excess = self._lag_excess[c]
            for u in tenants:
                if u not in starts:
                    snapshot = {
                        v: (
                            served[v] / self.weight(v),
                            last.get(v, 0.0) + excess.get(v, 0.0),
                        )
                        for v in tenants
                    }
                    starts[u] = (self._sweeps, now, snapshot)
            if len(tenants) < 2:
                continue
            self.exercised["fair-share: sweep with 2+ tenants backlogged in a class"] += 1
            names = sorted(tenants)
            for a_i, a in enumerate(names):
                for b in names[a_i + 1 :]:
                    sa, sb = starts[a], starts[b]
                    _, since, snap = sa if sa[0] >= sb[0] else sb
                    da = served[a] / self.weight(a) - snap[a][0]
                    db = served[b] / self.weight(b) - snap[b][0]
                    ahead, behind = (a, b) if da > db else (b, a)
                    # how far past the least counter the one ahead may be now, and
                    # the one behind may have been at the start
                    now_part = last.get(ahead, 0.0) + excess.get(ahead, 0.0)
                    limit = now_part + snap[behind][1] + self.lag_slack
                    if abs(da - db) > limit + 1e-9:
                        bent = excess.get(ahead, 0.0)
                        aging = f", {bent:.6g} of it out of share order" if bent else ""
                        self._fail(
                            "fair-share",
                            f"class {self.classes[c].name!r} at t={now:.6g}: tenants "
                            f"{a!r} (weight {self.weight(a):g}) and {b!r} (weight "
                            f"{self.weight(b):g}) both backlogged since t={since:.6g}; "
                            f"weighted service (cost / weight) since then {a!r} {da:.6g}, "
                            f"{b!r} {db:.6g}: {ahead!r} is ahead of {behind!r} by "
                            f"{abs(da - db):.6g}, over the bound {limit:.6g} (how far past "
                            f"the least counter {ahead!r} may be now, "
                            f"{now_part:.6g}{aging}; and {behind!r} at t={since:.6g}, "
                            f"{snap[behind][1]:.6g})",
                        )
                        starts.clear()  # report once per interval
                        return

    # ------------------------------------------------------------ the end
    def first(self) -> InvariantViolation | None:
        return self.violations[0].error() if self.violations else None

    def raise_first(self) -> None:
        if self.violations:
            raise self.violations[0].error()


def footprint(queue: Any) -> dict[str, int]:
    """Entries a FairQueue holds in its containers (live and dead): flow deques,
    per-class arrival orders, the expiry heap. Reads private attributes, defensively:
    a container it does not find counts 0."""
    flows = sum(len(q) for fl in getattr(queue, "_flows", ()) for q in fl.values())
    arrivals = sum(len(a) for a in getattr(queue, "_arrivals", ()))
    return {"flows": flows, "arrivals": arrivals, "expiry": len(getattr(queue, "_expiry", ()))}


def observer_for(
    limits: Any,
    *,
    bound: int,
    classes: Iterable[Any],
    weights: Mapping[str, float] | None,
    lag_slack: float = 0.0,
) -> QueueObserver:
    """An observer for a queue built with these FairQueue arguments."""
    return QueueObserver(
        max_size=limits.max_size,
        max_tokens=limits.max_tokens,
        padded=limits.padded,
        bound=bound,
        classes=[ClassBound(name=c.name, aging=c.aging) for c in classes],
        weights=weights,
        lag_slack=lag_slack,
    )
