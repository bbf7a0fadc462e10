"""Edges of the fault handling (docs/faults.md): a part of a failed batch that waits
for another replica than the one it raised on (a retry, or a part kept apart from its
hedge twin's replica): answered at its deadline, taken at once when it can run,
settled when its original fails, and marked as never run when its queue closes."""

from __future__ import annotations

import math
import threading

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import (
    GATE_LIMIT_S,
    ILLEGAL_ACCESS,
    NoZygote,
    X,
    Y,
    _StandIn,
    callable_model,
    config,
    item,
    key,
)
from trioserve import DeadlineExceeded, ModelConfig, ModelError, Request
from trioserve.actors import BatchLimits, Breaker, FairQueue, SchedulerActor
from trioserve.actors._scheduler import ELSEWHERE_RECHECK

HOLD = 100.0  # the input that keeps its replica busy until the test releases it


class _Replica:
    """A puller as the scheduler sees one: ready or not."""

    def __init__(self, ready: bool = True) -> None:
        self.ready = ready


def _request(*, deadline: float = math.inf, answer_expiry: bool = False) -> Request:
    return Request(
        model="m", item=None, cost=1, tenant="t", priority="default",
        arrival=0.0, deadline=deadline, answer_expiry=answer_expiry,
    )


async def _raised_alone_on(scheduler: SchedulerActor, replica: _Replica, requests) -> None:
    """Each of ``requests`` is queued, pulled by ``replica``, raises alone there and
    is handed back for another replica (as ``BatcherActor._model_failed`` does)."""
    for request in requests:
        scheduler.submit_nowait(request)
        (pulled,) = await scheduler.pull(replica)
        assert pulled is request
        scheduler.completed([request], failed=True)
        request.reply.suspect = request.reply.ran = True
        request.reply.raised_on = (replica, 0)
        scheduler.retry([[request]])


async def test_a_retry_waiting_for_another_replica_is_answered_at_its_deadline(
    autojump_clock,
):
    """A request that raised alone on replica A waits for another ready one, B, which
    is busy (a long batch). Its deadline passes meanwhile: A, looking again every
    ELSEWHERE_RECHECK, answers it DeadlineExceeded then, and drops one whose caller
    left. Before, A passed both by without a look at them, and the caller waited
    past its deadline for as long as B was busy."""
    queue = FairQueue(BatchLimits(max_size=4), bound=16, model="m", adaptive=False)
    scheduler = SchedulerActor("m", queue)
    a, b = _Replica(), _Replica()  # b: ready, and never pulls
    scheduler.batchers = [a, b]
    scheduler.replicas = 2
    late = _request(deadline=1.0, answer_expiry=True)
    left = _request()
    await _raised_alone_on(scheduler, a, [late, left])
    left.reply.withdraw()  # its caller leaves
    assert scheduler.queue_depth() == 2

    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.pull, a)
        with trio.fail_after(10), pytest.raises(DeadlineExceeded, match="being retried") as info:
            await late.reply.wait()
        assert trio.current_time() <= 1.0 + ELSEWHERE_RECHECK
        assert not info.value.in_queue  # it ran (and raised) once
        await trio.testing.wait_all_tasks_blocked()
        assert scheduler.queue_depth() == 0
        nursery.cancel_scope.cancel("the test is over")


class _Holder(_Replica):
    """A puller that may hold a request's hedge twin in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.held: set = set()

    def holds(self, reply) -> bool:
        return reply in self.held


@pytest.mark.parametrize("b_stops_being_ready", [False, True])
async def test_a_part_kept_apart_from_its_twin_still_waits_for_another_replica(
    autojump_clock, b_stops_being_ready
):
    """A part of a failed batch raised alone on A and waits for another replica; B
    pulls it while it runs the request's hedge twin and keeps it apart, for a third
    replica. A must not take it then: run again where it raised, it got A's error
    although its twin could still answer it. B takes it once its twin is done; and
    if B stops being ready meanwhile, A looks again within ELSEWHERE_RECHECK and
    runs it itself rather than leave it to its deadline."""
    queue = FairQueue(BatchLimits(max_size=4), bound=16, model="m", adaptive=False)
    scheduler = SchedulerActor("m", queue)
    a, b = _Holder(), _Holder()
    scheduler.batchers = [a, b]
    scheduler.replicas = 2
    request, twin = _request(), _request()
    scheduler.twins[request.reply] = twin.reply
    scheduler.twins[twin.reply] = request.reply
    await _raised_alone_on(scheduler, a, [request])
    b.held.add(twin.reply)
    assert await scheduler.pull(b) == [request]  # b would run it, but holds its twin:
    scheduler.keep_apart(request)  # (as BatcherActor._keep_apart does)

    got: list[list] = []
    taken = trio.Event()

    async def pull_a() -> None:
        got.append(await scheduler.pull(a))
        taken.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull_a)
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # left to another replica than a
        if b_stops_being_ready:
            start = trio.current_time()
            b.ready = False  # its breaker opens, say, while its twin still runs
            with trio.fail_after(0.1):
                await taken.wait()
            assert trio.current_time() - start <= ELSEWHERE_RECHECK
            assert got == [[request]]
        else:
            b.held.clear()  # its twin raised on b: b may run it now
            assert await scheduler.pull(b) == [request]
            assert scheduler.queue_depth() == 0
            nursery.cancel_scope.cancel("the test is over")
        assert request.reply.answerable  # not answered: the batcher that took it will


@pytest.mark.parametrize("ran", [False, True])
async def test_a_retry_held_past_its_deadline_says_whether_it_ran(autojump_clock, ran):
    """A batch staged behind the one a worker process was running goes back as it
    was when the worker dies: it never ran (not ``suspect``). Held for a retry past
    its deadline while no replica pulls, the actor's timer answers it
    DeadlineExceeded then, with ``in_queue`` saying it never ran: its caller is
    refunded, and a hedged caller's copy held so is no answer while its original
    may still run. It used to say it ran (charged, and the copy's 504 answered the
    hedged caller). A failed batch's part (``suspect``, ``ran``) ran, and is charged."""
    queue = FairQueue(BatchLimits(max_size=4), bound=16, model="m", adaptive=False)
    scheduler = SchedulerActor("m", queue)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        request = _request(deadline=1.0, answer_expiry=True)
        scheduler.submit_nowait(request)
        assert await scheduler.pull() == [request]
        scheduler.completed([request], failed=True)  # handed back: no longer running
        request.reply.suspect = request.reply.ran = ran  # (as split_failed marks it)
        scheduler.retry([[request]])
        assert queue.in_service == 0
        with pytest.raises(DeadlineExceeded, match="being retried") as info:
            await request.reply.wait()
        assert trio.current_time() == 1.0  # at its deadline, by the timer
        assert info.value.in_queue is not ran
        assert scheduler.queue_depth() == 0
        assert queue.in_service == 0
        nursery.cancel_scope.cancel("the test is over")


@pytest.mark.parametrize("suspect", [False, True])
async def test_a_request_kept_apart_is_answered_at_its_deadline_while_no_replica_pulls(
    autojump_clock, suspect
):
    """A replica pulls a request while it runs the request's hedge twin and keeps
    it apart for another replica, which never pulls (busy). The actor's timer
    answers it DeadlineExceeded at its deadline, saying whether it ran (a failed
    batch's part, ``suspect`` and ``ran``, did), and takes its cost off the devices' load
    (``in_service``), which kept it while it waited; a later request is queued and
    served as usual."""
    queue = FairQueue(BatchLimits(max_size=4), bound=16, model="m", adaptive=False)
    scheduler = SchedulerActor("m", queue)
    a, b = _Holder(), _Holder()  # b: ready, and never pulls
    scheduler.batchers = [a, b]
    scheduler.replicas = 2
    request, twin = _request(deadline=1.0, answer_expiry=True), _request()
    scheduler.twins[request.reply] = twin.reply
    scheduler.twins[twin.reply] = request.reply
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        scheduler.submit_nowait(request)
        a.held.add(twin.reply)
        assert await scheduler.pull(a) == [request]
        request.reply.suspect = request.reply.ran = suspect  # (as split_failed marks it)
        scheduler.keep_apart(request)  # (as BatcherActor._keep_apart does)
        assert queue.in_service == 1  # still dispatched: waiting for a device
        with pytest.raises(DeadlineExceeded, match="hedge twin") as info:
            await request.reply.wait()
        assert trio.current_time() == 1.0
        assert info.value.in_queue is not suspect
        assert scheduler.queue_depth() == 0
        assert queue.in_service == 0
        later = _request(deadline=5.0, answer_expiry=True)
        scheduler.submit_nowait(later)
        a.held.clear()
        assert await scheduler.pull(a) == [later]
        nursery.cancel_scope.cancel("the test is over")


async def test_a_part_kept_apart_is_taken_at_once_when_its_twin_is_handed_back(
    autojump_clock,
):
    """A part of a failed batch raised alone on A and waits for another replica;
    B, a worker process pulling with room in its pipeline, keeps it apart because
    it runs the part's hedge twin, and both park. The twin then raises alone on B
    and is handed back to run elsewhere: the hand-back wakes both, and each takes
    the other's request at that moment: B the part (its twin no longer on B), A
    the twin. Neither waits for a later arrival, ELSEWHERE_RECHECK or a deadline
    (``completed`` wakes nobody, but no request kept apart waits on it alone: a
    twin answered ends the hedge, one handed back goes through ``retry``)."""
    queue = FairQueue(BatchLimits(max_size=4), bound=16, model="m", adaptive=False)
    scheduler = SchedulerActor("m", queue)
    a, b = _Holder(), _Holder()
    scheduler.batchers = [a, b]
    scheduler.replicas = 2
    part, twin = _request(), _request()
    scheduler.twins[part.reply] = twin.reply
    scheduler.twins[twin.reply] = part.reply
    await _raised_alone_on(scheduler, a, [part])
    scheduler.submit_nowait(twin)
    assert await scheduler.pull(b) == [twin]  # b runs the twin
    b.held.add(twin.reply)
    assert await scheduler.pull(b) == [part]  # and pulls the part with room left:
    scheduler.keep_apart(part)  # kept apart (as BatcherActor._keep_apart does)

    got: dict[str, list] = {}

    async def pull(name: str, replica: _Holder) -> None:
        got[name] = await scheduler.pull(replica)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull, "a", a)
        nursery.start_soon(pull, "b", b)
        await trio.testing.wait_all_tasks_blocked()
        assert got == {}  # a: the part raised there, b ready; b: holds its twin
        start = trio.current_time()
        # The twin raises alone on b: handed back to run on another replica.
        b.held.clear()
        scheduler.completed([twin], failed=True)
        twin.reply.suspect = twin.reply.ran = True
        twin.reply.raised_on = (b, 0)
        scheduler.retry([[twin]])
        await trio.testing.wait_all_tasks_blocked()
        assert got == {"a": [twin], "b": [part]}
        assert trio.current_time() == start
    assert scheduler.queue_depth() == 0


class _ScriptedWorker(_StandIn):
    """Stands in for a worker process in the batcher's pipeline (no process):
    batches are staged up to SLOTS at a time and answered in order. Workers are
    numbered as they are made (a replacement gets the next number); a batch
    holding key 7 on worker 0 waits for ``gate``, then raises (``fate`` "raises")
    or dies ("lost"); on any later worker but 1 it runs until cancelled. Records
    each batch sent as (worker number, keys)."""

    gate: trio.Event
    fate: str
    sent: list
    made: int

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.number = _ScriptedWorker.made
        _ScriptedWorker.made += 1
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self._staged: list = []
        self._exited = trio.Event()

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        self.sent.append((self.number, [key(it) for it in items]))
        self._staged.append(items)

    async def result(self):
        items = self._staged.pop(0)
        if self.number != 1 and any(key(it) == 7.0 for it in items):
            if self.number == 0:
                await self.gate.wait()
                if self.fate == "raises":
                    raise self.Failed("cannot take 7")
                raise self.Died("it exited")  # (the batcher kills what is left)
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()
        return [{"y": it["x"]} for it in items]


@pytest.mark.parametrize("fate", ["raises", "lost"])
async def test_a_copy_kept_apart_in_a_pipeline_settles_when_its_original_fails(
    autojump_clock, monkeypatch, fate
):
    """Replica 0, a worker process, runs request 7 and, with room in its pipeline,
    pulls 7's hedge copy and keeps it apart; replica 1 is not ready (its breaker
    is open) until t=1. Replica 0 then parks in ``pull``, and ``completed`` would
    not wake it. Whatever happens to the original, the copy waits for nothing it
    should not: the original raising is no answer while the copy may still give
    one, and the copy runs on replica 1 at t=1, the moment that one becomes ready,
    and answers (it used to be withdrawn, the caller answered replica 0's error at
    t=0.5); the original's worker lost hands it back, to replica 0's next worker
    (where it runs on), and the copy runs on replica 1 at t=1 all the same."""
    import trioserve._runtime
    import trioserve.actors._batcher

    _ScriptedWorker.gate, _ScriptedWorker.fate = trio.Event(), fate
    _ScriptedWorker.sent, _ScriptedWorker.made = [], 0
    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _ScriptedWorker)
    breakers: list[Breaker] = []

    def breaker() -> Breaker:
        b = Breaker()
        if breakers:  # replica 1's: open for its first second
            b.open_until = trio.current_time() + 1.0
        breakers.append(b)
        return b

    monkeypatch.setattr(trioserve.actors, "Breaker", breaker)
    cfg = config(
        callable_model(
            "m", lambda items: items, execution="process", replicas=2, hedge=True,
            hedge_after_ms=50, max_batch_size=4, max_wait_ms=0, timeout_ms=None,
        )
    )
    outcome: list = []
    async with trioserve.open_runtime(cfg) as rt:
        scheduler = rt.models["m"].scheduler

        async def call() -> None:
            try:
                outcome.append(await rt.infer("m", item(7)))
            except ModelError as exc:
                outcome.append(exc)
            outcome.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await trio.sleep(0.5)
            await trio.testing.wait_all_tasks_blocked()
            assert rt.hedges == 1
            assert _ScriptedWorker.sent == [(0, [7.0])]
            assert scheduler.queue_depth() == 1  # the copy, kept apart from replica 0
            _ScriptedWorker.gate.set()
            with trio.fail_after(10):
                while not outcome:
                    await trio.testing.wait_all_tasks_blocked()
                    await trio.sleep(0.001)
            if fate == "raises":
                assert float(outcome[0]["y"][0]) == 7.0  # the copy's answer
                assert outcome[1] == pytest.approx(1.0)
                assert _ScriptedWorker.sent == [(0, [7.0]), (1, [7.0])]
            else:
                assert float(outcome[0]["y"][0]) == 7.0
                assert outcome[1] == pytest.approx(1.0)
                assert _ScriptedWorker.sent == [(0, [7.0]), (2, [7.0]), (1, [7.0])]
            assert scheduler.queue_depth() == 0


class _CountingScheduler(SchedulerActor):
    """A scheduler that counts its timer's looks at the requests it holds."""

    looks = 0

    def _expire_held(self, now: float) -> float:
        self.looks += 1
        return super()._expire_held(now)


async def test_the_timer_answers_held_requests_at_their_deadlines_and_looks_only_then(
    autojump_clock,
):
    """The actor's timer answers each retry at its deadline: those held before it
    parked, and one handed back later with an earlier deadline (it wakes for it);
    one that a pull took away before its deadline is left to its batcher. Queued
    requests expiring meanwhile do not make it look at what it holds (it scanned
    every retry and every request kept apart at each of its wakes, a cost in their
    number at each of the queue's expiries); it looks when one held may be due."""
    queue = FairQueue(BatchLimits(max_size=1), bound=16, model="m", adaptive=False)
    scheduler = _CountingScheduler("m", queue)

    def held(deadline: float) -> Request:
        """A request dispatched, failed in its batch and handed back."""
        request = _request(deadline=deadline, answer_expiry=True)
        scheduler.submit_nowait(request)
        assert queue.next_batch(trio.current_time()) == [request]
        scheduler.completed([request], failed=True)
        request.reply.suspect = request.reply.ran = True
        scheduler.retry([[request]])
        return request

    async def answered_at(request: Request) -> None:
        with pytest.raises(DeadlineExceeded, match="being retried"):
            await request.reply.wait()
        assert trio.current_time() == request.deadline

    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        taken, late = held(4.0), held(10.0)
        queued = [_request(deadline=1.0 + i / 4, answer_expiry=True) for i in range(4)]
        for r in queued:
            scheduler.submit_nowait(r)
        await trio.sleep(2.0)
        assert all(isinstance(r.reply.error, DeadlineExceeded) for r in queued)
        assert scheduler.looks == 0  # nothing held was due
        sooner = held(3.0)  # while the timer waits for 4.0
        await answered_at(sooner)
        assert scheduler.looks == 1
        assert await scheduler.pull() == [taken]  # runs again: no longer held
        await trio.sleep(4.5 - trio.current_time())
        assert taken.reply.answerable  # its batcher answers it, not the timer
        assert scheduler.looks == 2  # at 4.0, finding nothing due
        await answered_at(late)
        assert scheduler.looks == 3
        assert scheduler.queue_depth() == 0
        assert queue.in_service == 1  # taken, until its batcher completes it
        nursery.cancel_scope.cancel("the test is over")


class BusyOrBroken(trioserve.ModelBackend):
    """Thread replicas: a batch holding HOLD blocks its replica until ``gate`` is set
    (``busy``: that replica's device); a replica on a device in ``broken`` raises on
    anything else; otherwise ``y = x``."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "thread"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()  # set when a batch holding HOLD began
        self.busy: str | None = None
        self.broken: set[str] = set()

    def load(self, device, *, torch_threads=1):
        def run(items):
            if any(key(it) == HOLD for it in items):
                self.busy = device
                self.started.set()
                if not self.gate.wait(GATE_LIMIT_S):
                    raise RuntimeError("gate never opened")
            elif device in self.broken:
                raise RuntimeError(ILLEGAL_ACCESS)
            return [{"y": it["x"].copy()} for it in items]

        return run


async def test_parts_left_to_a_busy_replica_are_answered_at_their_deadline(mock_clock):
    """Through the runtime: replica B runs a long batch; a batch of two sound
    requests raises on the broken replica A, and each part, raising alone there
    too, waits for B. At their deadline (the model's timeout, 1 s) the caller gets
    DeadlineExceeded, while B is still busy; before, it waited until B was free.
    (The clock stands still: thread replicas.)"""
    backend = BusyOrBroken()
    cfg = config(ModelConfig(name="m", backend=backend, devices=("cpu:0", "cpu:1"),
                             max_batch_size=4, max_wait_ms=0, timeout_ms=1000))
    async with trioserve.open_runtime(cfg) as rt:
        scheduler = rt.models["m"].scheduler
        handed_back = trio.Event()
        retry = scheduler.retry

        def counting_retry(batches):
            retry(batches)
            if scheduler.retried == 4:  # the batch in two parts, then each part marked
                handed_back.set()

        scheduler.retry = counting_retry
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rt.infer, "m", item(HOLD))
                await trio.to_thread.run_sync(backend.started.wait, GATE_LIMIT_S)
                [broken] = [b.device for b in rt.models["m"].batchers
                            if b.device != backend.busy]
                backend.broken.add(broken)
                got: list[BaseException] = []

                async def call() -> None:
                    with pytest.raises(DeadlineExceeded) as info:
                        await rt.infer_batch("m", [item(1.0), item(2.0)])
                    got.append(info.value)

                nursery.start_soon(call)
                await handed_back.wait()
                await trio.testing.wait_all_tasks_blocked()
                assert all(r[0].reply.raised_on is not None for r in scheduler._retries)
                mock_clock.jump(1.0)  # their deadline
                await trio.testing.wait_all_tasks_blocked()
                assert got  # answered while B is still busy
                assert not backend.gate.is_set()
                assert scheduler.queue_depth() == 0
                backend.gate.set()
        finally:
            backend.gate.set()


async def test_a_closing_queue_marks_the_errors_of_what_never_ran():
    """``close`` (at shutdown) and ``retire``: a request still queued, or a hedge
    twin held apart that never ran, or a batch handed back as it was from behind a
    lost worker's, is answered with an error that says so (``in_queue``: its caller
    is refunded); a failed batch's retry ran, and is charged."""
    queue = FairQueue(BatchLimits(max_size=4), bound=16, model="m", adaptive=False)
    scheduler = SchedulerActor("m", queue)
    retry, apart, staged, queued = _request(), _request(), _request(), _request()
    for r in (retry, apart, staged):
        scheduler.submit_nowait(r)
    batch = await scheduler.pull()
    assert batch == [retry, apart, staged]
    scheduler.completed([retry, staged], failed=True)
    retry.reply.suspect = retry.reply.ran = True
    scheduler.retry([[retry], [staged]])
    scheduler.keep_apart(apart)
    scheduler.submit_nowait(queued)
    assert scheduler.close(trioserve.ActorClosed("shut down")) == 4
    assert [r.reply.error.in_queue for r in (retry, apart, staged, queued)] == [
        False, True, True, True
    ]
