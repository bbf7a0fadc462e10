"""``server.control_plane_keys``: the control plane (metadata, config, statistics, the
repository, /metrics) answers only an operator's key when keys are set; the health
probes and inference stay as they are. Real HTTP on a loopback port."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import trio
import trioserve
from http_helpers import config, echo_model, serving, v2_input
from trioserve import ConfigError, TenantConfig
from trioserve.transport import open_http, open_stream

TENANTS = (
    TenantConfig(name="A", api_keys=("key-a",)),
    TenantConfig(name="open", default=True),
)
OPS = ("ops-key", "ops-key-2")

#: (method, target, body) of every control-plane endpoint kind, each answering 200
#: to an operator (the repository's load and unload answer 400: model control is off).
CONTROL = [
    ("GET", "/metrics", b""),
    ("GET", "/v2", b""),
    ("GET", "/v2/models/echo", b""),
    ("GET", "/v2/models/echo/versions/1", b""),
    ("GET", "/v2/models/echo/ready", b""),
    ("GET", "/v2/models/echo/config", b""),
    ("GET", "/v2/models/stats", b""),
    ("GET", "/v2/models/echo/stats", b""),
    ("POST", "/v2/repository/index", b""),
    ("HEAD", "/v2", b""),
]
CONTROL_IDS = [f"{m} {t}" for m, t, _ in CONTROL]
BEARER = 'Bearer realm="trioserve"'


def infer_body():
    return orjson.dumps({"inputs": [v2_input(np.ones(3, np.float32))]})


@pytest.fixture
async def guarded():
    cfg = config(echo_model(), tenants=TENANTS, server={"control_plane_keys": OPS})
    async with serving(cfg) as gw:
        yield gw


@pytest.fixture
async def unguarded():
    async with serving(config(echo_model(), tenants=TENANTS)) as gw:
        yield gw


async def call(gw, method, target, body=b"", keys=()):
    async with open_http(gw.url) as http:
        return await http.request(
            method, target, body, headers=[("authorization", f"Bearer {k}") for k in keys]
        )


@pytest.mark.parametrize(("method", "target", "body"), CONTROL, ids=CONTROL_IDS)
async def test_by_default_the_control_plane_answers_anyone(unguarded, method, target, body):
    assert (await call(unguarded, method, target, body)).status == 200
    assert (await call(unguarded, method, target, body, keys=("nope",))).status == 200


@pytest.mark.parametrize(("method", "target", "body"), CONTROL, ids=CONTROL_IDS)
async def test_with_keys_the_control_plane_answers_only_an_operators_key(
    guarded, method, target, body
):
    for key in OPS:
        res = await call(guarded, method, target, body, keys=(key,))
        assert res.status == 200, (key, res.body)
    refusals = [
        ((), "missing API key: send 'Authorization: Bearer <api key>'"),
        (("wrong",), "unknown API key"),
        (("ops-key", "ops-key"), "more than one Authorization header: send one 'Bearer <api key>'"),
        (("wrong", "ops-key"), "more than one Authorization header: send one 'Bearer <api key>'"),
    ]
    for keys, message in refusals:
        res = await call(guarded, method, target, body, keys=keys)
        assert res.status == 401, (keys, res.body)
        assert res.headers["www-authenticate"] == BEARER
        if method != "HEAD":
            assert res.json() == {"error": message}
    async with open_http(guarded.url) as http:
        res = await http.request(method, target, body, headers=[("authorization", "Basic x")])
    assert res.status == 401
    if method != "HEAD":
        assert res.json() == {
            "error": "malformed Authorization header: expected 'Bearer <api key>'"
        }


async def test_a_tenants_key_is_403_and_the_default_tenant_reads_nothing(guarded):
    """A tenant's key is known but not an operator's: 403. The default tenant takes
    keyless inference, not a keyless look at every tenant's counts."""
    res = await call(guarded, "GET", "/metrics", keys=("key-a",))
    assert res.status == 403
    assert res.json() == {"error": "a tenant's API key may not read the control plane: "
                                   "that takes an operator's key (server.control_plane_keys)"}
    res = await call(guarded, "GET", "/v2/models/stats")
    assert res.status == 401


async def test_refusals_name_no_model_or_tenant(guarded):
    """An unknown model, route or method is refused before it is looked up: the 404's
    list of served models, and /metrics' tenants, reach only an operator."""
    for method, target in (
        ("GET", "/v2/models/nope"), ("GET", "/v2/nowhere"), ("OPTIONS", "/v2/models/nope"),
        ("OPTIONS", "/v2/models/echo/infer"), ("DELETE", "/v2"),
    ):
        res = await call(guarded, method, target)
        assert res.status == 401, (method, target, res.body)
        assert b"echo" not in res.body
    res = await call(guarded, "GET", "/v2/models/nope", keys=("ops-key",))
    assert res.status == 404
    assert "echo" in res.json()["error"]
    res = await call(guarded, "GET", "/metrics", keys=("ops-key",))
    assert 'tenant="A"' in res.body.decode()


async def test_a_tenants_key_is_told_what_it_may_not_do(guarded):
    """The 403 said "may not read the control plane" for a load or an unload too:
    a write is named as one."""
    tail = ": that takes an operator's key (server.control_plane_keys)"
    for method, target, doing in (
        ("POST", "/v2/repository/models/echo/load", "load or unload a model"),
        ("POST", "/v2/repository/models/echo/unload", "load or unload a model"),
        ("POST", "/v2/models/echo/rollout/promote", "act on a model's rollout"),
        ("GET", "/v2/models/echo/rollout", "read the control plane"),
        ("POST", "/v2/repository/index", "read the control plane"),
        ("GET", "/v2/models/echo", "read the control plane"),
    ):
        res = await call(guarded, method, target, keys=("key-a",))
        assert res.status == 403, (method, target)
        assert res.json() == {"error": f"a tenant's API key may not {doing}{tail}"}


async def test_the_repositorys_load_and_unload_need_the_key_too(guarded):
    for action in ("load", "unload"):
        target = f"/v2/repository/models/echo/{action}"
        assert (await call(guarded, "POST", target)).status == 401
        res = await call(guarded, "POST", target, keys=("ops-key",))
        assert res.status == 400  # model control is off
        assert "model control is off" in res.json()["error"]


async def test_the_health_probes_stay_open(guarded):
    for target in ("/v2/health/live", "/v2/health/ready"):
        for method in ("GET", "HEAD"):
            assert (await call(guarded, method, target)).status == 200, (method, target)
            res = await call(guarded, method, target, keys=("wrong",))
            assert res.status == 200, (method, target)


async def test_inference_is_the_tenants_as_before(guarded):
    """The data plane authenticates tenants only: an operator's key is no tenant's,
    and the refusal says so (it was "unknown API key", as for a key never issued)."""
    res = await call(guarded, "POST", "/v2/models/echo/infer", infer_body(), keys=("key-a",))
    assert res.status == 200, res.body
    res = await call(guarded, "POST", "/v2/models/echo/infer", infer_body())
    assert res.status == 200  # the default tenant
    res = await call(guarded, "POST", "/v2/models/echo/infer", infer_body(), keys=("ops-key",))
    assert res.status == 401
    assert res.json() == {"error": "an operator's API key (server.control_plane_keys) does "
                                   "not infer: send one of a tenant's api_keys"}
    res = await call(guarded, "POST", "/v2/models/echo/infer", infer_body(), keys=("nokey",))
    assert res.status == 401
    assert res.json() == {"error": "unknown API key"}
    assert dict(guarded.requests) == {("echo", "A", 200): 1, ("echo", "open", 200): 1,
                                      ("echo", "-", 401): 2}
    # the stream's plain-GET answer is the data plane's, as before
    res = await call(guarded, "GET", "/v2/stream")
    assert res.status == 426


async def test_the_stream_takes_tenants_keys_as_before(guarded):
    async with open_stream(guarded.url, api_key="key-a") as stream:
        await stream.send("1", "echo", {"x": np.ones(3, np.float32)})
        reply = await stream.receive()
    assert reply.error is None, reply
    assert guarded.requests[("echo", "A", 200)] == 1


def test_control_plane_keys_are_checked_as_config():
    with pytest.raises(ConfigError, match=r"control_plane_keys: must be a list of non-empty"):
        trioserve.ServerConfig(control_plane_keys=("",))
    with pytest.raises(ConfigError, match=r"server\.control_plane_keys: has duplicates"):
        trioserve.ServerConfig(control_plane_keys=("k", "k"))
    with pytest.raises(ConfigError, match=r"server\.control_plane_keys: must be a list"):
        trioserve.ServerConfig(control_plane_keys="ops-key")
    with pytest.raises(
        ConfigError, match=r"server\.control_plane_keys: a key also belongs to tenant 'A'"
    ):
        config(echo_model(), tenants=TENANTS, server={"control_plane_keys": ("key-a",)})
    assert trioserve.ServerConfig(control_plane_keys=["k"]).control_plane_keys == ("k",)


def test_control_plane_keys_load_from_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[server]\ncontrol_plane_keys = ["ops-key"]\n'
        '[models.echo]\nbackend = "echo"\n'
    )
    assert trioserve.load_config(path).server.control_plane_keys == ("ops-key",)


async def test_tritonclient_reads_the_control_plane_with_the_key(guarded):
    tritonclient_http = pytest.importorskip("tritonclient.http")
    host, port = guarded.addresses[0]
    ops = {"Authorization": "Bearer ops-key"}

    def calls():
        from tritonclient.utils import InferenceServerException

        client = tritonclient_http.InferenceServerClient(url=f"{host}:{port}")
        try:
            try:
                client.get_server_metadata()
            except InferenceServerException as exc:
                refused = exc.status()
            return (
                refused,
                client.is_server_live(),
                client.get_server_metadata(headers=ops),
                client.get_inference_statistics("echo", headers=ops),
                client.get_model_repository_index(headers=ops),
            )
        finally:
            client.close()

    refused, live, meta, stats, index = await trio.to_thread.run_sync(calls)
    assert refused == "401"
    assert live
    assert meta["name"] == "trioserve"
    assert stats["model_stats"][0]["name"] == "echo"
    assert index == [{"name": "echo", "version": "1", "state": "READY", "reason": ""}]
