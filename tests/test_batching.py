"""The sans-IO batching core (BatchLimits, BatchBuilder, FifoQueue), driven directly:
no trio run, time is an argument. Property tests use plain hypothesis.

Times here are whole numbers of milliseconds held in floats, so every sum the queue
and the checker compute is exact.
"""

from __future__ import annotations

import math

import pytest
import trio
import trioserve
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from trioserve import DeadlineExceeded, Overloaded, RequestState
from trioserve.actors import BatchBuilder, BatchLimits, FifoQueue

QUEUED = RequestState.QUEUED
DISPATCHED = RequestState.DISPATCHED


def req(*, cost=1, arrival=0.0, deadline=math.inf, answer_expiry=False, item=None):
    return trioserve.Request(
        model="m",
        item=item,
        cost=cost,
        arrival=arrival,
        deadline=deadline,
        answer_expiry=answer_expiry,
    )


def batch_cost(limits: BatchLimits, batch) -> int:
    costs = [r.cost for r in batch]
    return len(costs) * max(costs) if limits.padded else sum(costs)


# ---------------------------------------------------------------- BatchBuilder
def test_builder_counts_sum_of_costs_when_unpadded():
    b = BatchBuilder(BatchLimits(max_size=10, max_tokens=10))
    for cost in (3, 4):
        assert b.fits(cost)
        b.add(cost)
    assert b.cost == 7
    assert b.cost_with(3) == 10
    assert b.fits(3)
    assert not b.fits(4)


def test_builder_counts_padding_when_padded():
    b = BatchBuilder(BatchLimits(max_size=10, max_tokens=10, padded=True))
    b.add(2)
    b.add(5)
    assert b.cost == 10  # 2 items x longest 5
    assert b.cost_with(1) == 15  # 3 items x longest 5
    assert not b.fits(1)


def test_builder_stops_at_max_size_without_token_budget():
    b = BatchBuilder(BatchLimits(max_size=2))
    b.add(100)
    assert b.fits(100)
    b.add(100)
    assert not b.fits(1)


def test_limits_reject_zero_size():
    with pytest.raises(ValueError, match="max_size"):
        BatchLimits(max_size=0)


# ---------------------------------------------------------------- FifoQueue examples
def test_batch_closes_at_max_size_at_once():
    q = FifoQueue(BatchLimits(max_size=3, max_wait=1000.0), bound=100)
    rs = [req(arrival=0.0) for _ in range(4)]
    for r in rs:
        q.offer(r, 0.0)
    assert q.next_batch(0.0) == rs[:3]
    assert all(r.reply.state is DISPATCHED for r in rs[:3])
    assert q.next_batch(0.0) is None
    assert q.next_close_time() == 1000.0
    assert q.next_batch(999.0) is None
    assert q.next_batch(1000.0) == rs[3:]


def test_batch_closes_when_oldest_waited_max_wait_and_not_before():
    q = FifoQueue(BatchLimits(max_size=8, max_wait=5.0), bound=100)
    a, b = req(arrival=10.0), req(arrival=12.0)
    q.offer(a, 10.0)
    q.offer(b, 12.0)
    assert q.next_close_time() == 15.0
    assert q.next_batch(14.0) is None
    assert a.reply.state is QUEUED
    assert q.next_batch(15.0) == [a, b]
    assert q.next_close_time() == math.inf


def test_batch_closes_on_token_budget():
    q = FifoQueue(BatchLimits(max_size=8, max_tokens=10, max_wait=100.0), bound=100)
    rs = [req(cost=4) for _ in range(3)]
    for r in rs:
        q.offer(r, 0.0)
    assert q.next_batch(0.0) == rs[:2]  # 8 tokens; a third would make 12
    assert q.next_batch(0.0) is None
    assert q.next_batch(100.0) == rs[2:]


# Regression: a batch whose cost reached the budget exactly waited for max_wait (it
# closed only when a next request did not fit).
@pytest.mark.parametrize(("padded", "costs"), [(False, (5, 5)), (False, (4, 6)), (True, (5, 5))])
def test_batch_closes_at_once_when_its_cost_reaches_the_budget_exactly(padded, costs):
    q = FifoQueue(BatchLimits(max_size=8, max_tokens=10, max_wait=100.0, padded=padded), bound=9)
    rs = [req(cost=c) for c in costs]
    for r in rs:
        q.offer(r, 0.0)
    assert q.next_batch(0.0) == rs


def test_padded_token_budget_counts_items_times_longest():
    q = FifoQueue(BatchLimits(max_size=8, max_tokens=10, max_wait=100.0, padded=True), bound=100)
    rs = [req(cost=c) for c in (2, 5, 1, 1)]
    for r in rs:
        q.offer(r, 0.0)
    # 2 items x 5 = 10 fits; a third makes 3 x 5 = 15.
    assert q.next_batch(0.0) == rs[:2]
    assert q.next_batch(0.0) is None
    assert q.next_batch(100.0) == rs[2:]


def test_oversize_request_runs_alone_and_closes_the_batch_before_it():
    q = FifoQueue(
        BatchLimits(max_size=8, max_tokens=10, max_wait=100.0, oversize="alone"), bound=100
    )
    small, big, after = req(cost=2), req(cost=50), req(cost=2)
    for r in (small, big, after):
        q.offer(r, 0.0)
    assert q.next_batch(0.0) == [small]
    assert q.next_batch(0.0) == [big]
    assert q.next_batch(0.0) is None
    assert q.next_batch(100.0) == [after]


def test_withdrawn_request_is_never_dispatched():
    q = FifoQueue(BatchLimits(max_size=2, max_wait=10.0), bound=100)
    a, b, c = req(), req(), req()
    for r in (a, b, c):
        q.offer(r, 0.0)
    b.reply.withdraw()
    assert b.reply.state is RequestState.CANCELLED
    assert q.next_batch(0.0) == [a, c]
    assert q.next_batch(100.0) is None
    assert b.reply.state is RequestState.CANCELLED


def test_withdrawn_head_does_not_hold_the_close_time():
    q = FifoQueue(BatchLimits(max_size=8, max_wait=10.0), bound=100)
    a, b = req(arrival=0.0), req(arrival=4.0)
    q.offer(a, 0.0)
    q.offer(b, 4.0)
    a.reply.withdraw()
    assert q.next_close_time() == 14.0
    assert q.next_batch(10.0) is None
    assert q.next_batch(14.0) == [b]


def test_queue_bound_raises_overloaded():
    q = FifoQueue(BatchLimits(max_size=8, max_wait=10.0), bound=2, model="m")
    q.offer(req(), 0.0)
    q.offer(req(), 0.0)
    with pytest.raises(Overloaded, match=r"model 'm': queue full \(2 requests waiting\)"):
        q.offer(req(), 0.0)
    assert len(q) == 2


def test_model_deadline_expires_with_deadline_exceeded():
    q = FifoQueue(BatchLimits(max_size=8, max_wait=100.0), bound=100, model="m")
    timed = req(arrival=0.0, deadline=30.0, answer_expiry=True)
    caller = req(arrival=0.0, deadline=20.0, answer_expiry=False)
    keep = req(arrival=0.0)
    for r in (timed, caller, keep):
        q.offer(r, 0.0)
    # Only model deadlines are in the expiry heap: a caller's own scope fires itself.
    assert q.next_expiry() == 30.0
    assert q.expire(29.0) == 0
    assert q.expire(30.0) == 1
    assert timed.reply.state is RequestState.DONE
    with pytest.raises(DeadlineExceeded, match=r"model 'm': deadline passed after 30\.000s"):
        trio.run(timed.reply.wait)  # already answered: returns at its first checkpoint
    assert q.next_expiry() == math.inf
    # The caller-deadline request is dropped unanswered at its deadline, never dispatched.
    assert q.next_batch(100.0) == [keep]
    assert caller.reply.state is QUEUED  # never answered, never dispatched


def test_expired_requests_are_skipped_by_next_batch():
    q = FifoQueue(BatchLimits(max_size=2, max_wait=100.0), bound=100)
    a = req(arrival=0.0)
    dead = req(arrival=0.0, deadline=5.0, answer_expiry=True)
    c = req(arrival=0.0)
    for r in (a, dead, c):
        q.offer(r, 0.0)
    assert q.next_batch(6.0) == [a, c]  # without an expire() call first
    assert dead.reply.state is RequestState.DONE
    with pytest.raises(DeadlineExceeded):
        trio.run(dead.reply.wait)
    assert q.expired == 1


def test_drain_returns_queued_requests_only():
    q = FifoQueue(BatchLimits(max_size=8, max_wait=10.0), bound=100)
    a, b, c = req(), req(), req(deadline=50.0, answer_expiry=True)
    for r in (a, b, c):
        q.offer(r, 0.0)
    a.reply.withdraw()
    assert q.drain() == [b, c]
    assert len(q) == 0
    assert q.next_expiry() == math.inf
    assert q.next_batch(1000.0) is None


def test_reply_answers_once_and_drops_answers_for_a_gone_caller():
    r = req()
    assert r.reply.dispatch()
    assert not r.reply.dispatch()
    assert r.reply.set_result({"y": 1})
    with pytest.raises(trioserve.ActorBroken, match="cannot go from done to done"):
        r.reply.set_result({"y": 2})
    gone = req()
    gone.reply.dispatch()
    gone.reply.withdraw()
    assert gone.reply.state is RequestState.ABANDONED
    assert not gone.reply.set_result({"y": 1})
    assert not gone.reply.set_error(RuntimeError("x"))


# ---------------------------------------------------------------- the property checker
class QueueChecker:
    """Drives a FifoQueue and checks every answer against the batching rules.

    ``pending`` is the checker's own record of what is queued and not withdrawn, in
    arrival order; every batch must be its prefix (FIFO, nothing skipped).
    """

    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self.q = FifoQueue(limits, bound=10_000)
        self.now = 0.0
        self.pending: list[trioserve.Request] = []
        self.offered: list[trioserve.Request] = []
        self.cancelled: set[int] = set()
        self.dispatched: dict[int, int] = {}
        self.order: list[trioserve.Request] = []

    def oversize(self, r) -> bool:
        return self.limits.max_tokens is not None and r.cost > self.limits.max_tokens

    def timed_out(self, r) -> bool:
        return r.arrival + self.limits.max_wait <= self.now

    def token_closed(self, batch, nxt) -> bool:
        """True when ``nxt`` cannot join ``batch`` without breaking the token budget."""
        if self.limits.max_tokens is None:
            return False
        return batch_cost(self.limits, [*batch, nxt]) > self.limits.max_tokens

    def budget_full(self, batch) -> bool:
        """True when ``batch`` costs its whole token budget (nothing more can join)."""
        lim = self.limits
        return lim.max_tokens is not None and batch_cost(lim, batch) >= lim.max_tokens

    # ---- actions
    def arrive(self, cost: int) -> None:
        r = req(cost=cost, arrival=self.now)
        self.q.offer(r, self.now)
        self.pending.append(r)
        self.offered.append(r)

    def cancel(self, pick: int) -> None:
        if not self.pending:
            return
        r = self.pending.pop(pick % len(self.pending))
        r.reply.withdraw()
        assert r.reply.state is RequestState.CANCELLED
        self.cancelled.add(id(r))

    def advance(self, to: float) -> None:
        """Move time forward to ``to``, polling at every close time on the way."""
        assert to >= self.now
        while (t := self.q.next_close_time()) <= to:
            assert t > self.now, "a closed batch was left in the queue"
            self.now = t
            self.poll()
        self.now = to
        self.poll()

    def poll(self) -> None:
        while (batch := self.q.next_batch(self.now)) is not None:
            self.check_batch(batch)
        self.check_nothing_closed()

    def finish(self) -> None:
        while self.pending:
            t = self.q.next_close_time()
            assert t < math.inf, "pending requests but no close time"
            self.advance(t)
        assert self.q.next_batch(self.now + 10_000.0) is None
        assert self.q.next_close_time() == math.inf

    # ---- checks
    def check_batch(self, batch) -> None:
        lim = self.limits
        assert batch, "an empty batch was returned"
        n = len(batch)
        # FIFO, nothing skipped, nothing dispatched twice.
        assert [id(r) for r in batch] == [id(r) for r in self.pending[:n]]
        for r in batch:
            assert r.reply.state is DISPATCHED
            assert id(r) not in self.cancelled
            self.dispatched[id(r)] = self.dispatched.get(id(r), 0) + 1
        # Budgets.
        alone = n == 1 and self.oversize(batch[0])
        if alone:
            assert lim.oversize == "alone"
        else:
            assert n <= lim.max_size
            if lim.max_tokens is not None:
                assert batch_cost(lim, batch) <= lim.max_tokens
        # Never before it closed: full, timed out, the next item does not fit, or alone.
        rest = self.pending[n:]
        full = n == lim.max_size
        timed = self.timed_out(batch[0])
        by_tokens = (bool(rest) and self.token_closed(batch, rest[0])) or self.budget_full(
            batch
        )
        assert full or timed or by_tokens or alone, (
            f"batch of {n} returned at {self.now} before it closed"
        )
        del self.pending[:n]
        self.order.extend(batch)

    def check_nothing_closed(self) -> None:
        """After polling to None: no batch that has closed is still waiting."""
        if not self.pending:
            return
        lim = self.limits
        head = self.pending[0]
        assert not self.timed_out(head), "oldest request waited past max_wait"
        assert not self.oversize(head), "oversize request at the head was not run"
        assert len(self.pending) < lim.max_size, "a full batch was not returned"
        taken: list[trioserve.Request] = []
        for r in self.pending:
            assert not (taken and self.token_closed(taken, r)), "token budget reached"
            taken.append(r)
            assert not self.budget_full(taken), "a batch at its token budget was not returned"

    def check_end(self) -> None:
        for r in self.offered:
            if id(r) in self.cancelled:
                assert id(r) not in self.dispatched
                assert r.reply.state is RequestState.CANCELLED
            else:
                assert self.dispatched.get(id(r)) == 1
        kept = [r for r in self.offered if id(r) not in self.cancelled]
        assert [id(r) for r in self.order] == [id(r) for r in kept]


@st.composite
def limits_and_costs(draw):
    max_size = draw(st.integers(1, 6))
    max_tokens = draw(st.one_of(st.none(), st.integers(1, 20)))
    max_wait = float(draw(st.sampled_from([0, 1, 5, 20])))
    padded = draw(st.booleans())
    oversize_allowed = max_tokens is not None and draw(st.booleans())
    top = 30 if max_tokens is None or oversize_allowed else max_tokens
    limits = BatchLimits(
        max_size=max_size,
        max_tokens=max_tokens,
        max_wait=max_wait,
        padded=padded,
        oversize="alone" if oversize_allowed else "reject",
    )
    return limits, st.integers(1, top)


OPS = ("arrive", "cancel", "poll")


@settings(max_examples=300, deadline=None)
@given(data=st.data(), setup=limits_and_costs())
def test_fifo_queue_properties_over_random_arrivals(data, setup):
    limits, costs = setup
    checker = QueueChecker(limits)
    steps = data.draw(
        st.lists(
            st.tuples(
                st.sampled_from(OPS),
                st.integers(0, 8),  # ms since the previous step
                costs,
                st.integers(0, 1000),  # which pending request to cancel
            ),
            max_size=60,
        )
    )
    for op, dt, cost, pick in steps:
        checker.advance(checker.now + float(dt))
        if op == "arrive":
            checker.arrive(cost)
        elif op == "cancel":
            checker.cancel(pick)
        checker.poll()
    checker.finish()
    checker.check_end()


class FifoQueueMachine(RuleBasedStateMachine):
    """The same rules as a state machine: hypothesis picks the interleaving."""

    def __init__(self) -> None:
        super().__init__()
        self.checker: QueueChecker | None = None

    @precondition(lambda self: self.checker is None)
    @rule(setup=limits_and_costs())
    def configure(self, setup):
        limits, costs = setup
        self.checker = QueueChecker(limits)
        self.costs = costs

    @precondition(lambda self: self.checker is not None)
    @rule(data=st.data())
    def arrive(self, data):
        self.checker.arrive(data.draw(self.costs))
        self.checker.poll()

    @precondition(lambda self: self.checker is not None)
    @rule(pick=st.integers(0, 1000))
    def cancel(self, pick):
        self.checker.cancel(pick)
        self.checker.poll()

    @precondition(lambda self: self.checker is not None)
    @rule(dt=st.integers(0, 25))
    def advance(self, dt):
        self.checker.advance(self.checker.now + float(dt))

    @invariant()
    def nothing_closed_is_left(self):
        if self.checker is not None:
            self.checker.check_nothing_closed()

    def teardown(self):
        if self.checker is not None:
            self.checker.finish()
            self.checker.check_end()


TestFifoQueueMachine = FifoQueueMachine.TestCase
TestFifoQueueMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
