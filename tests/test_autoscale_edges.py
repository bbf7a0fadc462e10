"""Edges of autoscaling (docs/faults.md, Autoscaling) where a retirement or a scale-up
meets a fault or shutdown: the queue retired once the last replica that could serve
it was retired and every one left lost its device; a scale-up under way when
shutdown begins adds no more replicas; a replica that loses its device while
retiring, or is retired while its dead worker's successor waits, ends at once."""

from __future__ import annotations

import threading
from functools import partial

import trio
import trio.testing
import trioserve
from runtime_helpers import DEVICE_LOST, GATE_LIMIT_S, X, Y, config, item
from test_autoscale_runtime import call, model, ran_keys
from test_autoscale_runtime import workers as workers  # the stand-in workers' fixture
from test_faults import timed_workers as timed_workers  # stand-in workers in trio time
from trioserve import ActorState, AutoscalingConfig, ModelConfig, ModelError


class FirstLosesItsDevice(trioserve.ModelBackend):
    """Thread replicas on one device: each batch waits for ``gate``; then the first
    replica loaded raises and leaves the device unusable (``device_lost`` says so,
    through ``lose_devices``), the others answer ``y = x``. ``started`` counts the
    batches waiting."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "thread"

    def __init__(self, lost: set[str], loser: int = 0) -> None:
        self.lost = lost
        self.loser = loser  # the replica (in load order) whose batch loses the device
        self.loaded = 0
        self.gates = [threading.Event(), threading.Event()]
        self.started = [threading.Event(), threading.Event()]

    def load(self, device, *, torch_threads=1):
        number = self.loaded
        self.loaded += 1

        def run(items):
            self.started[number].set()
            if not self.gates[number].wait(GATE_LIMIT_S):
                raise RuntimeError("gate never opened")
            if number == self.loser:
                self.lost.add(device)
                raise RuntimeError(DEVICE_LOST)
            return [{"y": it["x"].copy()} for it in items]

        return run


def two_replicas(backend: FirstLosesItsDevice, devices: tuple[str, ...]) -> trioserve.Config:
    """Two replicas of ``backend`` on ``devices``, one request per batch, scaled
    between one and two by looks every second that act at once."""
    return config(ModelConfig(
        name="m", backend=backend, devices=devices, replicas=2, max_batch_size=1,
        max_wait_ms=0, timeout_ms=None, autoscaling=AutoscalingConfig(
            min_replicas=1, max_replicas=2, target_queued_per_replica=4,
            upscale_delay_s=0, downscale_delay_s=0, interval_s=1,
        ),
    ))


async def answer_into(answers: dict, answered: trio.Event, runtime, x: float) -> None:
    """Infer ``x`` on ``runtime()``'s model "m": ``answers[x]`` is its ``y`` or the
    error; ``answered`` is set after each."""
    try:
        answers[x] = float((await runtime().infer("m", item(x)))["y"][0])
    except trioserve.TrioserveError as exc:
        answers[x] = exc
    answered.set()


async def test_the_queue_is_retired_when_the_last_replica_that_serves_it_retires(
    autojump_clock, lose_devices
):
    """Two thread replicas on cpu:0, both running a batch: the newest is retired
    (one replica wanted), then the other loses the device. The retired one answers
    its batch and is unregistered; only the lost one is left, and no new replica
    can be placed (its device is lost): the queue is retired, so a request gets the
    model's error at once. Before, the queue stayed open and every later request
    waited for a replica that would never come (here, with no timeout, for ever)."""
    backend = FirstLosesItsDevice(lose_devices)
    cfg = two_replicas(backend, ("cpu:0",))
    answers: dict = {}
    answered = trio.Event()  # the first answer came
    call = partial(answer_into, answers, answered, lambda: rt)

    try:
        async with trioserve.open_runtime(cfg) as rt:
            t0 = trio.current_time()
            served = rt.models["m"]
            first, second = served.batchers
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 1.0)
                nursery.start_soon(call, 2.0)
                for started in backend.started:
                    await trio.to_thread.run_sync(started.wait, GATE_LIMIT_S)
                await trio.sleep_until(t0 + 1.5)  # the look at 1 retired the newest
                assert second.retiring
                assert not first.retiring
                backend.gates[0].set()
                await answered.wait()
                assert first.lost is not None
                assert not served.scheduler.closed  # the retiring one still serves
                backend.gates[1].set()
            await trio.testing.wait_all_tasks_blocked()
            assert served.batchers == [first]
            assert served.scheduler.closed
            with trio.fail_after(5):
                await call(3.0)
    finally:
        for gate in backend.gates:
            gate.set()
    assert isinstance(answers[3.0], ModelError)
    assert "no replica can serve it any more" in str(answers[3.0])
    held = [answers[1.0], answers[2.0]]
    assert sum(isinstance(a, ModelError) for a in held) == 1
    assert sorted(a for a in held if not isinstance(a, ModelError)) in ([1.0], [2.0])


async def test_a_scale_up_adds_no_more_replicas_once_shutdown_began(
    autojump_clock, workers
):
    """Six requests at 0.5 s: the look at 1 s asks for three replicas, and both new
    ones start at once (each takes 5 s to load). Twenty more come at 1.2 s, and the
    block is left at 1.5 s: the looks from 2 s on would ask for the most (4), but
    shutdown stops the decisions, so no replica is started after the two loading.
    Those serve once loaded (they help the drain)."""
    workers.load_s = 5.0
    cfg = trioserve.Config(
        models=(model(autoscaling=AutoscalingConfig(
            max_replicas=4, target_queued_per_replica=2, upscale_delay_s=0, interval_s=1,
        )),),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        runtime=trioserve.RuntimeLimits(graceful_timeout_s=30),
    )
    answers: dict = {}

    async def later(at: float, x: float) -> None:
        await trio.sleep_until(at)
        await call(rt, x, answers)

    with trio.fail_after(60):
        async with trio.open_nursery() as callers:
            async with trioserve.open_runtime(cfg) as rt:
                t0 = trio.current_time()
                for x in range(1, 27):
                    callers.start_soon(later, t0 + (0.5 if x <= 6 else 1.2), float(x))
                await trio.sleep_until(t0 + 1.5)
                assert len(workers.made) == 3  # the two new ones load side by side
                assert [b.health for b in rt.models["m"].batchers] == [
                    "ready", "starting", "starting",
                ]
    assert len(workers.made) == 3
    assert answers == {float(x): [2.0 * x + 1] for x in range(1, 27)}
    assert ran_keys(workers.ran) == dict.fromkeys(answers, 1)
    assert {w for w, _ in workers.ran} == {0, 1, 2}


async def test_a_replica_that_loses_its_device_while_retiring_ends_and_leaves(
    autojump_clock, lose_devices
):
    """The newest of two thread replicas is retired while it runs a batch, and that
    batch leaves its device unusable: its caller gets the model's error, and the
    replica ends and is unregistered. Before, a thread replica that lost its device
    slept for ever, retired or not: it stayed registered, and the controller's wait
    for it never ended."""
    backend = FirstLosesItsDevice(lose_devices, loser=1)
    cfg = two_replicas(backend, ("cpu:0", "cpu:1"))
    answers: dict = {}
    answered = trio.Event()  # the first answer came
    call = partial(answer_into, answers, answered, lambda: rt)

    try:
        async with trioserve.open_runtime(cfg) as rt:
            t0 = trio.current_time()
            served = rt.models["m"]
            first, second = served.batchers
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 1.0)
                nursery.start_soon(call, 2.0)
                for started in backend.started:
                    await trio.to_thread.run_sync(started.wait, GATE_LIMIT_S)
                await trio.sleep_until(t0 + 1.5)  # the look at 1 retired the newest
                assert second.retiring
                backend.gates[1].set()  # its batch loses cpu:1
                await answered.wait()  # (no trio timeout: the clock jumps past a thread)
                await trio.testing.wait_all_tasks_blocked()
                assert second.lost is not None
                assert second.state is ActorState.STOPPED  # it ended, as retired
                backend.gates[0].set()
            await trio.testing.wait_all_tasks_blocked()
            assert served.batchers == [first]
            assert not served.scheduler.closed  # the first still serves
            await call(3.0)  # (no trio timeout: the clock jumps past a thread)
    finally:
        for gate in backend.gates:
            gate.set()
    assert answers[3.0] == 3.0
    held = [answers[1.0], answers[2.0]]
    assert sum(isinstance(a, ModelError) for a in held) == 1
    assert sorted(a for a in held if not isinstance(a, ModelError)) in ([1.0], [2.0])


async def test_a_replica_retired_while_its_dead_workers_successor_waits_ends_at_once(
    autojump_clock, timed_workers, monkeypatch
):
    """Two process replicas whose workers die idle right after each start: their
    breakers open and space the successors (cooldowns 1, 2, 4, 8 s). The newest is
    retired at 11 s, inside its 8 s wait: it ends then. Before, it waited the cooldown
    out (to ~16 s) and started a worker only to close it."""
    import trioserve.actors._batcher
    from test_faults import ShortLived, timed_model

    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", ShortLived)
    ShortLived.starts, ShortLived.healed = [], False
    cfg = config(timed_model(replicas=2, autoscaling=AutoscalingConfig(
        min_replicas=1, max_replicas=2, downscale_delay_s=10, interval_s=1,
    )))
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        served = rt.models["m"]
        first, second = served.batchers
        await trio.sleep_until(t0 + 10.5)
        assert second.health == "open"  # waiting out a cooldown
        lost = second.workers_lost
        await trio.sleep_until(t0 + 11.5)  # the look at 11 retired it
        assert second.state is ActorState.STOPPED
        assert served.batchers == [first]
        assert second.workers_lost == lost  # no successor started and lost
        ShortLived.healed = True
