"""A load that brings a configuration of its own (``rt.load_model(name, config=...)``):
each key a load may change reaches the copy it loads, and a load without one goes
back to the configuration's table; a larger ``max_batch_size`` really batches more;
options reach the model's factory, called in a worker thread (a slow one does not
stall serving); refused keys and bad values are ConfigError
naming the key, as the TOML table's, and load nothing. The model runs in the
stand-in worker of test_model_control (trio time), or inline for options."""

from __future__ import annotations

import threading

import attrs
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import GATE_LIMIT_S, X, Y, item
from test_model_control import Worker, call, control_config, workers  # noqa: F401
from trioserve import ConfigError, ModelConfig, ModelLoadError
from trioserve._load_config import PER_COPY, REFUSED


class Recording(Worker):
    """The stand-in worker, keeping what its replica handed it."""

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        super().__init__(cfg, backend, device, torch_threads, zygote=zygote)
        self.cfg = cfg
        self.torch_threads = torch_threads


@pytest.fixture
def recording(workers, monkeypatch):  # noqa: F811
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", Recording)
    return workers


def batch_sizes(since: int = 0) -> list[int]:
    """The size of each batch the stand-in workers ran (from the ``since``-th)."""
    return [len(keys) for _, keys in Worker.ran[since:]]


def test_every_key_of_a_models_table_is_either_loadable_or_refused():
    """A key added to ModelConfig must be decided on: per copy, or refused (why)."""
    fields = [f.name for f in attrs.fields(ModelConfig)]
    assert sorted(fields) == sorted([*PER_COPY, *REFUSED, "name"])
    assert not set(PER_COPY) & set(REFUSED)


async def test_a_reload_with_a_larger_max_batch_size_batches_more_and_a_plain_load_restores_it(
    autojump_clock, workers  # noqa: F811
):
    answers: dict = {}

    async def eight(rt, base):
        async with trio.open_nursery() as callers:
            for x in range(8):
                callers.start_soon(call, rt, float(base + x), answers)

    async with trioserve.open_runtime(control_config(max_wait_ms=50)) as rt:
        await eight(rt, 0)
        assert batch_sizes() == [2, 2, 2, 2]
        await rt.load_model("m", config={"max_batch_size": 4})
        assert rt.model_state("m") == (
            "READY", "runs the configuration its load gave (changed: max_batch_size)"
        )
        assert rt.models["m"].config.max_batch_size == 4
        done = len(workers.ran)
        await eight(rt, 10)
        assert batch_sizes(done) == [4, 4]
        await rt.load_model("m")  # no config: the table again
        assert rt.model_state("m") == ("READY", "")
        assert rt.models["m"].config is rt.config.model("m")
        done = len(workers.ran)
        await eight(rt, 20)
        assert batch_sizes(done) == [2, 2, 2, 2]
        assert answers == {float(x): [float(x)] for b in (0, 10, 20) for x in range(b, b + 8)}
        assert len(workers.made) == 3
        assert [w.alive for w in workers.made] == [False, False, True]


def scaled(scale: float = 1.0, offset: float = 0.0) -> trioserve.CallableBackend:
    """A backend factory: ``y = scale * x + offset``, run inline."""
    return trioserve.CallableBackend(
        lambda items: [{"y": it["x"] * scale + offset} for it in items],
        inputs=(X,), outputs=(Y,), execution="inline",
    )


def options_config(**model):
    m = ModelConfig(name="m", backend=scaled, options={"scale": 2.0, "offset": 1.0},
                    max_wait_ms=0, **model)
    return trioserve.Config(
        models=(m,), tenants=(trioserve.TenantConfig(name="t", default=True),),
        server=trioserve.ServerConfig(model_control="explicit"),
    )


async def test_options_reach_the_models_factory_laid_over_the_tables(autojump_clock):
    async with trioserve.open_runtime(options_config()) as rt:
        assert (await rt.infer("m", item(3.0)))["y"][0] == 7.0
        await rt.load_model("m", config={"options": {"scale": 10.0}})
        assert (await rt.infer("m", item(3.0)))["y"][0] == 31.0  # offset 1 kept
        assert rt.models["m"].config.options == {"scale": 10.0, "offset": 1.0}
        assert rt.model_state("m")[1] == (
            "runs the configuration its load gave (changed: options)"
        )
        await rt.load_model("m")
        assert (await rt.infer("m", item(3.0)))["y"][0] == 7.0
        with pytest.raises(ConfigError) as caught:
            await rt.load_model("m", config={"options": {"scale": 1.0, "bias": 2.0}})
        assert str(caught.value).startswith(
            "models.m.backend: scaled failed with its options {'scale': 1.0, "
            "'offset': 1.0, 'bias': 2.0}: TypeError: "
        )
        assert (await rt.infer("m", item(3.0)))["y"][0] == 7.0  # the copy serves on


class Gated:
    """A backend factory (``scaled``'s) whose call with ``scale`` 10 waits in its
    thread for ``gate`` (``entered`` set then, ``made`` once it has made the
    backend); ``on_loop`` records, per call, whether it ran in the event loop's
    thread."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.made = threading.Event()
        self.on_loop: list[bool] = []
        self.loop_thread = threading.current_thread()

    def __call__(self, scale: float = 1.0, offset: float = 0.0) -> trioserve.CallableBackend:
        self.on_loop.append(threading.current_thread() is self.loop_thread)
        if scale != 10.0:
            return scaled(scale, offset)
        self.entered.set()
        self.gate.wait(GATE_LIMIT_S)
        backend = scaled(scale, offset)
        self.made.set()
        return backend


@pytest.fixture
def gated():
    factory = Gated()
    yield factory
    factory.gate.set()  # a test that failed leaves no thread held


def gated_config(factory: Gated, *, load_at_start: bool = True) -> trioserve.Config:
    m = ModelConfig(name="m", backend=factory, options={"scale": 2.0, "offset": 1.0},
                    max_wait_ms=0, load_at_start=load_at_start)
    other = ModelConfig(name="other", backend=scaled, max_wait_ms=0)
    return trioserve.Config(
        models=(m, other), tenants=(trioserve.TenantConfig(name="t", default=True),),
        server=trioserve.ServerConfig(model_control="explicit"),
    )


async def wait_in_thread(event: threading.Event) -> bool:
    return await trio.to_thread.run_sync(event.wait, GATE_LIMIT_S)


async def load_with(rt, config, outcomes: list) -> None:
    try:
        await rt.load_model("m", config=config)
    except (ConfigError, ModelLoadError) as exc:
        outcomes.append(exc)
    else:
        outcomes.append("loaded")


async def test_a_backend_a_load_makes_is_made_off_the_event_loop(autojump_clock, gated):
    # The user's factory, called for a load that changes the options, blocks: the
    # runtime serves on meanwhile (another model, and the copy being reloaded).
    async with trioserve.open_runtime(gated_config(gated)) as rt:
        assert gated.on_loop == [True]  # at the start, as ever
        outcomes: list = []
        async with trio.open_nursery() as ops:
            ops.start_soon(load_with, rt, {"options": {"scale": 10.0}}, outcomes)
            assert await wait_in_thread(gated.entered)
            assert (await rt.infer("other", item(3.0)))["y"][0] == 3.0
            assert (await rt.infer("m", item(3.0)))["y"][0] == 7.0  # the loaded copy
            assert rt.model_state("m") == (
                "READY", "reloading (the loaded copy serves meanwhile)"
            )
            assert outcomes == []
            gated.gate.set()
        assert outcomes == ["loaded"]
        assert gated.on_loop == [True, False]  # the load's: in a worker thread
        assert (await rt.infer("m", item(3.0)))["y"][0] == 31.0


async def test_loads_and_unloads_keep_their_order_while_a_backend_is_made(
    autojump_clock, gated,
):
    async with trioserve.open_runtime(gated_config(gated)) as rt:
        outcomes: list = []
        later: list = []
        async with trio.open_nursery() as ops:
            ops.start_soon(load_with, rt, {"options": {"scale": 10.0}}, outcomes)
            assert await wait_in_thread(gated.entered)
            # asked after it: runs after it, however long the factory takes
            ops.start_soon(load_with, rt, {"max_batch_size": 4}, later)
            await trio.testing.wait_all_tasks_blocked()
            assert (outcomes, later) == ([], [])
            gated.gate.set()
        assert (outcomes, later) == (["loaded"], ["loaded"])
        assert rt.models["m"].config.max_batch_size == 4
        assert (await rt.infer("m", item(3.0)))["y"][0] == 7.0  # the table's options

        # an unload asked while it is made abandons the load: its backend, when the
        # factory returns, is dropped
        for event in (gated.gate, gated.entered, gated.made):
            event.clear()
        outcomes.clear()
        async with trio.open_nursery() as ops:
            ops.start_soon(load_with, rt, {"options": {"scale": 10.0}}, outcomes)
            assert await wait_in_thread(gated.entered)
            await rt.unload_model("m")
            (abandoned,) = outcomes
            assert isinstance(abandoned, ModelLoadError)
            assert "its load was abandoned" in str(abandoned)
            assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
            gated.gate.set()
        assert await wait_in_thread(gated.made)
        await trio.testing.wait_all_tasks_blocked()
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert not rt.models["m"].loaded


@pytest.mark.parametrize("given", [True, False], ids=["the-loads", "the-tables"])
async def test_a_backend_made_past_load_timeout_s_fails_the_load_and_is_dropped(
    autojump_clock, gated, caplog, given,
):
    """The factory of a load's options holds its thread past the model's
    ``load_timeout_s`` (the load's own, or the table's): the load fails, naming the
    bound; the loaded copy serves on; the load asked behind it goes on; the backend
    the thread makes when it returns is dropped, never installed.

    The bound is wall time, as a replica's load's (a trio timer would fire at once
    under the autojumping clock while the loop waits for the thread): a small real
    one. Should the bound not hold, the gate opens after a while and the load
    would succeed. The table's bound also bounds the model's load at start (a real
    one, on a machine that may be busy): it is larger, so that load fits it."""
    cfg = gated_config(gated)
    if given:
        bound = 0.2
        change = {"options": {"scale": 10.0}, "load_timeout_s": bound}
    else:
        bound = 1.5
        change = {"options": {"scale": 10.0}}
        (m, other) = cfg.models
        cfg = attrs.evolve(cfg, models=(attrs.evolve(m, load_timeout_s=bound), other))
    opens = threading.Timer(10.0, gated.gate.set)
    opens.start()
    try:
        async with trioserve.open_runtime(cfg) as rt:
            outcomes: list = []
            later: list = []
            async with trio.open_nursery() as ops:
                ops.start_soon(load_with, rt, change, outcomes)
                assert await wait_in_thread(gated.entered)
                ops.start_soon(load_with, rt, {"max_batch_size": 4}, later)  # behind it
            (failed,) = outcomes
            assert type(failed) is ModelLoadError
            assert str(failed) == (
                "model 'm': the backend the load's options make did not return within "
                f"load_timeout_s ({bound:g} s)"
            )
            assert not gated.made.is_set()  # still held: abandoned, not waited for
            assert later == ["loaded"]
            assert rt.models["m"].config.max_batch_size == 4
            assert (await rt.infer("m", item(3.0)))["y"][0] == 7.0  # not scale 10
            assert rt.model_state("m") == (
                "READY", "runs the configuration its load gave (changed: max_batch_size)"
            )
            assert any("did not return within load_timeout_s" in r.getMessage()
                       for r in caplog.records)
            gated.gate.set()
            assert await wait_in_thread(gated.made)
            await trio.testing.wait_all_tasks_blocked()
            assert rt.models["m"].config.max_batch_size == 4  # the thread's is dropped
            assert (await rt.infer("m", item(3.0)))["y"][0] == 7.0
    finally:
        opens.cancel()


@pytest.mark.parametrize("first", ["the-bound", "the-unload"])
async def test_an_unload_as_the_load_timeout_fires_abandons_the_load(
    autojump_clock, gated, manual_watchdog, monkeypatch, caplog, first,
):
    """An unload abandons a first load whose options' factory holds its thread at
    the very moment the load's ``load_timeout_s`` passes: the unload's cancel and
    the bound's in one step of the event loop (in either order), before the load's
    task resumes. The abandonment wins: its callers get the abandonment's error, not
    the bound's; the model ends unloaded at once, not failed to load; nothing says
    the bound passed (its scope, inside the cancelled load's, caught nothing)."""
    async with trioserve.open_runtime(gated_config(gated, load_at_start=False)) as rt:
        dog = manual_watchdog.made[-1]
        control = type(rt._control)
        abandon = control._abandon

        def at_once(self, entry, op) -> None:
            if first == "the-bound":
                dog.advance(0.2)
            abandon(self, entry, op)
            if first == "the-unload":
                dog.advance(0.2)

        monkeypatch.setattr(control, "_abandon", at_once)
        outcomes: list = []
        async with trio.open_nursery() as ops:
            ops.start_soon(
                load_with, rt, {"options": {"scale": 10.0}, "load_timeout_s": 0.2}, outcomes
            )
            assert await wait_in_thread(gated.entered)
            await trio.testing.wait_all_tasks_blocked()
            fired = dog.fired
            await rt.unload_model("m")
            assert dog.fired == fired + 1  # the bound fired with it
            assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")  # at once
        (failed,) = outcomes
        assert type(failed) is ModelLoadError
        assert str(failed) == (
            "model 'm': its load was abandoned: an unload of the model was asked before "
            "it ended"
        )
        await trio.testing.wait_all_tasks_blocked()
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert not rt.models["m"].loaded
        assert not any("load_timeout_s" in r.getMessage() for r in caplog.records)


async def test_a_backend_that_cannot_be_made_is_a_config_error_and_starts_nothing(
    autojump_clock, gated, monkeypatch,
):
    async with trioserve.open_runtime(gated_config(gated, load_at_start=False)) as rt:
        with pytest.raises(ConfigError) as caught:  # the factory refuses its options
            await rt.load_model("m", config={"options": {"bias": 2.0}})
        assert str(caught.value).startswith(
            "models.m.backend: Gated failed with its options {'scale': 2.0, "
            "'offset': 1.0, 'bias': 2.0}: TypeError: "
        )
        assert rt.model_state("m") == ("UNAVAILABLE", "not loaded")  # as it was
        assert not rt.models["m"].loaded
        assert rt.statistics()["m"]["replica_count"] == 0

        def broken(m):
            raise RuntimeError("no such device")

        monkeypatch.setattr("trioserve._runtime.resolve_backend", broken)
        with pytest.raises(ConfigError, match=(
            r"^models\.m\.backend: its backend could not be made with the load's "
            r"options: RuntimeError: no such device$"
        )):
            await rt.load_model("m", config={"options": {"scale": 3.0}})
        assert rt.model_state("m") == ("UNAVAILABLE", "not loaded")
        monkeypatch.undo()

        await rt.load_model("m", config={"options": {"scale": 3.0}})
        assert (await rt.infer("m", item(3.0)))["y"][0] == 10.0


async def test_options_reach_each_version_with_weights_of_its_own(autojump_clock):
    """A version's own options are laid over the model's, the load's included."""
    cfg = options_config()
    m = attrs.evolve(cfg.models[0], versions={"1": {}, "2": {"options": {"offset": 5.0}}})
    async with trioserve.open_runtime(attrs.evolve(cfg, models=(m,))) as rt:

        async def y(version):
            return float((await rt.infer("m", item(3.0), version=version))["y"][0])

        assert (await y("1"), await y("2")) == (7.0, 11.0)
        await rt.load_model("m", config={"options": {"scale": 10.0}})
        assert (await y("1"), await y("2")) == (31.0, 35.0)
        await rt.load_model("m")
        assert (await y("1"), await y("2")) == (7.0, 11.0)


async def test_options_of_a_backend_object_are_refused(autojump_clock, workers):  # noqa: F811
    async with trioserve.open_runtime(control_config()) as rt:
        with pytest.raises(ConfigError, match=r"^models\.m\.options: the model's backend is "
                           "a ModelBackend object"):
            await rt.load_model("m", config={"options": {"scale": 2.0}})


def _timer(served):
    return served.batchers[0]._timer.policy


#: key, value given, and what the copy loaded runs with (from its ServedModel and
#: what its replicas handed their workers)
EFFECTS = [
    ("devices", ("cpu:1",), lambda s, w: tuple(x.device for x in w)),
    ("replicas", 3, lambda s, w: len(w)),
    ("max_batch_size", 5, lambda s, w: s.limits.max_size),
    ("max_batch_tokens", 64, lambda s, w: s.limits.max_tokens),
    ("max_wait_ms", 7.0, lambda s, w: s.limits.max_wait * 1e3),
    ("oversize", "alone", lambda s, w: s.limits.oversize),
    ("timeout_ms", 1500.0, lambda s, w: s.timeout * 1e3),
    ("torch_threads", 4, lambda s, w: w[0].torch_threads),
    ("load_timeout_s", 12.0, lambda s, w: w[0].cfg.load_timeout_s),
    ("adaptive_limit", False, lambda s, w: s.scheduler.policy.limit is not None),
    ("batch_timeout_factor", 2.5, lambda s, w: _timer(s).factor),
    ("batch_timeout_floor_ms", 500.0, lambda s, w: _timer(s).floor * 1e3),
    ("batch_timeout_cap_ms", 9000.0, lambda s, w: _timer(s).cap * 1e3),
    ("poison_attempts", 4, lambda s, w: _timer(s).poison_attempts),
    ("hedge", True, lambda s, w: s.hedge_timer is not None),
]


@pytest.mark.parametrize(("key", "value", "runs"), EFFECTS, ids=[e[0] for e in EFFECTS])
async def test_each_key_a_load_gives_reaches_the_copy_it_loads(
    autojump_clock, recording, key, value, runs
):
    async with trioserve.open_runtime(control_config()) as rt:
        table = rt.config.model("m")

        def now():
            served = rt.models["m"]
            return runs(served, [b._worker for b in served.batchers])

        before = now()
        await rt.load_model("m", config={key: value})
        assert now() == value != before
        assert getattr(rt.models["m"].config, key) == value
        await rt.load_model("m")
        assert now() == before
        assert rt.models["m"].config is table


async def test_hedge_after_ms_and_slow_lane_replicas_reach_the_copy(autojump_clock, workers):  # noqa: F811
    async with trioserve.open_runtime(
        control_config(replicas=4, slow_lane_cost=10, slow_lane_replicas=1)
    ) as rt:
        await rt.load_model(
            "m", config={"hedge": True, "hedge_after_ms": 30.0, "slow_lane_replicas": 2}
        )
        served = rt.models["m"]
        assert served.config.hedge_after_ms == 30.0  # read by each hedged request
        assert (served.scheduler.replicas, served.slow_scheduler.replicas) == (2, 2)
        await rt.load_model("m")
        served = rt.models["m"]
        assert (served.scheduler.replicas, served.slow_scheduler.replicas) == (3, 1)
        assert served.hedge_timer is None


async def test_a_load_timeout_given_by_a_load_bounds_that_load(workers):  # noqa: F811
    """In wall time, as every load's bound: a worker that takes 100 s to start."""
    async with trioserve.open_runtime(control_config()) as rt:
        (old,) = workers.made
        workers.load_s = 100.0
        start = trio.current_time()
        with pytest.raises(ModelLoadError) as caught:
            await rt.load_model("m", config={"load_timeout_s": 0.2})
        assert str(caught.value) == (
            "model 'm': replica 0 on cpu did not load within 0.2 s (models.m.load_timeout_s)"
        )
        assert trio.current_time() - start < 30
        assert rt.model_state("m") == ("READY", "")  # the old copy serves on
        assert old.alive


@pytest.mark.parametrize("key", sorted(REFUSED))
async def test_a_key_a_load_may_not_change_is_refused_and_nothing_is_loaded(
    autojump_clock, workers, key  # noqa: F811
):
    async with trioserve.open_runtime(control_config()) as rt:
        with pytest.raises(ConfigError) as caught:
            await rt.load_model("m", config={"max_batch_size": 4, key: None})
        assert str(caught.value) == (
            f"models.m.{key}: a load's config cannot change it: {REFUSED[key]}"
        )
        await trio.testing.wait_all_tasks_blocked()
        assert len(workers.made) == 1  # nothing started
        assert rt.model_state("m") == ("READY", "")
        assert rt.models["m"].config.max_batch_size == 2


async def test_the_models_own_name_is_taken_and_another_refused(autojump_clock, workers):  # noqa: F811
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        with pytest.raises(ConfigError, match=(
            r"^models\.m\.name: a load's config is for the model the load names \('m'\), "
            r"got 'n'$"
        )):
            await rt.load_model("m", config={"name": "n"})
        assert rt.model_state("m") == ("UNAVAILABLE", "not loaded")
        await rt.load_model("m", config={"name": "m"})  # as Triton's configs carry it
        assert rt.model_state("m") == ("READY", "")  # the table itself
        assert workers.made[0].alive


@pytest.mark.parametrize(
    "given",
    [{"max_batch_size": 0}, {"max_batch": 4}, {"oversize": "drop"}, {"devices": []},
     {"timeout_ms": -1}, {"hedge_after_ms": 5.0}],
)
async def test_a_bad_value_is_the_tables_own_error_and_loads_nothing(
    autojump_clock, workers, given  # noqa: F811
):
    with pytest.raises(ConfigError) as in_toml:
        trioserve.config_from_mapping(
            {"models": {"m": {"backend": "echo", **given}}}
        )
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        with pytest.raises(ConfigError) as caught:
            await rt.load_model("m", config=given)
        assert str(caught.value) == str(in_toml.value)
        assert str(caught.value).startswith(f"models.m.{next(iter(given))}: ")
        assert rt.model_state("m") == ("UNAVAILABLE", "not loaded")
        assert workers.made == []


async def test_what_a_copy_cannot_start_with_is_refused_before_it_starts(
    autojump_clock, workers  # noqa: F811
):
    async with trioserve.open_runtime(control_config()) as rt:
        for given, error in [
            ({"batch_timeout_cap_ms": 10.0}, "models.m.batch_timeout_cap_ms: must be >= "
             "batch_timeout_floor_ms (1000), got 10"),
            ({"devices": ("cuda:7",)}, "models.m.devices: cuda:7 is not available"),
        ]:
            with pytest.raises(ConfigError) as caught:
                await rt.load_model("m", config=given)
            assert str(caught.value).startswith(error)
        assert rt.model_state("m") == ("READY", "")
        assert len(workers.made) == 1


async def test_a_load_config_that_is_no_table_is_refused(autojump_clock, workers):  # noqa: F811
    async with trioserve.open_runtime(control_config()) as rt:
        with pytest.raises(ConfigError, match=(
            r"^models\.m: a load's config must be a table of the model's keys "
            r"\(as \[models\.m\]\), got \[1, 2\]$"
        )):
            await rt.load_model("m", config=[1, 2])


async def test_loads_of_different_configs_at_once_do_not_share(autojump_clock, workers):  # noqa: F811
    """Two loads of one config at once share one; a load of another config asked
    meanwhile is a load of its own, after it: the last asked is what serves."""
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        workers.load_s = 3.0
        t0 = trio.current_time()
        async with trio.open_nursery() as ops:
            ops.start_soon(rt.load_model, "m", {"max_batch_size": 4})
            ops.start_soon(rt.load_model, "m", {"max_batch_size": 4})
            await trio.testing.wait_all_tasks_blocked()
            ops.start_soon(rt.load_model, "m", {"max_batch_size": 6})
        assert trio.current_time() == pytest.approx(t0 + 6.0)
        assert len(workers.made) == 2
        assert rt.models["m"].config.max_batch_size == 6


def test_the_thread_clients_load_takes_a_config():
    m = ModelConfig(name="m", backend=scaled, options={"scale": 2.0}, max_wait_ms=0)
    cfg = trioserve.Config(models=(m,), server=trioserve.ServerConfig(model_control="explicit"))
    with trioserve.serve_in_thread(cfg) as client:
        client.load_model("m", config={"options": {"scale": 5.0}, "max_batch_size": 8})
        assert client.model_state("m") == (
            "READY", "runs the configuration its load gave (changed: max_batch_size, options)"
        )
        assert client.infer("m", item(2.0))["y"][0] == 10.0
        with pytest.raises(ConfigError, match=r"^models\.m\.cache: a load's config cannot"):
            client.load_model("m", config={"cache": False})
        client.load_model("m")
        assert client.infer("m", item(2.0))["y"][0] == 4.0


async def test_batch_fill_is_each_batchs_against_the_copy_that_ran_it(
    autojump_clock, workers  # noqa: F811
):
    """docs/gateway.md (/metrics): trioserve_batch_fill_ratio is the mean fill of the
    batches run, each over the max_batch_size of the copy that closed it; a reload
    that lowers max_batch_size does not read the earlier batches as overfull."""
    answers: dict = {}

    async def calls(rt, base, n):
        async with trio.open_nursery() as callers:
            for x in range(n):
                callers.start_soon(call, rt, float(base + x), answers)

    async with trioserve.open_runtime(control_config(max_batch_size=4, max_wait_ms=50)) as rt:
        metrics = rt.models["m"].metrics
        await calls(rt, 0, 8)
        assert batch_sizes() == [4, 4]
        assert metrics.fill_ratio == 1.0
        await rt.load_model("m", config={"max_batch_size": 1})
        assert metrics.fill_ratio == 1.0  # the two full batches of 4 stay full
        done = len(workers.ran)
        await calls(rt, 10, 2)
        assert batch_sizes(done) == [1, 1]
        assert metrics.fill_ratio == 1.0
        await rt.load_model("m", config={"max_batch_size": 8})
        done = len(workers.ran)
        await calls(rt, 20, 2)
        assert batch_sizes(done) == [2]
        assert metrics.fill_ratio == (4 * 1.0 + 2 / 8) / 5
        assert rt.statistics()["m"]["fill_ratio"] == metrics.fill_ratio
