"""Triton's model repository extension with explicit model control, over real HTTP
on a loopback port: load, unload and reload (``POST /v2/repository/models/NAME/load``
and ``/unload``), the index's states, what an unloaded model answers, requests in
flight through an unload and a reload, a failed load, and the control plane's keys.
The model ``m`` runs in the stand-in worker of test_model_control (trio time)."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import trio
import trio.testing
import trioserve
from http_helpers import config, echo_model, serving, v2_input
from runtime_helpers import callable_model
from test_model_control import Worker, hanging, workers  # noqa: F401  (fixtures)
from trioserve.transport import open_http

LOAD, UNLOAD = "/v2/repository/models/m/load", "/v2/repository/models/m/unload"


def served_config(*, load_at_start=False, server=None):
    m = callable_model(
        "m", lambda items: items, execution="process", max_batch_size=2, max_wait_ms=0,
        timeout_ms=None, load_at_start=load_at_start,
    )
    return config(m, echo_model(), server={"model_control": "explicit", **(server or {})})


async def call(gw, method, target, body=b"", key=None):
    headers = [("authorization", f"Bearer {key}")] if key else []
    async with open_http(gw.url) as http:
        return await http.request(method, target, body, headers=headers)


async def infer(gw, x: float):
    async with open_http(gw.url) as http:
        return await http.infer("m", [v2_input(np.full(1, x, np.float32))])


async def index(gw, body=b""):
    res = await call(gw, "POST", "/v2/repository/index", body)
    assert res.status == 200
    return [(e["name"], e["state"], e["reason"]) for e in res.json()]


async def test_load_and_unload_over_http_and_the_index_says_each_state(
    autojump_clock, workers  # noqa: F811
):
    async with serving(served_config()) as gw:
        assert await index(gw) == [("echo", "READY", ""), ("m", "UNAVAILABLE", "not loaded")]
        assert await index(gw, b'{"ready": true}') == [("echo", "READY", "")]
        # not loaded: as a model that is not served, but ready says not ready
        for target in ("/v2/models/m", "/v2/models/m/config"):
            res = await call(gw, "GET", target)
            assert res.status == 404
            assert "model 'm' is not loaded" in res.json()["error"]
        assert (await call(gw, "GET", "/v2/models/m/ready")).status == 503
        assert (await call(gw, "GET", "/v2/health/ready")).status == 200  # m not awaited
        res = await infer(gw, 2.0)
        assert res.status == 404
        assert "model 'm' is not loaded" in res.json()["error"]

        res = await call(gw, "POST", LOAD)
        assert (res.status, res.body) == (200, b"{}")
        assert await index(gw, b'{"ready": true}') == [("echo", "READY", ""), ("m", "READY", "")]
        assert (await call(gw, "GET", "/v2/models/m/ready")).status == 200
        assert (await call(gw, "GET", "/v2/models/m")).status == 200
        res = await infer(gw, 2.0)
        assert res.status == 200
        assert res.outputs()["y"].tolist() == [2.0]

        res = await call(gw, "POST", UNLOAD, b'{"parameters": {"unload_dependents": true}}')
        assert (res.status, res.body) == (200, b"{}")
        assert await index(gw) == [("echo", "READY", ""), ("m", "UNAVAILABLE", "unloaded")]
        assert (await infer(gw, 2.0)).status == 404
        assert (await call(gw, "POST", UNLOAD)).status == 200  # idempotent, as Triton's
        stats = (await call(gw, "GET", "/v2/models/stats")).json()
        (m_stats,) = [s for s in stats["model_stats"] if s["name"] == "m"]
        assert m_stats["inference_count"] == 1  # an unloaded model's series stay
        metrics = (await call(gw, "GET", "/metrics")).body.decode()
        assert 'trioserve_batches_total{model="m"} 1.0' in metrics


async def test_every_request_in_flight_through_a_reload_and_an_unload_is_answered(
    autojump_clock, workers  # noqa: F811
):
    answers: dict = {}

    async def one(gw, x):
        res = await infer(gw, x)
        answers[x] = (res.status, res.outputs()["y"].tolist() if res.status == 200 else None)

    async with serving(served_config(load_at_start=True)) as gw:
        workers.weight = 10.0
        async with trio.open_nursery() as clients:
            for x in range(1, 7):
                clients.start_soon(one, gw, float(x))
            await trio.testing.wait_all_tasks_blocked()
            res = await call(gw, "POST", LOAD)  # a reload
            assert res.status == 200
            for x in range(11, 17):
                clients.start_soon(one, gw, float(x))
            await trio.testing.wait_all_tasks_blocked()
            res = await call(gw, "POST", UNLOAD)
            assert res.status == 200
        assert answers == {
            **{float(x): (200, [float(x)]) for x in range(1, 7)},  # the first copy
            **{float(x): (200, [10.0 * x]) for x in range(11, 17)},  # the second
        }
        assert all(not w.alive for w in workers.made)


async def test_a_failed_load_is_400_and_says_why(autojump_clock, workers):  # noqa: F811
    async with serving(served_config(load_at_start=True)) as gw:
        workers.fail = True
        res = await call(gw, "POST", LOAD)
        assert res.status == 400
        # the model said once: the error's own "model 'm': " is not said again
        assert res.json()["error"] == (
            "failed to load 'm': replica 0 on cpu failed to load: RuntimeError: weights "
            "missing"
        )
        assert (await infer(gw, 3.0)).outputs()["y"].tolist() == [3.0]  # the old copy
        for action in ("load", "unload"):
            res = await call(gw, "POST", f"/v2/repository/models/nope/{action}")
            assert (res.status, res.json()["error"]) == (
                400, f"failed to {action} 'nope': not in the configuration; configured: "
                "echo, m"
            )
        res = await call(gw, "POST", LOAD, orjson.dumps({"parameters": {"file:1/m.pt": ""}}))
        assert res.status == 400
        assert "parameter 'file:1/m.pt' is not supported" in res.json()["error"]


async def test_load_and_unload_need_an_operators_key_when_keys_are_set(
    autojump_clock, workers  # noqa: F811
):
    async with serving(served_config(server={"control_plane_keys": ("ops",)})) as gw:
        for target in (LOAD, UNLOAD):
            assert (await call(gw, "POST", target)).status == 401
        assert (await call(gw, "POST", LOAD, key="ops")).status == 200
        assert (await call(gw, "POST", UNLOAD, key="ops")).status == 200


@pytest.mark.parametrize("action", ["load", "unload"])
async def test_with_model_control_off_load_and_unload_stay_refused(action):
    async with serving(config(echo_model())) as gw:
        res = await call(gw, "POST", f"/v2/repository/models/echo/{action}")
        assert res.status == 400
        assert "model control is off" in res.json()["error"]


async def test_an_autoscaled_models_counters_carry_on_through_a_reload_and_an_unload(
    autojump_clock, workers  # noqa: F811
):
    m = callable_model(
        "m", lambda items: items, execution="process", max_batch_size=2, max_wait_ms=0,
        timeout_ms=None, autoscaling=trioserve.AutoscalingConfig(
            min_replicas=1, max_replicas=3, upscale_delay_s=0, interval_s=0.5,
        ),
    )
    cfg = config(m, echo_model(), server={"model_control": "explicit"})

    async def autoscale_series():
        body = (await call(gw, "GET", "/metrics")).body.decode()
        return [line for line in body.splitlines()
                if line.startswith("trioserve_autoscale_") and 'model="m"' in line]

    async with serving(cfg) as gw:
        async with trio.open_nursery() as clients:
            for x in range(20):
                clients.start_soon(infer, gw, float(x))
        up = 'trioserve_autoscale_decisions_total{direction="up",model="m"} 1.0'
        assert up in await autoscale_series()  # scaled up once under the load
        assert (await call(gw, "POST", LOAD)).status == 200
        assert up in await autoscale_series()  # a counter: not reset by the reload
        assert gw.runtime.statistics()["m"]["autoscaler"]["decisions"]["up"] == 1
        assert (await call(gw, "POST", UNLOAD)).status == 200
        series = await autoscale_series()
        assert up in series  # and still there while unloaded, with 0 replicas
        assert 'trioserve_autoscale_replicas{model="m"} 0.0' in series
        assert gw.runtime.statistics()["m"]["autoscaler"]["replicas"] == 0
        assert (await call(gw, "POST", LOAD)).status == 200
        assert up in await autoscale_series()


async def test_a_load_under_way_when_the_server_drains_is_answered_at_once(
    autojump_clock, workers  # noqa: F811
):
    """The drain waited for the load's answer for its whole grace (a load that
    ends when the runtime closes anyway): now the load is answered 503 as the drain
    begins, the drain ends at once, and the load is cut off with the runtime."""
    answers = []

    async def load(gw):
        answers.append(await call(gw, "POST", LOAD))

    async with serving(served_config()) as gw:
        workers.load_s = 100.0
        async with trio.open_nursery() as clients:
            clients.start_soon(load, gw)
            await trio.testing.wait_all_tasks_blocked()
            assert gw.runtime.model_state("m") == ("LOADING", "loading")
            t0 = trio.current_time()
            await gw.drain(30.0)
            assert trio.current_time() == t0  # no grace spent on the load
        (res,) = answers
        assert res.status == 503
        assert "the server is shutting down: model 'm' was not loaded" in res.json()["error"]
    assert trio.current_time() == t0
    assert [w.alive for w in workers.made] == [False]


async def test_the_banner_names_the_models_not_loaded_apart(autojump_clock, workers):  # noqa: F811
    """The startup banner listed a model not loaded as served: it now names the loaded
    ones as served, the others apart with how to load one, and its curl line asks a
    loaded model; with none loaded it gives no curl line."""
    from trioserve.transport._main import banner

    async with serving(served_config()) as gw:
        text = banner(gw)
        assert f": serving echo on {gw.url}" in text.splitlines()[0]
        load = f"{gw.url}/v2/repository/models/NAME/load"
        assert f"  not loaded: m (load one with POST {load})" in text
        assert "/v2/models/echo/infer" in text.splitlines()[-1]
    only_m = served_config()
    only_m = trioserve.Config(models=only_m.models[:1], tenants=only_m.tenants,
                              server=only_m.server)
    async with serving(only_m) as gw:
        text = banner(gw)
        assert ": serving no model on" in text.splitlines()[0]
        assert "curl" not in text


async def test_a_version_the_model_has_not_gets_one_answer_everywhere_loaded_or_not(
    autojump_clock, workers  # noqa: F811
):
    """Infer answered a version the model has not "not loaded" for a model not
    loaded, where its metadata, config and ready said "has no version": every entry
    point now answers such a version 404 "has no version", naming the model, the
    version asked and the model's versions, whether the model is loaded or not; a
    version it has of a model not loaded stays "not loaded"."""
    from trioserve.transport import open_stream

    m = callable_model(
        "m", lambda items: items, execution="process", max_batch_size=2, max_wait_ms=0,
        timeout_ms=None, versions=("1", "2"),
    )
    no_version = "model 'm' has no version '9'; versions: 1, 2"
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1],
                                     "data": [1.0]}]})

    async def every_entry_point(gw) -> list:
        seen = []
        for method, target in [
            ("POST", "/v2/models/m/versions/9/infer"),
            ("GET", "/v2/models/m/versions/9"),
            ("GET", "/v2/models/m/versions/9/ready"),
            ("GET", "/v2/models/m/versions/9/config"),
            ("GET", "/v2/models/m/versions/9/stats"),
        ]:
            res = await call(gw, method, target, body if method == "POST" else b"")
            seen.append((target, res.status, res.json()["error"]))
        async with open_stream(gw.url) as stream:
            await stream.send("r", "m", {"x": np.full(1, 1.0, np.float32)}, version="9")
            reply = await stream.receive()
            seen.append(("stream", reply.status, reply.error))
        rt = gw.runtime
        for act in (
            lambda: rt.infer("m", {"x": np.full(1, 1.0, np.float32)}, version="9"),
            lambda: rt.infer_batch("m", [{"x": np.full(1, 1.0, np.float32)}], version="9"),
        ):
            with pytest.raises(trioserve.UnknownModel) as caught:
                await act()
            seen.append(("in process", caught.value.status, str(caught.value)))
        with pytest.raises(trioserve.UnknownModel) as caught:
            rt.model_ready("m", "9")
        seen.append(("in process", caught.value.status, str(caught.value)))
        return seen

    cfg = config(m, echo_model(), server={"model_control": "explicit"})
    async with serving(cfg) as gw:
        for loaded in (True, False):
            seen = await every_entry_point(gw)
            assert len(seen) == 9
            assert {(status, error) for _, status, error in seen} == {(404, no_version)}, (
                loaded, seen
            )
            if loaded:
                assert (await call(gw, "POST", UNLOAD)).status == 200
        # a version the model has, of a model not loaded: "not loaded", as ever
        res = await call(gw, "POST", "/v2/models/m/versions/2/infer", body)
        assert res.status == 404
        assert "model 'm' is not loaded" in res.json()["error"]
        with pytest.raises(trioserve.UnknownModel, match="model 'm' is not loaded"):
            await gw.runtime.infer("m", {"x": np.full(1, 1.0, np.float32)}, version="2")


async def test_unload_dependents_must_be_true_or_false_as_tritons(
    autojump_clock, workers  # noqa: F811
):
    """Triton refuses an unload whose ``unload_dependents`` is not a boolean (400,
    nothing unloaded); ours took any value, so ``"false"`` unloaded as ``true``
    does. An unload's other parameters are ignored, as Triton ignores them (ours
    refused ``config`` there as if it were a load's override)."""
    async with serving(served_config(load_at_start=True)) as gw:
        for value in (b'"false"', b"1", b"null", b"[]"):
            body = b'{"parameters": {"unload_dependents": %s}}' % value
            res = await call(gw, "POST", UNLOAD, body)
            assert res.status == 400
            assert res.json()["error"] == (
                "repository unload request: parameter 'unload_dependents' must be true or "
                f"false, got {value.decode()}"
            )
            assert await index(gw, b'{"ready": true}') == [
                ("echo", "READY", ""), ("m", "READY", "")
            ]  # nothing unloaded
        res = await call(gw, "POST", UNLOAD, b'{"parameters": {"config": "{}"}}')
        assert (res.status, res.body) == (200, b"{}")
        assert (await call(gw, "POST", LOAD, b'{"parameters": {"unload_dependents": true}}'
                           )).status == 200  # a load takes it and ignores it, as Triton's
        res = await call(gw, "POST", UNLOAD, b'{"parameters": {"unload_dependents": false}}')
        assert (res.status, res.body) == (200, b"{}")
        assert await index(gw) == [("echo", "READY", ""), ("m", "UNAVAILABLE", "unloaded")]


async def test_loads_and_unloads_from_several_clients_at_once_run_in_the_order_asked(
    autojump_clock, workers  # noqa: F811
):
    """Four operators at once, with requests in flight: load, unload, load, unload,
    in that order. Each unload abandons the load asked just before it, 400 at once:
    the first (a reload, under way) and the second (waiting for its turn); each
    unload is answered 200 once its turn has run, in the order asked; every request
    admitted is answered once; the model ends unloaded, nothing of it left running.
    In memory (quart's test client), so that each call has reached the server when
    the next is made."""
    from trioserve.transport import Gateway

    ops: list = []
    said: list = []
    answers: dict = {}

    async def op(client, name):
        res = await client.post(f"/v2/repository/models/m/{name}")
        ops.append((name, res.status_code, trio.current_time()))
        if res.status_code != 200:
            said.append(orjson.loads(await res.get_data()))

    async def one(client, x):
        body = orjson.dumps({"inputs": [v2_input(np.full(1, x, np.float32))]})
        res = await client.post("/v2/models/m/infer", data=body)
        answers.setdefault(x, []).append(res.status_code)

    async with trioserve.open_runtime(served_config(load_at_start=True)) as rt:
        client = Gateway(rt).app.test_client()
        workers.load_s = 2.0
        t0 = trio.current_time()
        async with trio.open_nursery() as clients:
            for x in range(1, 5):  # two batches on the loaded copy: 2 s
                clients.start_soon(one, client, float(x))
            await trio.testing.wait_all_tasks_blocked()
            for name in ("load", "unload", "load", "unload"):
                clients.start_soon(op, client, name)
                await trio.testing.wait_all_tasks_blocked()  # asked in this order
        # both loads abandoned at once; the unload drains the loaded copy (its two
        # batches: 2 s), then the second unload (the model not loaded)
        assert ops == [("load", 400, t0), ("load", 400, t0),
                       ("unload", 200, t0 + 2.0), ("unload", 200, t0 + 2.0)]
        assert said == [{"error": "failed to load 'm': its load was abandoned: an unload "
                                  "of the model was asked before it ended"}] * 2
        assert answers == {float(x): [200] for x in range(1, 5)}
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert len(workers.made) == 2  # the reload's worker, stopped; none for the second
        assert not any(w.alive for w in workers.made)


async def test_an_unload_over_http_is_bounded_by_unload_timeout_s(
    autojump_clock, hanging  # noqa: F811
):
    """A model that never answers held an unload (and its HTTP call) for ever: after
    ``runtime.unload_timeout_s`` the requests it holds are answered 503, the unload
    200, and the model is unloaded."""
    import attrs
    from trioserve.transport import Gateway

    cfg = attrs.evolve(served_config(load_at_start=True),
                       runtime=trioserve.RuntimeLimits(unload_timeout_s=7.0))
    answers: list = []

    async def one(client, x):
        body = orjson.dumps({"inputs": [v2_input(np.full(1, x, np.float32))]})
        res = await client.post("/v2/models/m/infer", data=body)
        answers.append((res.status_code, (await res.get_json())["error"]))

    async with trioserve.open_runtime(cfg) as rt:
        client = Gateway(rt).app.test_client()
        async with trio.open_nursery() as clients:
            for x in range(1, 4):
                clients.start_soon(one, client, float(x))
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            with trio.fail_after(60):
                res = await client.post(UNLOAD)
            assert (res.status_code, trio.current_time()) == (200, t0 + 7.0)
        assert answers == [(503, "model 'm' was unloaded before this request was answered: "
                            "the requests it held did not finish within "
                            "runtime.unload_timeout_s (7 s)")] * 3
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert not any(w.alive for w in hanging.made)
