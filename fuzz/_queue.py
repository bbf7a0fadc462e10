"""Suite ``queue``: a hypothesis state machine over the sans-IO FairQueue.

Fast (no trio, no tasks): arrivals from several tenants and classes with random costs
and deadlines (single requests, and calls of several items queued all or none),
caller cancellations, time advances, pulls, completions and expiry
sweeps, under random limits (batch size and tokens, padding, bound, adaptive limit,
queue shares, weights, aging bounds). After every step the QueueObserver's invariants
are checked, plus the queue's own duties: only an expired request is expired, only a
full queue pushes a request out, and only for a request or call it then queues,
``expire(now)`` leaves nothing expired queued.
At teardown the queue is flushed (pulls until empty) and drained.
"""

from __future__ import annotations

import math

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from trioserve import Overloaded, Request, RequestState
from trioserve.actors import BatchLimits, ClassSpec

from ._checker import InvariantViolation, QueueObserver, Tracked, footprint
from ._product import PRODUCT, Product, observed_queue_class
from ._stats import count_example, note

TENANTS = ("t0", "t1", "t2", "t3")
CLASSES = ("c0", "c1", "c2")
MS = 1e-3


@attrs.frozen(kw_only=True)
class QueueSetup:
    """One queue's configuration. Times in integer milliseconds; ``aging_ms[c]`` is
    class c's aging bound (None: never promoted; class 0's is unused)."""

    max_size: int = 4
    max_tokens: int | None = None
    padded: bool = False
    max_wait_ms: int = 0
    bound: int = 16
    adaptive: bool = False
    min_limit: int | None = None
    aging_ms: tuple[int | None, ...] = (None,)
    weights: tuple[float, ...] = (1.0,)
    shares: tuple[float, ...] = (1.0,)

    @property
    def tenants(self) -> tuple[str, ...]:
        return TENANTS[: len(self.weights)]

    @property
    def classes(self) -> tuple[str, ...]:
        return CLASSES[: len(self.aging_ms)]


@st.composite
def queue_setups(draw: st.DrawFn) -> QueueSetup:
    n_tenants = draw(st.integers(1, 4))
    n_classes = draw(st.integers(1, 3))
    max_size = draw(st.integers(1, 5))
    return QueueSetup(
        max_size=max_size,
        max_tokens=draw(st.none() | st.integers(1, 12)),
        padded=draw(st.booleans()),
        max_wait_ms=draw(st.sampled_from([0, 0, 1, 5, 20])),
        bound=draw(st.integers(1, 24)),
        adaptive=draw(st.booleans()),
        min_limit=draw(st.none() | st.integers(1, 8)),
        aging_ms=tuple(
            draw(
                st.lists(
                    st.none() | st.sampled_from([0, 1, 5, 20, 100]),
                    min_size=n_classes,
                    max_size=n_classes,
                )
            )
        ),
        weights=tuple(
            draw(
                st.lists(
                    st.sampled_from([1.0, 1.0, 2.0, 3.0, 0.5]),
                    min_size=n_tenants,
                    max_size=n_tenants,
                )
            )
        ),
        shares=tuple(
            draw(
                st.lists(
                    st.sampled_from([1.0, 1.0, 1.0, 0.5, 0.25]),
                    min_size=n_tenants,
                    max_size=n_tenants,
                )
            )
        ),
    )


@attrs.frozen(kw_only=True)
class Arrival:
    """One request: tenant and class (indices, taken modulo the configured counts),
    cost, time to live (None: no deadline) and whether its expiry is answered."""

    tenant: int = 0
    cls: int = 0
    cost: int = 1
    ttl_ms: int | None = None
    answer_expiry: bool = False


def arrivals() -> st.SearchStrategy[Arrival]:
    return st.builds(
        Arrival,
        tenant=st.integers(0, 3),
        cls=st.integers(0, 2),
        cost=st.integers(1, 6) | st.sampled_from([1, 1, 9, 20]),
        ttl_ms=st.none() | st.sampled_from([0, 1, 2, 5, 10, 50, 200]),
        answer_expiry=st.booleans(),
    )


class QueueMachine(RuleBasedStateMachine):
    """Drives one FairQueue (``product.queue_class``) and checks it after every step."""

    product: Product = PRODUCT

    def __init__(self) -> None:
        super().__init__()
        count_example("queue")
        self.ms = 0
        self.queue = None
        self.observer: QueueObserver | None = None
        self.cfg = QueueSetup()
        self.in_service: list[list[Request]] = []
        self.cancelled: set[int] = set()  # id(reply) of requests their caller withdrew
        self.step = ""
        self.step_tenant = ""
        #: what the current "arrive" step offered ("request #7", "a call of 3 ...")
        #: and the queue's refusal of it ("": admitted)
        self.step_offer = ""
        self.step_refusal = ""
        self.items = 0
        self.peak: dict[str, int] = {}

    @property
    def now(self) -> float:
        return self.ms * MS

    # ------------------------------------------------------------ rules
    @initialize(config=queue_setups())
    def setup(self, config: QueueSetup) -> None:
        self.cfg = config
        limits = BatchLimits(
            max_size=config.max_size,
            max_tokens=config.max_tokens,
            max_wait=config.max_wait_ms * MS,
            padded=config.padded,
            oversize="alone",
        )
        classes = [
            ClassSpec(name=name, aging=math.inf if a is None else a * MS)
            for name, a in zip(config.classes, config.aging_ms, strict=True)
        ]
        queue_class = observed_queue_class(self.product.queue_class)
        self.queue = queue_class(
            limits,
            bound=config.bound,
            classes=classes,
            weights=dict(zip(config.tenants, config.weights, strict=True)),
            shares=dict(zip(config.tenants, config.shares, strict=True)),
            model="fuzz",
            adaptive=config.adaptive,
            min_limit=config.min_limit,
        )
        self.observer = self.queue.observer
        self.observer.keep_gone = True
        self.step = "setup"

    @rule(arrivals=st.lists(arrivals(), min_size=1, max_size=4))
    def arrive(self, arrivals: list[Arrival]) -> None:
        """A burst of arrivals at the same instant, offered one by one."""
        for a in arrivals:
            self._offer(a)

    @rule(first=arrivals(), costs=st.lists(st.integers(1, 6), max_size=4))
    def arrive_call(self, first: Arrival, costs: list[int]) -> None:
        """One call of several items (``offer_all``): ``first``'s tenant, class, time
        to live and expiry, and costs ``first.cost`` then ``costs``."""
        call = [self._request(first, first.cost)]
        call += [self._request(first, cost) for cost in costs]
        self.step, self.step_tenant = "arrive", call[0].tenant
        self.step_offer = (
            f"a call of {len(call)} item(s) (costs {[r.cost for r in call]}, class "
            f"{call[0].priority!r})"
        )
        self.step_refusal = ""
        try:
            self.queue.offer_all(call, self.now)
        except Overloaded as exc:  # QuotaExceeded included: refused whole
            self.step_refusal = f"{type(exc).__name__}: {exc}"
        self.observer.exercised["calls " + ("refused" if self.step_refusal else "admitted")] += 1
        self.holds()

    def _request(self, a: Arrival, cost: int) -> Request:
        cfg = self.cfg
        self.items += 1
        return Request(
            model="fuzz",
            item=self.items,
            cost=cost,
            tenant=cfg.tenants[a.tenant % len(cfg.tenants)],
            priority=cfg.classes[a.cls % len(cfg.classes)],
            arrival=self.now,
            deadline=math.inf if a.ttl_ms is None else (self.ms + a.ttl_ms) * MS,
            answer_expiry=a.answer_expiry,
        )

    def _offer(self, a: Arrival) -> None:
        request = self._request(a, a.cost)
        self.step, self.step_tenant = "arrive", request.tenant
        self.step_offer = f"a request of cost {request.cost} (class {request.priority!r})"
        self.step_refusal = ""
        try:
            self.queue.offer(request, self.now)
        except Overloaded as exc:  # QuotaExceeded included: refused, nothing queued
            self.step_refusal = f"{type(exc).__name__}: {exc}"
            if request.reply.state is not RequestState.QUEUED:
                raise InvariantViolation(
                    "outcome",
                    f"a refused request's reply was touched (state {request.reply.state.value})",
                ) from None
        self.holds()

    @rule(k=st.integers(0, 1 << 16))
    def cancel(self, k: int) -> None:
        waiting = [
            t
            for t in self.observer.pending.values()
            if t.request.reply.state is RequestState.QUEUED
        ]
        self.step = "cancel"
        if waiting:
            t = waiting[k % len(waiting)]
            self.cancelled.add(id(t.request.reply))
            t.request.reply.withdraw()

    @rule(ms=st.sampled_from([1, 1, 2, 5, 10, 50, 250, 1000]))
    def advance(self, ms: int) -> None:
        self.ms += ms
        self.step = "advance"

    @rule()
    def advance_to_next_event(self) -> None:
        """Jump to the next close time or expiry (whichever is first), if any."""
        at = min(self.queue.next_close_time(), self.queue.next_expiry())
        self.step = "advance"
        if math.isfinite(at) and at > self.now:
            self.ms = max(self.ms, math.ceil(round(at / MS, 6)))

    @rule()
    def pull(self) -> None:
        self.step = "pull"
        batch = self.queue.next_batch(self.now)
        if batch:
            self.in_service.append(batch)

    @rule()
    def serve(self) -> None:
        """Pull until no batch closes at this instant (batchers pulling back to back)."""
        for _ in range(64):
            self.step = "pull"
            batch = self.queue.next_batch(self.now)
            self.holds()
            if not batch:
                break
            self.in_service.append(batch)

    @rule()
    def complete(self) -> None:
        self.step = "complete"
        if self.in_service:
            batch = self.in_service.pop(0)
            for req in batch:
                req.reply.set_result(req.item)
            self.queue.completed(batch, self.now)

    @rule()
    def expire(self) -> None:
        self.step = "expire"
        self.queue.expire(self.now)
        for t in self.observer.pending.values():
            r = t.request
            if r.answer_expiry and r.deadline <= self.now and r.reply.state is RequestState.QUEUED:
                raise InvariantViolation(
                    "deadline",
                    f"expire(t={self.now:.6g}) left {self.observer.describe(t)} queued past "
                    "its deadline, unanswered",
                )

    # ------------------------------------------------------------ checks
    @invariant()
    def holds(self) -> None:
        if self.observer is None:
            return
        self.observer.sweep(self.now, len(self.queue))
        for t in self.observer.take_gone():  # the queue's own sweeps' finds too
            self._check_gone(t)
        self.observer.raise_first()
        self._check_footprint()

    def _check_footprint(self) -> None:
        """Memory bounded by configuration and by what is queued: each of the queue's
        containers, dead entries included, holds at most 4/3 of the bound, plus one
        (FairQueue compacts one when a quarter of its entries are dead); the arrival
        orders and the expiry heap, compacted after every departure, also at most 4/3
        of the live requests, plus one (the flows are compacted at the next offer)."""
        limit = (4 * self.cfg.bound) // 3 + 1
        live = len(self.queue)
        for name, n in footprint(self.queue).items():
            self.peak[name] = max(self.peak.get(name, 0), n)
            if n > limit:
                raise InvariantViolation(
                    "memory",
                    f"at t={self.now:.6g} the queue's {name} container holds {n} entries, "
                    f"over 4/3 of its bound {self.cfg.bound} (+1); live requests: {live}",
                )
            if name != "flows" and n > (4 * live) // 3 + 1:
                raise InvariantViolation(
                    "memory",
                    f"at t={self.now:.6g} (after {self.step}) the queue's {name} container "
                    f"holds {n} entries, over 4/3 of its {live} live requests (+1): dead "
                    "entries are not compacted",
                )

    def _check_gone(self, t: Tracked) -> None:
        """``t`` left the queue without being dispatched: was that allowed?"""
        r = t.request
        state = r.reply.state
        expired = r.deadline <= self.now
        if state is RequestState.CANCELLED:
            if id(r.reply) in self.cancelled or (expired and not r.answer_expiry):
                return
            raise InvariantViolation(
                "lost",
                f"{self.observer.describe(t)} was withdrawn by the queue at t={self.now:.6g}, "
                "before its deadline, and never answered: its caller waits forever",
            )
        if state is RequestState.DONE:
            if expired and r.answer_expiry:
                return  # answered DeadlineExceeded
            if self.step == "arrive" and self.step_tenant != r.tenant:
                # pushed out of a full queue by another tenant's request
                if not self.step_refusal:
                    self.observer.exercised["push-outs"] += 1
                    return
                raise InvariantViolation(
                    "push-out",
                    f"{self.observer.describe(t)} was pushed out of the queue at "
                    f"t={self.now:.6g} (answered {r.reply.error!r}) for "
                    f"{self.step_offer} of tenant {self.step_tenant!r}, which the queue "
                    f"then refused ({self.step_refusal}): it was shed for nothing",
                )
            raise InvariantViolation(
                "outcome",
                f"{self.observer.describe(t)} was answered by the queue at t={self.now:.6g} "
                f"during a {self.step!r} step without being dispatched, expired or pushed out",
            )

    def teardown(self) -> None:
        if self.queue is None:
            return
        obs = self.observer
        # Flush: serve everything still live, as a batcher pulling continuously would.
        for _ in range(10_000):
            self.queue.expire(self.now)
            self.step = "pull"
            batch = self.queue.next_batch(self.now)
            self.holds()
            if batch:
                continue
            if not obs.live(self.now):
                break
            at = min(self.queue.next_close_time(), self.queue.next_expiry())
            if not math.isfinite(at) or at <= self.now:
                stuck = obs.live(self.now)[0]
                raise InvariantViolation(
                    "lost",
                    f"at t={self.now:.6g} {obs.describe(stuck)} is queued, yet no batch "
                    "closes now and no close time or expiry is due: it would wait forever",
                )
            self.ms = max(self.ms + 1, math.ceil(round(at / MS, 6)))
        drained = self.queue.drain()
        left = {
            id(t.request.reply)
            for t in obs.pending.values()
            if t.request.reply.state is RequestState.QUEUED
        }
        if {id(r.reply) for r in drained} != left:
            raise InvariantViolation(
                "lost",
                f"drain() returned {len(drained)} requests, but {len(left)} were still queued",
            )
        if len(self.queue) != 0:
            raise InvariantViolation(
                "memory", f"the queue holds {len(self.queue)} entries after drain()"
            )
        for r in drained:
            r.reply.set_error(RuntimeError("drained"))
        self.step = "drain"
        self.holds()
        for feature, n in obs.exercised.items():
            note("queue", feature, n)
