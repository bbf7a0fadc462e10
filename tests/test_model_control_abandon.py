"""An unload asked while the model's first load, or a reload, is under way abandons
the load, as Triton cancels a load on an unload (docs/model-control.md): the load's
callers get ModelLoadError at once, the unload answers at once (a first load) or
once the copy that served meanwhile is unloaded (a reload), and the model a stuck
load's thread returns later is dropped, never installed. The loads run in worker
threads held by a ``threading.Event`` the test sets."""

from __future__ import annotations

import collections
import threading
import weakref

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import GATE_LIMIT_S, X, Y, item
from trioserve import ModelBackend, ModelLoadError, Overloaded, ServerConfig, UnknownModel

ABANDONED = "model 'm': its load was abandoned: an unload of the model was asked before it ended"


class Plus:
    """A loaded model: ``y = x + k``."""

    def __init__(self, k: float) -> None:
        self.k = k

    def __call__(self, items):
        return [{"y": it["x"] + self.k} for it in items]


class Held(ModelBackend):
    """A backend whose load, in a worker thread, waits for ``gate`` while ``held``;
    its n-th load's model adds ``100 * n``. ``released`` is set once the model of
    its first load is freed; ``freed[n]`` once its n-th load's is."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "thread"

    def __init__(self) -> None:
        self.held = True
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.freed = collections.defaultdict(threading.Event)
        self.released = self.freed[1]
        self.loads = 0

    def load(self, device: str, *, torch_threads: int = 1):
        self.loads += 1
        model = Plus(100.0 * self.loads)
        weakref.finalize(model, self.freed[self.loads].set)
        if self.held:
            self.entered.set()
            self.gate.wait(GATE_LIMIT_S)
        return model


def controlled(*models: trioserve.ModelConfig) -> trioserve.Config:
    return trioserve.Config(
        models=models,
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        server=ServerConfig(model_control="explicit"),
    )


@pytest.fixture
def held():
    backend = Held()
    yield backend
    backend.gate.set()  # a test that failed leaves no thread held


async def load_abandoned(rt, failures: list) -> None:
    with pytest.raises(ModelLoadError) as caught:
        await rt.load_model("m")
    failures.append(str(caught.value))


async def wait_in_thread(event: threading.Event) -> bool:
    return await trio.to_thread.run_sync(event.wait, GATE_LIMIT_S)


async def test_an_unload_abandons_a_first_load_stuck_in_its_thread(autojump_clock, held):
    m = trioserve.ModelConfig(name="m", backend=held, load_at_start=False, max_wait_ms=0)
    async with trioserve.open_runtime(controlled(m)) as rt:
        failures: list = []
        async with trio.open_nursery() as ops:
            ops.start_soon(load_abandoned, rt, failures)
            ops.start_soon(load_abandoned, rt, failures)  # shares the first
            assert await wait_in_thread(held.entered)
            assert rt.model_state("m") == ("LOADING", "loading")
            with pytest.raises(Overloaded, match=r"'m' is loading: .* retry shortly"):
                await rt.infer("m", item(1.0))  # refused at once, as before (503)
            t0 = trio.current_time()
            await rt.unload_model("m")  # does not wait for the load
            unloaded_in = trio.current_time() - t0
            state = rt.model_state("m")
        assert unloaded_in == 0
        assert state == ("UNAVAILABLE", "unloaded")
        assert failures == [ABANDONED, ABANDONED]  # each caller answered

        # the thread returns its model: dropped (freed), never installed
        held.gate.set()
        assert await wait_in_thread(held.released)
        await trio.testing.wait_all_tasks_blocked()
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert not rt.models["m"].loaded
        with pytest.raises(UnknownModel, match="'m' is not loaded"):
            await rt.infer("m", item(1.0))

        # a later load of the model is one of its own, and serves
        held.held = False
        await rt.load_model("m")
        assert rt.model_state("m") == ("READY", "")
        assert (await rt.infer("m", item(1.0)))["y"][0] == 201.0  # its second load's
    assert held.loads == 2


async def test_a_later_load_serves_while_the_abandoned_loads_thread_is_still_held(
    autojump_clock, held,
):
    m = trioserve.ModelConfig(name="m", backend=held, load_at_start=False, max_wait_ms=0)
    async with trioserve.open_runtime(controlled(m)) as rt:
        failures: list = []
        async with trio.open_nursery() as ops:
            ops.start_soon(load_abandoned, rt, failures)
            assert await wait_in_thread(held.entered)
            await rt.unload_model("m")
        held.held = False
        await rt.load_model("m")  # a replica of its own: not held up by the first
        assert (await rt.infer("m", item(1.0)))["y"][0] == 201.0
        held.gate.set()  # the first thread ends now: what it loaded is dropped
        assert await wait_in_thread(held.released)
        await trio.testing.wait_all_tasks_blocked()
        assert (await rt.infer("m", item(2.0)))["y"][0] == 202.0  # still the second's
    assert failures == [ABANDONED]


async def test_the_runtime_closes_while_an_abandoned_loads_thread_is_held(
    autojump_clock, held,
):
    m = trioserve.ModelConfig(name="m", backend=held, load_at_start=False, max_wait_ms=0)
    failures: list = []
    # (no trio deadline: the clock jumps to it while a thread is waited for)
    async with trioserve.open_runtime(controlled(m)) as rt:
        async with trio.open_nursery() as ops:
            ops.start_soon(load_abandoned, rt, failures)
            assert await wait_in_thread(held.entered)
            await rt.unload_model("m")
        t0 = trio.current_time()
    closed_in = trio.current_time() - t0
    assert closed_in == 0  # not held by the thread (nor by a timer)
    assert failures == [ABANDONED]
    assert rt.model_state("m") == ("UNAVAILABLE", "the runtime is shut down")
    held.gate.set()
    assert await wait_in_thread(held.released)


class Instant(ModelBackend):
    """A backend that loads at once: ``y = x + 1``."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "thread"

    def load(self, device: str, *, torch_threads: int = 1):
        return Plus(1.0)


async def test_an_unload_abandons_the_first_load_of_a_model_with_a_rollout(
    autojump_clock, held,
):
    # Version 2's weights of its own load in a held thread, version 1's at once: the
    # whole load is abandoned, version 1's replica stopped, nothing installed.
    m = trioserve.ModelConfig(
        name="m", backend=Instant(), load_at_start=False, max_wait_ms=0,
        versions={"1": {}, "2": {"backend": held}},
        rollout={"stable": "1", "canary": "2", "steps": [0.5]},
    )
    async with trioserve.open_runtime(controlled(m)) as rt:
        failures: list = []
        async with trio.open_nursery() as ops:
            ops.start_soon(load_abandoned, rt, failures)
            assert await wait_in_thread(held.entered)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            await rt.unload_model("m")
            assert trio.current_time() == t0
        assert failures == [ABANDONED]
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert "m" not in rt._families
        assert not rt.models["m"].loaded
        held.gate.set()
        assert await wait_in_thread(held.released)
        held.held = False
        await rt.load_model("m")
        assert rt.model_state("m") == ("READY", "")
        assert (await rt.infer("m", item(1.0), version="1"))["y"][0] == 2.0
        assert (await rt.infer("m", item(1.0), version="2"))["y"][0] == 201.0


async def load_with(rt, config, outcomes: list) -> None:
    try:
        await rt.load_model("m", config=config)
    except ModelLoadError as exc:
        outcomes.append(str(exc))
    else:
        outcomes.append("loaded")


async def test_an_unload_abandons_a_reload_stuck_in_its_thread_and_a_load_after_it(
    autojump_clock, held,
):
    # A reload (held in its thread) and a load of another configuration waiting for
    # its turn behind it: the unload abandons both, as it abandons a first load (it
    # waited for them, up to load_timeout_s each); their callers are answered at
    # once, and the copy that served meanwhile is unloaded (nothing in flight: at
    # once). The reload's model, when its thread returns, is dropped, never installed.
    m = trioserve.ModelConfig(name="m", backend=held, load_at_start=False, max_wait_ms=0)
    async with trioserve.open_runtime(controlled(m)) as rt:
        held.held = False
        await rt.load_model("m")
        held.held = True
        first: list = []
        second: list = []
        async with trio.open_nursery() as ops:
            ops.start_soon(load_with, rt, {"max_batch_size": 4}, first)
            assert await wait_in_thread(held.entered)
            ops.start_soon(load_with, rt, {"max_batch_size": 8}, second)
            await trio.testing.wait_all_tasks_blocked()
            assert rt.model_state("m") == (
                "READY", "reloading (the loaded copy serves meanwhile)"
            )
            assert (await rt.infer("m", item(1.0)))["y"][0] == 101.0  # the loaded copy
            t0 = trio.current_time()
            await rt.unload_model("m")
            unloaded_in = trio.current_time() - t0
            state = rt.model_state("m")
        assert unloaded_in == 0
        assert state == ("UNAVAILABLE", "unloaded")
        assert first == second == [ABANDONED]
        assert held.freed[1].is_set() or await wait_in_thread(held.freed[1])  # unloaded
        with pytest.raises(UnknownModel, match="'m' is not loaded"):
            await rt.infer("m", item(1.0))

        held.gate.set()
        assert await wait_in_thread(held.freed[2])  # the reload's: dropped
        await trio.testing.wait_all_tasks_blocked()
        assert held.loads == 2  # the second never started
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert not rt.models["m"].loaded

        held.held = False
        await rt.load_model("m")  # a later load is one of its own
        assert (await rt.infer("m", item(1.0)))["y"][0] == 301.0


async def test_an_unload_abandons_a_first_load_and_a_load_of_another_config_after_it(
    autojump_clock, held,
):
    # The first load (held in its thread), and a load of another configuration
    # waiting for its turn behind it: both are abandoned, the unload answers at once.
    m = trioserve.ModelConfig(name="m", backend=held, load_at_start=False, max_wait_ms=0)
    async with trioserve.open_runtime(controlled(m)) as rt:
        first: list = []
        second: list = []
        async with trio.open_nursery() as ops:
            ops.start_soon(load_with, rt, None, first)
            assert await wait_in_thread(held.entered)
            ops.start_soon(load_with, rt, {"max_batch_size": 8}, second)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            await rt.unload_model("m")
            unloaded_in = trio.current_time() - t0
            state = rt.model_state("m")
        assert unloaded_in == 0
        assert state == ("UNAVAILABLE", "unloaded")
        assert first == second == [ABANDONED]
        held.gate.set()
        assert await wait_in_thread(held.released)
        await trio.testing.wait_all_tasks_blocked()
        assert held.loads == 1  # the second never started
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert not rt.models["m"].loaded
