"""The slow lane and hedging: long requests kept from holding back short ones; a
hedged request's copy answering for a straggling original, taking only free room in
the queue, expiring, withdrawn or superseded, never in its original's batch nor
staged behind it on a worker process; what a hedged caller is charged or refunded."""

from __future__ import annotations

import collections
import threading
from functools import partial

import attrs
import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import (
    GATE_LIMIT_S,
    NoZygote,
    _StandIn,
    callable_model,
    config,
    crash_on_666,
    item,
    key,
)
from trioserve import ModelConfig, TenantConfig
from trioserve.actors import Breaker, SchedulerActor


# ---------------------------------------------------------------- slow lane, hedging
class LenCost(trioserve.ModelBackend):
    """Items cost their length; run in a worker thread; an item starting with 99 waits
    for ``release``. Records the thread (replica) each batch ran on."""

    inputs = (trioserve.TensorSpec(name="x", datatype="FP32", shape=(-1,)),)
    outputs = (trioserve.TensorSpec(name="y", datatype="FP32", shape=(-1,)),)
    default_execution = "thread"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.holding = threading.Event()  # an item starting with 99 is running
        self.ran: list[tuple[int, list[float]]] = []

    def prepare(self, name, inputs):
        it, _ = super().prepare(name, inputs)
        return it, int(it["x"].shape[0])

    def load(self, device, *, torch_threads=1):
        def run(items):
            self.ran.append((threading.get_ident(), [key(it) for it in items]))
            if any(key(it) == 99.0 for it in items):
                self.holding.set()
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
                # Running, holding its thread: had the short ones run first, trio's
                # thread cache could have handed one of their threads to it after.
                assert await trio.to_thread.run_sync(backend.holding.wait, 30)
                outs = [await rt.infer("m", item(v, n=4)) for v in range(3)]
                assert [float(o["y"][0]) for o in outs] == [0.0, 1.0, 2.0]
                assert served.slow_scheduler.policy.stats[("t", "realtime")].dispatched == 1
                assert served.scheduler.policy.stats[("t", "realtime")].dispatched == 3
                backend.release.set()
    finally:
        backend.release.set()
    slow_thread = next(t for t, keys in backend.ran if 99.0 in keys)
    assert all(t != slow_thread for t, keys in backend.ran if 99.0 not in keys)


async def test_each_lanes_adaptive_limit_floor_counts_its_own_replicas():
    """The floor is two full batches per replica of the lane's own (scheduling.md):
    the fast lane counted every replica of the model, the slow lane's too, so with 3
    replicas, 1 of them slow, its floor was 48 where its 2 replicas drain 32."""
    cfg = config(
        ModelConfig(
            name="m", backend=LenCost(), replicas=3, slow_lane_cost=100,
            slow_lane_replicas=1, max_batch_size=8,
        )
    )
    async with trioserve.open_runtime(cfg) as rt:
        served = rt.models["m"]
        fast = served.scheduler.policy.limit
        slow = served.slow_scheduler.policy.limit
    assert (fast.minimum, slow.minimum) == (2 * 8 * 2, 2 * 8 * 1)


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



@pytest.fixture(autouse=True)
def threads_hedge_as_processes(monkeypatch):
    """The hedging mechanics tested here (a copy's room, its expiry, refunds, which
    answer wins) are those of any replicas; thread replicas send a copy only while
    three or more are ready (``hedge_room``: tests/test_hedge_hang.py), so these
    tests' two thread replicas, gated by events, hedge as worker processes do."""
    monkeypatch.setattr(SchedulerActor, "hedge_room", lambda self: True)


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


async def test_a_twin_dropped_from_apart_does_not_disturb_the_service_rate(autojump_clock):
    """Dropping a twin kept apart (its hedge over) went through
    ``completed(failed=True)``, which forgets the full batch just answered: the pair
    of full batches in a row the rate is measured on was broken by a request that
    never ran as a batch. Its cost leaves the devices; the measurement goes on."""
    from trioserve import Reply, Request
    from trioserve.actors import BatchLimits, FairQueue, SchedulerActor

    queue = FairQueue(BatchLimits(max_size=2), bound=16, adaptive=False)
    scheduler = SchedulerActor("m", queue)
    now = trio.current_time()
    original = Request(model="m", item=None, cost=1, arrival=now)
    copy = attrs.evolve(original, reply=Reply())
    scheduler.submit_nowait(original)
    assert scheduler.submit_copy_nowait(original, copy)
    assert queue.next_batch(now) == [original, copy]  # one replica pulled both
    scheduler.keep_apart(copy)  # it holds the original: the copy waits for another
    full = [Request(model="m", item=None, cost=1, arrival=now) for _ in range(4)]
    for r in full:
        scheduler.submit_nowait(r)
    first = queue.next_batch(now)
    assert first == full[:2]
    scheduler.completed(first)  # a full batch answered at 0
    original.reply.set_result({})
    copy.reply.withdraw()  # its twin answered
    scheduler.forget_copy(original, copy)  # the copy kept apart is dropped
    # two queued; on the devices only the original, its batch not done yet
    assert (scheduler.queue_depth(), queue.in_service) == (2, 1)
    second = queue.next_batch(now)
    for r in second:
        r.reply.run = (now, 0.5)
    await trio.sleep(0.5)
    scheduler.completed(second)  # the next full batch, 0.5 s later: 2 items over 0.5 s
    assert queue.rate == pytest.approx(4.0)


async def test_a_twin_kept_apart_leaves_the_queue_when_its_hedge_ends(autojump_clock):
    """A copy kept apart from the replica running its original used to stay among the
    requests held for another replica after its hedge ended (the original's error
    answered the caller) until some replica pulled again: meanwhile it counted in
    the queue depth and, as cost on the devices, in every newcomer's estimated wait."""
    from trioserve import ModelError, Reply, Request
    from trioserve.actors import BatchLimits, FairQueue, SchedulerActor

    queue = FairQueue(BatchLimits(max_size=4), bound=8, adaptive=False)
    scheduler = SchedulerActor("m", queue)
    now = trio.current_time()
    original = Request(model="m", item=None, cost=3, arrival=now)
    copy = attrs.evolve(original, reply=Reply())
    scheduler.submit_nowait(original)
    assert scheduler.submit_copy_nowait(original, copy)
    assert queue.next_batch(now) == [original, copy]  # one replica pulled both
    scheduler.keep_apart(copy)  # it holds the original: the copy waits for another
    assert (scheduler.queue_depth(), queue.in_service) == (1, 6)
    original.reply.set_error(ModelError("model 'm' failed"))
    scheduler.completed([original], failed=True)
    copy.reply.withdraw()  # the caller took the error and left
    scheduler.forget_copy(original, copy)
    assert (scheduler.queue_depth(), queue.in_service) == (0, 0)
    assert queue.estimated_wait("default", 0, 1) == 0.0  # no rate measured yet
    queue.rate = 1.0
    assert queue.estimated_wait("default", 0, 1) == 1.0  # only its own cost


class HeldThenRaises(HeldKeys):
    """HeldKeys whose first batch holding 1.0 waits for ``release`` (then answers, or
    raises when ``first_raises``); each later batch holding 1.0 raises at once, as a
    replica whose model fails every call would."""

    def __init__(self, *, first_raises: bool = False) -> None:
        super().__init__(1.0)
        self.first_raises = first_raises
        self.runs = 0

    def __call__(self, items):
        keys = [key(it) for it in items]
        if 1.0 not in keys:
            return super().__call__(items)
        with self._lock:
            self.batches.append(keys)
            self.runs += 1
            run = self.runs
        if run == 1:
            if not self.gates[1.0].wait(GATE_LIMIT_S):
                raise RuntimeError("1 never released")
            if not self.first_raises:
                return [{"y": it["x"]} for it in items]
        raise ValueError(f"run {run} raised")


async def test_a_hedge_twin_that_raises_does_not_fail_the_caller_while_the_other_runs(
    autojump_clock,
):
    """The copy runs on another replica and the model raises there at once, while the
    original still runs: that error is no answer while the original may still give
    one (the caller used to get the failing replica's ModelError at once, its
    original's value dropped). The original's answer is the caller's."""
    model = HeldThenRaises()
    cfg = config(hedged_threads(model))
    try:
        async with trioserve.open_runtime(cfg) as rt:
            got: list[float] = []
            answered = trio.Event()

            async def call() -> None:
                out = await rt.infer("m", item(1.0))
                got.append(float(out["y"][0]))
                answered.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()  # the original runs, held
                await trio.sleep(0.05)
                while model.runs < 2:  # the copy ran on the other replica, and raised
                    await trio.testing.wait_all_tasks_blocked()
                    await trio.sleep(0.001)
                await trio.testing.wait_all_tasks_blocked()
                assert rt.hedges == 1
                assert not answered.is_set()  # the original may still answer
                model.release(1.0)
            assert got == [1.0]
            flow = hedged_flow(rt, "t/realtime")
            assert (flow["admitted"], flow["hedged"], flow["dispatched"]) == (1, 1, 2)
            assert rt.credits_used["t"] == 1  # the copy is not charged
    finally:
        model.release()
    assert model.batches == [[1.0], [1.0]]


async def test_a_hedged_caller_gets_the_first_model_error_when_both_twins_raise(
    autojump_clock,
):
    """When the original raises too, no value can come: the caller gets the first
    of the two errors (the copy's), once the original's run ended."""
    model = HeldThenRaises(first_raises=True)
    cfg = config(hedged_threads(model))
    try:
        async with trioserve.open_runtime(cfg) as rt:
            errors: list[str] = []

            async def call() -> None:
                with pytest.raises(trioserve.ModelError) as err:
                    await rt.infer("m", item(1.0))
                errors.append(str(err.value))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                while model.runs < 2:  # the copy ran on the other replica, and raised
                    await trio.testing.wait_all_tasks_blocked()
                    await trio.sleep(0.001)
                # ... and its replica answered the copy with that error: its thread
                # returns to trio after the tasks are blocked (a wait for tasks
                # blocked does not wait for a thread), so wait for the answer itself
                for _ in range(10_000):
                    if rt.statistics()["m"]["statuses"].get("model_error", 0):
                        break
                    await trio.to_thread.run_sync(threading.Event().wait, 0.0001)
                    await trio.testing.wait_all_tasks_blocked()
                assert rt.statistics()["m"]["statuses"]["model_error"] == 1
                assert not errors  # the original may still answer
                model.release(1.0)  # it raises too
            assert len(errors) == 1
            assert "run 2 raised" in errors[0]  # the first of the two
            flow = hedged_flow(rt, "t/realtime")
            assert (flow["admitted"], flow["hedged"], flow["dispatched"]) == (1, 1, 2)
    finally:
        model.release()
    assert model.batches == [[1.0], [1.0]]


async def test_a_drain_returns_once_a_twin_kept_apart_leaves_with_its_hedge(autojump_clock):
    """A drain (an unload or a reload waiting for the queue to empty) waits for the
    copy kept apart from its original's replica. When the hedge ends, the copy leaves
    (:meth:`SchedulerActor.forget_copy`), which used to leave the drain parked until
    something else woke it (a batch taken or completed, a batcher finding none)."""
    from trioserve import ModelError, Reply, Request
    from trioserve.actors import BatchLimits, FairQueue, SchedulerActor

    queue = FairQueue(BatchLimits(max_size=4), bound=8, adaptive=False)
    scheduler = SchedulerActor("m", queue)
    now = trio.current_time()
    original = Request(model="m", item=None, cost=1, arrival=now)
    copy = attrs.evolve(original, reply=Reply())
    scheduler.submit_nowait(original)
    assert scheduler.submit_copy_nowait(original, copy)
    assert queue.next_batch(now) == [original, copy]  # one replica pulled both
    scheduler.keep_apart(copy)  # it holds the original: the copy waits for another
    drained = trio.Event()

    async def drain() -> None:
        await scheduler.wait_empty()
        drained.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain)
        original.reply.set_error(ModelError("model 'm' failed"))
        scheduler.completed([original], failed=True)
        await trio.testing.wait_all_tasks_blocked()
        assert not drained.is_set()  # the copy is still kept apart
        began = trio.current_time()
        copy.reply.withdraw()  # the caller took the error and left
        scheduler.forget_copy(original, copy)
        await trio.testing.wait_all_tasks_blocked()
        assert scheduler.queue_depth() == 0
        assert drained.is_set()
        assert trio.current_time() == began


async def test_a_drain_returns_once_what_waits_expires_with_no_batcher_pulling(autojump_clock):
    """A drain waits for a queued request while no batcher pulls (each degraded by a
    hung thread, say). The queue's timer answers it at its deadline, which used to
    wake only the idle batchers (none here), not the drain: it stayed parked."""
    from trioserve import DeadlineExceeded, Request
    from trioserve.actors import BatchLimits, FairQueue, SchedulerActor

    queue = FairQueue(BatchLimits(max_size=4), bound=8, adaptive=False)
    scheduler = SchedulerActor("m", queue)
    t0 = trio.current_time()
    request = Request(model="m", item=None, arrival=t0, deadline=t0 + 1.0, answer_expiry=True)
    scheduler.submit_nowait(request)
    drained = trio.Event()

    async def drain() -> None:
        await scheduler.wait_empty()
        drained.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        nursery.start_soon(drain)
        with trio.fail_after(5):
            await drained.wait()
        assert trio.current_time() == t0 + 1.0
        with pytest.raises(DeadlineExceeded):
            await request.reply.wait()  # answered at its deadline, never run
        nursery.cancel_scope.cancel("the test is over")
