"""Straggler isolation and fault tolerance: the batch deadline, bisection down to the
poison request, model errors reaching only their own input, killed worker processes
replaced with their batches retried, the circuit breaker and readiness.

Batch deadlines are wall-clock (a device's time is real time), so the tests that
need one to pass use real time with deadlines of tens of milliseconds; the decisions
themselves (deadline from observed times, the split, the breaker) are sans-IO and
tested with explicit times.
"""

from __future__ import annotations

import collections
import math
import os
import signal
import threading
import time
from functools import partial

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import (
    GATE_LIMIT_S,
    callable_model,
    config,
    crash_on_666,
    item,
    key,
    pythonpath_with,
)
from trioserve import (
    DeadlineExceeded,
    ModelConfig,
    ModelError,
    Reply,
    Request,
    RequestState,
    TenantConfig,
    WorkerProcess,
)
from trioserve.actors import (
    BatchLimits,
    BatchTimer,
    Breaker,
    FairQueue,
    SchedulerActor,
    StragglerPolicy,
    Watchdog,
    retried,
    split_failed,
)

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
    """A thread model doubling ``x``; an item with x[0] == 99 makes its batch take
    ``seconds`` of wall time. Records each batch's keys."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.batches: list[list[float]] = []
        self._lock = threading.Lock()

    def __call__(self, items):
        keys = [key(it) for it in items]
        with self._lock:
            self.batches.append(keys)
        if 99.0 in keys:
            time.sleep(self.seconds)
        return [{"y": it["x"] * 2} for it in items]


def straggler_model(fn, **cfg) -> ModelConfig:
    cfg.setdefault("batch_timeout_floor_ms", 50.0)
    cfg.setdefault("batch_timeout_cap_ms", 50.0)
    return callable_model("m", fn, execution="thread", max_batch_size=8, max_wait_ms=5, **cfg)


async def test_a_straggler_batch_is_bisected_until_the_poison_request_is_isolated():
    # Real time: a deadline of 150 ms (not 50) leaves an innocent part room on a
    # loaded machine; a part counted a straggler would change every count below.
    model = SlowOn(0.6)
    cfg = config(straggler_model(
        model, replicas=2, batch_timeout_floor_ms=150.0, batch_timeout_cap_ms=150.0
    ))
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
    assert "ran past its deadline of 0.150s each of the 2 times it ran alone" in str(poison)
    assert {v: float(r["y"][0]) for v, r in results.items()} == {v: 2 * v for v in range(7)}
    # 8 -> each alone (no more than retry_parts), then alone once more: three
    # batches held 99 (halving took five: 8 -> 4 -> 2 -> 1 -> 1).
    assert [len(b) for b in model.batches if 99.0 in b] == [8, 1, 1]
    assert stats["statuses"]["straggler"] == 3
    assert stats["statuses"]["poison"] == 1


async def test_a_replica_with_a_straggling_thread_is_not_ready_until_it_returns():
    release = threading.Event()

    def held(items):
        if any(key(it) == 99.0 for it in items):
            release.wait(30)
        return [{"y": it["x"]} for it in items]

    cfg = config(straggler_model(held, poison_attempts=1))
    async with trioserve.open_runtime(cfg) as rt:
        assert rt.model_ready("m")
        with pytest.raises(ModelError, match="poison request"):
            await rt.infer("m", item(99))  # cut off after 50 ms; alone: poison at once
        batcher = rt.models["m"].batchers[0]
        assert batcher.health == "degraded"
        assert not rt.model_ready("m")
        assert rt.health()["m"] == {"ready": False, "replicas": {batcher.name: "degraded"}}
        release.set()
        out = await rt.infer("m", item(1))  # served once the thread has returned
        assert float(out["y"][0]) == 1.0
        assert rt.model_ready("m")


@pytest.mark.parametrize("timeout_ms", [20.0, 500.0])
async def test_a_retried_request_is_answered_at_its_deadline_while_its_only_replica_straggles(
    timeout_ms,
):
    """The lone thread replica hangs on 99 in a batch with 1; the batch is cut off
    after 50 ms and its parts go back for a retry, but the replica pulls nothing
    until the thread returns. Both callers are answered DeadlineExceeded at the
    model's timeout (at once when it had passed at the cut, 20 ms; at it, 500 ms),
    while the thread still hangs: they waited for the thread to return before,
    because only a pull answered a retry past its deadline. Real clock: the
    watchdog keeps wall time."""
    release = threading.Event()

    def held(items):
        if any(key(it) == 99.0 for it in items):
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


class Held:
    """A model for a worker thread that blocks until released; ``entered`` is set
    once a call is running."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, items):
        self.entered.set()
        if not self.release.wait(30):
            raise RuntimeError("never released")
        return [{"y": it["x"]} for it in items]


async def test_shutdown_waits_for_a_model_call_it_cut_off_in_a_thread():
    """A thread cannot be stopped: the runtime's exit waits (within its grace) for a
    call it gave up to return, so the process never exits under a running model
    (torch would abort it in the interpreter's finalisation)."""
    from trioserve.actors import model_threads_running

    held = Held()
    cfg = config(straggler_model(held, batch_timeout_cap_ms=60_000), graceful_timeout_s=30)
    closed = trio.Event()

    async def serve_one_and_leave():
        async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as callers:
            callers.start_soon(rt.infer, "m", item(1))
            await trio.to_thread.run_sync(held.entered.wait)
            callers.cancel_scope.cancel()  # the caller leaves; the call runs on
        closed.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_one_and_leave)
        await trio.to_thread.run_sync(held.entered.wait)
        await trio.testing.wait_all_tasks_blocked()
        assert not closed.is_set()  # the runtime's exit waits for the thread
        assert model_threads_running() == 1
        held.release.set()
        await closed.wait()
    assert model_threads_running() == 0


async def test_shutdown_waits_for_a_cut_off_model_call_only_for_its_grace(autojump_clock):
    from trioserve.actors import model_threads_running

    held = Held()
    cfg = config(straggler_model(held, batch_timeout_cap_ms=60_000), graceful_timeout_s=5)
    try:
        async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as callers:
            callers.start_soon(rt.infer, "m", item(1))
            await trio.to_thread.run_sync(held.entered.wait)
            callers.cancel_scope.cancel()
            t0 = trio.current_time()
        assert trio.current_time() - t0 == pytest.approx(5.0)
        assert model_threads_running() == 1  # still running: the exit did not wait on
    finally:
        held.release.set()
    await rt.models["m"].batchers[0].join_thread()  # gone before the next test
    assert model_threads_running() == 0


async def test_a_grace_begun_before_leaving_the_block_is_the_close_s_too(autojump_clock):
    """A server that begins its shutdown before leaving ``open_runtime`` (the gateway
    drains its connections first, on a signal) sets ``grace_deadline`` then: the
    close waits for a cut-off model call until that deadline, not a whole
    ``graceful_timeout_s`` more."""
    from trioserve.actors import model_threads_running

    held = Held()
    cfg = config(straggler_model(held, batch_timeout_cap_ms=60_000), graceful_timeout_s=5)
    try:
        async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as callers:
            callers.start_soon(rt.infer, "m", item(1))
            await trio.to_thread.run_sync(held.entered.wait)
            t0 = trio.current_time()
            rt.grace_deadline = t0 + 5
            await trio.sleep(3)  # the drain of connections spends part of it
            callers.cancel_scope.cancel()
        assert trio.current_time() - t0 == pytest.approx(5.0)
        assert rt.grace_deadline == t0 + 5
        assert model_threads_running() == 1
    finally:
        held.release.set()
    await rt.models["m"].batchers[0].join_thread()
    assert model_threads_running() == 0


async def test_moving_the_grace_deadline_to_the_past_ends_the_close_at_once(autojump_clock):
    """The close's wait for a model thread is shielded (an outer cancellation does
    not skip it); a second signal ends it by moving the grace deadline."""
    from trioserve.actors import model_threads_running

    held = Held()
    cfg = config(straggler_model(held, batch_timeout_cap_ms=60_000), graceful_timeout_s=30)

    async def stop_in(seconds: float, rt: trioserve.Runtime) -> None:
        await trio.sleep(seconds)
        rt.grace_deadline = -math.inf

    try:
        async with trio.open_nursery() as outside:
            async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as callers:
                callers.start_soon(rt.infer, "m", item(1))
                await trio.to_thread.run_sync(held.entered.wait)
                callers.cancel_scope.cancel()
                t0 = trio.current_time()
                outside.start_soon(stop_in, 2.0, rt)
            assert trio.current_time() - t0 == pytest.approx(2.0)
            assert model_threads_running() == 1
    finally:
        held.release.set()
    await rt.models["m"].batchers[0].join_thread()
    assert model_threads_running() == 0


def test_the_command_ends_at_once_when_a_model_call_outlived_the_runtime(monkeypatch):
    """``trioserve``'s entry point: a model thread still running after the runtime
    closed ends the process with ``os._exit`` (the interpreter's finalisation would
    abort it), with main's status; otherwise it exits normally."""
    import trioserve.actors
    from trioserve import cli

    class Exited(BaseException):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    def crash() -> int:
        raise RuntimeError("escalated")

    running = [1]
    monkeypatch.setattr(trioserve.actors, "model_threads_running", lambda: running[0])
    monkeypatch.setattr(cli, "main", lambda: 3)
    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    with pytest.raises(Exited) as ended:
        cli.entry()
    assert ended.value.args == (3,)
    monkeypatch.setattr(cli, "main", crash)  # an error out of main: status 1, at once
    with pytest.raises(Exited) as ended:
        cli.entry()
    assert ended.value.args == (1,)
    running[0] = 0
    with pytest.raises(RuntimeError, match="escalated"):
        cli.entry()
    monkeypatch.setattr(cli, "main", lambda: 3)
    with pytest.raises(SystemExit) as info:
        cli.entry()
    assert info.value.code == 3


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


# ---------------------------------------------------------------- slow lane, hedging
class LenCost(trioserve.ModelBackend):
    """Items cost their length; run in a worker thread; an item starting with 99 waits
    for ``release``. Records the thread (replica) each batch ran on."""

    inputs = (trioserve.TensorSpec(name="x", datatype="FP32", shape=(-1,)),)
    outputs = (trioserve.TensorSpec(name="y", datatype="FP32", shape=(-1,)),)
    default_execution = "thread"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.ran: list[tuple[int, list[float]]] = []

    def prepare(self, name, inputs):
        it, _ = super().prepare(name, inputs)
        return it, int(it["x"].shape[0])

    def load(self, device, *, torch_threads=1):
        def run(items):
            self.ran.append((threading.get_ident(), [key(it) for it in items]))
            if any(key(it) == 99.0 for it in items):
                self.release.wait(30)
            return [{"y": it["x"]} for it in items]

        return run


async def test_the_slow_lane_keeps_long_requests_from_holding_back_short_ones(autojump_clock):
    backend = LenCost()
    cfg = config(
        ModelConfig(
            name="m", backend=backend, replicas=2, slow_lane_cost=100, max_batch_size=8,
            max_wait_ms=1, timeout_ms=None,
        )
    )
    try:
        async with trioserve.open_runtime(cfg) as rt:
            served = rt.models["m"]
            async with trio.open_nursery() as nursery:
                long = np.zeros(200, np.float32)
                long[0] = 99.0
                nursery.start_soon(rt.infer, "m", {"x": long})  # held in the slow lane
                await trio.testing.wait_all_tasks_blocked()
                outs = [await rt.infer("m", item(v, n=4)) for v in range(3)]
                assert [float(o["y"][0]) for o in outs] == [0.0, 1.0, 2.0]
                assert served.slow_scheduler.policy.stats[("t", "realtime")].dispatched == 1
                assert served.scheduler.policy.stats[("t", "realtime")].dispatched == 3
                backend.release.set()
    finally:
        backend.release.set()
    slow_thread = next(t for t, keys in backend.ran if 99.0 in keys)
    assert all(t != slow_thread for t, keys in backend.ran if 99.0 not in keys)


async def test_a_slow_lane_needs_a_replica_of_its_own():
    cfg = config(ModelConfig(name="m", backend=LenCost(), slow_lane_cost=10))
    with pytest.raises(trioserve.ConfigError, match=r"^models\.m\.slow_lane_replicas: the slow"):
        async with trioserve.open_runtime(cfg):
            pass


async def test_a_hedged_request_takes_the_copys_answer_when_the_first_straggles(autojump_clock):
    backend = LenCost()
    first_run = threading.Event()

    class OnceSlow(LenCost):
        def load(self, device, *, torch_threads=1):
            def run(items):
                self.ran.append((threading.get_ident(), [key(it) for it in items]))
                if not first_run.is_set():
                    first_run.set()
                    self.release.wait(30)  # the first run of all straggles
                return [{"y": it["x"] + 1} for it in items]

            return run

    backend = OnceSlow()
    cfg = config(
        ModelConfig(
            name="m", backend=backend, replicas=2, hedge=True, hedge_after_ms=50,
            max_batch_size=4, max_wait_ms=0, timeout_ms=None,
        )
    )
    try:
        async with trioserve.open_runtime(cfg) as rt:
            t0 = trio.current_time()
            out = await rt.infer("m", item(7))
            assert float(out["y"][0]) == 8.0
            assert trio.current_time() - t0 >= 0.05  # the copy went after 50 ms
            assert rt.hedges == 1
            backend.release.set()
            # A batch-class request is never hedged.
            await rt.infer("m", item(8), priority="batch")
            assert rt.hedges == 1
    finally:
        backend.release.set()
    assert [keys for _, keys in backend.ran[:2]] == [[7.0], [7.0]]


class HeldKeys:
    """A worker-thread model echoing ``x``; a batch holding a key of ``held`` waits
    until the test releases that key. Records each batch's keys."""

    def __init__(self, *held: float) -> None:
        self.gates = {k: threading.Event() for k in held}
        self.batches: list[list[float]] = []
        self._lock = threading.Lock()

    def __call__(self, items):
        keys = [key(it) for it in items]
        with self._lock:
            self.batches.append(keys)
        for k in keys:
            gate = self.gates.get(k)
            if gate is not None and not gate.wait(GATE_LIMIT_S):
                raise RuntimeError(f"{k:g} never released")
        return [{"y": it["x"]} for it in items]

    def release(self, *keys: float) -> None:
        for k in keys or self.gates:
            self.gates[k].set()


def two_tenants(model: ModelConfig, **runtime) -> trioserve.Config:
    """``model`` served to tenants a (the default) and b."""
    return trioserve.Config(
        models=(model,),
        tenants=(TenantConfig(name="a", default=True), TenantConfig(name="b")),
        runtime=trioserve.RuntimeLimits(**runtime),
    )


def hedged_threads(model: HeldKeys, **cfg) -> ModelConfig:
    """Two worker-thread replicas of ``model``; realtime requests hedge after 50 ms."""
    cfg = {"max_batch_size": 1, "max_wait_ms": 0, "timeout_ms": None, **cfg}
    return callable_model(
        "m", model, execution="thread", replicas=2, hedge=True, hedge_after_ms=50,
        adaptive_limit=False, **cfg,
    )


async def test_a_running_request_whose_hedge_copy_gives_its_room_away_is_answered(
    autojump_clock,
):
    """The copy's Overloaded was taken as the first answer: the caller got 503 while
    its original ran, and would have answered."""
    model = HeldKeys(1.0, 5.0)
    cfg = two_tenants(hedged_threads(model), queue_bound=1)
    results = {}
    try:
        async with trioserve.open_runtime(cfg) as rt:
            queue = rt.models["m"].scheduler.policy

            async def call(v: float, tenant: str, priority: str | None = None) -> None:
                results[v] = await rt.infer("m", item(v), tenant=tenant, priority=priority)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 5.0, "b", "batch")  # holds one replica (no hedge)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(call, 1.0, "a")  # runs, held, on the other
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(0.05)
                await trio.testing.wait_all_tasks_blocked()
                assert rt.hedges == 1
                assert len(queue) == 1  # the copy, in the queue's only room
                # takes the copy's room (a batch request: it is never hedged, so no
                # copy of its own races the worker thread while the clock jumps)
                nursery.start_soon(call, 2.0, "b", "batch")
                await trio.testing.wait_all_tasks_blocked()
                assert len(queue) == 1
                assert 1.0 not in results  # the caller still waits for its original
                model.release(5.0)  # the freed replica runs b's second request
                model.release(1.0)
        assert {v: float(r["y"][0]) for v, r in results.items()} == {1.0: 1, 2.0: 2, 5.0: 5}
        assert sorted(model.batches) == [[1.0], [2.0], [5.0]]  # the copy never ran
        a, b = queue.stats["a", "realtime"], queue.stats["b", "batch"]
        assert (a.admitted, a.hedged, a.shed, a.dispatched) == (1, 1, 0, 1)
        assert (b.admitted, b.shed) == (2, 0)
        assert rt.hedges == 1
        assert rt.credits_refunded["a"] == 0
    finally:
        model.release()


async def test_a_hedge_copy_expiring_in_the_queue_does_not_fail_its_running_original(
    autojump_clock,
):
    model = HeldKeys(1.0, 5.0)
    cfg = two_tenants(hedged_threads(model, timeout_ms=1000))
    results = {}
    try:
        async with trioserve.open_runtime(cfg) as rt:
            queue = rt.models["m"].scheduler.policy

            async def call(v: float, tenant: str, priority: str | None = None) -> None:
                results[v] = await rt.infer("m", item(v), tenant=tenant, priority=priority)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 5.0, "b", "batch")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(call, 1.0, "a")
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(1.0)  # both replicas busy: the copy expires queued
                await trio.testing.wait_all_tasks_blocked()
                assert rt.hedges == 1
                assert queue.stats["a", "realtime"].expired == 1
                assert 1.0 not in results
                model.release()
        assert {v: float(r["y"][0]) for v, r in results.items()} == {1.0: 1, 5.0: 5}
        assert sorted(model.batches) == [[1.0], [5.0]]
    finally:
        model.release()


async def test_a_hedged_caller_leaving_before_either_copy_ran_is_refunded(autojump_clock):
    """A hedged caller that left while its request and its copy were both queued kept
    paying for work that never ran (only the unhedged path refunded)."""
    model = HeldKeys(5.0, 6.0)
    cfg = two_tenants(hedged_threads(model))
    try:
        async with trioserve.open_runtime(cfg) as rt:
            queue = rt.models["m"].scheduler.policy
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(rt.infer, "m", item(5.0), tenant="b", priority="batch"))
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(partial(rt.infer, "m", item(6.0), tenant="b", priority="batch"))
                await trio.testing.wait_all_tasks_blocked()  # both replicas held
                with trio.move_on_after(0.2) as scope:  # the caller leaves
                    await rt.infer("m", item(1.0), tenant="a")
                assert scope.cancelled_caught
                assert rt.hedges == 1  # its copy was queued too
                assert rt.credits_used["a"] == 0
                assert rt.credits_refunded["a"] == 1
                model.release()
        assert sorted(model.batches) == [[5.0], [6.0]]  # neither copy ran
        assert queue.stats["a", "realtime"].hedged == 1
    finally:
        model.release()


async def test_a_hedged_caller_leaving_while_its_copy_runs_is_charged(autojump_clock):
    model = HeldKeys(1.0, 5.0)
    cfg = two_tenants(hedged_threads(model))
    try:
        async with trioserve.open_runtime(cfg) as rt:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(rt.infer, "m", item(5.0), tenant="b", priority="batch"))
                await trio.testing.wait_all_tasks_blocked()
                left = trio.Event()
                scope = trio.CancelScope()

                async def leaving() -> None:
                    with scope:
                        await rt.infer("m", item(1.0), tenant="a")
                    left.set()

                nursery.start_soon(leaving)
                await trio.testing.wait_all_tasks_blocked()  # 1.0 runs, held
                await trio.sleep(0.05)
                await trio.testing.wait_all_tasks_blocked()
                assert rt.hedges == 1  # the copy waits for a replica
                model.release(5.0)  # the copy runs on the freed one, held
                while len(model.batches) < 3:
                    await trio.testing.wait_all_tasks_blocked()
                    await trio.sleep(0.001)
                scope.cancel()
                await left.wait()
                assert rt.credits_refunded["a"] == 0  # it ran: charged
                assert rt.credits_used["a"] == 1
                model.release()
        assert sorted(model.batches) == [[1.0], [1.0], [5.0]]
    finally:
        model.release()


FLOW_ENDS = (
    "dispatched", "expired", "withdrawn", "closed", "pushed_out", "superseded", "gave_way",
    "queued",
)


def hedged_flow(rt: trioserve.Runtime, flow: str) -> dict[str, int]:
    """``flow``'s counts in ``rt.statistics()``, checked to balance exactly."""
    f = rt.statistics()["m"]["flows"][flow]
    assert f["admitted"] + f["hedged"] == sum(f[k] for k in FLOW_ENDS), f
    return {k: f[k] for k in ("admitted", "hedged", *FLOW_ENDS)}


class HeldOnce(HeldKeys):
    """HeldKeys holding only the first batch with each held key (a hedge copy of it
    then runs at once)."""

    def __init__(self, *held: float) -> None:
        super().__init__(*held)
        self.seen: set[float] = set()

    def __call__(self, items):
        keys = [key(it) for it in items]
        with self._lock:
            self.batches.append(keys)
            first = [k for k in keys if k in self.gates and k not in self.seen]
            self.seen.update(keys)
        for k in first:
            if not self.gates[k].wait(GATE_LIMIT_S):
                raise RuntimeError(f"{k:g} never released")
        return [{"y": it["x"]} for it in items]


async def test_a_hedged_flow_balances_when_its_copy_answers_while_the_original_runs(
    autojump_clock,
):
    """Whichever of the two answers, the flow's counts add up exactly: here the copy
    answers while the original, already dispatched, still runs (a copy queues behind
    its original, so it never runs while the original is still queued)."""
    model = HeldOnce(1.0, 5.0)
    cfg = two_tenants(hedged_threads(model))
    try:
        async with trioserve.open_runtime(cfg) as rt:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(rt.infer, "m", item(5.0), tenant="b", priority="batch"))
                await trio.testing.wait_all_tasks_blocked()
                answered = trio.Event()

                async def call() -> None:
                    out = await rt.infer("m", item(1.0), tenant="a")
                    assert float(out["y"][0]) == 1.0
                    answered.set()

                nursery.start_soon(call)  # runs, held, on the other replica
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(0.05)
                await trio.testing.wait_all_tasks_blocked()
                assert rt.hedges == 1  # the copy waits in the queue
                assert hedged_flow(rt, "a/realtime")["queued"] == 1
                model.release(5.0)  # the copy runs on the freed replica, and answers
                await answered.wait()
                flow = hedged_flow(rt, "a/realtime")
                assert (flow["admitted"], flow["hedged"], flow["dispatched"]) == (1, 1, 2)
                assert flow["superseded"] == flow["withdrawn"] == flow["queued"] == 0
                model.release(1.0)
    finally:
        model.release()
    assert sorted(model.batches) == [[1.0], [1.0], [5.0]]


async def test_a_hedge_copy_withdrawn_queued_when_its_original_answers_is_superseded(
    autojump_clock,
):
    """A copy withdrawn from the queue because its original answered first was
    counted nowhere, so a hedged flow's counts fell short of admitted + hedged."""
    model = HeldKeys(1.0, 5.0)
    cfg = two_tenants(hedged_threads(model))
    try:
        async with trioserve.open_runtime(cfg) as rt:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(rt.infer, "m", item(5.0), tenant="b", priority="batch"))
                await trio.testing.wait_all_tasks_blocked()
                answered = trio.Event()

                async def call() -> None:
                    await rt.infer("m", item(1.0), tenant="a")
                    answered.set()

                nursery.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(0.05)
                await trio.testing.wait_all_tasks_blocked()
                assert rt.hedges == 1
                assert hedged_flow(rt, "a/realtime")["queued"] == 1  # the copy
                model.release(1.0)  # the original answers; its copy is still queued
                await answered.wait()
                flow = hedged_flow(rt, "a/realtime")
                assert (flow["admitted"], flow["hedged"], flow["dispatched"]) == (1, 1, 1)
                assert (flow["superseded"], flow["withdrawn"], flow["queued"]) == (1, 0, 0)
                model.release(5.0)
            # A caller leaving while its original runs withdraws its queued copy:
            # counted as its withdrawal, not as superseded.
            model.gates.update({2.0: threading.Event(), 6.0: threading.Event()})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(rt.infer, "m", item(6.0), tenant="b", priority="batch"))
                await trio.testing.wait_all_tasks_blocked()
                left = trio.Event()
                scope = trio.CancelScope()

                async def leaving() -> None:
                    with scope:
                        await rt.infer("m", item(2.0), tenant="a")
                    left.set()

                nursery.start_soon(leaving)
                await trio.testing.wait_all_tasks_blocked()  # 2.0 runs, held
                await trio.sleep(0.05)
                await trio.testing.wait_all_tasks_blocked()
                assert rt.hedges == 2  # its copy waits in the queue
                scope.cancel()  # cancelled, not at its deadline
                await left.wait()
                model.release()
            flow = hedged_flow(rt, "a/realtime")
            assert (flow["admitted"], flow["hedged"], flow["dispatched"]) == (2, 2, 2)
            assert (flow["superseded"], flow["withdrawn"], flow["queued"]) == (1, 1, 0), flow
    finally:
        model.release()


async def test_a_hedge_copy_takes_only_free_room_and_pushes_nobody_out(autojump_clock):
    """The copy was admitted like a new request: in a full queue it pushed out
    another tenant's real request, which got 503."""
    model = HeldKeys(1.0, 5.0)
    cfg = two_tenants(hedged_threads(model), queue_bound=2)
    results = {}
    try:
        async with trioserve.open_runtime(cfg) as rt:
            queue = rt.models["m"].scheduler.policy

            async def call(v: float, tenant: str, priority: str | None = None) -> None:
                results[v] = await rt.infer("m", item(v), tenant=tenant, priority=priority)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 5.0, "b", "batch")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(call, 1.0, "a")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(call, 2.0, "b")
                nursery.start_soon(call, 3.0, "b")  # the queue is full
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(0.05)
                await trio.testing.wait_all_tasks_blocked()
                assert rt.hedges == 0  # no free room: no copy
                assert len(queue) == 2
                model.release()
        assert sorted(results) == [1.0, 2.0, 3.0, 5.0]
        a, b = queue.stats["a", "realtime"], queue.stats["b", "realtime"]
        assert (a.admitted, a.hedged, a.shed) == (1, 0, 0)
        assert (b.admitted, b.shed) == (2, 0)
    finally:
        model.release()


async def test_a_hedge_copy_is_not_run_in_the_same_batch_as_its_original(autojump_clock):
    model = HeldKeys(5.0, 6.0)
    cfg = config(hedged_threads(model, max_batch_size=4))
    results = {}
    answered = collections.defaultdict(trio.Event)
    try:
        async with trioserve.open_runtime(cfg) as rt:
            scheduler = rt.models["m"].scheduler

            async def call(v: float, priority: str | None = None) -> None:
                results[v] = await rt.infer("m", item(v), priority=priority)
                answered[v].set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 5.0, "batch")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(call, 6.0, "batch")  # both replicas busy
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(call, 1.0)
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(0.05)
                await trio.testing.wait_all_tasks_blocked()
                assert rt.hedges == 1
                assert len(scheduler.policy) == 2  # the original and its copy, queued
                model.release(5.0)  # the freed replica pulls both: it runs one
                await answered[1.0].wait()
                model.release(6.0)
        assert sorted(model.batches) == [[1.0], [5.0], [6.0]]
        assert scheduler.queue_depth() == 0
        assert scheduler.twins == {}
    finally:
        model.release()


class _StandIn:
    """What the batcher asks of a worker process besides running batches: its error
    types, its pipeline depth, and closing and waiting for its exit."""

    SLOTS = 3
    Died = WorkerProcess.Died
    Failed = WorkerProcess.Failed
    _exited: trio.Event

    def kill(self) -> None:
        self._exited.set()

    async def aclose(self) -> None:
        self.kill()
        await trio.lowlevel.checkpoint()

    async def wait_exited(self) -> None:
        await self._exited.wait()


class FakeWorker(_StandIn):
    """Stands in for a worker process in the batcher's pipeline (no process): batches
    are staged up to SLOTS at a time and run in order; the first worker made runs a
    batch holding ``HELD`` only once ``gate`` is set. Records each batch sent as
    (worker, keys)."""

    HELD = 7.0
    gate: trio.Event
    sent: list
    made = False

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.holds = not FakeWorker.made
        FakeWorker.made = True
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self.in_flight = 0
        self._staged: collections.deque = collections.deque()
        self._exited = trio.Event()

    async def start(self) -> None:
        await trio.lowlevel.checkpoint()

    @property
    def alive(self) -> bool:
        return not self._exited.is_set()

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        self.sent.append((self, [key(it) for it in items]))
        self._staged.append(items)

    async def result(self):
        items = self._staged[0]
        if self.holds and any(key(it) == self.HELD for it in items):
            await self.gate.wait()
        self._staged.popleft()
        return [{"y": it["x"]} for it in items]


class NoZygote:
    async def start(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_a_worker_process_replica_never_stages_a_hedge_copy_behind_its_original(
    autojump_clock, monkeypatch
):
    """A process replica pulls while it has room in its pipeline: it took the copy of
    the request it was running, to run after it, while another replica sat idle."""
    import trioserve._runtime
    import trioserve.actors._batcher

    FakeWorker.gate, FakeWorker.sent, FakeWorker.made = trio.Event(), [], False
    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", FakeWorker)
    breakers: list[Breaker] = []

    def breaker() -> Breaker:
        # The second replica's breaker is open for its first second: the first
        # replica alone is pulling when the copy is queued.
        b = Breaker()
        if breakers:
            b.open_until = trio.current_time() + 1.0
        breakers.append(b)
        return b

    monkeypatch.setattr(trioserve.actors, "Breaker", breaker)
    cfg = config(
        callable_model(
            "m", crash_on_666, execution="process", replicas=2, hedge=True,
            hedge_after_ms=50, max_batch_size=4, max_wait_ms=0, timeout_ms=None,
        )
    )
    try:
        async with trioserve.open_runtime(cfg) as rt:
            first, second = (b._worker for b in rt.models["m"].batchers)
            with trio.fail_after(10):
                out = await rt.infer("m", item(7))
            # The copy waited for the second replica, which answered at once.
            assert trio.current_time() == pytest.approx(1.0)
            assert float(out["y"][0]) == 7.0
            assert FakeWorker.sent == [(first, [7.0]), (second, [7.0])]
            assert rt.hedges == 1
            FakeWorker.gate.set()
    finally:
        FakeWorker.gate.set()


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


async def test_straggling_retries_do_not_open_the_breaker_of_a_thread_replica(monkeypatch):
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
