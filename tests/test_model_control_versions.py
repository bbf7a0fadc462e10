"""Explicit model control of models whose versions have weights of their own, and of
models with a rollout: loaded, reloaded and unloaded as a whole (every version's
queues and replicas, the rollout's controller), in process and over HTTP. The
versions run in the stand-in worker of test_model_control, each version's answer
``y = x * weight * scale`` with a scale of its own, so every timing is exact under the
MockClock and each answer says which copy and version gave it."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from http_helpers import config, echo_model, serving, v2_input
from runtime_helpers import NoZygote, callable_model, item
from test_model_control import Worker
from trioserve import ActorState, ModelLoadError, ServerConfig, UnknownModel
from trioserve.transport import open_http

#: a version's scale, by the ``tag`` of its options ("base": the model's backend)
SCALE = {"base": 1.0, "2": 100.0, "3": 1000.0}
TWO = {"1": {}, "2": {"options": {"tag": "2"}}}
THREE = {"1": {}, "2": {"options": {"tag": "2"}}, "3": {"options": {"tag": "3"}}}


class VWorker(Worker):
    """The stand-in worker of one version: its scale and its failure by its tag."""

    failing: frozenset = frozenset()

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        super().__init__(cfg, backend, device, torch_threads, zygote=zygote)
        self.tag = cfg.options.get("tag", "base")
        self.weight = VWorker.weight * SCALE[self.tag]

    async def start(self) -> None:
        await trio.sleep(VWorker.load_s)
        if self.tag in VWorker.failing:
            raise RuntimeError(f"weights of {self.tag} missing")


@pytest.fixture
def vworkers(monkeypatch):
    import trioserve._runtime
    import trioserve.actors._batcher

    Worker.made, Worker.ran = [], []
    Worker.weight, Worker.load_s, Worker.fail = 1.0, 0.0, False
    VWorker.weight, VWorker.load_s, VWorker.failing = 1.0, 0.0, frozenset()
    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", VWorker)
    return VWorker


def family_model(*, load_at_start=True, versions=TWO, **model):
    args = dict(execution="process", max_batch_size=2, max_wait_ms=0, timeout_ms=None,
                load_at_start=load_at_start, versions=versions)
    args.update(model)
    return callable_model("m", lambda items: items, **args)


def family_config(**model):
    return trioserve.Config(
        models=(family_model(**model),),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        server=ServerConfig(model_control="explicit"),
    )


async def y(rt, x: float, version: str | None = None) -> float:
    return float((await rt.infer("m", item(x), version=version))["y"][0])


async def refused_everywhere(rt) -> None:
    for version in (None, "1", "2"):
        with pytest.raises(UnknownModel, match="model 'm' is not loaded"):
            await rt.infer("m", item(1.0), version=version)
        with pytest.raises(UnknownModel, match="model 'm' is not loaded"):
            await rt.infer_batch("m", [item(1.0), item(2.0)], version=version)
        assert rt.model_ready("m", version) is False


def tasks() -> list:
    out, todo = [], [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        out.append(task)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return out


@pytest.mark.parametrize(
    "model",
    [dict(versions=TWO), dict(versions=("1", "2"), rollout={"stable": "1", "canary": "2"})],
    ids=["own-weights", "rollout"],
)
def test_versions_with_weights_or_a_rollout_are_under_explicit_control(model):
    server = ServerConfig(model_control="explicit")
    cfg = trioserve.Config(
        models=(trioserve.ModelConfig(name="m", backend="mlp", load_at_start=False, **model),),
        server=server,
    )
    assert not cfg.models[0].load_at_start


async def test_a_family_is_loaded_and_unloaded_as_a_whole(autojump_clock, vworkers):
    async with trioserve.open_runtime(family_config(load_at_start=False)) as rt:
        assert vworkers.made == []
        assert rt.model_state("m") == ("UNAVAILABLE", "not loaded")
        await refused_everywhere(rt)
        assert "versions" not in rt.statistics()["m"]

        await rt.load_model("m")
        assert rt.model_state("m") == ("READY", "")
        assert sorted(w.tag for w in vworkers.made) == ["2", "base"]
        assert await y(rt, 3.0) == 300.0  # unversioned: the latest version
        assert await y(rt, 3.0, "1") == 3.0
        assert await y(rt, 3.0, "2") == 300.0
        assert rt.model_ready("m", "1")
        assert rt.model_ready("m", "2")
        assert rt.statistics()["m"]["versions"]["2"]["own_weights"] is True

        await rt.unload_model("m")
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert all(not w.alive for w in vworkers.made)  # every version's worker
        await refused_everywhere(rt)
        stats = rt.statistics()["m"]
        assert "versions" not in stats  # shown as any model not loaded
        assert stats["replica_count"] == 0
        assert stats["items"] == 3  # the counters stay
        # every version's flows, added up: none goes back
        assert stats["flows"]["t/realtime"]["dispatched"] == 3

        await rt.load_model("m")  # and loaded again
        assert await y(rt, 4.0, "2") == 400.0
        assert await y(rt, 4.0, "1") == 4.0
        assert len(vworkers.made) == 4
        assert rt.statistics()["m"]["flows"]["t/realtime"]["dispatched"] == 5


async def test_a_family_unloaded_with_requests_queued_keeps_their_counts(
    autojump_clock, vworkers
):
    # the model's flows while unloaded are its versions' added up: with those the
    # drain answered, not only those dispatched when the unload began
    async with trioserve.open_runtime(family_config()) as rt:
        async with trio.open_nursery() as callers:
            for x in range(20):
                callers.start_soon(y, rt, float(x), "1" if x % 2 else "2")
            await trio.testing.wait_all_tasks_blocked()
            flow = rt.statistics()["m"]["flows"]["t/realtime"]
            assert flow["admitted"] == 20
            assert flow["queued"] > 0  # some wait when the unload begins
            await rt.unload_model("m")
        flow = rt.statistics()["m"]["flows"]["t/realtime"]
        assert (flow["admitted"], flow["dispatched"], flow["queued"]) == (20, 20, 0)
        assert flow["wait"].count == 20
        await rt.load_model("m")  # and they go on from there
        await y(rt, 1.0, "2")
        flow = rt.statistics()["m"]["flows"]["t/realtime"]
        assert (flow["admitted"], flow["dispatched"]) == (21, 21)


async def test_a_version_that_fails_to_load_fails_the_whole_load(
    autojump_clock, vworkers, caplog
):
    async with trioserve.open_runtime(family_config(load_at_start=False)) as rt:
        vworkers.failing = frozenset({"2"})
        with pytest.raises(
            ModelLoadError,
            match=r"model 'm', version '2' \(weights of its own\): .*weights of 2 missing",
        ):
            await rt.load_model("m")
        (line,) = [r.getMessage() for r in caplog.records if "failed to load" in r.getMessage()]
        # the model said once: not "model 'm': failed to load: model 'm', version '2' …"
        assert line.startswith("model 'm': failed to load: version '2' (weights of its own): ")
        assert line.count("'m'") == 1
        state, reason = rt.model_state("m")
        assert state == "UNAVAILABLE"
        assert reason.startswith("failed to load: ")
        assert "version '2'" in reason
        # the version started before the failure was stopped: nothing half-loaded
        (base,) = [w for w in vworkers.made if w.tag == "base"]
        assert not base.alive
        await refused_everywhere(rt)

        vworkers.failing = frozenset()
        await rt.load_model("m")
        serving = [w for w in vworkers.made if w.alive]
        assert sorted(w.tag for w in serving) == ["2", "base"]
        # a reload that fails leaves every old copy serving
        vworkers.failing = frozenset({"2"})
        with pytest.raises(ModelLoadError, match="version '2'"):
            await rt.load_model("m")
        assert rt.model_state("m") == ("READY", "")
        assert all(w.alive for w in serving)
        assert await y(rt, 2.0, "1") == 2.0
        assert await y(rt, 2.0, "2") == 200.0
        assert await y(rt, 2.0) == 200.0


class Gated(VWorker):
    """A version's worker whose start waits until every version's worker has begun
    its own: loaded one after the other, the first would wait for ever."""

    begun: list
    all_begun: trio.Event
    expected = 3

    async def start(self) -> None:
        Gated.begun.append(self.tag)
        if len(Gated.begun) == Gated.expected:
            Gated.all_begun.set()
        await Gated.all_begun.wait()
        await super().start()


@pytest.fixture
def gated(vworkers, monkeypatch):
    import trioserve.actors._batcher

    def reset() -> None:
        Gated.begun, Gated.all_begun = [], trio.Event()

    reset()
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", Gated)
    return reset


async def test_a_familys_versions_load_at_once(autojump_clock, vworkers, gated):
    """A load (and a reload) started the versions with weights of their own one
    after the other: now all at once, each version's load overlapping the others'."""
    cfg = family_config(load_at_start=False, versions=THREE)
    async with trioserve.open_runtime(cfg) as rt:
        with trio.fail_after(60):  # in turn, the first start would wait for ever
            await rt.load_model("m")
        assert sorted(Gated.begun) == ["2", "3", "base"]
        assert [await y(rt, 2.0, v) for v in ("1", "2", "3")] == [2.0, 200.0, 2000.0]
        first = list(vworkers.made)

        gated()  # a reload, the same
        with trio.fail_after(60):
            await rt.load_model("m")
        assert sorted(Gated.begun) == ["2", "3", "base"]
        assert [await y(rt, 3.0, v) for v in ("1", "2", "3")] == [3.0, 300.0, 3000.0]
        await trio.testing.wait_all_tasks_blocked()  # the old copies' drain ends
        assert not any(w.alive for w in first)
        # the versions share the model's measurements, as when they loaded in turn
        served = rt._families["m"].groups
        assert len({id(g.metrics) for g in served}) == 1
        assert rt.statistics()["m"]["items"] == 6


async def test_versions_that_fail_to_load_at_once_are_each_named_and_nothing_stays(
    autojump_clock, vworkers
):
    """Loaded at once, every version's load ends before the load's outcome: the
    versions that failed are each named with their reason, those that loaded are
    stopped again (all or nothing), and a reload that fails so leaves the old copy
    serving."""
    cfg = family_config(load_at_start=False, versions=THREE)
    async with trioserve.open_runtime(cfg) as rt:
        vworkers.failing, vworkers.load_s = frozenset({"2", "3"}), 4.0
        t0 = trio.current_time()
        with pytest.raises(ModelLoadError) as caught:
            await rt.load_model("m")
        assert trio.current_time() == pytest.approx(t0 + 4.0)  # one load's time, not three
        text = str(caught.value)
        assert text.startswith("model 'm': 2 versions' loads failed: version '2' (weights "
                               "of its own): ")
        assert "weights of 2 missing; version '3' (weights of its own): " in text
        assert text.endswith("weights of 3 missing")
        state, reason = rt.model_state("m")
        assert (state, reason) == ("UNAVAILABLE", f"failed to load: {text}")
        # the model's backend's version loaded, and was stopped again
        (base,) = [w for w in vworkers.made if w.tag == "base"]
        assert not base.alive
        assert not any(w.alive for w in vworkers.made)
        await refused_everywhere(rt)

        vworkers.failing = frozenset()
        await rt.load_model("m")
        serving = [w for w in vworkers.made if w.alive]
        vworkers.failing = frozenset({"3"})
        with pytest.raises(ModelLoadError, match=r"^model 'm', version '3' \(weights of its "
                                                 r"own\): .*weights of 3 missing$"):
            await rt.load_model("m")
        assert rt.model_state("m") == ("READY", "")
        assert sorted(w.tag for w in vworkers.made if w.alive) == ["2", "3", "base"]
        assert all(w.alive for w in serving)
        assert await y(rt, 2.0, "3") == 2000.0


async def test_a_family_reload_answers_every_request_in_flight_exactly_once(
    autojump_clock, vworkers
):
    answers: dict = {}

    async def call(rt, x: float, version: str | None) -> None:
        try:
            out = await y(rt, x, version)
        except trioserve.TrioserveError as exc:
            answers.setdefault((x, version), []).append(exc)
        else:
            answers.setdefault((x, version), []).append(out)

    versions = (None, "1", "2")
    async with trioserve.open_runtime(family_config()) as rt:
        old = list(vworkers.made)
        vworkers.weight, vworkers.load_s = 10.0, 2.0
        async with trio.open_nursery() as callers:
            for x in range(1, 7):  # queued on the old copies: version 2's for 6 s
                for v in versions:
                    callers.start_soon(call, rt, float(x), v)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            async with trio.open_nursery() as ops:
                ops.start_soon(rt.load_model, "m")
                await trio.testing.wait_all_tasks_blocked()
                # the old copies serve meanwhile: READY, ready
                assert rt.model_state("m") == (
                    "READY", "reloading (the loaded copy serves meanwhile)"
                )
                assert all(rt.model_ready("m", v) for v in versions)
                for v in versions:
                    callers.start_soon(call, rt, 7.0, v)
            # every version's copy loaded at once; version 2's old one still drains
            assert trio.current_time() == pytest.approx(t0 + 2.0)
            assert rt.model_state("m") == ("READY", "")
            assert rt._families["m"].by_version["2"].batchers[0]._worker.weight == 1000.0
            for v in versions:
                callers.start_soon(call, rt, 11.0, v)
        # each answered once, by the copy that admitted it
        assert answers == {
            **{(float(x), v): [x * SCALE["2" if v != "1" else "base"]]
               for x in range(1, 8) for v in versions},
            (11.0, None): [11.0 * 10 * 100], (11.0, "1"): [110.0], (11.0, "2"): [11000.0],
        }
        await trio.testing.wait_all_tasks_blocked()  # the old copies' drain ends
        assert all(not w.alive for w in old)
        new = vworkers.made[len(old):]
        assert sorted(w.tag for w in new) == ["2", "base"]
        assert all(w.alive for w in new)


ROLLOUT = {"stable": "1", "canary": "2", "shadow": "3", "steps": [0.5], "step_s": 1,
           "min_requests": 2}


async def test_a_rollout_starts_afresh_on_each_load_and_stops_cleanly_on_unload(
    autojump_clock, vworkers
):
    cfg = family_config(load_at_start=False, versions=THREE, rollout=ROLLOUT)
    async with trioserve.open_runtime(cfg) as rt:
        before = len(tasks())
        await rt.load_model("m")
        first = rt._families["m"].controller
        assert rt.statistics()["m"]["rollout"]["state"] == "canary"
        # one each in turn, a second apiece: the canary answers two, the step ends
        got = [await y(rt, float(x)) for x in range(1, 5)]
        assert got == [1.0, 200.0, 3.0, 400.0]  # stable, canary, in turn
        await first.wait_shadow_results(2)  # stable's two, copied to the shadow
        assert rt.statistics()["m"]["rollout"]["state"] == "promoted"

        await rt.load_model("m")  # a reload starts the rollout afresh
        await trio.testing.wait_all_tasks_blocked()  # the old copy drains
        second = rt._families["m"].controller
        assert second is not first
        assert first.state is ActorState.STOPPED
        r = rt.statistics()["m"]["rollout"]
        assert (r["state"], r["step"], r["share"]) == ("canary", 0, 0.5)
        assert all(c["ok"] == c["errors"] == c["late"] == 0 for c in r["counts"].values())
        assert r["events"] == {"step": 0, "promoted": 0, "rolled_back": 0, "paused": 0,
                               "resumed": 0, "started": 0}
        # the operator acts on the loaded copy's rollout, not the one replaced
        assert rt.pause_rollout("m")["state"] == "paused"
        assert rt.resume_rollout("m")["state"] == "canary"
        assert first.statistics()["events"]["paused"] == 0
        assert r["shadow"] == {"version": "3", "match": 0, "mismatch": 0, "error": 0,
                               "dropped": 0}

        # mid-step, with the shadow's copies of stable's answers in flight
        async with trio.open_nursery() as callers:
            for x in range(5, 8):  # two to stable, one to the canary: the step goes on
                callers.start_soon(y, rt, float(x))
        counts = rt.statistics()["m"]["rollout"]["counts"]
        assert (counts["1"]["ok"], counts["2"]["ok"]) == (2, 1)
        # stable's two copies are running on the shadow, none counted yet
        assert second._send.statistics().tasks_waiting_receive == 0
        assert sum(second.shadow_results.values()) == 0
        with trio.fail_after(10):
            await rt.unload_model("m")
        assert second.state is ActorState.STOPPED
        assert sum(second.shadow_results.values()) == 0  # withdrawn, not failed
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert "rollout" not in rt.statistics()["m"]  # not loaded, as any model
        for act in (rt.rollout_state, rt.promote, rt.rollback, rt.pause_rollout):
            with pytest.raises(trioserve.UnknownModel, match="'m' is not loaded"):
                act("m")
        assert all(not w.alive for w in vworkers.made)
        await refused_everywhere(rt)
        await trio.testing.wait_all_tasks_blocked()
        assert len(tasks()) == before  # nothing of the copies or the controller left

        await rt.load_model("m")  # loaded again: afresh too
        r = rt.statistics()["m"]["rollout"]
        assert (r["state"], r["step"]) == ("canary", 0)
        assert all(c["ok"] == 0 for c in r["counts"].values())


# ---------------------------------------------------------------- over HTTP
LOAD, UNLOAD = "/v2/repository/models/m/load", "/v2/repository/models/m/unload"


async def call(gw, method, target, body=b""):
    async with open_http(gw.url) as http:
        return await http.request(method, target, body)


async def infer(gw, x: float, version: str | None = None):
    async with open_http(gw.url) as http:
        return await http.infer("m", [v2_input(np.full(1, x, np.float32))], version=version)


async def index(gw):
    res = await call(gw, "POST", "/v2/repository/index")
    assert res.status == 200
    return sorted({(e["name"], e["state"], e["reason"]) for e in res.json()})


async def test_a_rollout_model_over_http_loads_reloads_and_unloads(autojump_clock, vworkers):
    m = family_model(load_at_start=False, versions=THREE, rollout=ROLLOUT)
    async with serving(config(m, echo_model(), server={"model_control": "explicit"})) as gw:
        assert await index(gw) == [("echo", "READY", ""), ("m", "UNAVAILABLE", "not loaded")]
        # every version of a model not loaded answers as the model does
        for target in ("/v2/models/m/versions/2", "/v2/models/m/versions/2/config"):
            res = await call(gw, "GET", target)
            assert res.status == 404
            assert "model 'm' is not loaded" in res.json()["error"]
        assert (await call(gw, "GET", "/v2/models/m/versions/2/ready")).status == 503
        res = await infer(gw, 2.0, "2")
        assert res.status == 404
        assert "model 'm' is not loaded" in res.json()["error"]
        metrics = await call(gw, "GET", "/metrics")
        assert metrics.status == 200
        assert "trioserve_rollout_share" not in metrics.body.decode()
        assert (await call(gw, "GET", "/v2/models/stats")).status == 200

        assert (await call(gw, "POST", LOAD)).status == 200
        assert await index(gw) == [("echo", "READY", ""), ("m", "READY", "")]
        assert (await call(gw, "GET", "/v2/models/m/versions/3/ready")).status == 200
        res = await infer(gw, 2.0, "3")
        assert res.status == 200
        assert res.outputs()["y"].tolist() == [2000.0]
        body = (await call(gw, "GET", "/metrics")).body.decode()
        assert 'trioserve_rollout_share{model="m",version="2"} 0.5' in body

        # the index during a reload: READY, the old copies serving
        vworkers.load_s = 5.0
        async with trio.open_nursery() as ops:
            ops.start_soon(call, gw, "POST", LOAD)
            await trio.testing.wait_all_tasks_blocked()
            assert await index(gw) == [
                ("echo", "READY", ""),
                ("m", "READY", "reloading (the loaded copy serves meanwhile)"),
            ]
            assert (await call(gw, "GET", "/v2/models/m/ready")).status == 200
            assert (await call(gw, "GET", "/v2/models/m/versions/2/ready")).status == 200
        assert await index(gw) == [("echo", "READY", ""), ("m", "READY", "")]

        assert (await call(gw, "POST", UNLOAD)).status == 200
        assert await index(gw) == [("echo", "READY", ""), ("m", "UNAVAILABLE", "unloaded")]
        assert (await call(gw, "GET", "/v2/models/m/versions/1/ready")).status == 503
        assert (await infer(gw, 2.0)).status == 404
        body = (await call(gw, "GET", "/metrics")).body.decode()
        assert "trioserve_rollout_share" not in body
        assert 'trioserve_batches_total{model="m"}' in body  # the model's series stay
        assert all(not w.alive for w in vworkers.made)


tritonclient_http = pytest.importorskip("tritonclient.http")


async def test_tritonclient_loads_and_unloads_a_model_with_versions_of_their_own():
    """NVIDIA's own client (blocking: in a worker thread), against a real server: a
    model whose version 2 has weights of its own, under explicit model control."""
    from tritonclient.utils import InferenceServerException

    m = trioserve.ModelConfig(
        name="m", backend="mlp", load_at_start=False,
        versions={"1": {}, "2": {"options": {"seed": 2}}},
    )
    x = np.random.default_rng(3).standard_normal((1, 256)).astype(np.float32)

    async with serving(config(m, server={"model_control": "explicit"})) as gw:
        host, port = gw.addresses[0]

        def session():
            client = tritonclient_http.InferenceServerClient(url=f"{host}:{port}")
            try:
                before = client.get_model_repository_index()
                ready_before = client.is_model_ready("m", model_version="2")
                client.load_model("m")
                loaded = client.get_model_repository_index()
                ready = client.is_model_ready("m", model_version="2")
                inp = tritonclient_http.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                y1 = client.infer("m", [inp], model_version="1").as_numpy("y")
                y2 = client.infer("m", [inp], model_version="2").as_numpy("y")
                client.load_model("m")  # a reload
                client.unload_model("m")
                after = client.get_model_repository_index()
                try:
                    client.infer("m", [inp], model_version="2")
                except InferenceServerException as exc:
                    refused = str(exc)
                else:
                    refused = ""
                return before, ready_before, loaded, ready, y1, y2, after, refused
            finally:
                client.close()

        before, ready_before, loaded, ready, y1, y2, after, refused = (
            await trio.to_thread.run_sync(session)
        )
        assert {(e["version"], e["state"]) for e in before} == {
            ("1", "UNAVAILABLE"), ("2", "UNAVAILABLE")
        }
        assert ready_before is False
        assert {(e["version"], e["state"]) for e in loaded} == {("1", "READY"), ("2", "READY")}
        assert ready is True
        assert y1.shape == y2.shape == (1, 16)
        assert not np.allclose(y1, y2)  # version 2's weights are its own
        assert {(e["version"], e["state"], e["reason"]) for e in after} == {
            ("1", "UNAVAILABLE", "unloaded"), ("2", "UNAVAILABLE", "unloaded")
        }
        assert "model 'm' is not loaded" in refused
