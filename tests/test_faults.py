"""Straggler isolation and fault tolerance: the batch deadline, bisection down to the
poison request, model errors reaching only their own input, killed worker processes
replaced with their batches retried, the circuit breaker and readiness.

Batch deadlines are wall-clock (a device's time is real time): the tests that need
one to pass through the runtime keep it on the ``manual_watchdog`` fixture's clock,
which the straggling call itself moves past its deadline (``SlowOn``, or a call held
until the test releases it): a real sleep against a real deadline is cut late, or
not at all, on a loaded machine, and an innocent call can be cut off there. Only the
watchdog's own thread is tested in real time; the decisions
themselves (deadline from observed times, the split, the breaker) are sans-IO and
tested with explicit times. Shutdown with a model call cut off is in
test_shutdown_grace.py, the slow lane and hedging in test_hedging.py.
"""

from __future__ import annotations

import collections
import itertools
import os
import signal
import threading
import time

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import (
    GATE_LIMIT_S,
    ManualWatchdog,
    NoZygote,
    _StandIn,
    callable_model,
    config,
    crash_on_666,
    item,
    key,
    pythonpath_with,
    straggler_model,
)
from trioserve import DeadlineExceeded, ModelConfig, ModelError, Reply, Request, RequestState
from trioserve.actors import (
    BatchLimits,
    BatchTimer,
    Breaker,
    FairQueue,
    LateOutcome,
    SchedulerActor,
    StragglerPolicy,
    Watchdog,
    retried,
    split_failed,
)
from trioserve.actors._straggler import to_retry

TESTS = os.path.dirname(os.path.abspath(__file__))


def dispatched(n: int) -> list[Request]:
    reqs = [Request(model="m", item=i, reply=Reply()) for i in range(n)]
    for r in reqs:
        r.reply.dispatch()
    return reqs


# ---------------------------------------------------------------- sans-IO decisions
def test_a_failed_batch_is_halved_and_a_request_alone_counts_attempts_until_poison():
    batch = dispatched(5)
    retry, poison = split_failed(batch, poison_attempts=2)
    assert retry == [batch[:2], batch[2:]]
    assert poison == []
    (alone,), poison = split_failed([batch[0]], poison_attempts=2)
    assert alone == [batch[0]]
    assert batch[0].reply.attempts == 1
    retry, poison = split_failed(alone, poison_attempts=2)
    assert (retry, poison) == ([], [batch[0]])
    assert batch[0].reply.attempts == 2


def test_requests_whose_caller_left_are_not_retried():
    batch = dispatched(3)
    batch[1].reply.withdraw()  # abandoned
    batch[2].reply.set_result("done elsewhere")
    retry, poison = split_failed(batch, poison_attempts=2)
    assert retry == [[batch[0]]]
    assert poison == []
    assert split_failed([batch[1], batch[2]], poison_attempts=2) == ([], [])


def test_a_carried_item_keeps_the_answered_requests_record_as_a_retry():
    # A request answered while its batch ran (its deadline passed), whose item
    # others wait for, is carried into the retry by a request of its own: that one
    # is retried as the answered one would have been, the replica it raised alone
    # on included (else it would run on a third replica, and its result there
    # would tell the first replica's breaker nothing).
    batch = dispatched(2)
    answered = batch[0].reply
    answered.late = late = LateOutcome()
    late.expect()
    answered.attempts = 1
    answered.suspect = answered.ran = True
    answered.raised_on = raised_on = ("the replica it raised alone on", 3)
    answered.set_error(DeadlineExceeded("its deadline passed while its batch ran"))
    carried, waiting = to_retry(batch)
    assert waiting is batch[1]
    assert carried.reply is not answered
    assert carried.item == batch[0].item
    assert (carried.reply.attempts, carried.reply.suspect, carried.reply.ran) == (1, True, True)
    assert carried.reply.raised_on == raised_on


def test_the_batch_deadline_is_the_cap_until_enough_samples_then_p99_times_factor():
    timer = BatchTimer(StragglerPolicy(factor=4.0, floor=0.05, cap=10.0, min_samples=16))
    assert timer.deadline() == 10.0
    for _ in range(15):
        timer.record(0.02)
    assert timer.deadline() == 10.0
    timer.record(0.02)
    assert timer.deadline() == pytest.approx(0.08)
    for _ in range(256):
        timer.record(0.001)  # the window is now all 1 ms: 4 ms is under the floor
    assert timer.deadline() == pytest.approx(0.05)
    for _ in range(256):
        timer.record(5.0)  # 20 s is over the cap
    assert timer.deadline() == 10.0


def test_the_breaker_opens_after_consecutive_failures_and_backs_off():
    br = Breaker(threshold=3, cooldown=1.0, max_cooldown=3.0)
    br.failure(0.0)
    br.failure(0.0)
    assert not br.is_open(0.0)
    br.failure(10.0)
    assert br.is_open(10.5)
    assert not br.is_open(11.0)
    br.failure(11.0)  # still failing: open twice as long
    assert br.is_open(12.9)
    assert not br.is_open(13.0)
    br.failure(13.0)
    assert br.open_until == 16.0  # capped at max_cooldown
    br.success()
    assert not br.is_open(13.0)
    assert br.failures == 0


async def test_the_watchdog_cancels_a_scope_after_wall_time_and_not_when_disarmed():
    dog = Watchdog()
    dog.start()
    try:
        t0 = time.monotonic()
        with trio.CancelScope() as scope:
            dog.arm(0.05, scope)
            await trio.sleep_forever()
        assert scope.cancelled_caught
        assert time.monotonic() - t0 >= 0.05
        with trio.CancelScope() as quiet:
            Watchdog.disarm(dog.arm(0.01, quiet))
            await trio.sleep(0.05)
        assert not quiet.cancel_called
        assert dog.fired == 1
    finally:
        dog.stop()


# ---------------------------------------------------------------- through the runtime
class SlowOn:
    """A thread model doubling ``x``; a batch holding an item with x[0] == 99 takes
    ``seconds`` on its replica's wall clock, the runtime's :class:`ManualWatchdog`
    (the ``manual_watchdog`` fixture): the model moves that clock from its thread, so
    a batch deadline shorter than ``seconds`` passes while the call runs, and no other
    batch takes any of that clock (whatever the machine's load, neither a late cut
    nor an innocent batch cut off). Records each batch's keys."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.batches: list[list[float]] = []
        self._lock = threading.Lock()

    def __call__(self, items):
        keys = [key(it) for it in items]
        with self._lock:
            self.batches.append(keys)
        if 99.0 in keys:
            # the cut is delivered in the event loop before this returns
            trio.from_thread.run_sync(ManualWatchdog.made[-1].advance, self.seconds)
        return [{"y": it["x"] * 2} for it in items]


async def test_a_straggler_batch_is_bisected_until_the_poison_request_is_isolated(
    manual_watchdog,
):
    # The batches' wall clock moves only in the model's batches holding 99: a part
    # counted a straggler would change every count below.
    model = SlowOn(0.6)
    cfg = config(straggler_model(model, replicas=2))
    results: dict[float, object] = {}
    async with trioserve.open_runtime(cfg) as rt:

        async def one(v: float) -> None:
            try:
                results[v] = await rt.infer("m", item(v))
            except ModelError as exc:
                results[v] = exc

        async with trio.open_nursery() as nursery:
            for v in [*range(7), 99]:
                nursery.start_soon(one, float(v))
        stats = rt.statistics()["m"]
    poison = results.pop(99.0)
    assert isinstance(poison, ModelError)
    assert "poison request, not retried" in str(poison)
    # Alone once: of two thread replicas, a second run would hang the last ready
    # one (test_thread_hang.py). The parts waited for the first thread to return.
    assert (
        "ran past its deadline of 0.050s when it ran alone, its worker thread still "
        "runs, and no other replica can be spared"
    ) in str(poison)
    assert {v: float(r["y"][0]) for v, r in results.items()} == {v: 2 * v for v in range(7)}
    # 8 -> each alone (no more than retry_parts): two batches held 99 (halving
    # took five: 8 -> 4 -> 2 -> 1 -> 1).
    assert [len(b) for b in model.batches if 99.0 in b] == [8, 1]
    assert stats["statuses"]["straggler"] == 2
    assert stats["statuses"]["poison"] == 1


async def test_a_replica_with_a_straggling_thread_is_not_ready_until_it_returns(
    manual_watchdog,
):
    # The call holding 99 moves the wall clock past its deadline, then hangs until
    # released; no other call takes any of that clock (a real 50 ms deadline could
    # cut off the innocent call below on a loaded machine).
    release = threading.Event()

    def held(items):
        if any(key(it) == 99.0 for it in items):
            trio.from_thread.run_sync(manual_watchdog.made[-1].advance, 0.05)
            release.wait(30)
        return [{"y": it["x"]} for it in items]

    cfg = config(straggler_model(held, poison_attempts=1))
    async with trioserve.open_runtime(cfg) as rt:
        assert rt.model_ready("m")
        with pytest.raises(ModelError, match="poison request"):
            await rt.infer("m", item(99))  # cut off at 50 ms; alone: poison at once
        batcher = rt.models["m"].batchers[0]
        assert batcher.health == "degraded"
        assert not rt.model_ready("m")
        assert rt.health()["m"] == {"ready": False, "replicas": {batcher.name: "degraded"}}
        release.set()
        out = await rt.infer("m", item(1))  # served once the thread has returned
        assert float(out["y"][0]) == 1.0
        assert rt.model_ready("m")


async def test_a_retried_request_is_answered_at_its_deadline_while_its_only_replica_straggles(
    manual_watchdog,
):
    """The lone thread replica hangs on 99 in a batch with 1; the batch is cut off
    after 50 ms and its parts go back for a retry, but the replica pulls nothing
    until the thread returns. Both callers are answered DeadlineExceeded at the
    model's timeout (500 ms), while the thread still hangs: they waited for the
    thread to return before, because only a pull answered a retry past its
    deadline. (A timeout sooner than the cut is answered while the batch runs:
    test_running_deadlines.py.) Real clock for the timeout; the call moves the
    watchdog's wall clock by the 50 ms itself, so the cut comes before the
    timeout whatever the machine's load."""
    timeout_ms = 500.0
    release = threading.Event()

    def held(items):
        if any(key(it) == 99.0 for it in items):
            trio.from_thread.run_sync(manual_watchdog.made[-1].advance, 0.05)
            release.wait(GATE_LIMIT_S)
        return [{"y": it["x"]} for it in items]

    cfg = config(
        callable_model(
            "m", held, execution="thread", max_batch_size=2, max_wait_ms=10_000,
            timeout_ms=timeout_ms, batch_timeout_floor_ms=50.0, batch_timeout_cap_ms=50.0,
        )
    )
    got: dict[float, BaseException] = {}
    try:
        async with trioserve.open_runtime(cfg) as rt:

            async def one(v: float) -> None:
                with pytest.raises(DeadlineExceeded) as info:
                    await rt.infer("m", item(v))
                got[v] = info.value
                assert not release.is_set()  # answered while the thread still hangs

            with trio.fail_after(GATE_LIMIT_S):
                async with trio.open_nursery() as nursery:
                    for v in (99.0, 1.0):
                        nursery.start_soon(one, v)
            batcher = rt.models["m"].batchers[0]
            assert batcher.health == "degraded"  # the thread has not returned
            assert rt.models["m"].scheduler.queue_depth() == 0
            assert rt.statistics()["m"]["statuses"]["straggler"] == 1
            release.set()
    finally:
        release.set()
    assert sorted(got) == [1.0, 99.0]
    for error in got.values():
        assert "deadline passed while its batch was being retried" in str(error)
        assert not error.in_queue  # it ran: charged


async def test_a_killed_worker_process_is_replaced_and_its_batches_retried():
    cfg = config(
        ModelConfig(
            name="slow", backend="sleep", options={"delay_per_batch_ms": 300.0},
            execution="process", max_batch_size=4, max_wait_ms=1.0,
        )
    )
    async with trioserve.open_runtime(cfg) as rt:
        batcher = rt.models["slow"].batchers[0]
        first_pid = batcher._worker.pid
        results = {}

        async def one(v: float) -> None:
            results[v] = await rt.infer("slow", {"x": np.array([0.0, v], np.float32)})

        async with trio.open_nursery() as nursery:
            for v in range(4):
                nursery.start_soon(one, float(v))
            await trio.testing.wait_all_tasks_blocked()  # the batch is in the worker
            os.kill(first_pid, signal.SIGKILL)
        assert {v: r["y"].tolist() for v, r in results.items()} == {
            v: [0.0, v] for v in range(4)
        }
        assert batcher._worker.pid != first_pid
        assert batcher.workers_lost == 1
        assert batcher.restarts == 0  # replaced inside the batcher: no actor restart
        statuses = rt.statistics()["slow"]["statuses"]
        assert statuses["worker_lost"] == 1
        assert rt.model_ready("slow")


async def test_retried_requests_are_answered_exactly_once(autojump_clock):
    # A model raising on one input among many: the retried halves answer each of the
    # others once (a second answer would raise inside the Reply state machine).
    seen: list[float] = []

    def picky(items):
        seen.extend(key(it) for it in items)
        if any(key(it) == 3.0 for it in items):
            raise ValueError("no threes")
        return [{"y": it["x"]} for it in items]

    cfg = config(callable_model("m", picky, max_batch_size=8, max_wait_ms=1))
    async with trioserve.open_runtime(cfg) as rt:
        outs = await rt.infer_batch("m", [item(v) for v in range(3)])
        assert [float(o["y"][0]) for o in outs] == [0.0, 1.0, 2.0]
        with pytest.raises(ModelError, match="no threes"):
            await rt.infer_batch("m", [item(v) for v in range(8)])
        requests = [r for r in rt.models["m"].scheduler.policy]  # nothing left queued
    assert requests == []
    assert RequestState.DONE  # (the state machine is what guarantees once)
    assert seen.count(3.0) == 2  # 8 -> each alone (halving ran it 4 times: 8, 4, 2, 1)


# ---------------------------------------------------------------- the breaker and poison
class CountingBreaker(Breaker):
    """A Breaker that counts the failures it was told of and the times it opened."""

    def __init__(self) -> None:
        super().__init__()
        self.told = self.opened = 0

    def failure(self, now: float) -> None:
        self.told += 1
        was = self.open_until
        super().failure(now)
        self.opened += self.open_until != was


def test_the_retries_of_a_failed_batch_are_marked_as_its_requests_failures():
    batch = dispatched(4)
    assert not retried(batch)
    halves, _ = split_failed(batch, poison_attempts=2)
    assert all(retried(h) for h in halves)
    assert not retried([*halves[0], *dispatched(1)])  # fresh work among them
    assert not retried([])


async def poison_among_normal(rt, poison: float, normal: float) -> dict[float, object]:
    """Four requests of x[0] = ``poison`` (the model fails on them) sent at once with
    one of ``normal``; what each caller got, by its number (the normal one is 9)."""
    results: dict[float, object] = {}

    async def one(i: float, v: float) -> None:
        try:
            results[i] = await rt.infer("m", item(v))
        except ModelError as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, float(i), poison)
        nursery.start_soon(one, 9.0, normal)
    return results


async def test_requests_that_crash_their_worker_do_not_open_its_breaker(monkeypatch):
    """Every worker death counted towards the breaker, the bisection of a few
    crashing requests included: it opened, for longer each time the trial batch (a
    retry: crashing again) failed, the replica stopped pulling, and the others'
    requests and the poison callers themselves timed out. Real processes."""
    # where the worker finds ``crash_on_666``
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    monkeypatch.setattr(trioserve.actors, "Breaker", CountingBreaker)
    cfg = config(
        callable_model(
            "m", crash_on_666, execution="process", max_batch_size=8, max_wait_ms=20,
            timeout_ms=None,
        )
    )
    async with trioserve.open_runtime(cfg) as rt:
        batcher = rt.models["m"].batchers[0]
        with trio.fail_after(30):
            results = await poison_among_normal(rt, 666.0, 1.0)
            assert float(results.pop(9.0)["y"][0]) == 1.0
            for err in results.values():
                assert isinstance(err, ModelError)
                assert "poison request, not retried: its batch failed: its worker " in str(err)
            assert (await rt.infer("m", item(2)))["y"][0] == 2.0
        assert batcher._breaker.told == 1  # the first batch, of fresh work
        assert batcher._breaker.opened == 0
        assert batcher.workers_lost > 4
        assert rt.model_ready("m")


async def test_straggling_retries_do_not_open_the_breaker_of_a_thread_replica(
    monkeypatch, manual_watchdog
):
    monkeypatch.setattr(trioserve.actors, "Breaker", CountingBreaker)
    model = SlowOn(0.1)
    cfg = config(straggler_model(model))
    async with trioserve.open_runtime(cfg) as rt:
        batcher = rt.models["m"].batchers[0]
        with trio.fail_after(30):
            results = await poison_among_normal(rt, 99.0, 1.0)
        assert float(results.pop(9.0)["y"][0]) == 2.0
        assert all("poison request, not retried" in str(e) for e in results.values())
        assert batcher._breaker.told == 1
        assert batcher._breaker.opened == 0


# Regression: a retried batch's cost came off the work in service twice (when it was
# handed back, and when its retry finished), so the estimate of the work ahead of a
# new request (its shedding, Retry-After) left out batches still running.
async def test_a_retried_batch_counts_in_service_again_while_it_runs():
    queue = FairQueue(BatchLimits(max_size=2), bound=16, model="m", adaptive=False)
    scheduler = SchedulerActor("m", queue)
    for _ in range(4):
        scheduler.submit_nowait(
            Request(model="m", item=None, cost=1, tenant="a", priority="default",
                    arrival=0.0, deadline=float("inf"), answer_expiry=False)
        )
    a = await scheduler.pull()
    b = await scheduler.pull()
    assert queue.in_service == 4
    scheduler.completed(a, failed=True)  # a's replica died: a is handed back
    scheduler.retry([a])
    assert queue.in_service == 2
    again = await scheduler.pull()
    assert again == a
    assert queue.in_service == 4  # b, and a running again
    scheduler.completed(again)
    assert queue.in_service == 2  # b still runs
    scheduler.completed(b)
    assert queue.in_service == 0


# ---------------------------------------------------------------- rounds an innocent waits
class TrioWatchdog:
    """Batch deadlines in trio time, for fake workers that take trio time."""

    fired = 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def arm(self, seconds: float, scope: trio.CancelScope) -> None:
        scope.deadline = trio.current_time() + seconds


class TimedWorker(_StandIn):
    """A worker process in trio time: it starts in ``START`` s and runs each batch in
    ``RUN`` s, in order; a batch holding ``HANG`` never ends (its deadline cuts it
    off), one holding ``CRASH`` kills the worker. Records each batch submitted as
    (time, keys, whether a retried batch was staged ahead of it) in ``submitted``,
    and each key of a batch that ran to the end in ``done``."""

    START, RUN = 0.1, 0.01
    HANG, CRASH = 99.0, 666.0
    death = "killed by its batch"  # (its died_of: the only death it has)
    submitted: list
    done: list

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self._staged: collections.deque = collections.deque()
        self._exited = trio.Event()
        self._killed = False

    async def start(self) -> None:
        await trio.sleep(self.START)

    @property
    def alive(self) -> bool:
        return not self._killed  # as WorkerProcess: not killed (it may have died)

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        keys = [key(it) for it in items]
        behind_retry = any(suspect for _, suspect in self._staged)
        TimedWorker.submitted.append((trio.current_time(), keys, behind_retry))
        self._staged.append((items, all(k in self.suspects for k in keys)))

    suspects: set  # keys whose requests were retried (the test tells the worker)

    async def result(self):
        items, _ = self._staged[0]
        keys = [key(it) for it in items]
        await trio.sleep(self.RUN)
        if self.HANG in keys:
            await trio.sleep_forever()
        if self.CRASH in keys:
            self._exited.set()  # dead, not killed: the batcher finds out
            raise self.Died("killed by its batch")
        self._staged.popleft()
        TimedWorker.done.extend(keys)
        TimedWorker.suspects.difference_update(keys)
        self.last_run_seconds = self.RUN
        return [{"y": it["x"]} for it in items]

    def kill(self) -> None:
        # What it held was handed back: each of those may be retried.
        for items, _ in self._staged:
            TimedWorker.suspects.update(key(it) for it in items)
        self._staged.clear()
        self._killed = True
        self._exited.set()


@pytest.fixture
def timed_workers(monkeypatch):
    import trioserve._runtime
    import trioserve.actors._batcher

    TimedWorker.submitted, TimedWorker.done, TimedWorker.suspects = [], [], set()
    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", TimedWorker)
    monkeypatch.setattr(trioserve.actors, "Watchdog", TrioWatchdog)
    return TimedWorker


def timed_model(**cfg) -> ModelConfig:
    """A process model whose batches have a deadline of 1 s from the start."""
    cfg.setdefault("max_batch_size", 8)
    return callable_model(
        "m", crash_on_666, execution="process", max_wait_ms=1, timeout_ms=None,
        batch_timeout_floor_ms=1000.0, batch_timeout_cap_ms=1000.0, **cfg,
    )


async def answers(rt, values: list[float]) -> dict[float, tuple[object, float]]:
    """Send a request of each value at once; what each got and when, by value."""
    got: dict[float, tuple[object, float]] = {}

    async def one(v: float) -> None:
        try:
            out: object = await rt.infer("m", item(v))
        except ModelError as exc:
            out = exc
        assert v not in got
        got[v] = (out, trio.current_time())

    async with trio.open_nursery() as nursery:
        for v in values:
            nursery.start_soon(one, v)
    return got


@pytest.mark.parametrize("poison", [TimedWorker.HANG, TimedWorker.CRASH])
async def test_an_innocent_batch_mate_waits_one_failed_round_not_one_per_halving(
    autojump_clock, timed_workers, poison
):
    """A batch of 8 holding a request that hangs (or kills its worker) was halved,
    8 -> 4 -> 2 -> 1: the request beside it waited three failed rounds (3 × the 1 s
    deadline for a hang). Now a batch of at most retry_parts is retried each request
    alone: the seven innocents are answered right after the first failure, and each
    ran twice (its batch, then alone) and was answered once."""
    cfg = config(timed_model(replicas=2))
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        values = [0.0, 1.0, 2.0, poison, 4.0, 5.0, 6.0, 7.0]
        with trio.fail_after(30):
            got = await answers(rt, values)
        stats = rt.statistics()["m"]["statuses"]
    err, _ = got.pop(poison)
    assert isinstance(err, ModelError)
    assert "poison request, not retried" in str(err)
    fail = 1.0 if poison == TimedWorker.HANG else 0.0  # what the first failure took
    for v, (out, at) in got.items():
        assert float(out["y"][0]) == v
        # the first batch's run (and its deadline), then a worker's start and a few
        # runs alone: under a tenth of the deadline past the first failure
        assert at - t0 <= fail + TimedWorker.RUN + TimedWorker.START + 8 * TimedWorker.RUN
    runs = collections.Counter(k for _, keys, _ in TimedWorker.submitted for k in keys)
    assert runs == {**{v: 2 for v in got}, poison: 3}  # halving: 2-4 each, 5 for the poison
    assert sorted(TimedWorker.done) == sorted(got)  # each answered once
    assert stats["retried"] == 8 + 1
    assert stats["poison"] == 1
    assert [len(keys) for _, keys, _ in TimedWorker.submitted if poison in keys] == [8, 1, 1]


@pytest.mark.parametrize("replicas", [1, 2])
async def test_new_work_is_not_staged_behind_a_retried_batch_on_a_worker(
    autojump_clock, timed_workers, replicas
):
    """A worker process pulls while it has room in its pipeline, so it staged new
    work behind a retry running the hanging request alone: that work waited out the
    deadline, went back, and was staged behind the next retry again. Now a replica
    running a retry pulls nothing more until it is done, while another replica takes
    the new work; a lone replica stages it, and hands it back once, before the
    retry's next run."""
    cfg = config(timed_model(max_batch_size=2, replicas=replicas))
    async with trioserve.open_runtime(cfg) as rt:
        async with trio.open_nursery() as nursery:
            first: dict = {}
            later: dict = {}
            sent: list[float] = []

            async def send_first() -> None:
                first.update(await answers(rt, [TimedWorker.HANG, 1.0]))

            async def send_later() -> None:
                # while the hanging request runs alone the first time
                await trio.sleep(1.5)
                sent.append(trio.current_time())
                later.update(await answers(rt, [10.0, 11.0, 12.0, 13.0]))

            nursery.start_soon(send_first)
            nursery.start_soon(send_later)
    err, poisoned_at = first.pop(TimedWorker.HANG)
    assert isinstance(err, ModelError)
    assert float(first[1.0][0]["y"][0]) == 1.0
    runs = collections.Counter(k for _, keys, _ in TimedWorker.submitted for k in keys)
    assert runs[TimedWorker.HANG] == 3
    for v, (out, at) in later.items():
        assert float(out["y"][0]) == v
        if replicas == 2:
            # on the other replica at once: two batches of two
            assert at <= sent[0] + 2 * TimedWorker.RUN
            assert runs[v] == 1
        else:
            # Nowhere else to run: staged behind a run alone (the worker is serial,
            # it would wait as long in the queue), handed back when it was cut off,
            # run right after it: handed back once, not round after round.
            assert runs[v] == 2
            assert at <= poisoned_at + TimedWorker.START + TimedWorker.RUN
    if replicas == 2:
        assert not [s for s in TimedWorker.submitted if s[2]]  # nothing behind a retry


class ShortLived(TimedWorker):
    """A worker process in trio time that exits on its own ``LIFE`` s after its start,
    idle (a model's native thread crashing it), unless ``healed``."""

    LIFE = 0.05
    healed = False
    starts: list

    async def start(self) -> None:
        await super().start()
        ShortLived.starts.append(trio.current_time())

    async def wait_exited(self) -> None:
        if not ShortLived.healed:
            with trio.move_on_after(self.LIFE):
                await self._exited.wait()
            self._exited.set()  # dead, not killed: the batcher finds out
        await self._exited.wait()


async def test_workers_that_keep_dying_are_replaced_at_the_pace_of_the_breaker(
    autojump_clock, timed_workers, monkeypatch
):
    """A worker that died idle right after each start was replaced at once, for ever:
    forked and loading the model a dozen times a second. Its deaths open the breaker
    (5 in a row), whose cooldown (1 s, doubling) now spaces its successors; the
    replica is 'open' meanwhile, and serves again once its workers live."""
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", ShortLived)
    ShortLived.starts, ShortLived.healed = [], False
    async with trioserve.open_runtime(config(timed_model())) as rt:
        batcher = rt.models["m"].batchers[0]
        await trio.sleep(20)
        assert batcher.health == "open"
        starts = ShortLived.starts
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        # the first four deaths replaced at once (each gap a start and a life); the
        # fifth opens the breaker, and each death after it doubles its cooldown
        assert all(g == pytest.approx(ShortLived.START + ShortLived.LIFE) for g in gaps[:4])
        for gap, cooldown in zip(gaps[4:], [1.0, 2.0, 4.0, 8.0], strict=True):
            assert gap >= cooldown
        assert batcher.workers_lost == len(starts)
        ShortLived.healed = True
        with trio.fail_after(60):
            out = await rt.infer("m", item(3.0))
        assert float(out["y"][0]) == 3.0
        assert batcher.health == "ready"


async def test_a_lost_worker_is_logged_with_why(autojump_clock, timed_workers, caplog):
    """A worker's death was only counted (worker_lost), never logged: an operator saw
    nothing of workers dying and being replaced."""
    import logging

    caplog.set_level(logging.WARNING, logger="trioserve")
    async with trioserve.open_runtime(config(timed_model(max_batch_size=1))) as rt:
        got = await answers(rt, [TimedWorker.CRASH])
        batcher = rt.models["m"].batchers[0]
    assert isinstance(got[TimedWorker.CRASH][0], ModelError)  # a poison request
    lost = [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "worker process lost: " in r.getMessage()]
    assert len(lost) == batcher.workers_lost >= 1
    assert lost[0] == (
        f"{batcher.name}: worker process lost: its worker process died (killed by its "
        "batch); a new one is started"
    )
