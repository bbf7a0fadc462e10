"""Suite ``queue``: a hypothesis state machine over the sans-IO FairQueue.

Fast (no trio, no tasks): arrivals from several tenants and classes with random costs
and deadlines (single requests, and calls of several items queued all or none),
caller cancellations, callers leaving at their own deadline (``withdrawn_at_deadline``),
hedge copies (``offer_spare``), time advances, pulls, completions, failed batches
(``completed(failed=True)``, then answered with errors, or handed back whole or split
and run again, as the scheduler does) and expiry sweeps, under random limits (batch
size and tokens, padding, bound, adaptive limit, queue shares, weights, aging bounds).
After every step the QueueObserver's invariants are checked, plus the queue's own
duties: only an expired request is expired, only a full queue pushes a request out
(a hedge copy's room first), and only for a request or call it then queues,
``expire(now)`` leaves nothing expired queued, nothing on a device is touched by the
queue; and its accounting against the reference (``fuzz/_callers.py``): every caller
ends once, its credits kept exactly when one of its requests ran, the queue's live
count, cost in service, service rate, fair-share counters and flow statistics. Its
queues rebase their fair-share counters at a low threshold (``REBASE_AT``), so that
the rebase, which must change no decision, runs under every check.
At teardown the queue is flushed (pulls until empty), what is on the devices
finished, and drained.
"""

from __future__ import annotations

import math
import sys

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from trioserve import DeadlineExceeded, ModelError, Overloaded, Request, RequestState
from trioserve.actors import BatchLimits, ClassSpec

from ._callers import Callers
from ._checker import InvariantViolation, QueueObserver
from ._product import PRODUCT, Product, observed_queue_class
from ._queue_checks import QueueChecks
from ._stats import count_example, note

TENANTS = ("t0", "t1", "t2", "t3")
CLASSES = ("c0", "c1", "c2")
MS = 1e-3
#: The suite's queues rebase their fair-share counters once one reaches this (the
#: product's threshold, 2**32, is far beyond what the suite serves): a rebase must
#: change no decision, so every check holds the same, and the suite sees it at work.
REBASE_AT = 4.0


def rebasing(queue_class: type) -> type:
    """``queue_class`` with its fair-share counters rebased at ``REBASE_AT``, counting
    its rebases (``rebases``, for the summary)."""

    class Rebasing(queue_class):  # type: ignore[misc, valid-type]
        rebases = 0

        def _rebase(self, c: int) -> None:
            self.rebases += 1
            super()._rebase(c)

    Rebasing.REBASE_AT = REBASE_AT
    Rebasing.__name__ = Rebasing.__qualname__ = queue_class.__name__
    return Rebasing


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


class QueueMachine(QueueChecks, RuleBasedStateMachine):
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
        self.callers: Callers | None = None
        #: batches handed back after a failure, to run again (the scheduler's retries)
        self.retries: list[list[Request]] = []
        #: the hedge copies queued when the current "arrive" step began
        self.step_copies: list[Request] = []
        # the reference of the queue's service rate (FairQueue.completed's rule)
        self.ref_rate = 0.0
        self.ref_prev_full = False
        self.ref_last_done = -math.inf

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
        queue_class = observed_queue_class(rebasing(self.product.queue_class))
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
        self.callers = Callers(self.observer, self.cancelled)
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
        self.step_copies = self._queued_copies()
        try:
            self.queue.offer_all(call, self.now)
        except Overloaded as exc:  # QuotaExceeded included: refused whole
            self.step_refusal = f"{type(exc).__name__}: {exc}"
            self.callers.expected[call[0].tenant, call[0].priority]["shed"] += len(call)
        else:
            for r in call:
                self.callers.admitted(r, single=False)
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
        self.step_copies = self._queued_copies()
        try:
            self.queue.offer(request, self.now)
        except Overloaded as exc:  # QuotaExceeded included: refused, nothing queued
            self.step_refusal = f"{type(exc).__name__}: {exc}"
            self.callers.expected[request.tenant, request.priority]["shed"] += 1
            if request.reply.state is not RequestState.QUEUED:
                raise InvariantViolation(
                    "outcome",
                    f"a refused request's reply was touched (state {request.reply.state.value})",
                ) from None
        else:
            self.callers.admitted(request, single=True)
        self.holds()

    def _queued_copies(self) -> list[Request]:
        return [r for r in self.callers.copies if r.reply.state is RequestState.QUEUED]

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
            caller = self.callers.of[id(t.request.reply)]
            if caller.end is None:  # its caller leaves, at or before its deadline
                self.callers.waiting.remove(caller)
                self.callers.leave(caller, self.now)

    @rule(k=st.integers(0, 1 << 16))
    def deadline_passes(self, k: int) -> None:
        """A caller whose own deadline has passed (a request that does not answer its
        expiry: the deadline is its caller's cancel scope) leaves now, whether the
        queue already withdrew its request (its expiry came first) or not; the
        runtime notes a request it finds queued with ``withdrawn_at_deadline``."""
        self.step = "deadline"
        due = [
            c for c in self.callers.waiting
            if not c.original.answer_expiry and c.original.deadline <= self.now
        ]
        if due:
            caller = due[k % len(due)]
            self.callers.waiting.remove(caller)
            self.observer.exercised[
                "callers leaving at their deadline, "
                + ("still queued" if caller.original.reply.state is RequestState.QUEUED
                   else "not queued")
            ] += 1
            self.callers.leave(caller, self.now)

    @rule(k=st.integers(0, 1 << 16))
    def hedge(self, k: int) -> None:
        """A copy of a waiting caller's request, queued or running (the runtime hedges
        a request alone, once), offered into free room only (``offer_spare``)."""
        self.step = "hedge"
        DISPATCHED = RequestState.DISPATCHED
        can = [
            c for c in self.callers.waiting
            if c.single and c.copy is None and c.original.deadline > self.now
            and c.original.reply.state in (RequestState.QUEUED, DISPATCHED)
        ]
        if not can:
            return
        caller = can[k % len(can)]
        original = caller.original
        copy = attrs.evolve(original, reply=type(original.reply)(), arrival=self.now)
        queue = self.queue
        before, capacity = len(queue), queue.capacity()
        if queue.offer_spare(copy, self.now):
            self.callers.hedged(caller, copy)
            self.observer.exercised["hedge copies queued"] += 1
            if before >= capacity:
                raise InvariantViolation(
                    "push-out",
                    f"offer_spare took {self.callers.describe(copy)} at t={self.now:.6g} "
                    f"into a queue holding {before} requests, at its capacity {capacity}: "
                    "a copy takes free room only",
                )
        else:
            self.observer.exercised["hedge copies declined"] += 1
            if copy.reply.state is not RequestState.QUEUED or len(queue) != before:
                raise InvariantViolation(
                    "outcome",
                    f"offer_spare declined a copy at t={self.now:.6g} yet touched it or "
                    f"the queue (its reply {copy.reply.state.value}, {before} queued "
                    f"before, {len(queue)} after)",
                )

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
            if batch:
                self.in_service.append(batch)
            self.holds()
            if not batch:
                break

    @rule()
    def complete(self) -> None:
        self.step = "complete"
        if self.in_service:
            batch = self.in_service.pop(0)
            for req in batch:
                self._answer(req, None)
            self._completed(batch, failed=False)

    @rule(k=st.integers(0, 1 << 16), how=st.sampled_from(["error", "retry", "split"]))
    def fail(self, k: int, how: str) -> None:
        """A batch in service fails: ``completed(failed=True)``, then its requests
        are answered with the model's error, or the batch is handed back to run
        again, whole or split in two (the batcher's bisection)."""
        self.step = "fail"
        if not self.in_service:
            return
        batch = self.in_service.pop(k % len(self.in_service))
        self._completed(batch, failed=True)
        self.observer.exercised[f"failed batches ({how})"] += 1
        if how == "error":
            for req in batch:
                self._answer(req, ModelError(f"planted failure of item {req.item}"))
            return
        for req in batch:
            req.reply.suspect = req.reply.ran = True  # as split_failed marks them
        half = len(batch) // 2 if how == "split" else 0
        self.retries.extend(part for part in (batch[:half], batch[half:]) if part)

    @rule()
    def rerun(self) -> None:
        """The next batch handed back runs again (``SchedulerActor._next_retry``):
        without the requests whose caller left, those past their deadline answered
        (or withdrawn, for the caller's own deadline), the rest back in service."""
        self.step = "rerun"
        if not self.retries:
            return
        alive = []
        for req in self.retries.pop(0):
            reply = req.reply
            if reply.state is not RequestState.DISPATCHED:
                continue  # the caller left
            if req.deadline <= self.now:
                if req.answer_expiry:
                    self._answer(req, DeadlineExceeded("deadline passed while retried"))
                else:
                    self.cancelled.add(id(reply))
                    reply.withdraw()
                continue
            alive.append(req)
        if alive:
            self.queue.in_service += sum(r.cost for r in alive)
            self.in_service.append(alive)
            self.observer.exercised["retried batches run again"] += 1

    def _answer(self, req: Request, error: BaseException | None) -> None:
        """A device answers ``req`` (dropped if its caller left)."""
        if req.reply.state is RequestState.DONE:
            raise InvariantViolation(
                "duplicated",
                f"{self.callers.describe(req)} is answered twice: its batch answers it at "
                f"t={self.now:.6g}, but it was answered already ({req.reply.error!r})",
            )
        if error is None:
            req.reply.set_result(req.item)
        else:
            req.reply.set_error(error)
        self.callers.settle(self.now)  # its caller takes it, withdraws the twin

    def _completed(self, batch: list[Request], *, failed: bool) -> None:
        """``queue.completed`` and the reference's rate rule; a completion moves no
        fair-share counter."""
        queue = self.queue
        vt = [dict(v) for v in getattr(queue, "_vt", ())]
        queue.completed(batch, self.now, failed=failed)
        if [dict(v) for v in getattr(queue, "_vt", ())] != vt:
            raise InvariantViolation(
                "accounting",
                f"completed(failed={failed}) at t={self.now:.6g} moved the fair-share "
                "counters: service is counted when a batch is dispatched",
            )
        if failed:
            self.ref_prev_full = False
            return
        lim = queue.limits
        cost = sum(r.cost for r in batch)
        full = len(batch) >= lim.max_size or (
            lim.max_tokens is not None and 2 * cost > lim.max_tokens
        )
        if full and self.ref_prev_full and self.now > self.ref_last_done:
            sample = cost / (self.now - self.ref_last_done)
            self.ref_rate = sample if self.ref_rate <= 0.0 else 0.9 * self.ref_rate + 0.1 * sample
        self.ref_prev_full = full
        self.ref_last_done = self.now

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
        self._check_devices()
        self.callers.settle(self.now)
        self.observer.sweep(self.now, len(self.queue))
        for t in self.observer.take_gone():  # the queue's own sweeps' finds too
            self._check_gone(t)
        self.observer.raise_first()
        self._check_footprint()
        self._check_accounting()

    def teardown(self) -> None:
        # hypothesis calls teardown in a ``finally``: after a failed step, the flush
        # below would report a later consequence in place of the violation itself
        if self.queue is None or sys.exc_info()[1] is not None:
            return
        obs = self.observer
        # Flush: serve everything still live, as a batcher pulling continuously would.
        for _ in range(10_000):
            self.queue.expire(self.now)
            self.step = "pull"
            batch = self.queue.next_batch(self.now)
            if batch:
                self.in_service.append(batch)
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
        # Callers whose own deadline passed leave (their cancel scope fired); the
        # devices finish what they hold, retries included.
        callers = self.callers
        for caller in list(callers.waiting):
            if not caller.original.answer_expiry and caller.original.deadline <= self.now:
                callers.waiting.remove(caller)
                callers.leave(caller, self.now)
        self.holds()
        for _ in range(10_000):
            if self.retries:
                self.rerun()
            elif self.in_service:
                self.complete()
            else:
                break
            self.holds()
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
            callers.expected[r.tenant, r.priority]["closed"] += 1  # failed, never run
            caller = callers.of[id(r.reply)]
            if caller in callers.waiting:  # not a refund question: shut down
                callers.waiting.remove(caller)
                caller.end = "drained"
            r.reply.set_error(RuntimeError("drained"))
        self.step = "drain"
        self.holds()
        if callers.waiting:
            caller = callers.waiting[0]
            raise InvariantViolation(
                "lost",
                f"caller #{caller.no} ({callers.describe(caller.original)}) is never "
                f"answered: everything is served, yet its replies are "
                f"{[r.reply.state.value for r in caller.requests]}",
            )
        for feature, n in obs.exercised.items():
            note("queue", feature, n)
        note("queue", "fair-share counters rebased", getattr(self.queue, "rebases", 0))
