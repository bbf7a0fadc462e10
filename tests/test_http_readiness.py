"""Readiness probes that say why: ``/v2/health/ready`` and ``/v2/models/{m}/ready``
answer 503 with the models that cannot serve, each with its state, reason and
replicas by health (``Runtime.readiness``); their status codes, and their 200
bodies, are as before (Triton's and KServe's clients read the status alone)."""

from __future__ import annotations

import orjson
import trio
import trio.testing
import trioserve
from http_helpers import config, echo_model, serving
from runtime_helpers import callable_model, item
from test_http_model_control import LOAD, UNLOAD, call, served_config
from test_model_control import workers  # noqa: F401  (fixture)
from trioserve import ModelConfig
from trioserve.actors import Breaker
from trioserve.transport import Gateway

THRESHOLD = Breaker().threshold


async def probe(client, target: str) -> tuple[int, bytes]:
    res = await client.get(target)
    return res.status_code, await res.get_data()


async def test_a_lone_replicas_open_breaker_is_said_by_both_probes(mock_clock):
    m = callable_model("m", lambda items: [{"y": it["x"]} for it in items],
                       execution="thread", max_wait_ms=0)
    async with trioserve.open_runtime(config(m, echo_model())) as rt:
        client = Gateway(rt).app.test_client()
        ready = {t: await probe(client, t) for t in
                 ("/v2/health/ready", "/v2/models/m/ready", "/v2/models/m/versions/1/ready")}
        (replica,) = rt.models["m"].batchers
        for _ in range(THRESHOLD):
            replica._breaker.failure(trio.current_time())
        server = await probe(client, "/v2/health/ready")
        model = await probe(client, "/v2/models/m/ready")
        version = await probe(client, "/v2/models/m/versions/1/ready")
        echo = await probe(client, "/v2/models/echo/ready")
        readiness = rt.readiness("m")
        mock_clock.jump(1.0)  # its cooldown passed: half-open, taking work
        again = {t: await probe(client, t) for t in ready}
        assert float((await rt.infer("m", item(2.0)))["y"][0]) == 2.0
    # ready: the bodies are what they were
    assert ready == {
        "/v2/health/ready": (200, b'{"ready":true}'),
        "/v2/models/m/ready": (200, b'{"name":"m","ready":true}'),
        "/v2/models/m/versions/1/ready": (200, b'{"name":"m","ready":true}'),
    }
    assert again == ready
    why = {"state": "UNAVAILABLE", "reason": "no replica ready", "replicas": {"open": 1}}
    assert readiness == {"ready": False, **why}
    assert server[0] == 503
    assert orjson.loads(server[1]) == {
        "error": "not ready: m: no replica ready (replicas: open 1)",
        "ready": False,
        "models": {"m": why},  # echo is ready: not named
    }
    assert model[0] == 503
    assert orjson.loads(model[1]) == {
        "error": "model 'm' is not ready: no replica ready (replicas: open 1)",
        "name": "m", "ready": False, **why,
    }
    assert version[0] == 503
    assert orjson.loads(version[1]) == {
        "error": "model 'm' is not ready: no replica ready (replicas: open 1)",
        "name": "m", "version": "1", "ready": False, **why,
    }
    assert echo == (200, b'{"name":"echo","ready":true}')


async def test_a_model_not_loaded_loading_or_unloaded_says_so(autojump_clock, workers):  # noqa: F811
    """Explicit model control: a model not loaded is not awaited by the server's
    probe (200, as before), and its own probe says it is not loaded, loading, or
    unloaded."""
    async with serving(served_config()) as gw:
        not_loaded = await call(gw, "GET", "/v2/models/m/ready")
        server = await call(gw, "GET", "/v2/health/ready")
        workers.load_s = 3.0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, gw, "POST", LOAD)
            await trio.sleep(1.0)
            loading = await call(gw, "GET", "/v2/models/m/ready")
            loading_server = await call(gw, "GET", "/v2/health/ready")
        loaded = await call(gw, "GET", "/v2/models/m/ready")
        await call(gw, "POST", UNLOAD)
        unloaded = await call(gw, "GET", "/v2/models/m/ready")
    assert (server.status, server.body) == (200, b'{"ready":true}')  # m not awaited
    assert (loading_server.status, loading_server.body) == (200, b'{"ready":true}')
    assert (loaded.status, loaded.body) == (200, b'{"name":"m","ready":true}')
    for res, state, reason in (
        (not_loaded, "UNAVAILABLE", "not loaded"),
        (loading, "LOADING", "loading"),
        (unloaded, "UNAVAILABLE", "unloaded"),
    ):
        assert res.status == 503
        assert res.json() == {
            "error": f"model 'm' is not ready: {reason}", "name": "m", "ready": False,
            "state": state, "reason": reason, "replicas": {},
        }


def _open_breaker(replica) -> None:
    for _ in range(THRESHOLD):
        replica._breaker.failure(trio.current_time())


async def test_a_rollouts_probes_count_the_versions_asked_for_each_labelled(mock_clock):
    """A model whose versions have replicas of their own (a rollout with a canary):
    ``replicas`` are those ``model_ready`` looks at (the stable's without a version,
    the version's with one) and the other versions' are each labelled by version,
    so a 503 never says "no replica ready" beside a count of ready ones."""
    from test_rollout_runtime import model

    m = model({"stable": "1", "canary": "2", "steps": [0.5], "min_requests": 1000})
    targets = ("/v2/health/ready", "/v2/models/m/ready",
               "/v2/models/m/versions/1/ready", "/v2/models/m/versions/2/ready")
    async with trioserve.open_runtime(config(m)) as rt:
        client = Gateway(rt).app.test_client()
        family = rt._families["m"]
        (stable,) = family.by_version["1"].batchers
        (canary,) = family.by_version["2"].batchers
        _open_breaker(stable)
        stable_down = {t: await probe(client, t) for t in targets}
        in_process = (rt.model_ready("m"), rt.readiness("m"), rt.readiness("m", "2"))
        mock_clock.jump(1.0)  # its cooldown passed: half-open, ready again
        _open_breaker(canary)
        canary_down = {t: await probe(client, t) for t in targets}
        canary_readiness = rt.readiness("m", "2")
    no_stable = {"state": "UNAVAILABLE", "reason": "no replica ready",
                 "replicas": {"open": 1}, "replicas_of": ["1"],
                 "other_versions": {"2": {"ready": 1}, "3": {"ready": 1}}}
    said = ("no replica ready (replicas of version '1': open 1; version '2': ready 1; "
            "version '3': ready 1)")
    assert in_process == (
        False,
        {"ready": False, **no_stable},
        {"ready": True, "state": "READY", "reason": "", "replicas": {"ready": 1},
         "replicas_of": ["2"], "other_versions": {"1": {"open": 1}, "3": {"ready": 1}}},
    )
    # the status codes are as they were: the stable's decides the model's probes
    assert {t: s for t, (s, _) in stable_down.items()} == {
        "/v2/health/ready": 503, "/v2/models/m/ready": 503,
        "/v2/models/m/versions/1/ready": 503, "/v2/models/m/versions/2/ready": 200,
    }
    assert orjson.loads(stable_down["/v2/health/ready"][1]) == {
        "error": f"not ready: m: {said}", "ready": False, "models": {"m": no_stable},
    }
    assert orjson.loads(stable_down["/v2/models/m/ready"][1]) == {
        "error": f"model 'm' is not ready: {said}", "name": "m", "ready": False,
        **no_stable,
    }
    assert orjson.loads(stable_down["/v2/models/m/versions/1/ready"][1]) == {
        "error": f"model 'm' is not ready: {said}", "name": "m", "version": "1",
        "ready": False, **no_stable,
    }
    assert stable_down["/v2/models/m/versions/2/ready"][1] == b'{"name":"m","ready":true}'
    # the canary down: the model serves (200), its version's probe says why
    no_canary = {"state": "UNAVAILABLE", "reason": "no replica of version '2' ready",
                 "replicas": {"open": 1}, "replicas_of": ["2"],
                 "other_versions": {"1": {"half_open": 1}, "3": {"ready": 1}}}
    assert canary_readiness == {"ready": False, **no_canary}
    assert {t: s for t, (s, _) in canary_down.items()} == {
        "/v2/health/ready": 200, "/v2/models/m/ready": 200,
        "/v2/models/m/versions/1/ready": 200, "/v2/models/m/versions/2/ready": 503,
    }
    assert orjson.loads(canary_down["/v2/models/m/versions/2/ready"][1]) == {
        "error": ("model 'm' is not ready: no replica of version '2' ready (replicas of "
                  "version '2': open 1; version '1': half_open 1; version '3': ready 1)"),
        "name": "m", "version": "2", "ready": False, **no_canary,
    }


async def test_versions_sharing_the_models_replicas_are_not_counted_as_others(mock_clock):
    """Versions served by the model's backend share its replicas: the version asked
    for and those sharing its replicas are in ``replicas``, each other version with
    its own, labelled."""
    from test_rollout_runtime import adder

    m = ModelConfig(name="m", backend=adder(1), max_wait_ms=0.0,
                    versions={"1": {}, "2": {"backend": adder(2)}, "3": {}})
    async with trioserve.open_runtime(config(m)) as rt:
        client = Gateway(rt).app.test_client()
        (shared,) = rt._families["m"].by_version["3"].batchers
        _open_breaker(shared)
        latest = rt.readiness("m")  # 3, the latest: the model's backend's replica
        one = await probe(client, "/v2/models/m/versions/1/ready")
        two = rt.readiness("m", "2")
    assert latest == {
        "ready": False, "state": "UNAVAILABLE", "reason": "no replica ready",
        "replicas": {"open": 1}, "replicas_of": ["1", "3"],
        "other_versions": {"2": {"ready": 1}},
    }
    assert one[0] == 503
    assert orjson.loads(one[1])["error"] == (
        "model 'm' is not ready: no replica ready (replicas of versions '1', '3': open 1; "
        "version '2': ready 1)"
    )
    assert two == {
        "ready": True, "state": "READY", "reason": "",
        "replicas": {"ready": 1}, "replicas_of": ["2"],
        "other_versions": {"1": {"open": 1}, "3": {"open": 1}},
    }


def _decided_by(rt) -> str:
    """The version whose replicas the model's unversioned readiness counts (its
    ``replicas_of``: here no version shares another's replicas), the one not among
    its ``other_versions``."""
    readiness = rt.readiness("m")
    (version,) = readiness["replicas_of"]
    assert {version} == set(rt._families["m"].by_version) - set(readiness["other_versions"])
    return version


async def test_after_a_promotion_the_models_probes_decide_on_the_promoted_version(
    mock_clock,
):
    """Once the canary is promoted it takes every unversioned request: the model's
    probes, its state and its unversioned config document follow it, so the
    configured stable's replicas down no longer make the model unready (its
    requests succeed), and the promoted version's down do."""
    from test_rollout_runtime import adder, model, one, version_of

    # the canary runs in a thread: its config document differs from the stable's
    m = model({"stable": "1", "canary": "2", "steps": [0.5], "min_requests": 1000},
              canary=adder(2, execution="thread"))
    targets = ("/v2/health/ready", "/v2/models/m/ready",
               "/v2/models/m/versions/1/ready", "/v2/models/m/versions/2/ready")
    async with trioserve.open_runtime(config(m)) as rt:
        client = Gateway(rt).app.test_client()
        family = rt._families["m"]
        (stable,) = family.by_version["1"].batchers
        (canary,) = family.by_version["2"].batchers
        config_on_trial = rt.triton_config("m")
        _open_breaker(stable)
        on_trial = (await probe(client, "/v2/models/m/ready"))[0]
        rt.promote("m")
        stable_down = {t: await probe(client, t) for t in targets}
        in_process = (rt.model_ready("m"), rt.readiness("m"), rt.model_state("m"),
                      rt.statistics()["m"]["ready"], rt.health()["m"]["ready"])
        answered = [version_of(await rt.infer("m", one(i)), i) for i in range(3)]
        configs = (rt.triton_config("m"), rt.triton_config("m", "1"),
                   rt.triton_config("m", "2"))
        config_doc = await client.get("/v2/models/m/config")
        config_doc = orjson.loads(await config_doc.get_data())
        mock_clock.jump(1.0)  # the stable's cooldown passed: half-open
        _open_breaker(canary)
        canary_down = {t: await probe(client, t) for t in targets}
        down = (rt.model_ready("m"), rt.readiness("m"), rt.model_state("m"))
    # on trial the stable decides (as before); promoted, the canary does
    assert on_trial == 503
    assert answered == ["2", "2", "2"]  # served while the stable's breaker is open
    no_stable = {"1": {"open": 1}, "3": {"ready": 1}}
    assert in_process == (
        True,
        {"ready": True, "state": "READY", "reason": "", "replicas": {"ready": 1},
         "replicas_of": ["2"], "other_versions": no_stable},
        ("READY", ""), True, True,
    )
    assert {t: s for t, (s, _) in stable_down.items()} == {
        "/v2/health/ready": 200, "/v2/models/m/ready": 200,
        "/v2/models/m/versions/1/ready": 503, "/v2/models/m/versions/2/ready": 200,
    }
    assert stable_down["/v2/models/m/ready"][1] == b'{"name":"m","ready":true}'
    assert orjson.loads(stable_down["/v2/models/m/versions/1/ready"][1]) == {
        "error": ("model 'm' is not ready: no replica of version '1' ready (replicas of "
                  "version '1': open 1; version '2': ready 1; version '3': ready 1)"),
        "name": "m", "version": "1", "ready": False, "state": "UNAVAILABLE",
        "reason": "no replica of version '1' ready", "replicas": {"open": 1},
        "replicas_of": ["1"],
        "other_versions": {"2": {"ready": 1}, "3": {"ready": 1}},
    }
    # the unversioned config document is the promoted version's
    assert configs[0] == configs[2] != configs[1]
    assert configs[0]["parameters"]["execution"] == {"string_value": "thread"}
    assert config_on_trial == configs[1]
    assert config_doc == configs[2]
    # the promoted version's replica down: the model is not ready, and says why
    no_canary = {"state": "UNAVAILABLE", "reason": "no replica ready",
                 "replicas": {"open": 1}, "replicas_of": ["2"],
                 "other_versions": {"1": {"half_open": 1}, "3": {"ready": 1}}}
    said = ("no replica ready (replicas of version '2': open 1; version '1': half_open 1; "
            "version '3': ready 1)")
    assert down == (False, {"ready": False, **no_canary}, ("UNAVAILABLE", "no replica ready"))
    assert {t: s for t, (s, _) in canary_down.items()} == {
        "/v2/health/ready": 503, "/v2/models/m/ready": 503,
        "/v2/models/m/versions/1/ready": 200, "/v2/models/m/versions/2/ready": 503,
    }
    assert orjson.loads(canary_down["/v2/health/ready"][1]) == {
        "error": f"not ready: m: {said}", "ready": False, "models": {"m": no_canary},
    }
    assert orjson.loads(canary_down["/v2/models/m/ready"][1]) == {
        "error": f"model 'm' is not ready: {said}", "name": "m", "ready": False,
        **no_canary,
    }


async def test_the_models_probes_follow_each_trial_its_rollback_and_its_promotion(
    mock_clock,
):
    """Which version the model's unversioned probes decide on: the stable while a
    canary is on trial (whatever its share) and after it is rolled back, the
    canary once promoted, and a new trial's stable (the version that took every
    unversioned request) from its start."""
    from test_rollout_runtime import model

    m = model({"stable": "1", "canary": "2", "steps": [0.5], "min_requests": 1000})
    async with trioserve.open_runtime(config(m)) as rt:
        seen = [("trial 1/2", _decided_by(rt))]
        rt.rollback("m", reason="bad")
        seen.append(("rolled back", _decided_by(rt)))
        rt.start_rollout("m", canary="2")
        seen.append(("trial 1/2 again", _decided_by(rt)))
        rt.promote("m")
        seen.append(("promoted 2", _decided_by(rt)))
        rt.start_rollout("m", canary="3")
        seen.append(("trial 2/3", _decided_by(rt)))
        rt.rollback("m", reason="bad")
        seen.append(("rolled back", _decided_by(rt)))
        rt.start_rollout("m", canary="1")
        rt.promote("m")
        seen.append(("promoted 1", _decided_by(rt)))
    assert seen == [
        ("trial 1/2", "1"), ("rolled back", "1"), ("trial 1/2 again", "1"),
        ("promoted 2", "2"), ("trial 2/3", "2"), ("rolled back", "2"), ("promoted 1", "1"),
    ]
