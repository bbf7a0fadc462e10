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
