"""Versions with weights of their own (``versions`` as a table): config, routing by
version in process and over HTTP, the cache keyed by the version that answered."""

from __future__ import annotations

import logging

import numpy as np
import orjson
import pytest
import trio
import trioserve
from http_helpers import config as http_config
from http_helpers import echo_model, mlp_model, serving, v2_input
from runtime_helpers import X, Y, config
from trioserve import CallableBackend, ConfigError, ModelConfig, UnknownModel
from trioserve.transport import Gateway, open_http


def _adder(k: float):
    """A backend computing ``y = x + k`` (each version its own ``k``)."""

    def run(items):
        return [{"y": it["x"] + np.float32(k)} for it in items]

    return CallableBackend(run, inputs=[X], outputs=[Y], execution="inline")


def adders(**cfg) -> ModelConfig:
    """Model ``m``: version 1 on the model's backend (+1), 2 and 3 on their own
    (+2, +3); the last (3) is the latest."""
    return ModelConfig(
        name="m", backend=_adder(1), max_wait_ms=0.0,
        versions={"1": {}, "2": {"backend": _adder(2)}, "3": {"backend": _adder(3)}},
        **cfg,
    )


def one(v: float) -> dict[str, np.ndarray]:
    return {"x": np.asarray([v], np.float32)}


async def test_each_version_answers_with_its_own_weights():
    async with trioserve.open_runtime(config(adders())) as rt:
        got = {
            v: float((await rt.infer("m", one(10), version=v))["y"][0])
            for v in ("1", "2", "3")
        }
        latest = float((await rt.infer("m", one(10)))["y"][0])
        batch = await rt.infer_batch("m", [one(1), one(2)], version="2")
        stats = rt.statistics()["m"]
        health = rt.health()["m"]
    assert got == {"1": 11.0, "2": 12.0, "3": 13.0}
    assert latest == 13.0  # the last version, as with a list
    assert [float(r["y"][0]) for r in batch] == [3.0, 4.0]
    assert {v: s["own_weights"] for v, s in stats["versions"].items()} == {
        "1": False, "2": True, "3": True,
    }
    assert all(len(s["replicas"]) == 1 for s in stats["versions"].values())
    # the model's replicas are all its versions': it said 1, the default version's
    assert stats["replica_count"] == 3
    assert [r["versions"] for r in stats["replicas"]] == [["1"], ["2"], ["3"]]
    # and so is its health: it listed one version's replica alone
    assert health == {
        "ready": True, "replicas": {r["name"]: "ready" for r in stats["replicas"]},
    }
    # and so are its replicas counted by health (as trioserve_replicas counts them)
    assert stats["replica_health"]["ready"] == 3
    assert sum(stats["replica_health"].values()) == 3
    assert [r["health"] for r in stats["versions"]["2"]["replicas"]] == ["ready"]
    assert "rollout" not in stats


async def test_the_load_lines_name_the_versions_each_load_serves(caplog):
    """Each group of versions loads replicas of its own: the lines said "model 'm':
    loading 1 replica" three times, not which version each was."""
    caplog.set_level(logging.INFO, logger="trioserve")
    async with trioserve.open_runtime(config(adders(), ModelConfig(name="e", backend="echo"))):
        pass
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("trioserve")]
    loading = [line for line in lines if ": loading " in line or ": ready in " in line]
    said = [line.partition(" (")[0].partition(" in ")[0] for line in loading]
    # a model's versions load at once, so their lines interleave in any order
    assert sorted(said[:6]) == [
        "model 'm', version '1': loading 1 replica",
        "model 'm', version '1': ready",
        "model 'm', version '2': loading 1 replica",
        "model 'm', version '2': ready",
        "model 'm', version '3': loading 1 replica",
        "model 'm', version '3': ready",
    ]
    assert said[6:] == [
        "model 'e': loading 1 replica",  # a model of one backend: as before
        "model 'e': ready",
    ]


async def test_each_replica_is_named_with_the_version_whose_weights_it_serves():
    # a rollout's stable on the model's backend, its canary with weights of its own:
    # their replicas' names told them apart only by their order
    m = adders(replicas=2, rollout={"stable": "1", "canary": "2"})
    async with trioserve.open_runtime(config(m)) as rt:
        stats = rt.statistics()["m"]
        lanes = {v: rt._families["m"].by_version[v].scheduler.name for v in ("1", "2", "3")}
    names = [(r["name"], r["versions"]) for r in stats["replicas"]]
    assert names == [
        ("batcher[m#0@cpu]", ["1"]), ("batcher[m#1@cpu]", ["1"]),
        ("batcher[m/2#0@cpu]", ["2"]), ("batcher[m/2#1@cpu]", ["2"]),
        ("batcher[m/3#0@cpu]", ["3"]), ("batcher[m/3#1@cpu]", ["3"]),
    ]
    assert len({name for name, _ in names}) == 6
    assert [r["name"] for r in stats["versions"]["2"]["replicas"]] == [
        "batcher[m/2#0@cpu]", "batcher[m/2#1@cpu]"]
    assert lanes == {"1": "scheduler[m]", "2": "scheduler[m/2]", "3": "scheduler[m/3]"}


async def test_a_list_of_versions_is_served_as_before():
    m = ModelConfig(name="m", backend=_adder(1), versions=["1", "2"], max_wait_ms=0.0)
    async with trioserve.open_runtime(config(m)) as rt:
        a = await rt.infer("m", one(1), version="1")
        b = await rt.infer("m", one(1))
        stats = rt.statistics()["m"]
    assert float(a["y"][0]) == float(b["y"][0]) == 2.0
    assert "versions" not in stats
    assert "rollout" not in stats
    assert not rt._families


async def test_an_unknown_version_is_refused_naming_the_versions():
    async with trioserve.open_runtime(config(adders())) as rt:
        with pytest.raises(UnknownModel, match="has no version '9'; versions: 1, 2, 3"):
            await rt.infer("m", one(1), version="9")


def test_version_tables_from_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[models.mlp]\nbackend = "mlp"\noptions = { seed = 1 }\n'
        "[models.mlp.versions.1]\n[models.mlp.versions.2]\noptions = { seed = 2 }\n"
    )
    m = trioserve.load_config(path).models[0]
    assert tuple(m.versions) == ("1", "2")
    assert m.versions[-1] == "2"
    assert m.versions.own("2")
    assert not m.versions.own("1")
    assert m.versions.tables["2"].options == {"seed": 2}


@pytest.mark.parametrize(
    ("versions", "message"),
    [
        ({}, "models.m.versions: must not be empty"),
        ({"1": {"seed": 2}}, "models.m.versions.1.seed: unknown key; a version may "
                             "override backend, options"),
        ({"1": 3}, "models.m.versions.1: must be a table of overrides"),
        ({"a/b": {}}, 'models.m.versions."a/b": the name must be usable as one segment'),
        ({"1": {"options": 3}}, "models.m.versions.1.options: must be a table, got 3"),
        ({"1": {"backend": "nope"}}, "models.m.versions.1.backend: 'nope' is neither"),
    ],
)
def test_bad_version_tables_are_refused_naming_the_key(versions, message):
    with pytest.raises(ConfigError) as exc:
        ModelConfig(name="m", backend="echo", versions=versions)
    assert str(exc.value).startswith(message), str(exc.value)


async def test_a_version_whose_backend_does_not_load_is_refused_naming_it():
    m = ModelConfig(name="m", backend="mlp", versions={"1": {}, "2": {"options": {"nope": 1}}})
    with pytest.raises(ConfigError, match=r"^models\.m\.versions\.2\.options"):
        async with trioserve.open_runtime(config(m)):
            pass


async def test_versions_whose_signatures_differ_are_refused_at_start():
    z = trioserve.TensorSpec(name="z", datatype="FP32", shape=(-1,))
    other = CallableBackend(lambda items: items, inputs=[X], outputs=[z], execution="inline")
    m = ModelConfig(name="m", backend=_adder(1), versions={"1": {}, "2": {"backend": other}})
    with pytest.raises(ConfigError) as caught:
        async with trioserve.open_runtime(config(m)):
            pass
    assert str(caught.value) == (
        "models.m.versions.2: its signature (inputs x FP32 [-1]; outputs z FP32 [-1]) "
        "differs from that of the model's backend (inputs x FP32 [-1]; outputs y FP32 [-1]); "
        "every version of a model must take and give the same"
    )


async def test_shutdown_closes_every_versions_replicas():
    async with trioserve.open_runtime(config(adders())) as rt:
        groups = rt._all_served()
    assert len(groups) == 3
    assert all(b.state.value == "stopped" for g in groups for b in g.batchers)


async def test_cached_results_are_keyed_by_the_version_that_computed_them():
    cfg = config(adders())
    cfg = trioserve.Config(models=cfg.models, tenants=cfg.tenants,
                           cache=trioserve.CacheConfig(capacity_bytes=1 << 20))
    async with trioserve.open_runtime(cfg) as rt:
        unversioned = await rt.infer("m", one(5))  # routed to 3, the latest
        v2 = await rt.infer("m", one(5), version="2")
        v3 = await rt.infer("m", one(5), version="3")
        stats = rt.cache_statistics()
    assert float(unversioned["y"][0]) == float(v3["y"][0]) == 8.0
    assert float(v2["y"][0]) == 7.0
    assert stats["hits"] == 1  # version 3's answer, kept under 3, served to "3"


async def test_per_version_weights_over_http():
    m = mlp_model(versions={"1": {}, "2": {"options": {"seed": 2}}})
    x = np.linspace(-1, 1, 256, dtype=np.float32)[None, :]
    body = orjson.dumps({"inputs": [v2_input(x)]})
    async with serving(http_config(m)) as gw, open_http(gw.url) as http:
        r1 = await http.request("POST", "/v2/models/mlp/versions/1/infer", body)
        r2 = await http.request("POST", "/v2/models/mlp/versions/2/infer", body)
        latest = await http.request("POST", "/v2/models/mlp/infer", body)
        meta = await http.get("/v2/models/mlp")
        meta2 = await http.get("/v2/models/mlp/versions/2")
        ready2 = await http.get("/v2/models/mlp/versions/2/ready")
        stats2 = await http.get("/v2/models/mlp/versions/2/stats")
        direct1 = await gw.runtime.infer("mlp", {"x": x[0]}, version="1")
        direct2 = await gw.runtime.infer("mlp", {"x": x[0]}, version="2")
    assert r1.status == r2.status == latest.status == 200
    y1 = r1.json()["outputs"][0]["data"]
    y2 = r2.json()["outputs"][0]["data"]
    assert y1 != y2  # seed 1 and seed 2: other weights
    assert np.allclose(y1, direct1["y"].reshape(-1), atol=1e-6)
    assert np.allclose(y2, direct2["y"].reshape(-1), atol=1e-6)
    assert latest.json()["outputs"][0]["data"] == y2
    assert meta.json()["versions"] == ["1", "2"]
    assert meta2.json()["versions"] == ["2"]
    assert ready2.status == 200
    assert stats2.status == 200
    await trio.lowlevel.checkpoint()


async def test_unversioned_statistics_give_all_versions_together_naming_none():
    """Triton's statistics extension answers a request without a version with the
    statistics of all the model's versions. Here a model's figures are all its
    versions' together (they share its measurements): the unversioned answers
    (``/v2/models/m/stats``, ``m`` in ``/v2/models/stats``) give them once, with
    an empty version (Triton's field for a server without versions), so a client
    adding entries up counts each request once. They named the latest version
    (``3``), as if the figures were its alone. A version asked for is named as
    before; a model of one version names it (its figures are that version's)."""
    paths = ("/v2/models/m/stats", "/v2/models/stats", "/v2/models/m/versions/2/stats",
             "/v2/models/echo/stats")
    async with trioserve.open_runtime(http_config(adders(), echo_model())) as rt:
        client = Gateway(rt).app.test_client()
        for version in ("1", "2", None):  # None: routed to 3, the latest
            await rt.infer("m", one(1), version=version)
        docs = {}
        for path in paths:
            res = await client.get(path)
            assert res.status_code == 200, path
            docs[path] = orjson.loads(await res.get_data())["model_stats"]

    def said(path):
        return [(s["name"], s["version"], s["inference_count"]) for s in docs[path]]

    assert said("/v2/models/m/stats") == [("m", "", 3)]
    assert said("/v2/models/stats") == [("echo", "1", 0), ("m", "", 3)]
    assert said("/v2/models/m/versions/2/stats") == [("m", "2", 3)]
    assert said("/v2/models/echo/stats") == [("echo", "1", 0)]


async def test_a_model_name_that_is_not_a_string_is_unknown_beside_versioned_models():
    async with trioserve.open_runtime(config(adders())) as rt:
        with pytest.raises(UnknownModel, match=r"^unknown model \['m'\]; serving: m$"):
            await rt.infer(["m"], one(1))
        with pytest.raises(UnknownModel, match=r"^unknown model "):
            await rt.infer_batch({"m": 1}, [one(1)])


@pytest.mark.parametrize(("queue", "refused"), [(65_536, False), (65_537, True), (10**12, True)])
def test_the_shadows_queue_is_bounded(queue, refused):
    # a channel of a trillion places bounds nothing: past 65,536 it is refused, naming the key
    def make():
        return ModelConfig(name="m", backend="echo", versions=["1", "3"],
                           rollout={"stable": "1", "shadow": "3", "shadow_queue": queue})

    if not refused:
        assert make().rollout.shadow_queue == queue
        return
    with pytest.raises(ConfigError) as exc:
        make()
    assert str(exc.value) == (
        f"models.m.rollout.shadow_queue: must be an integer <= 65536, got {queue}"
    )
