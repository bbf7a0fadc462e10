"""An autoscaled model in the runtime (``[models.NAME.autoscaling]``): replicas added
under a sustained backlog once the upscale delay passed, and serving; replicas
retired when idle for the downscale delay, finishing the batch they run; every
request answered exactly once throughout; shutdown during a scale event; hedging.

The model runs in a stand-in for a worker process (no process) whose batches take
trio time, so every timing below is exact under the autojumping MockClock."""

from __future__ import annotations

import collections
import logging

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import (
    NoZygote,
    X,
    Y,
    _StandIn,
    callable_model,
    config,
    crash_on_666,
    item,
    key,
)
from trioserve import ActorClosed, ActorState, AutoscalingConfig, CallableBackend

#: trio seconds a stand-in worker takes per batch
RUN_S = 1.0
#: x[0] of an item whose batch also waits for ``TimedWorker.gate``
HELD = 700.0


class TimedWorker(_StandIn):
    """Stands in for a worker process: its batches run one after another, each taking
    ``RUN_S`` of trio time (and one holding ``HELD`` waiting for ``gate`` too; with
    ``hold_once``, only the first such batch). Records every worker made and every
    batch run as (worker, keys)."""

    made: list
    ran: list
    gate: trio.Event
    load_s = 0.0  # trio seconds a worker takes to start, but the first one
    fail: set  # the workers (by number) whose start fails, after ``load_s``
    hold_once = False
    held: list  # the workers that held a batch

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = None
        self.device = device
        self.busy_seconds = self.last_run_seconds = 0.0
        self._staged: collections.deque = collections.deque()
        self._exited = trio.Event()
        self.number = len(TimedWorker.made)
        TimedWorker.made.append(self)

    async def start(self) -> None:
        await trio.sleep(self.load_s if self.number else 0.0)
        if self.number in TimedWorker.fail:
            raise RuntimeError(f"worker {self.number} cannot load")

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        self._staged.append(items)

    async def result(self):
        items = self._staged[0]
        await trio.sleep(RUN_S)
        if any(key(it) == HELD for it in items) and not (self.hold_once and self.held):
            TimedWorker.held.append(self.number)
            await TimedWorker.gate.wait()
        self._staged.popleft()
        TimedWorker.ran.append((self.number, [key(it) for it in items]))
        return [{"y": it["x"] * 2 + 1} for it in items]


@pytest.fixture
def workers(monkeypatch):
    import trioserve._runtime
    import trioserve.actors._batcher

    TimedWorker.made, TimedWorker.ran, TimedWorker.gate = [], [], trio.Event()
    TimedWorker.load_s, TimedWorker.hold_once, TimedWorker.held = 0.0, False, []
    TimedWorker.fail = set()
    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", TimedWorker)
    yield TimedWorker
    TimedWorker.gate.set()


def model(**kw):
    autoscaling = kw.pop("autoscaling")
    args = dict(execution="process", max_batch_size=2, max_wait_ms=0, timeout_ms=None)
    args.update(kw)
    return callable_model("m", crash_on_666, autoscaling=autoscaling, **args)


async def call(rt, x: float, answers: dict) -> None:
    try:
        out = await rt.infer("m", item(x))
    except trioserve.TrioserveError as exc:
        answers.setdefault(x, []).append(exc)
    else:
        answers.setdefault(x, []).append(float(out["y"][0]))


def ran_keys(ran) -> collections.Counter:
    return collections.Counter(k for _, keys in ran for k in keys)


async def test_a_sustained_backlog_adds_replicas_after_the_upscale_delay(
    autojump_clock, workers
):
    """24 requests on one replica (2 per batch, 1 s a batch): the load asks for 3
    replicas (target 4) from the first look, at 1 s, and the count moves at the
    look 3 s later; both new replicas take work at once."""
    cfg = config(model(autoscaling=AutoscalingConfig(
        max_replicas=3, target_queued_per_replica=4, upscale_delay_s=3,
        downscale_delay_s=1000, interval_s=1,
    )))
    answers: dict = {}
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        served = rt.models["m"]
        scaler = served.scaler.scaler
        assert scaler.look_back == 3  # the default: the upscale delay
        async with trio.open_nursery() as nursery:
            for x in range(1, 25):
                nursery.start_soon(call, rt, float(x), answers)
            await trio.sleep_until(t0 + 3.5)
            assert (len(served.batchers), scaler.desired) == (1, 3)
            await trio.sleep_until(t0 + 4.5)
            assert [b.index for b in served.batchers] == [0, 1, 2]
            assert all(b.health == "ready" for b in served.batchers)
            assert served.scheduler.replicas == 3
            # the adaptive limit's floor: two full batches per replica
            assert served.scheduler.policy.limit.minimum == 2 * 2 * 3
        d = scaler.last_decision
        assert (d.direction, d.before, d.after, d.at) == ("up", 1, 3, t0 + 4)
    assert answers == {float(x): [2.0 * x + 1] for x in range(1, 25)}
    assert ran_keys(workers.ran) == {float(x): 1 for x in range(1, 25)}
    assert {w for w, _ in workers.ran} == {0, 1, 2}


async def test_the_replicas_of_one_decision_load_side_by_side(autojump_clock, workers):
    """One replica on two devices, a backlog asking for four (each new one takes 5 s
    to load): the look at 1 s starts the three at once, placed on the device with
    the fewest (cpu:1, cpu:0, cpu:1), and all three serve at 6 s (one after another,
    the last served at 16 s). The look-back window defaults to the upscale delay."""
    workers.load_s = 5.0
    cfg = config(model(
        replicas=1, devices=("cpu:0", "cpu:1"), autoscaling=AutoscalingConfig(
            max_replicas=4, target_queued_per_replica=2, upscale_delay_s=0,
            downscale_delay_s=1000, interval_s=1,
        ),
    ))
    answers: dict = {}
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        served = rt.models["m"]
        assert served.scaler.scaler.look_back == 0
        async with trio.open_nursery() as nursery:
            for x in range(1, 31):
                nursery.start_soon(call, rt, float(x), answers)
            await trio.sleep_until(t0 + 1.5)
            assert [(b.index, b.device, b.health) for b in served.batchers] == [
                (0, "cpu:0", "ready"), (1, "cpu:1", "starting"), (2, "cpu:0", "starting"),
                (3, "cpu:1", "starting"),
            ]
            assert len(workers.made) == 4
            await trio.sleep_until(t0 + 5.9)
            assert [b.health for b in served.batchers[1:]] == ["starting"] * 3
            await trio.sleep_until(t0 + 6.1)
            assert [b.health for b in served.batchers] == ["ready"] * 4
            assert served.scheduler.policy.limit.minimum == 2 * 2 * 4
        assert served.scaler.scaler.decisions == {"up": 1, "down": 0}
        assert served.scaler.start_failures == 0
    assert answers == {float(x): [2.0 * x + 1] for x in range(1, 31)}
    assert {w for w, _ in workers.ran} == {0, 1, 2, 3}


async def test_a_replica_failing_to_load_beside_others_is_handled_alone(
    autojump_clock, workers
):
    """Up at the look at 3 s (asking for more since 1 s): two replicas start, each
    taking 2.5 s to load, and the second fails (at 5.5 s): it is counted, logged and
    unregistered while the first serves. The next try waits the upscale delay again
    from the look after the failure (at 6 s, the first to count two replicas): at
    8 s a replica starts, and serves at 10.5 s."""
    workers.load_s = 2.5
    workers.fail = {2}
    cfg = config(model(autoscaling=AutoscalingConfig(
        max_replicas=3, target_queued_per_replica=2, upscale_delay_s=2,
        downscale_delay_s=1000, interval_s=1, look_back_s=0,
    )), queue_bound=1000)
    answers: dict = {}
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        served = rt.models["m"]
        controller = served.scaler
        async with trio.open_nursery() as nursery:
            for x in range(1, 61):
                nursery.start_soon(call, rt, float(x), answers)
            await trio.sleep_until(t0 + 3.5)
            assert [b.health for b in served.batchers] == ["ready", "starting", "starting"]
            assert len(workers.made) == 3
            await trio.sleep_until(t0 + 5.7)
            assert [(b.index, b.health) for b in served.batchers] == [(0, "ready"), (1, "ready")]
            assert controller.start_failures == 1
            await trio.sleep_until(t0 + 7.5)
            assert len(served.batchers) == 2
            await trio.sleep_until(t0 + 8.5)
            assert [(b.index, b.health) for b in served.batchers][2:] == [(3, "starting")]
            await trio.sleep_until(t0 + 10.7)
            assert [b.health for b in served.batchers] == ["ready"] * 3
        assert controller.scaler.decisions == {"up": 2, "down": 0}
        assert controller.start_failures == 1
    assert answers == {float(x): [2.0 * x + 1] for x in range(1, 61)}
    assert ran_keys(workers.ran) == dict.fromkeys(answers, 1)
    assert {w for w, _ in workers.ran} == {0, 1, 3}


async def test_an_idle_model_retires_replicas_after_the_downscale_delay(
    autojump_clock, workers
):
    """Three replicas, no load, min 1: the count drops to 1 at the look 5 s after the
    first (at 1 s); the two newest go, idle: their run returns, their workers are
    closed and they are unregistered. The one left serves."""
    cfg = config(model(replicas=3, autoscaling=AutoscalingConfig(
        min_replicas=1, max_replicas=3, downscale_delay_s=5, interval_s=1,
    )))
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        served = rt.models["m"]
        first, second, third = served.batchers
        await trio.sleep_until(t0 + 5.5)
        assert len(served.batchers) == 3
        await trio.sleep_until(t0 + 6)
        await trio.testing.wait_all_tasks_blocked()
        assert served.batchers == [first] == served.scheduler.batchers
        assert served.scheduler.replicas == 1
        assert second.state is third.state is ActorState.STOPPED
        assert (second._worker, third._worker) == (None, None)
        assert not workers.made[1].alive
        assert not workers.made[2].alive
        assert served.scheduler.policy.limit.minimum == 2 * 2 * 1
        d = served.scaler.scaler.last_decision
        assert (d.direction, d.before, d.after, d.at) == ("down", 3, 1, t0 + 6)
        out = await rt.infer("m", item(3.0))
    assert float(out["y"][0]) == 7.0
    assert workers.ran == [(0, [3.0])]


async def test_a_replica_retired_while_it_runs_a_batch_answers_that_batch(
    autojump_clock, workers
):
    """Both replicas run a held batch (load 2, target 4: one replica wanted); the
    newest is retired: it pulls no more, its batch is answered when it completes,
    and only then does it stop and leave the model."""
    cfg = config(model(replicas=2, max_batch_size=1, autoscaling=AutoscalingConfig(
        min_replicas=1, max_replicas=2, target_queued_per_replica=4,
        downscale_delay_s=2, interval_s=1,
    )))
    answers: dict = {}
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        served = rt.models["m"]
        first, second = served.batchers
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, rt, HELD, answers)
            nursery.start_soon(call, rt, HELD, answers)
            await trio.sleep_until(t0 + 3.5)  # retired at the look at 3
            assert not first.idle
            assert not second.idle
            assert second.health == "retiring"
            assert served.batchers == [first, second]
            assert not first.retiring
            # a request now goes to the replica that stays
            nursery.start_soon(call, rt, 5.0, answers)
            await trio.sleep(10)
            assert answers == {}
            assert second.state is ActorState.RUNNING
            workers.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert served.batchers == [first]
        assert second.state is ActorState.STOPPED
        assert not workers.made[1].alive
    assert answers == {HELD: [1401.0, 1401.0], 5.0: [11.0]}
    assert sorted(workers.ran) == [(0, [5.0]), (0, [HELD]), (1, [HELD])]


async def test_a_retired_thread_replica_finishes_its_batch_and_lets_its_model_go(
    autojump_clock, gates
):
    """The same with worker threads: the retired replica's model call returns and is
    answered, then its run returns and its runner is let go."""
    gate = gates()
    cfg = config(callable_model(
        "m", gate, execution="thread", replicas=2, max_batch_size=1, max_wait_ms=0,
        timeout_ms=None, autoscaling=AutoscalingConfig(
            min_replicas=1, max_replicas=2, target_queued_per_replica=4,
            downscale_delay_s=2, interval_s=1,
        ),
    ))
    answers: dict = {}
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        served = rt.models["m"]
        first, second = served.batchers
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, rt, 1.0, answers)
            nursery.start_soon(call, rt, 2.0, answers)
            await trio.sleep_until(t0 + 3.5)
            assert second.retiring
            assert not first.retiring
            assert not second.idle
            assert answers == {}
            gate.release()
        await trio.testing.wait_all_tasks_blocked()
        assert served.batchers == [first]
        assert second.state is ActorState.STOPPED
        assert second._runner is None
        assert first._runner is not None
    assert answers == {1.0: [3.0], 2.0: [5.0]}


async def test_every_request_is_answered_once_through_a_scale_up_and_a_scale_down(
    autojump_clock, workers
):
    """400 callers over 40 s: a burst of 10 a second for 20 s (the count goes up to 4),
    then a trickle of one every 2 s (it comes down to 1 while requests still come
    in and retired replicas still run batches). Each caller gets exactly one answer,
    its own, and each request runs exactly once."""
    cfg = config(model(autoscaling=AutoscalingConfig(
        min_replicas=1, max_replicas=4, target_queued_per_replica=4,
        upscale_delay_s=2, downscale_delay_s=4, interval_s=1,
    )), queue_bound=1000)
    answers: dict = {}
    counts: list[int] = []
    xs = [float(x) for x in range(1, 201)] + [float(x) for x in range(1001, 1011)]
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        served = rt.models["m"]

        async def caller(at: float, x: float) -> None:
            await trio.sleep_until(at)
            await call(rt, x, answers)

        async with trio.open_nursery() as nursery:
            for i, x in enumerate(xs[:200]):
                nursery.start_soon(caller, t0 + i * 0.1, x)
            for i, x in enumerate(xs[200:]):
                nursery.start_soon(caller, t0 + 30 + 2 * i, x)
            for t in range(1, 60):
                await trio.sleep_until(t0 + t)
                counts.append(sum(1 for b in served.batchers if not b.retiring))
        decisions = served.scaler.scaler.decisions
    assert answers == {x: [2 * x + 1] for x in xs}
    assert ran_keys(workers.ran) == dict.fromkeys(xs, 1)
    assert max(counts) == 4
    assert counts[-1] == 1
    assert decisions["up"] >= 1
    assert decisions["down"] >= 1
    assert len(workers.made) >= 4
    assert all(not w.alive for w in workers.made[1:])  # each added one retired since


async def test_shutdown_while_a_replica_loads_neither_hangs_nor_loses_a_request(
    autojump_clock, workers
):
    """The block is left while a new replica loads (10 s) with requests queued: the
    runtime closes within the grace, every caller gets one answer."""
    workers.load_s = 10.0
    cfg = trioserve.Config(
        models=(model(autoscaling=AutoscalingConfig(
            max_replicas=2, target_queued_per_replica=2, upscale_delay_s=0, interval_s=1,
        )),),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        runtime=trioserve.RuntimeLimits(graceful_timeout_s=3),
    )
    answers: dict = {}
    with trio.fail_after(30):
        async with trio.open_nursery() as callers:
            async with trioserve.open_runtime(cfg) as rt:
                t0 = trio.current_time()
                for x in range(1, 21):
                    callers.start_soon(call, rt, float(x), answers)
                await trio.sleep_until(t0 + 2)  # the look at 1 began loading one
                assert len(workers.made) == 2
                assert len(rt.models["m"].batchers) == 2
                assert rt.models["m"].batchers[1].state is ActorState.STARTING
            assert trio.current_time() == pytest.approx(t0 + 2 + 3)
    assert sorted(answers) == [float(x) for x in range(1, 21)]
    assert all(len(a) == 1 for a in answers.values())
    served = [x for x, (a,) in answers.items() if not isinstance(a, Exception)]
    closed = [a for (a,) in answers.values() if isinstance(a, Exception)]
    assert all(isinstance(a, ActorClosed) for a in closed)
    assert ran_keys(workers.ran) == dict.fromkeys(served, 1)
    assert served
    assert closed


async def test_no_replica_is_started_once_shutdown_began(autojump_clock, workers):
    """A decision's replica starts in a task of its own, after a checkpoint: should
    shutdown begin meanwhile (the block left with requests in flight), that task
    starts nothing. Before, it checked nothing and started the replica anyway, to
    load during the grace and be cut off by it."""
    cfg = trioserve.Config(
        models=(model(autoscaling=AutoscalingConfig(
            max_replicas=2, target_queued_per_replica=2, upscale_delay_s=0, interval_s=1,
        )),),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        runtime=trioserve.RuntimeLimits(graceful_timeout_s=3),
    )
    answers: dict = {}
    entered, proceed = trio.Event(), trio.Event()
    started_closed: list = []
    async with trio.open_nursery() as callers:
        async with trioserve.open_runtime(cfg) as rt:
            ctl = rt.models["m"].scaler
            add, start = ctl._add_replica, ctl._start_replica

            async def gated_add(*, task_status=trio.TASK_STATUS_IGNORED):
                entered.set()
                await proceed.wait()  # shutdown begins here
                await add(task_status=task_status)

            async def observed_start(index, device):
                started_closed.append(rt._closed)
                return await start(index, device)

            ctl._add_replica, ctl._start_replica = gated_add, observed_start

            async def release():
                await trio.sleep(0.5)  # the block was left: the drain waits
                proceed.set()

            for x in range(1, 21):
                callers.start_soon(call, rt, float(x), answers)
            await entered.wait()  # the look at 1 decided to add a replica
            callers.start_soon(release)
        assert started_closed == []
        assert len(rt.models["m"].batchers) == 1
    assert sorted(answers) == [float(x) for x in range(1, 21)]
    assert all(len(a) == 1 for a in answers.values())


async def test_shutdown_while_a_replica_retires_neither_hangs_nor_loses_a_request(
    autojump_clock, workers
):
    """The block is left while a retired replica still runs a held batch: the grace
    passes, the held request is answered ActorClosed, and the runtime closes."""
    cfg = trioserve.Config(
        models=(model(replicas=2, max_batch_size=1, autoscaling=AutoscalingConfig(
            min_replicas=1, max_replicas=2, target_queued_per_replica=4,
            downscale_delay_s=0, interval_s=1,
        )),),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        runtime=trioserve.RuntimeLimits(graceful_timeout_s=3),
    )
    answers: dict = {}
    with trio.fail_after(30):
        async with trio.open_nursery() as callers:
            async with trioserve.open_runtime(cfg) as rt:
                t0 = trio.current_time()
                callers.start_soon(call, rt, HELD, answers)
                callers.start_soon(call, rt, HELD, answers)
                await trio.sleep_until(t0 + 1.5)
                assert [b.retiring for b in rt.models["m"].batchers] == [False, True]
            assert trio.current_time() == pytest.approx(t0 + 1.5 + 3)
    assert len(answers[HELD]) == 2
    assert all(isinstance(a, ActorClosed) for a in answers[HELD])


async def test_hedging_works_on_replicas_the_autoscaler_added(autojump_clock, workers):
    """One replica (no hedging), scaled up to two under a backlog; then a realtime
    request held on the first replica is hedged after 50 ms and answered by the
    replica the autoscaler added."""
    cfg = config(model(
        max_batch_size=1, hedge=True, hedge_after_ms=50,
        autoscaling=AutoscalingConfig(
            max_replicas=2, target_queued_per_replica=1, upscale_delay_s=0,
            downscale_delay_s=1000, interval_s=1,
        ),
    ))
    workers.hold_once = True
    answers: dict = {}
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        served = rt.models["m"]
        async with trio.open_nursery() as nursery:
            for x in (1.0, 2.0, 3.0):
                nursery.start_soon(call, rt, x, answers)
            await trio.sleep_until(t0 + 1.5)
        assert len(served.batchers) == 2
        assert served.scheduler.replicas == 2
        assert answers == {1.0: [3.0], 2.0: [5.0], 3.0: [7.0]}
        workers.ran.clear()
        start = trio.current_time()
        out = await rt.infer("m", item(HELD))
        assert float(out["y"][0]) == 1401.0
        assert trio.current_time() == pytest.approx(start + 0.05 + RUN_S)
        assert rt.hedges == 1
        (holder,) = workers.held  # the original is held there; the copy ran on the other
        assert workers.ran == [(1 - holder, [HELD])]
        workers.gate.set()


async def test_a_model_without_autoscaling_has_no_controller(autojump_clock, workers):
    cfg = config(callable_model(
        "m", crash_on_666, execution="process", replicas=2, max_batch_size=2,
    ))
    async with trioserve.open_runtime(cfg) as rt:
        served = rt.models["m"]
        assert served.scaler is None
        with pytest.raises(RuntimeError, match="only an autoscaled model's replica"):
            served.batchers[0].retire()
        await trio.sleep(1000)
        assert len(served.batchers) == 2


async def test_worker_process_replicas_are_added_and_retired():
    """With real worker processes (the ``sleep`` model, 100 ms a batch; real time,
    as the zygote's start is timed in trio time): a backlog adds a replica forked
    from the zygote, which serves; once the load is gone it is retired and its
    worker process ends."""
    cfg = config(trioserve.ModelConfig(
        name="s", backend="sleep", execution="process", max_batch_size=1, timeout_ms=None,
        options={"delay_per_batch_ms": 100},
        autoscaling=AutoscalingConfig(
            max_replicas=2, target_queued_per_replica=1, upscale_delay_s=0,
            downscale_delay_s=0, interval_s=0.02,
        ),
    ))
    async with trioserve.open_runtime(cfg) as rt:
        served = rt.models["s"]
        controller = served.scaler
        scaler = controller.scaler
        outs = {}
        added, retired = trio.Event(), trio.Event()
        start, unregister = controller._start_replica, controller._unregister

        async def start_replica(index: int, device: str):
            replica = await start(index, device)
            added.set()
            return replica

        async def unregistered(replica) -> None:
            await unregister(replica)
            retired.set()

        controller._start_replica, controller._unregister = start_replica, unregistered

        async def one(x: float) -> None:
            outs[x] = float((await rt.infer("s", item(x)))["y"][0])

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for x in range(1, 13):
                    nursery.start_soon(one, float(x))
                await added.wait()
                both = list(served.batchers)
                workers = [r._worker for r in both]
                assert all(w is not None and w.alive for w in workers)
            assert outs == {float(x): float(x) for x in range(1, 13)}
            await retired.wait()
        assert both[1].device_seconds > 0  # the one added served
        # the one retired (idle first, then the newest): stopped, its worker gone
        gone = 1 - both.index(served.batchers[0])
        assert both[gone].state is ActorState.STOPPED
        assert not workers[gone].alive
        assert workers[1 - gone].alive
        assert scaler.decisions == {"up": 1, "down": 1}
        out = await rt.infer("s", item(2.0))
    assert float(out["y"][0]) == 2.0


async def test_scale_events_are_in_the_statistics_the_metrics_and_the_log(
    autojump_clock, workers, caplog
):
    """``rt.statistics()`` has the replica count and the autoscaler's state, /metrics
    ``trioserve_autoscale_replicas`` and ``trioserve_autoscale_decisions_total`` for
    the autoscaled model (not for one with fixed replicas), and the log each scale
    event at INFO."""
    from prometheus_client.parser import text_string_to_metric_families
    from trioserve.transport import Gateway

    caplog.set_level(logging.INFO, logger="trioserve")
    cfg = config(
        model(autoscaling=AutoscalingConfig(
            max_replicas=3, target_queued_per_replica=4, upscale_delay_s=1,
            downscale_delay_s=2, interval_s=0.9,  # looks apart from batch ends
        )),
        callable_model("fixed", crash_on_666, execution="process", replicas=2),
    )
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        before = rt.statistics()
        async with trio.open_nursery() as nursery:
            for x in range(1, 25):
                nursery.start_soon(call, rt, float(x), {})
            await trio.sleep_until(t0 + 3)
            up = rt.statistics()["m"]
        await trio.sleep_until(t0 + 20)
        down = rt.statistics()["m"]
        text = (await (await Gateway(rt).app.test_client().get("/metrics")).get_data()).decode()
    assert before["m"]["replica_count"] == 1
    assert before["m"]["autoscaler"] == {
        "replicas": 1, "min_replicas": 1, "max_replicas": 3,
        "target_queued_per_replica": 4, "desired": None, "last_decision": None,
        "decisions": {"up": 0, "down": 0}, "start_failures": 0,
    }
    assert (before["fixed"]["replica_count"], before["fixed"]["autoscaler"]) == (2, None)
    assert up["replica_count"] == up["autoscaler"]["replicas"] == 3
    # up at the look at 2.7 (wanted more since 0.9), for the mean load of the looks
    # of the last second (look_back_s: the upscale delay): 22 at 1.8 (one batch of 2
    # run) and 20 at 2.7
    assert up["autoscaler"]["last_decision"] == {
        "direction": "up", "from": 1, "to": 3, "at": pytest.approx(t0 + 2.7), "load": 21,
    }
    assert down["replica_count"] == down["autoscaler"]["replicas"] == 1
    assert down["autoscaler"]["last_decision"]["direction"] == "down"
    # down in one step, 3 -> 1: the backlog drains 18, 12, 6, 0 at the looks from 3.6
    # on; the last look alone asked for 2 at 5.4 (load 6), which held a first step
    # down at 2, but the mean with the look before (9) still asks for 3, and the
    # wait begins at 6.3 (mean 3): every look of it asks for 1
    assert down["autoscaler"]["decisions"] == {"up": 1, "down": 1}
    assert down["autoscaler"]["last_decision"]["at"] == pytest.approx(t0 + 9.0)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }
    autoscale = {k: v for k, v in samples.items() if k[0].startswith("trioserve_autoscale_")}
    assert autoscale == {
        ("trioserve_autoscale_replicas", (("model", "m"),)): 1,
        ("trioserve_autoscale_decisions_total", (("direction", "down"), ("model", "m"))): 1,
        ("trioserve_autoscale_decisions_total", (("direction", "up"), ("model", "m"))): 1,
    }
    events = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    scaling = "model 'm': scaling {} replicas (load {} cost units, 4 per replica wanted)"
    assert scaling.format("up from 1 to 3", 21) in events
    assert scaling.format("down from 3 to 1", 0) in events
    for n in (1, 2):
        assert f"model 'm': replica batcher[m#{n}@cpu] serving" in events
        assert f"model 'm': retiring replica batcher[m#{n}@cpu]" in events
        assert f"model 'm': replica batcher[m#{n}@cpu] retired" in events


async def test_a_runtime_without_autoscaling_exposes_no_autoscale_series(autojump_clock):
    from trioserve.transport import Gateway

    cfg = config(callable_model("m", crash_on_666, replicas=2))
    async with trioserve.open_runtime(cfg) as rt:
        text = (await (await Gateway(rt).app.test_client().get("/metrics")).get_data()).decode()
        assert rt.statistics()["m"]["autoscaler"] is None
    assert "trioserve_autoscale" not in text


async def test_a_model_whose_versions_scale_apart_shows_every_versions_autoscaler(
    autojump_clock, workers
):
    """Versions with replicas of their own each have an autoscaler: the model's
    ``autoscaler`` statistics and ``trioserve_autoscale_*`` series add them all up
    (they showed the default version's alone), and each version's are in its
    ``versions`` entry and in the ``trioserve_autoscale_version_*`` series."""
    from prometheus_client.parser import text_string_to_metric_families
    from trioserve.transport import Gateway

    own = CallableBackend(crash_on_666, inputs=(X,), outputs=(Y,), execution="process")
    cfg = config(model(
        autoscaling=AutoscalingConfig(
            max_replicas=3, target_queued_per_replica=4, upscale_delay_s=1,
            downscale_delay_s=1000, interval_s=0.9,
        ),
        versions={"1": {}, "2": {"backend": own}},
    ))

    async def call_version(rt, x: float) -> None:
        await rt.infer("m", item(x), version="1")

    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        # a backlog on version 1 (the model's backend), none on 2 (the default)
        async with trio.open_nursery() as nursery:
            for x in range(1, 25):
                nursery.start_soon(call_version, rt, float(x))
            await trio.sleep_until(t0 + 3)
            stats = rt.statistics()["m"]
        text = (await (await Gateway(rt).app.test_client().get("/metrics")).get_data()).decode()
    v1, v2 = stats["versions"]["1"]["autoscaler"], stats["versions"]["2"]["autoscaler"]
    assert (v1["replicas"], v1["decisions"]) == (3, {"up": 1, "down": 0})
    assert (v2["replicas"], v2["decisions"], v2["last_decision"]) == (
        1, {"up": 0, "down": 0}, None
    )
    assert stats["autoscaler"] == {
        "replicas": 4, "min_replicas": 2, "max_replicas": 6,
        "target_queued_per_replica": 4, "desired": v1["desired"] + v2["desired"],
        "last_decision": {**v1["last_decision"], "versions": ["1"]},
        "decisions": {"up": 1, "down": 0}, "start_failures": 0,
    }
    assert stats["replica_count"] == 4
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }
    autoscale = {k: v for k, v in samples.items() if k[0].startswith("trioserve_autoscale_")}
    assert autoscale == {
        ("trioserve_autoscale_replicas", (("model", "m"),)): 4,
        ("trioserve_autoscale_decisions_total", (("direction", "down"), ("model", "m"))): 0,
        ("trioserve_autoscale_decisions_total", (("direction", "up"), ("model", "m"))): 1,
        ("trioserve_autoscale_version_replicas", (("model", "m"), ("version", "1"))): 3,
        ("trioserve_autoscale_version_replicas", (("model", "m"), ("version", "2"))): 1,
        **{
            ("trioserve_autoscale_version_decisions_total",
             (("direction", d), ("model", "m"), ("version", v))): n
            for v, d, n in (("1", "down", 0), ("1", "up", 1), ("2", "down", 0), ("2", "up", 0))
        },
    }
