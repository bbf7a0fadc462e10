"""Explicit model control through the embedding API (``rt.load_model``,
``rt.unload_model``): a model not loaded at start, loads, unloads that answer every
request admitted, reloads that move traffic to a new copy while the old one finishes
what it holds, a reload that fails, loads shared, loads and unloads serialized, and a
shutdown during a load. The model runs in a stand-in for a worker process whose
starts and batches take trio time, so every timing is exact under the MockClock."""

from __future__ import annotations

import collections
import functools

import attrs
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import NoZygote, _StandIn, callable_model, item, key
from trioserve import (
    ActorClosed,
    ConfigError,
    ModelLoadError,
    ServerConfig,
    UnknownModel,
)

RUN_S = 1.0  # trio seconds per batch


class Worker(_StandIn):
    """A stand-in worker process answering ``y = x * weight``, ``weight`` as it was
    when the worker was made; its start takes ``load_s`` and raises when ``fail``
    is set. Records every worker and every batch run as (worker, weight, keys)."""

    made: list
    ran: list
    weight = 1.0
    load_s = 0.0
    fail = False

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = None
        self.device = device
        self.busy_seconds = self.last_run_seconds = 0.0
        self._staged: collections.deque = collections.deque()
        self._exited = trio.Event()
        self.weight = Worker.weight
        Worker.made.append(self)

    async def start(self) -> None:
        await trio.sleep(Worker.load_s)
        if Worker.fail:
            raise RuntimeError("weights missing")

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        self._staged.append(items)

    async def result(self):
        items = self._staged[0]
        await trio.sleep(RUN_S)
        self._staged.popleft()
        Worker.ran.append((self, [key(it) for it in items]))
        return [{"y": it["x"] * self.weight} for it in items]


@pytest.fixture
def workers(monkeypatch):
    import trioserve._runtime
    import trioserve.actors._batcher

    Worker.made, Worker.ran = [], []
    Worker.weight, Worker.load_s, Worker.fail = 1.0, 0.0, False
    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", Worker)
    return Worker


def control_config(*, control="explicit", load_at_start=True, **model):
    args = dict(execution="process", max_batch_size=2, max_wait_ms=0, timeout_ms=None,
                load_at_start=load_at_start)
    args.update(model)
    return trioserve.Config(
        models=(callable_model("m", lambda items: items, **args),),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        server=ServerConfig(model_control=control),
    )


async def call(rt, x: float, answers: dict) -> None:
    try:
        out = await rt.infer("m", item(x))
    except trioserve.TrioserveError as exc:
        answers.setdefault(x, []).append(exc)
    else:
        answers.setdefault(x, []).append(float(out["y"][0]))


async def test_a_model_not_loaded_at_start_serves_once_loaded(autojump_clock, workers):
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        assert workers.made == []
        assert rt.model_state("m") == ("UNAVAILABLE", "not loaded")
        assert rt.model_ready("m") is False
        with pytest.raises(UnknownModel, match="model 'm' is not loaded"):
            await rt.infer("m", item(1.0))
        assert rt.statistics()["m"]["replica_count"] == 0
        await rt.load_model("m")
        assert rt.model_state("m") == ("READY", "")
        assert rt.model_ready("m") is True
        assert (await rt.infer("m", item(3.0)))["y"][0] == 3.0
        assert len(workers.made) == 1


async def test_unload_answers_every_admitted_request_then_refuses(autojump_clock, workers):
    answers: dict = {}
    async with trioserve.open_runtime(control_config()) as rt:
        (worker,) = workers.made
        async with trio.open_nursery() as callers:
            for x in range(1, 7):
                callers.start_soon(call, rt, float(x), answers)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            async with trio.open_nursery() as ops:
                ops.start_soon(rt.unload_model, "m")
                await trio.testing.wait_all_tasks_blocked()
                assert rt.model_state("m") == ("UNLOADING", "unloading (requests admitted finish)")
                with pytest.raises(UnknownModel, match="is unloading"):
                    await rt.infer("m", item(9.0))
        # the unload returned once the six (three batches of two) were answered
        assert trio.current_time() == pytest.approx(t0 + 3 * RUN_S)
        assert answers == {float(x): [float(x)] for x in range(1, 7)}
        assert not worker.alive  # its worker process was closed
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert rt.model_ready("m") is False
        stats = rt.statistics()["m"]
        assert stats["replica_count"] == 0
        assert stats["items"] == 6  # the counters stay
        assert stats["flows"]["t/realtime"]["dispatched"] == 6
        await rt.unload_model("m")  # unloading an unloaded model: nothing to do


async def test_reload_moves_new_requests_to_the_new_copy_and_the_old_finishes_its_own(
    autojump_clock, workers
):
    answers: dict = {}
    async with trioserve.open_runtime(control_config()) as rt:
        (old,) = workers.made
        workers.weight, workers.load_s = 10.0, 5.0
        async with trio.open_nursery() as callers:
            for x in range(1, 7):  # queued on the old copy: three batches
                callers.start_soon(call, rt, float(x), answers)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            async with trio.open_nursery() as ops:
                ops.start_soon(rt.load_model, "m")
                await trio.testing.wait_all_tasks_blocked()
                # the old copy serves: READY, as Triton says of a model reloading
                assert rt.model_state("m") == (
                    "READY", "reloading (the loaded copy serves meanwhile)"
                )
                assert rt.model_ready("m")
                # while the new copy loads, the old one serves new requests too
                callers.start_soon(call, rt, 7.0, answers)
            assert trio.current_time() == pytest.approx(t0 + 5.0)
            assert rt.model_state("m") == ("READY", "")
            (_, new) = workers.made
            for x in (11.0, 12.0):
                callers.start_soon(call, rt, x, answers)
        assert answers == {
            **{float(x): [float(x)] for x in range(1, 8)},  # the old copy's answers
            11.0: [110.0], 12.0: [120.0],  # the new copy's
        }
        assert {k for w, keys in workers.ran if w is new for k in keys} == {11.0, 12.0}
        await trio.testing.wait_all_tasks_blocked()
        assert not old.alive
        assert new.alive
        assert rt.statistics()["m"]["items"] == 9  # one series over both copies


async def test_requests_queued_on_the_old_copy_at_the_swap_finish_there(
    autojump_clock, workers
):
    """Twelve requests (six batches, three staged in the worker, three queued) when
    the new copy is ready: the queued ones are still the old copy's to run."""
    answers: dict = {}
    async with trioserve.open_runtime(control_config()) as rt:
        (old,) = workers.made
        workers.weight, workers.load_s = 10.0, 0.5
        async with trio.open_nursery() as callers:
            for x in range(1, 13):
                callers.start_soon(call, rt, float(x), answers)
            await trio.testing.wait_all_tasks_blocked()
            assert rt.statistics()["m"]["queue_depth"] == 6
            await rt.load_model("m")
            assert rt.statistics()["m"]["queue_depth"] == 0  # the new copy's queue
            callers.start_soon(call, rt, 20.0, answers)
        assert answers == {**{float(x): [float(x)] for x in range(1, 13)}, 20.0: [200.0]}
        assert sum(len(keys) for w, keys in workers.ran if w is old) == 12


async def test_a_request_that_looked_the_model_up_before_a_reload_runs_on_the_new_copy(
    autojump_clock, workers
):
    """A request waiting for its tenant's credits while the model is reloaded holds
    the old copy: its queue hands it over to the new one, which answers it."""
    cfg = control_config()
    cfg = trioserve.Config(
        models=cfg.models, server=cfg.server,
        tenants=(trioserve.TenantConfig(name="t", default=True, credit_rate=0.5,
                                        credit_burst=1),),
    )
    answers: dict = {}

    async def call_batch(x):
        out = await rt.infer("m", item(x), priority="batch")  # waits for credits
        answers[x] = float(out["y"][0])

    async with trioserve.open_runtime(cfg) as rt:
        workers.weight = 10.0
        async with trio.open_nursery() as callers:
            callers.start_soon(call_batch, 1.0)  # takes the one credit
            await trio.testing.wait_all_tasks_blocked()
            callers.start_soon(call_batch, 2.0)  # waits 2 s for the next
            await trio.testing.wait_all_tasks_blocked()
            await rt.load_model("m")
            assert rt.credit_waits["t"] == 1  # still waiting, on the old copy
        assert answers == {1.0: 1.0, 2.0: 20.0}


async def test_a_reload_that_fails_leaves_the_old_copy_serving(
    autojump_clock, workers, caplog
):
    async with trioserve.open_runtime(control_config()) as rt:
        (old,) = workers.made
        workers.fail = True
        with pytest.raises(ModelLoadError, match="weights missing"):
            await rt.load_model("m")
        (line,) = [r.getMessage() for r in caplog.records if "reload failed" in r.getMessage()]
        assert line.startswith("model 'm': reload failed, the loaded copy serves on: ")
        assert line.count("'m'") == 1  # the error's own "model 'm': " is not said again
        assert rt.model_state("m") == ("READY", "")
        assert (await rt.infer("m", item(4.0)))["y"][0] == 4.0
        assert old.alive
        assert rt.models["m"].batchers[0]._worker is old


async def test_a_load_that_fails_says_why_and_leaves_the_model_unloaded(
    autojump_clock, workers, caplog
):
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        workers.fail = True
        with pytest.raises(ModelLoadError, match="weights missing"):
            await rt.load_model("m")
        (line,) = [r.getMessage() for r in caplog.records if "failed to load" in r.getMessage()]
        assert line.startswith("model 'm': failed to load: ")
        assert "weights missing" in line
        assert line.count("'m'") == 1  # the error's own "model 'm': " is not said again
        state, reason = rt.model_state("m")
        assert state == "UNAVAILABLE"
        assert reason.startswith("failed to load: ")
        assert "weights missing" in reason
        with pytest.raises(UnknownModel, match="not loaded"):
            await rt.infer("m", item(1.0))
        workers.fail = False
        await rt.load_model("m")
        assert (await rt.infer("m", item(2.0)))["y"][0] == 2.0


async def test_two_loads_at_once_share_one(autojump_clock, workers):
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        workers.load_s = 3.0
        t0 = trio.current_time()
        async with trio.open_nursery() as ops:
            ops.start_soon(rt.load_model, "m")
            ops.start_soon(rt.load_model, "m")
        assert trio.current_time() == pytest.approx(t0 + 3.0)
        assert len(workers.made) == 1


ABANDONED = "model 'm': its load was abandoned: an unload of the model was asked before it ended"


async def load_abandoned(rt, failures: list) -> None:
    with pytest.raises(ModelLoadError) as caught:
        await rt.load_model("m")
    failures.append(str(caught.value))


async def test_an_unload_during_a_first_load_abandons_it(autojump_clock, workers):
    # (as Triton cancels a load on an unload: it does not wait for the load)
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        workers.load_s = 3.0
        failures: list = []
        async with trio.open_nursery() as ops:
            ops.start_soon(load_abandoned, rt, failures)
            await trio.testing.wait_all_tasks_blocked()
            assert rt.model_state("m") == ("LOADING", "loading")
            t0 = trio.current_time()
            await rt.unload_model("m")
            unloaded_in = trio.current_time() - t0
        assert unloaded_in == 0
        assert failures == [ABANDONED]
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        (worker,) = workers.made
        assert not worker.alive  # its worker process stopped
        workers.load_s = 0.0
        await rt.load_model("m")  # a later load of the model is one of its own
        assert (await rt.infer("m", item(2.0)))["y"][0] == 2.0
        assert len(workers.made) == 2


class SlowToStop(Worker):
    """The stand-in worker; stopping it takes 2 s (shielded, as a worker process's
    wait for its exit is)."""

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await trio.sleep(2.0)
        self.kill()


async def test_an_abandoned_load_is_unloading_until_what_it_started_has_stopped(
    autojump_clock, workers, monkeypatch,
):
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", SlowToStop)
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        workers.load_s = 10.0
        failures: list = []
        answered: list = []

        async def unload():
            await rt.unload_model("m")
            answered.append(trio.current_time() - t0)

        async with trio.open_nursery() as ops:
            ops.start_soon(load_abandoned, rt, failures)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            ops.start_soon(unload)
            await trio.sleep(1.0)  # its worker is stopping
            assert failures == [ABANDONED]  # the load's caller: at once
            assert rt.model_state("m") == ("UNLOADING", "unloading (its load abandoned)")
            (worker,) = workers.made
            assert worker.alive
            assert answered == []
        assert answered == [2.0]  # once its worker has stopped, not the load's 10 s
        assert not worker.alive
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")


async def test_an_unload_during_a_reload_abandons_it_then_unloads_the_loaded_copy(
    autojump_clock, workers, monkeypatch,
):
    # The reload is not waited for (its load may hang up to load_timeout_s): its
    # caller is answered at once, its worker stopped; the copy that served meanwhile
    # answers what it admitted, then is unloaded as by any unload: new requests are
    # refused at once (not once the reload's worker has stopped).
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", SlowToStop)
    async with trioserve.open_runtime(control_config()) as rt:
        (old,) = workers.made
        workers.load_s = 30.0
        failures: list = []
        answers: dict = {}
        unloaded: list = []

        async def unload():
            await rt.unload_model("m")
            unloaded.append(trio.current_time() - t0)

        async with trio.open_nursery() as ops:
            ops.start_soon(load_abandoned, rt, failures)  # a reload: the copy serves on
            await trio.testing.wait_all_tasks_blocked()
            assert rt.model_state("m") == ("READY", "reloading (the loaded copy serves "
                                           "meanwhile)")
            for x in (1.0, 2.0, 3.0):  # two batches of the loaded copy: 2 s
                ops.start_soon(call, rt, x, answers)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            ops.start_soon(unload)
            await trio.testing.wait_all_tasks_blocked()
            assert failures == [ABANDONED]  # at once
            assert rt.model_state("m") == ("UNLOADING", "unloading (requests admitted "
                                           "finish)")
            with pytest.raises(UnknownModel, match="'m' is unloading"):
                await rt.infer("m", item(4.0))  # refused at once, as by any unload
        # its drain and its worker's stop (the reload's stopped meanwhile), not the
        # reload's 30 s
        assert unloaded == [2.0 * RUN_S + 2.0]
        assert answers == {1.0: [1.0], 2.0: [2.0], 3.0: [3.0]}  # none lost
        assert {w for w, _ in workers.ran} == {old}
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert len(workers.made) == 2
        assert all(not w.alive for w in workers.made)


async def test_shutdown_during_a_load_is_clean(autojump_clock, workers):
    failures: list = []

    async def load(rt):
        try:
            await rt.load_model("m")
        except ActorClosed as exc:
            failures.append(exc)

    with trio.fail_after(30):
        async with trio.open_nursery() as outside:
            async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
                workers.load_s = 10.0
                outside.start_soon(load, rt)
                await trio.sleep(2)
                assert rt.model_state("m")[0] == "LOADING"
            assert trio.current_time() == pytest.approx(2.0)
    assert len(failures) == 1
    assert "shut down before the model loaded" in str(failures[0])
    assert all(not w.alive for w in workers.made)
    with pytest.raises(ActorClosed):
        await rt.load_model("m")


async def test_a_model_not_configured_is_unknown(autojump_clock, workers):
    async with trioserve.open_runtime(control_config()) as rt:
        for op in (rt.load_model, rt.unload_model):
            with pytest.raises(UnknownModel, match="not in the configuration; configured: m"):
                await op("nope")


async def test_with_model_control_off_load_and_unload_are_refused(autojump_clock, workers):
    async with trioserve.open_runtime(control_config(control="none")) as rt:
        for op, action in ((rt.load_model, "load"), (rt.unload_model, "unload")):
            refused = f"cannot {action} model 'm': model control is off"
            with pytest.raises(ConfigError, match=refused):
                await op("m")
        assert rt.model_state("m") == ("READY", "")


async def test_a_refused_load_or_unload_is_still_a_checkpoint(autojump_clock, workers):
    # (every async call of the runtime checkpoints, a refusal included)
    async with trioserve.open_runtime(control_config()) as rt:
        refusals = [
            (ConfigError, functools.partial(rt.load_model, "m", {"cache": False})),
            (ConfigError, functools.partial(rt.load_model, "m", {"max_batch_size": 0})),
            (ConfigError, functools.partial(rt.load_model, "m", {"devices": ["cuda:7"]})),
            (UnknownModel, functools.partial(rt.load_model, "nope")),
            (UnknownModel, functools.partial(rt.unload_model, "nope")),
        ]
        for error, op in refusals:
            with trio.testing.assert_checkpoints(), pytest.raises(error):
                await op()
        assert rt.model_state("m") == ("READY", "")
    for op in (rt.load_model, rt.unload_model):
        with trio.testing.assert_checkpoints(), pytest.raises(ActorClosed):
            await op("m")  # the runtime is shut down
    async with trioserve.open_runtime(control_config(control="none")) as rt:
        for op in (rt.load_model, rt.unload_model):
            with trio.testing.assert_checkpoints(), pytest.raises(ConfigError):
                await op("m")  # model control is off


def test_load_at_start_false_needs_explicit_model_control():
    with pytest.raises(ConfigError, match=r"models\.m\.load_at_start: false needs server"):
        control_config(control="none", load_at_start=False)
    with pytest.raises(ConfigError, match=r"server\.model_control: must be one of"):
        ServerConfig(model_control="poll")


async def test_reloading_and_unloading_drop_the_models_cached_results(autojump_clock, workers):
    cfg = control_config()
    cfg = trioserve.Config(
        models=cfg.models, tenants=cfg.tenants, server=cfg.server,
        cache=trioserve.CacheConfig(capacity_bytes=1 << 20),
    )
    async with trioserve.open_runtime(cfg) as rt:
        assert (await rt.infer("m", item(5.0)))["y"][0] == 5.0
        assert (await rt.infer("m", item(5.0)))["y"][0] == 5.0  # a hit
        assert rt.cache_statistics()["hits"] == 1
        workers.weight = 3.0
        await rt.load_model("m")
        assert (await rt.infer("m", item(5.0)))["y"][0] == 15.0  # the new copy's
        await rt.unload_model("m")
        with pytest.raises(UnknownModel):
            await rt.infer("m", item(5.0))


async def test_a_model_loaded_at_start_that_fails_fails_the_start(autojump_clock, workers):
    """As with model control off: open_runtime raises the load's ModelLoadError."""
    workers.fail = True
    with pytest.raises(ModelLoadError, match="weights missing"):
        async with trioserve.open_runtime(control_config()):
            pytest.fail("the runtime started")


async def test_a_load_asked_after_an_unload_does_not_share_the_load_before_it(
    autojump_clock, workers
):
    """load, unload, load ends loaded (the second load is not the first's: the
    first, under way, is abandoned by the unload), and unload, load, unload ends
    unloaded (the load, waiting for its turn, is abandoned before it starts)."""
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        workers.load_s = 3.0
        failures: list = []
        async with trio.open_nursery() as ops:
            for op in (functools.partial(load_abandoned, rt, failures),
                       functools.partial(rt.unload_model, "m"),
                       functools.partial(rt.load_model, "m")):
                ops.start_soon(op)
                await trio.testing.wait_all_tasks_blocked()
        assert rt.model_state("m") == ("READY", "")
        assert failures == [ABANDONED]
        first, second = workers.made
        assert (first.alive, second.alive) == (False, True)

        answers: dict = {}
        async with trio.open_nursery() as ops:
            ops.start_soon(call, rt, 4.0, answers)  # in flight: the unload drains it
            await trio.testing.wait_all_tasks_blocked()
            for op in (functools.partial(rt.unload_model, "m"),
                       functools.partial(load_abandoned, rt, failures),
                       functools.partial(rt.unload_model, "m")):
                ops.start_soon(op)
                await trio.testing.wait_all_tasks_blocked()
            # the load, abandoned before its turn, is answered at once
            assert failures == [ABANDONED, ABANDONED]
        assert answers == {4.0: [4.0]}
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert len(workers.made) == 2  # (the abandoned load started no worker)
        assert all(not w.alive for w in workers.made)


async def test_loads_and_unloads_asked_at_once_run_in_the_order_asked(autojump_clock, workers):
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        workers.load_s = 1.0
        abandoned: list = []
        loaded_once = False
        for _ in range(12):
            asked: list[str] = []

            async def ask(action, asked=asked):
                asked.append(action)  # the call below asks before its first checkpoint
                if action == "unload":
                    await rt.unload_model("m")
                    return
                try:
                    await rt.load_model("m")
                except ModelLoadError as exc:  # a first load an unload overtook
                    abandoned.append((str(exc), list(asked)))

            async with trio.open_nursery() as ops:
                # both callers run in one scheduling batch, in an order trio picks
                ops.start_soon(ask, "load")
                ops.start_soon(ask, "unload")
            # (a load abandoned before it began leaves a model never loaded as it was)
            gone = ("UNAVAILABLE", "unloaded" if loaded_once else "not loaded")
            expected = ("READY", "") if asked[-1] == "load" else gone
            assert rt.model_state("m") == expected, asked
            loaded_once = loaded_once or asked[-1] == "load"
            for said, order in abandoned:
                assert (said, order) == (ABANDONED, ["load", "unload"])
            abandoned.clear()


class Raising(Worker):
    """The stand-in worker; a batch holding the input 13 fails."""

    async def result(self):
        items = self._staged[0]
        await trio.sleep(RUN_S)
        self._staged.popleft()
        Worker.ran.append((self, [key(it) for it in items]))
        if any(key(it) == 13.0 for it in items):
            raise self.Failed("ValueError: cannot take 13")
        return [{"y": it["x"] * self.weight} for it in items]


@pytest.mark.parametrize("action", ["reload", "unload"])
async def test_a_batch_that_fails_while_its_copy_drains_is_run_again_in_parts(
    autojump_clock, workers, monkeypatch, action
):
    """The copy's replicas retired as soon as its queue was empty: the parts of a
    batch of theirs that failed then (handed back to run again, to find the input
    that raised) had no replica left, and both requests got ActorClosed ('its copy
    was unloaded'). They are answered as without a reload or an unload."""
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", Raising)
    async with trioserve.open_runtime(control_config(max_wait_ms=100)) as rt:
        answers: dict = {}
        async with trio.open_nursery() as callers:
            for x in (13.0, 4.0):
                callers.start_soon(call, rt, x, answers)
            await trio.sleep(0.5)  # one batch of both, running
            assert [len(b) for b in rt.models["m"].batchers[0]._in_flight] == [2]
            workers.weight = 10.0
            await (rt.load_model("m") if action == "reload" else rt.unload_model("m"))
        assert answers[4.0] == [4.0]  # the old copy's
        (error,) = answers[13.0]
        assert isinstance(error, trioserve.ModelError)
        assert "cannot take 13" in str(error)
        await trio.testing.wait_all_tasks_blocked()  # (a reload's old copy retires)
        first = workers.made[0]
        assert not first.alive
        # the batch, then each alone, on the first copy's replica
        ran = [keys for w, keys in workers.ran if w is first]
        assert sorted(ran[0]) == [4.0, 13.0]
        assert sorted(ran[1:]) == [[4.0], [13.0]]


async def test_a_reload_of_an_autoscaled_model_keeps_the_replicas_it_scaled_to(
    autojump_clock, workers
):
    """A reload under load started the configured one replica, dropping the
    capacity the autoscaler had added: it now starts as many as serve."""
    cfg = control_config(replicas=1, autoscaling=trioserve.AutoscalingConfig(
        min_replicas=1, max_replicas=3, upscale_delay_s=0, interval_s=0.5,
    ))
    answers: dict = {}
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        async with trio.open_nursery() as callers:
            for x in range(1, 31):
                callers.start_soon(call, rt, float(x), answers)
            await trio.sleep_until(t0 + 1.0)  # the first look (at 0.5 s) scaled up
            old = rt.models["m"]
            assert len(old.scaler.serving()) == 3
            await rt.load_model("m")
            new = rt.models["m"]
            assert new is not old
            assert len(new.batchers) == 3
            assert len(new.scaler.serving()) == 3
        assert answers == {float(x): [float(x)] for x in range(1, 31)}


def test_a_reloads_replica_count_is_within_the_autoscalers_bounds():
    from types import SimpleNamespace

    from trioserve._runtime import _replica_devices

    m = trioserve.ModelConfig(
        name="m", backend="echo", devices=("cpu:0", "cpu:1"), replicas=2,
        autoscaling=trioserve.AutoscalingConfig(min_replicas=2, max_replicas=3),
    )

    def serving(n, *, loaded=True, config=m):
        scaler = SimpleNamespace(serving=lambda: [object()] * n)
        return SimpleNamespace(loaded=loaded, scaler=scaler, batchers=[], config=config)

    assert _replica_devices(m, serving(5)) == ("cpu:0", "cpu:1", "cpu:0")  # max 3
    assert _replica_devices(m, serving(3)) == ("cpu:0", "cpu:1", "cpu:0")
    assert _replica_devices(m, serving(0)) == ("cpu:0", "cpu:1")  # min 2
    # a load of a model not loaded (its stand-in), or a first start: as configured
    assert _replica_devices(m, serving(3, loaded=False)) == ("cpu:0", "cpu:1")
    assert _replica_devices(m, None) == ("cpu:0", "cpu:1")
    # a copy of other replicas (a load's config, or the table after one): as asked
    three = attrs.evolve(m, replicas=3)
    assert _replica_devices(three, serving(2)) == ("cpu:0", "cpu:1", "cpu:0")
    assert _replica_devices(m, serving(3, config=three)) == ("cpu:0", "cpu:1")


class Hanging(Worker):
    """A stand-in worker whose batches never end when ``hang`` was set as it was made
    (a model stuck on something)."""

    hang = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hangs = Hanging.hang

    async def result(self):
        if self.hangs:
            await trio.sleep_forever()
        return await super().result()


@pytest.fixture
def hanging(workers, monkeypatch):
    import trioserve.actors._batcher

    Hanging.hang = True
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", Hanging)
    return Hanging


def bounded_config(unload_timeout_s: float = 5.0, **model):
    return attrs.evolve(
        control_config(**model),
        runtime=trioserve.RuntimeLimits(unload_timeout_s=unload_timeout_s),
    )


async def test_an_unload_answers_what_a_stuck_model_holds_after_unload_timeout_s(
    autojump_clock, hanging, caplog
):
    """An unload waited for the requests in flight without a bound: with a model
    that never answers, for ever. After ``runtime.unload_timeout_s`` what is still
    running or queued is answered ActorClosed, once each, the replica is stopped
    (its worker killed) and the unload returns."""
    answers: dict = {}
    async with trioserve.open_runtime(bounded_config(5.0)) as rt:
        (worker,) = hanging.made
        async with trio.open_nursery() as callers:
            for x in range(1, 9):
                callers.start_soon(call, rt, float(x), answers)
            await trio.testing.wait_all_tasks_blocked()
            # three batches of two staged in the worker, two requests queued
            assert rt.statistics()["m"]["queue_depth"] == 2
            t0 = trio.current_time()
            with trio.fail_after(60):  # it waited for ever
                await rt.unload_model("m")
            assert trio.current_time() == t0 + 5.0
        assert sorted(answers) == [float(x) for x in range(1, 9)]
        errors = [error for got in answers.values() for error in got]
        assert len(errors) == 8  # one answer each
        assert all(type(e) is ActorClosed for e in errors)
        assert {str(e) for e in errors} == {
            "model 'm' was unloaded before this request was answered: the requests it "
            "held did not finish within runtime.unload_timeout_s (5 s)"
        }
        # the two never dispatched are not charged to their caller; the six were
        assert sum(e.in_queue for e in errors) == 2
        # logged once, naming the model once ("model 'm': model 'm' was ..." before)
        (line,) = [r.getMessage() for r in caplog.records if "unload_timeout_s" in r.getMessage()]
        assert line == str(errors[0])
        assert not worker.alive
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert rt.statistics()["m"]["replica_count"] == 0

        hanging.hang = False  # loaded again, it serves
        await rt.load_model("m")
        assert (await rt.infer("m", item(3.0)))["y"][0] == 3.0


async def test_a_reloads_stuck_old_copy_is_stopped_after_unload_timeout_s(
    autojump_clock, hanging
):
    """The copy a reload replaced drained without a bound; stuck, it held its worker
    for ever, and a later unload waited for it. Now its requests are answered
    ActorClosed after ``runtime.unload_timeout_s`` while the new copy serves."""
    answers: dict = {}
    async with trioserve.open_runtime(bounded_config(5.0)) as rt:
        (old,) = hanging.made
        async with trio.open_nursery() as callers:
            for x in range(1, 5):
                callers.start_soon(call, rt, float(x), answers)
            await trio.testing.wait_all_tasks_blocked()
            hanging.hang, Worker.weight = False, 10.0
            t0 = trio.current_time()
            await rt.load_model("m")  # a reload: the new copy serves at once
            assert trio.current_time() == t0
            (_, new) = hanging.made
            await call(rt, 11.0, answers)  # the new copy answers
            assert answers == {11.0: [110.0]}
            assert trio.current_time() == t0 + RUN_S
            assert old.alive  # still draining
            # an unload now waits for the old copy too, within the same bound
            with trio.fail_after(60):  # it waited for ever
                await rt.unload_model("m")
            assert trio.current_time() == t0 + 5.0
        assert answers[11.0] == [110.0]
        cut = [answers[float(x)] for x in range(1, 5)]
        assert all(len(got) == 1 and type(got[0]) is ActorClosed for got in cut)
        assert str(cut[0][0]) == (
            "model 'm' was reloaded, and the copy it replaced unloaded, before this "
            "request was answered: the requests it held did not finish within "
            "runtime.unload_timeout_s (5 s)"
        )
        assert not old.alive
        assert not new.alive
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")


async def test_an_unload_timeout_of_zero_answers_what_is_in_flight_at_once(
    autojump_clock, hanging
):
    answers: dict = {}
    async with trioserve.open_runtime(bounded_config(0.0)) as rt:
        async with trio.open_nursery() as callers:
            for x in range(1, 4):
                callers.start_soon(call, rt, float(x), answers)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            await rt.unload_model("m")
            assert trio.current_time() == t0
        assert all(len(got) == 1 and type(got[0]) is ActorClosed for got in answers.values())
        assert len(answers) == 3
