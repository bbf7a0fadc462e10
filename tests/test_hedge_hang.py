"""A hedged request whose input hangs a worker thread (docs/faults.md, "A hedged
input that hangs").

A hedge copy is sent while its original runs, before its batch deadline: nothing is
known of the input yet, so a copy of an input that hangs hangs a second replica.
The original used to be retried as well, on a third replica, so one bad input
took three. Now a request and its hedge twin are one input, run on two replicas at
most: once one hangs, the other's run is the input's last (or, if it has not
started, it never does).
"""

from __future__ import annotations

import threading
import types

import outcome
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import GATE_LIMIT_S, callable_model, config, item
from test_hung_inputs import request, with_metrics
from test_thread_hang import HANG, SERVED_WITHIN, Hangs, hanging_model, healths, values
from trioserve import ModelError, Reply, Request
from trioserve._hedging import _Hedging
from trioserve.actors import BatchLimits, FifoQueue, SchedulerActor
from trioserve.actors._straggler import Hang, mark_hung


# ---------------------------------------------------------------- through the runtime
async def test_a_hedged_input_that_hangs_takes_two_replicas_at_most_and_is_answered_poison(
    manual_watchdog,
):
    """Three thread replicas, hedging after 1 ms. The input hangs its replica, its
    copy hangs a second; the original was retried on the third, which hung too, and
    the model served nobody. Now neither is run again: the caller gets the poison
    error once the copy's batch too ran past its deadline, and the third replica
    serves what comes. (The copy, hanging beside the original, moves the wall clock
    past both batches' deadlines.)"""
    model = Hangs(cut=2)
    try:
        cfg = hanging_model(model, replicas=3, hedge=True, hedge_after_ms=1)
        async with trioserve.open_runtime(config(cfg)) as rt:
            with trio.fail_after(SERVED_WITHIN):
                with pytest.raises(ModelError) as info:
                    await rt.infer("m", item(HANG))
            assert rt.hedges == 1
            assert model.runs_of(HANG) == [1, 1]  # the original and its copy, no more
            assert healths(rt) == ["degraded", "degraded", "ready"]
            assert "poison request, not retried" in str(info.value)
            assert "a hedged input is run on two replicas at most" in str(info.value)
            with trio.fail_after(SERVED_WITHIN):
                got = await values(rt, [float(v) for v in range(1, 9)])
            assert got == {float(v): 2.0 * v for v in range(1, 9)}
            assert model.runs_of(HANG) == [1, 1]
            assert rt.statistics()["m"]["statuses"]["poison"] == 2  # the two answered
            model.let_all_return()  # before the close, which waits for hung calls
    finally:
        model.let_all_return()


async def test_two_thread_replicas_send_no_hedge_copy_so_a_hanging_input_takes_one(
    manual_watchdog,
):
    """Two thread replicas, hedging after 1 ms. The copy of an input that hangs used
    to hang the other replica too, and the model served nobody (readiness 503,
    every request waiting to its deadline). No copy is sent now: the input takes
    its own replica, is answered poison, and the other replica serves. (The call
    moves the wall clock once the hedge delay has passed: a copy would be sent.)"""
    model = Hangs(cut=1, cut_after=0.001)
    try:
        cfg = hanging_model(model, replicas=2, hedge=True, hedge_after_ms=1)
        async with trioserve.open_runtime(config(cfg)) as rt:
            with trio.fail_after(SERVED_WITHIN):
                with pytest.raises(ModelError, match="poison request, not retried"):
                    await rt.infer("m", item(HANG))
            assert rt.hedges == 0
            assert model.runs_of(HANG) == [1]
            assert healths(rt) == ["degraded", "ready"]
            with trio.fail_after(SERVED_WITHIN):
                got = await values(rt, [float(v) for v in range(1, 9)])
            assert got == {float(v): 2.0 * v for v in range(1, 9)}
            assert model.runs_of(HANG) == [1]
            model.let_all_return()  # before the close, which waits for hung calls
    finally:
        model.let_all_return()


class SlowFirst:
    """A thread model doubling ``x`` whose first call blocks until the test lets it
    go on (a slow replica that is healthy: it would answer)."""

    def __init__(self) -> None:
        self.go_on = threading.Event()
        self.calls = 0
        self.finished = 0
        self._lock = threading.Lock()

    def __call__(self, items):
        with self._lock:
            self.calls += 1
            first = self.calls == 1
        if first and not self.go_on.wait(GATE_LIMIT_S):
            raise RuntimeError("the test never let the call go on")
        with self._lock:
            self.finished += 1
        return [{"y": it["x"] * 2} for it in items]


async def test_a_slow_healthy_replicas_hedge_is_still_answered_first(autojump_clock):
    """The rule costs a slow replica nothing: its request's copy runs on another
    replica and answers first, while the original still runs (no batch deadline is
    reached: a replica that is slow, not hung). Three replicas: with two, thread
    replicas send no copy (below)."""
    model = SlowFirst()
    cfg = callable_model(
        "m", model, execution="thread", replicas=3, max_batch_size=8, max_wait_ms=5,
        hedge=True, hedge_after_ms=50, timeout_ms=None,
    )
    try:
        async with trioserve.open_runtime(config(cfg)) as rt:
            out = await rt.infer("m", item(3.0))
            assert float(out["y"][0]) == 6.0
            assert rt.hedges == 1
            assert model.calls == 2
            assert model.finished == 1  # the copy's; the original still runs
            assert not model.go_on.is_set()
            model.go_on.set()
            for batcher in rt.models["m"].batchers:
                await batcher.join_thread()
            assert model.finished == 2
            assert rt.statistics()["m"]["statuses"].get("poison", 0) == 0
    finally:
        model.go_on.set()


def doubled(items):
    return [{"y": it["x"] * 2} for it in items]


@pytest.mark.parametrize(("replicas", "waits"), [(2, False), (3, True)])
async def test_no_hedge_wait_is_started_while_no_copy_could_be_sent(
    autojump_clock, monkeypatch, replicas, waits,
):
    """Two thread replicas send no hedge copy (``hedge_room``): the caller used to
    wait the hedge delay all the same, to be refused its copy then. It now waits
    for its answer alone; with three, the hedge is waited for."""
    from trioserve._hedging import _Hedging

    hedged = _Hedging._hedged
    started: list[float] = []

    async def note_hedged(self, scheduler, request, delay, refund):
        started.append(delay)
        return await hedged(self, scheduler, request, delay, refund)

    monkeypatch.setattr(_Hedging, "_hedged", note_hedged)
    cfg = callable_model(
        "m", doubled, execution="thread", replicas=replicas, max_batch_size=8,
        max_wait_ms=5, hedge=True, hedge_after_ms=50, timeout_ms=None,
    )
    async with trioserve.open_runtime(config(cfg)) as rt:
        out = await rt.infer("m", item(3.0))
        assert float(out["y"][0]) == 6.0
        assert started == ([0.05] if waits else [])
        if not waits:
            assert rt.hedges == 0


# ---------------------------------------------------------------- the queue's rule
class Replica:
    """What the scheduler reads of a replica pulling from it; ``running``: the
    replies of the batch it runs."""

    def __init__(self, *, ready: bool = True) -> None:
        self.ready = ready
        self.risking = False
        self.running: list = []

    def holds(self, reply) -> bool:
        return reply in self.running


def scheduler_of(*replicas: Replica, threads: bool = True) -> SchedulerActor:
    scheduler = SchedulerActor("m", FifoQueue(BatchLimits(max_size=4), bound=16))
    scheduler.batchers = list(replicas)
    scheduler.replicas = len(replicas)
    scheduler.threads = threads
    return scheduler


def copy_sent(scheduler: SchedulerActor, on: Replica) -> bool:
    """Whether a copy of a request running on ``on`` is queued."""
    original = Request(model="m", item=item(1.0), reply=Reply())
    original.reply.dispatch()
    on.running.append(original.reply)
    copy = Request(model="m", item=item(1.0), reply=Reply())
    sent = scheduler.submit_copy_nowait(original, copy)
    assert scheduler.queue_depth() == (1 if sent else 0)
    assert (copy.reply in scheduler.twins) is sent
    return sent


def test_thread_replicas_hedge_only_while_a_third_is_ready_to_serve():
    # two thread replicas: the original's and the copy's would be all of them
    a, b = Replica(), Replica()
    assert not copy_sent(scheduler_of(a, b), a)
    # three, one of them not ready (hung, or its breaker open): the same
    a, b, c = Replica(), Replica(), Replica(ready=False)
    assert not copy_sent(scheduler_of(a, b, c), a)
    # three ready: one is left that runs neither
    a, b, c = Replica(), Replica(), Replica()
    assert copy_sent(scheduler_of(a, b, c), a)
    # replicas that are killed at their deadline hedge with two, as before
    a, b = Replica(), Replica()
    assert copy_sent(scheduler_of(a, b, threads=False), a)


def hedged(scheduler: SchedulerActor, on: Replica) -> tuple[Request, Request]:
    """A request of ``HANG`` running on ``on``, and its hedge copy, queued."""
    original = Request(model="m", item=item(HANG), reply=Reply())
    original.reply.dispatch()
    on.running.append(original.reply)
    copy = Request(model="m", item=item(HANG), reply=Reply())
    assert scheduler.submit_copy_nowait(original, copy)
    return original, copy


def hangs(scheduler: SchedulerActor, replica: Replica, req: Request) -> Hang:
    """``req``'s batch, alone, ran past its deadline on ``replica``."""
    hang = Hang()
    mark_hung([req], hang)
    scheduler.note_hang([req], hang, replica, "its batch ran past its deadline of 0.100s")
    replica.ready = False
    return hang


async def test_a_request_whose_copy_runs_elsewhere_is_not_retried_when_it_hangs(
    autojump_clock,
):
    a, b, c = Replica(), Replica(), Replica()
    scheduler = scheduler_of(a, b, c)
    original, copy = hedged(scheduler, a)
    assert await scheduler.pull(b) == [copy]
    b.running.append(copy.reply)
    hangs(scheduler, a, original)
    # answered (its caller waits for the copy's run, the input's last), not retried
    with pytest.raises(ModelError, match="runs on another replica, which is its last run"):
        await original.reply.wait()
    hangs(scheduler, b, copy)  # the copy hangs too: poison, not retried either
    with pytest.raises(ModelError, match="and so did its hedge twin"):
        await copy.reply.wait()


async def test_a_copy_held_while_its_original_is_retried_never_runs_beside_it(
    autojump_clock,
):
    # Four replicas: the original hangs before its copy starts, and is retried
    # where a replica is spared. The copy, held apart, used to run on a third
    # replica meanwhile (a fourth one spared); it waits for the retry instead,
    # and once the retry is poison it is answered, never run.
    a, b, c, d = Replica(), Replica(), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(a, b, c, d))
    original, copy = hedged(scheduler, a)
    hangs(scheduler, a, original)
    assert copy.reply.hung is not None
    a.running.clear()
    original.reply.suspect = original.reply.ran = True
    scheduler.retry([[original]])
    assert await scheduler.pull(b) == [original]  # c and d to spare
    b.running.append(original.reply)
    got: list = []

    async def pull() -> None:
        got.append(await scheduler.pull(c))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull)
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # the copy waits apart, beside its original's retry
        assert scheduler.queue_depth() == 1
        # the retry hangs b too, and is answered poison (as the batcher does: its
        # input is marked so, then the queue looks at what it holds)
        original.reply.set_error(ModelError("poison request, not retried"))
        scheduler.metrics.statuses["poison"] += 1
        scheduler.poisoned_alone([original])
        scheduler.after_hang()
        with pytest.raises(ModelError, match=r"its hedge twin .* was not run again") as info:
            await copy.reply.wait()
        assert info.value.in_queue  # it never ran
        assert scheduler.metrics.statuses["poison"] == 2  # the input's two runs
        assert scheduler.queue_depth() == 0
        nursery.cancel_scope.cancel("the test is over")


@pytest.mark.parametrize("retry_answer", ["the model raised", "a value"])
async def test_a_copy_held_while_its_original_is_retried_is_not_poison_when_the_retry_is_not(
    autojump_clock, retry_answer,
):
    # As above, but the original's retry is answered otherwise than poison: the
    # model raises on it (a ModelError of its own), or it answers. The held copy
    # used to be answered poison all the same, and counted so; it is answered
    # "not run" now, not counted, and the hedged caller gets the retry's answer.
    a, b, c, d = Replica(), Replica(), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(a, b, c, d))
    original = Request(model="m", item=item(HANG), reply=Reply())
    original.reply.dispatch()
    a.running.append(original.reply)
    refunds: list[int] = []
    caller: list = []

    async def hedged_caller() -> None:
        caller.append(await outcome.acapture(
            _Hedging._hedged, types.SimpleNamespace(hedges=0), scheduler, original,
            0.001, lambda: refunds.append(1),
        ))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hedged_caller)
        await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked()
        copy_reply = scheduler.twins[original.reply]  # the copy is queued
        hangs(scheduler, a, original)
        assert copy_reply.hung is not None
        a.running.clear()
        original.reply.suspect = original.reply.ran = True
        scheduler.retry([[original]])
        assert await scheduler.pull(b) == [original]  # c and d to spare
        b.running.append(original.reply)
        innocent = request(1.0)
        scheduler.submit_nowait(innocent)
        assert await scheduler.pull(c) == [innocent]  # the copy is held apart
        assert scheduler.queue_depth() == 1
        b.running.clear()
        if retry_answer == "the model raised":
            original.reply.set_error(ModelError("model 'm' failed on cpu: boom"))
        else:
            original.reply.set_result(2.0)
        # b pulls again at once (nothing lets the hedged caller run first): its
        # look answers the held copy
        innocent = request(2.0)
        scheduler.submit_nowait(innocent)
        assert await scheduler.pull(b) == [innocent]
        assert not copy_reply.answerable
        await trio.testing.wait_all_tasks_blocked()
        assert caller
        if retry_answer == "the model raised":
            with pytest.raises(ModelError, match="boom"):
                caller[0].unwrap()
        else:
            assert caller[0].unwrap() == 2.0
        assert scheduler.metrics.statuses["poison"] == 0
        assert scheduler.queue_depth() == 0
        assert refunds == []  # the caller did not leave

