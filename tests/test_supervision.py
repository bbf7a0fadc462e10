"""Supervision: ``trioserve.supervise`` on scripted actors, and crashing batchers
inside a running runtime (restart within the budget, escalation past it)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import CostModel, Recorder, callable_model, config, item
from trioserve import Actor, ActorBroken, ActorState, ModelConfig, RestartPolicy, supervise
from trioserve.actors import BatcherActor


class Scripted(Actor):
    """An actor whose runs numbered in ``load_failures`` fail before reporting started
    (a model that cannot load); other runs report started and obey commands from the
    inbox: ``("crash", at)`` raises at trio time ``at``, ``("stop", at)`` returns."""

    name = "scripted"

    def __init__(self, *, load_failures: frozenset[int] | range = frozenset()) -> None:
        super().__init__()
        self.load_failures = load_failures
        self.runs = 0
        self.crashes: list[BaseException] = []
        self.states_seen: list[ActorState] = []
        self.send, self.recv = trio.open_memory_channel[tuple[str, float]](16)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.runs += 1
        self.states_seen.append(self.state)
        if self.runs in self.load_failures:
            raise OSError(f"load failed (run {self.runs})")
        task_status.started(self)
        async for command, at in self.recv:
            await trio.sleep_until(at)
            if command == "crash":
                raise RuntimeError(f"crash in run {self.runs}")
            return

    def on_crash(self, exc: BaseException) -> None:
        self.crashes.append(exc)

    def script(self, *commands: tuple[str, float]) -> None:
        for c in commands:
            self.send.send_nowait(c)


# ---------------------------------------------------------------- supervise
async def test_supervise_restarts_a_crashed_actor_and_reports_started_once(autojump_clock):
    actor = Scripted()
    policy = RestartPolicy(intensity=2, period=10.0)
    async with trio.open_nursery() as nursery:
        started = await nursery.start(supervise, actor, policy)
        assert started is actor
        assert actor.state is ActorState.RUNNING
        now = trio.current_time()
        actor.script(("crash", now))
        await trio.testing.wait_all_tasks_blocked()
        assert actor.runs == 2
        assert actor.restarts == 1
        assert actor.state is ActorState.RUNNING
        assert actor.states_seen == [ActorState.STARTING, ActorState.RESTARTING]
        assert [str(e) for e in actor.crashes] == ["crash in run 1"]
        actor.script(("crash", now), ("stop", now))
        await trio.testing.wait_all_tasks_blocked()
    # A clean return stops it for good: supervise returned and the nursery closed.
    assert actor.state is ActorState.STOPPED
    assert actor.restarts == 2
    assert actor.runs == 3


async def test_supervise_escalates_past_the_restart_budget(autojump_clock):
    actor = Scripted()
    t0 = trio.current_time()
    actor.script(("crash", t0), ("crash", t0 + 1), ("crash", t0 + 2), ("stop", t0 + 3))
    with pytest.raises(
        ActorBroken,
        match=r"^scripted crashed 3 times within 10s \(restart budget 2\); "
        r"last error: RuntimeError\('crash in run 3'\)$",
    ) as excinfo:
        await supervise(actor, RestartPolicy(intensity=2, period=10.0))
    assert isinstance(excinfo.value.__cause__, RuntimeError)
    assert str(excinfo.value.__cause__) == "crash in run 3"
    assert actor.state is ActorState.BROKEN
    assert actor.restarts == 2
    assert len(actor.crashes) == 3  # on_crash ran for every crash, the last included
    assert trio.current_time() == t0 + 2


async def test_supervise_forgets_crashes_older_than_the_period(autojump_clock):
    actor = Scripted()
    t0 = trio.current_time()
    # One restart per second allowed: crashes exactly one period apart never escalate.
    actor.script(("crash", t0), ("crash", t0 + 1), ("crash", t0 + 2), ("stop", t0 + 3))
    await supervise(actor, RestartPolicy(intensity=1, period=1.0))
    assert actor.state is ActorState.STOPPED
    assert actor.restarts == 3
    assert trio.current_time() == t0 + 3


async def test_supervise_escalates_two_crashes_within_one_period(autojump_clock):
    actor = Scripted()
    t0 = trio.current_time()
    actor.script(("crash", t0), ("crash", t0 + 0.5), ("stop", t0 + 3))
    with pytest.raises(ActorBroken, match=r"crashed 2 times within 1s \(restart budget 1\)"):
        await supervise(actor, RestartPolicy(intensity=1, period=1.0))
    assert trio.current_time() == t0 + 0.5
    assert actor.restarts == 1


async def test_supervise_with_zero_budget_escalates_the_first_crash(autojump_clock):
    actor = Scripted()
    actor.script(("crash", trio.current_time()))
    with pytest.raises(ActorBroken, match=r"crashed 1 times .*budget 0"):
        await supervise(actor, RestartPolicy(intensity=0, period=10.0))
    assert actor.restarts == 0
    assert actor.state is ActorState.BROKEN


async def test_a_start_up_failure_is_raised_as_is_and_not_retried(autojump_clock):
    actor = Scripted(load_failures={1})
    async with trio.open_nursery() as nursery:
        with pytest.raises(OSError, match=r"^load failed \(run 1\)$"):
            await nursery.start(supervise, actor, RestartPolicy(intensity=5, period=10))
    assert actor.runs == 1
    assert actor.restarts == 0
    assert actor.state is ActorState.BROKEN
    assert [str(e) for e in actor.crashes] == ["load failed (run 1)"]


async def test_a_restart_that_fails_to_load_is_retried_within_the_budget(autojump_clock):
    actor = Scripted(load_failures={2, 3})
    async with trio.open_nursery() as nursery:
        await nursery.start(supervise, actor, RestartPolicy(intensity=5, period=10))
        actor.script(("crash", trio.current_time()))
        await trio.testing.wait_all_tasks_blocked()
        assert actor.runs == 4
        assert actor.restarts == 3
        assert actor.state is ActorState.RUNNING
        assert actor.states_seen == [ActorState.STARTING] + [ActorState.RESTARTING] * 3
        assert [str(e) for e in actor.crashes] == [
            "crash in run 1",
            "load failed (run 2)",
            "load failed (run 3)",
        ]
        actor.script(("stop", trio.current_time()))
    assert actor.state is ActorState.STOPPED


async def test_a_restart_that_never_loads_escalates(autojump_clock):
    actor = Scripted(load_failures=range(2, 100))
    actor.script(("crash", trio.current_time()))
    with pytest.raises(
        ActorBroken, match=r"crashed 3 times .*budget 2\); last error: OSError\('load failed"
    ):
        await supervise(actor, RestartPolicy(intensity=2, period=10))
    assert actor.state is ActorState.BROKEN
    assert actor.runs == 3


async def test_cancelling_supervise_stops_the_actor_without_a_restart(autojump_clock):
    actor = Scripted()
    async with trio.open_nursery() as nursery:
        await nursery.start(supervise, actor, RestartPolicy())
        nursery.cancel_scope.cancel("test done")
    assert actor.state is ActorState.STOPPED
    assert actor.restarts == 0
    assert actor.crashes == []



class TwoTasks(Actor):
    """An actor whose run serves from a nursery of two tasks (as a worker process's
    batcher does): cancelled, it raises a group of Cancelled, not one."""

    name = "two-tasks"

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(trio.sleep_forever)
            task_status.started(self)


async def test_cancelling_an_actor_whose_run_raises_a_group_of_cancelled_stops_it(
    autojump_clock,
):
    actor = TwoTasks()
    async with trio.open_nursery() as nursery:
        await nursery.start(supervise, actor, RestartPolicy())
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel("test done")
    assert actor.state is ActorState.STOPPED  # not left RUNNING, reported 'ready'
    assert actor.restarts == 0


class TwoTasksOneFailsToStop(Actor):
    """As TwoTasks, but one task's cleanup raises when cancelled: the group holds
    Cancelled and that error."""

    name = "two-tasks-one-fails"

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async def fails_to_stop() -> None:
            try:
                await trio.sleep_forever()
            finally:
                raise RuntimeError("cleanup failed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(fails_to_stop)
            task_status.started(self)


async def test_an_actor_cancelled_with_an_error_of_its_own_in_the_group_is_broken(
    autojump_clock,
):
    actor = TwoTasksOneFailsToStop()

    async def supervise_then_cancel() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(supervise, actor, RestartPolicy())
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel("test done")

    with pytest.raises(BaseExceptionGroup) as info:
        await supervise_then_cancel()
    assert info.group_contains(RuntimeError, match="cleanup failed", depth=None)
    assert actor.state is ActorState.BROKEN  # down: not left RUNNING, read as ready
    assert actor.restarts == 0


# ---------------------------------------------------------------- batchers in a runtime
@pytest.fixture
def crashing_execute(monkeypatch):
    """Make BatcherActor._execute raise for the first ``n`` batches; returns the
    number of crashes so far."""
    original = BatcherActor._execute
    state = {"left": 0, "crashes": 0}

    async def execute(self, batch):
        if state["left"]:
            state["left"] -= 1
            state["crashes"] += 1
            raise RuntimeError(f"batcher bug #{state['crashes']}")
        await original(self, batch)

    monkeypatch.setattr(BatcherActor, "_execute", execute)

    def arm(n: int) -> dict:
        state["left"] = n
        return state

    return arm


async def test_a_crashed_batcher_fails_its_batch_and_is_restarted(autojump_clock, crashing_execute):
    rec = Recorder()
    cfg = config(callable_model("m", rec, max_batch_size=2, max_wait_ms=0))
    crashing_execute(1)
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(
            ActorBroken,
            match=r"batcher\[m#0@cpu\] crashed mid-batch: RuntimeError\('batcher bug #1'\)",
        ):
            await rt.infer_batch("m", [item(1), item(2)])
        outs = await rt.infer_batch("m", [item(3), item(4)])
        replica = rt.statistics()["m"]["replicas"][0]
    assert [float(o["y"][0]) for o in outs] == [7.0, 9.0]
    assert rec.seen == [3.0, 4.0]  # the crashed batch never reached the model
    assert replica == {
        "name": "batcher[m#0@cpu]", "state": "running", "health": "ready", "restarts": 1,
    }


async def test_a_batcher_crashing_past_its_budget_escalates_out_of_open_runtime(
    autojump_clock, crashing_execute
):
    rec = Recorder()
    cfg = config(
        callable_model("m", rec, max_batch_size=1, max_wait_ms=0),
        restart_intensity=2,
        restart_period_s=10,
    )
    crashing_execute(100)
    failed = []
    runtimes = []

    async def serve():
        async with trioserve.open_runtime(cfg) as rt:
            runtimes.append(rt)
            for i in range(3):
                with pytest.raises(ActorBroken, match="crashed mid-batch"):
                    await rt.infer("m", item(i))
                failed.append(i)
            await trio.sleep_forever()  # the escalation cancels the block

    with pytest.raises(
        ActorBroken,
        match=r"^batcher\[m#0@cpu\] crashed 3 times within 10s \(restart budget 2\); "
        r"last error: RuntimeError\('batcher bug #3'\)$",
    ) as excinfo:
        await serve()
    assert isinstance(excinfo.value.__cause__, RuntimeError)
    assert failed == [0, 1, 2]
    assert rec.seen == []
    (rt,) = runtimes
    assert rt.closed
    with pytest.raises(trioserve.ActorClosed):
        await rt.infer("m", item(9))


class FailingLoad(CostModel):
    """A model whose weights cannot be read."""

    def __init__(self) -> None:
        super().__init__()
        self.loads = 0

    def load(self, device, *, torch_threads=1):
        self.loads += 1
        raise OSError(f"weights unreadable (attempt {self.loads})")


async def test_a_model_that_cannot_load_fails_open_runtime_with_its_error(autojump_clock):
    backend = FailingLoad()
    cfg = config(
        ModelConfig(name="ok", backend="echo"),
        ModelConfig(name="m", backend=backend),
        restart_intensity=5,
    )
    with pytest.raises(trioserve.ModelLoadError) as caught:
        async with trioserve.open_runtime(cfg):
            pytest.fail("the runtime started without its model")
    assert str(caught.value) == (
        "model 'm': replica 0 on cpu failed to load: OSError: weights unreadable (attempt 1)"
    )
    assert isinstance(caught.value.__cause__, OSError)
    assert backend.loads == 1  # a start-up failure is not retried
