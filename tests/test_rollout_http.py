"""A model with a rollout over the wire: v2 HTTP and the WebSocket stream
(docs/rollout.md)."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest
import trio
from http_helpers import _events_until, _raw_client, serving, v2_input
from http_helpers import config as http_config
from test_rollout_runtime import model
from trioserve import InvalidInput
from trioserve.transport import open_http


async def test_an_unversioned_v2_answer_names_the_version_that_answered():
    m = model({"stable": "1", "canary": "2", "steps": [0.5], "min_requests": 1000})
    one = orjson.dumps({"inputs": [v2_input(np.asarray([0.0], np.float32))]})
    two = orjson.dumps({"inputs": [v2_input(np.zeros((2, 1), np.float32))]})
    pinned = orjson.dumps({"inputs": [v2_input(np.zeros((2, 1), np.float32))]})
    async with serving(http_config(m)) as gw, open_http(gw.url) as http:
        singles = [(await http.request("POST", "/v2/models/m/infer", one)).json()
                   for _ in range(4)]
        mixed = (await http.request("POST", "/v2/models/m/infer", two)).json()
        named = (await http.request("POST", "/v2/models/m/versions/3/infer", pinned)).json()
        from wsproto.events import TextMessage

        sock, ws = await _raw_client(gw)
        message = {"id": 1, "model": "m",
                   "inputs": [v2_input(np.asarray([0.0], np.float32))]}
        frames = []
        for _ in range(2):
            await sock.send_all(ws.send(TextMessage(data=json.dumps(message))))
            events = await _events_until(sock, ws, TextMessage)
            frames.append(json.loads(events[-1].data))
        await sock.aclose()
    # the stable (+1) and the canary (+2) alternate; each answer names its own
    assert [(s["model_version"], s["outputs"][0]["data"]) for s in singles] == [
        ("1", [1.0]), ("2", [2.0]), ("1", [1.0]), ("2", [2.0]),
    ]
    # a batch whose items two versions answered names neither
    assert mixed["outputs"][0]["data"] == [1.0, 2.0]
    assert "model_version" not in mixed
    assert named["model_version"] == "3"
    assert [(f["model_version"], f["outputs"][0]["data"]) for f in frames] == [
        ("1", [1.0]), ("2", [2.0]),
    ]
    await trio.lowlevel.checkpoint()


async def test_a_models_queue_figures_count_every_versions_requests():
    # stable and canary each have a queue of their own: the model's flows (in
    # statistics and /metrics) count the requests of both
    m = model({"stable": "1", "canary": "2", "steps": [0.5], "min_requests": 1000})
    async with serving(http_config(m)) as gw, open_http(gw.url) as http:
        rt = gw.runtime
        for i in range(6):
            await rt.infer("m", {"x": np.asarray([i], np.float32)})
        await rt.infer("m", {"x": np.asarray([0], np.float32)}, version="3")
        stats = rt.statistics()["m"]
        text = (await http.get("/metrics")).body.decode()
    flow = stats["flows"]["t/realtime"]
    assert (flow["admitted"], flow["dispatched"], flow["queued"]) == (7, 7, 0)
    assert flow["wait"].count == 7
    assert stats["queue_depth"] == 0
    assert stats["admission_limit"] == 3 * 4096  # three queues' limits
    assert {v: s["queue_depth"] for v, s in stats["versions"].items()} == {
        "1": 0, "2": 0, "3": 0,
    }
    lines = text.splitlines()
    assert ('trioserve_flow_requests_total{class="realtime",model="m",outcome="dispatched",'
            'tenant="t"} 7.0') in lines
    assert 'trioserve_flow_wait_seconds_count{class="realtime",model="m",tenant="t"} 7.0' \
        in lines


async def test_a_versions_config_document_is_its_own():
    from test_rollout_runtime import adder

    m = model({"stable": "1"}, canary=adder(2, execution="thread"))
    async with serving(http_config(m)) as gw, open_http(gw.url) as http:
        docs = {v: (await http.get(f"/v2/models/m/versions/{v}/config")).json()
                for v in ("1", "2")}
        unversioned = (await http.get("/v2/models/m/config")).json()
    execution = {v: d["parameters"]["execution"]["string_value"] for v, d in docs.items()}
    assert execution == {"1": "inline", "2": "thread"}  # version 2's own backend
    assert unversioned["parameters"]["execution"]["string_value"] == "inline"


async def test_a_versions_config_document_gives_its_own_platform_and_backend():
    """A version whose own backend is of another kind than the model's (a callable
    beside a torch module): its document names its platform and backend, as it does
    its tensors and replicas; the model's (unversioned) is its default version's.
    (Triton has one configuration a model and answers a version's with it.)"""
    from trioserve import CallableBackend, ModelConfig
    from trioserve._builtin import mlp_backend

    torch_like = mlp_backend()
    plain = CallableBackend(lambda items: items, inputs=torch_like.inputs,
                            outputs=torch_like.outputs, execution="inline")
    m = ModelConfig(name="m", backend="mlp", execution="inline", max_wait_ms=0.0,
                    versions={"1": {}, "2": {"backend": plain}})
    async with serving(http_config(m)) as gw, open_http(gw.url) as http:
        docs = {v: (await http.get(f"/v2/models/m/versions/{v}/config")).json()
                for v in ("1", "2")}
        unversioned = (await http.get("/v2/models/m/config")).json()
        in_process = {v: gw.runtime.triton_config("m", v) for v in ("1", "2")}
    kinds = {v: (d["platform"], d["backend"]) for v, d in docs.items()}
    assert kinds == {"1": ("pytorch", "mlp"), "2": ("python", "CallableBackend")}
    assert in_process == docs
    assert unversioned == docs["2"]  # the latest: where unversioned requests go


# ---------------------------------------------------------------- the operator's
async def test_the_operator_acts_on_a_rollout_over_http():
    from http_helpers import echo_model

    m = model({"stable": "1", "canary": "2", "steps": [0.5], "min_requests": 1000})
    async with serving(http_config(m, echo_model())) as gw, open_http(gw.url) as http:
        async def call(method, target, body=b""):
            res = await http.request(method, target, body)
            return res.status, res.json()

        got = {
            "state": await call("GET", "/v2/models/m/rollout"),
            "pause": await call("POST", "/v2/models/m/rollout/pause"),
            "pause again": await call("POST", "/v2/models/m/rollout/pause"),
            "resume": await call("POST", "/v2/models/m/rollout/resume", b"{}"),
            "bad json": await call("POST", "/v2/models/m/rollout/rollback", b"{"),
            "a list": await call("POST", "/v2/models/m/rollout/rollback", b"[]"),
            "unknown key": await call("POST", "/v2/models/m/rollout/pause", b'{"x": 1}'),
            "bad reason": await call("POST", "/v2/models/m/rollout/rollback",
                                     b'{"reason": 3}'),
            "rollback": await call("POST", "/v2/models/m/rollout/rollback",
                                   b'{"reason": "errors on the dashboard"}'),
            "promote after": await call("POST", "/v2/models/m/rollout/promote"),
            "unknown model": await call("POST", "/v2/models/nope/rollout/promote"),
            "unknown model state": await call("GET", "/v2/models/nope/rollout"),
            "no rollout": await call("POST", "/v2/models/echo/rollout/pause"),
            "no rollout state": await call("GET", "/v2/models/echo/rollout"),
        }
        text = (await http.get("/metrics")).body.decode()
        in_process = gw.runtime.rollout_state("m")
    status = {k: s for k, (s, _) in got.items()}
    assert status == {
        "state": 200, "pause": 200, "pause again": 409, "resume": 200, "bad json": 400,
        "a list": 400, "unknown key": 400, "bad reason": 400, "rollback": 200,
        "promote after": 409, "unknown model": 404, "unknown model state": 404,
        "no rollout": 404, "no rollout state": 404,
    }
    assert got["state"][1]["state"] == "canary"
    assert (got["pause"][1]["state"], got["pause"][1]["paused"]) == ("paused", True)
    assert got["pause again"][1]["error"] == (
        "model 'm': cannot pause its rollout: it is already paused")
    assert got["resume"][1]["state"] == "canary"
    assert got["a list"][1]["error"] == "rollout rollback request: expected a JSON object"
    assert got["unknown key"][1]["error"] == (
        "rollout pause request: unknown key 'x'; a pause takes no parameters")
    assert got["bad reason"][1]["error"] == (
        "rollout rollback request: 'reason' must be a non-empty string")
    rolled = got["rollback"][1]
    assert (rolled["state"], rolled["share"], rolled["reason"]) == (
        "rolled_back", 0.0, "errors on the dashboard")
    assert rolled == in_process  # the same state in process
    assert got["promote after"][1]["error"] == (
        "model 'm': cannot promote its rollout: the canary is already rolled_back (final)")
    assert got["no rollout"][1]["error"] == (
        "model 'echo' has no rollout (no [models.echo.rollout] in its configuration)")
    lines = text.splitlines()
    for event, n in (("paused", 1), ("resumed", 1), ("rolled_back", 1), ("promoted", 0)):
        assert f'trioserve_rollout_events_total{{event="{event}",model="m"}} {n}.0' in lines


async def test_rollout_actions_need_an_operators_key_when_keys_are_set():
    from trioserve import TenantConfig

    m = model({"stable": "1", "canary": "2", "steps": [0.5], "min_requests": 1000})
    tenants = (TenantConfig(name="A", api_keys=("key-a",)),
               TenantConfig(name="open", default=True))
    cfg = http_config(m, tenants=tenants, server={"control_plane_keys": ("ops-key",)})
    async with serving(cfg) as gw, open_http(gw.url) as http:
        async def status(method, target, key=None):
            headers = [("authorization", f"Bearer {key}")] if key else []
            return (await http.request(method, target, b"", headers=headers)).status

        refused = [
            await status(method, target, key)
            for method, target in (("GET", "/v2/models/m/rollout"),
                                   ("POST", "/v2/models/m/rollout/pause"),
                                   ("POST", "/v2/models/m/rollout/rollback"))
            for key in (None, "key-a", "wrong")
        ]
        untouched = gw.runtime.rollout_state("m")["state"]
        allowed = [await status("GET", "/v2/models/m/rollout", "ops-key"),
                   await status("POST", "/v2/models/m/rollout/pause", "ops-key"),
                   await status("POST", "/v2/models/m/rollout/promote", "ops-key")]
        final = gw.runtime.rollout_state("m")
    # no key, or an unknown one: 401; a tenant's key: 403
    assert refused == [401, 403, 401] * 3
    assert untouched == "canary"
    assert allowed == [200, 200, 200]
    assert (final["state"], final["events"]["paused"]) == ("promoted", 1)


async def test_a_rollback_reason_that_is_not_valid_unicode_is_refused():
    # kept as the rollout's reason, it would make every later GET of the state fail
    m = model({"stable": "1", "canary": "2", "steps": [0.5], "min_requests": 1000})
    async with serving(http_config(m)) as gw, open_http(gw.url) as http:
        rt = gw.runtime
        with pytest.raises(InvalidInput, match="reason must be valid Unicode: surrogates"):
            rt.rollback("m", "bad \udcff reason")
        res = await http.request("GET", "/v2/models/m/rollout")
        assert res.status == 200
        assert (res.json()["state"], res.json()["reason"]) == ("canary", None)
        assert rt.rollback("m", "\U0001f600 latency")["reason"] == "\U0001f600 latency"
        res = await http.request("GET", "/v2/models/m/rollout")
        assert (res.status, res.json()["reason"]) == (200, "\U0001f600 latency")


async def test_a_decision_restored_from_the_state_file_is_shown_and_counted(tmp_path):
    m = model({"stable": "1", "canary": "2", "steps": [0.5], "min_requests": 1000})
    cfg = http_config(m, rollout_state_file=str(tmp_path / "rollout.json"))
    async with serving(cfg) as gw, open_http(gw.url) as http:
        body = orjson.dumps({"reason": "p99 up on the dashboards"})
        rolled = await http.request("POST", "/v2/models/m/rollout/rollback", body)
        await gw.runtime._rollout_state.flush()
        before = (await http.get("/metrics")).body.decode().splitlines()
    async with serving(cfg) as gw, open_http(gw.url) as http:
        res = await http.request("GET", "/v2/models/m/rollout")
        after = (await http.get("/metrics")).body.decode().splitlines()
    assert (rolled.status, rolled.json()["restored"]) == (200, None)
    doc = res.json()
    assert res.status == 200
    assert (doc["state"], doc["restored"], doc["reason"]) == (
        "rolled_back", "rolled_back", "p99 up on the dashboards")
    assert doc["state_file"]["path"] == str(tmp_path / "rollout.json")
    assert 'trioserve_rollout_state_writes_total{result="ok"} 1.0' in before
    assert 'trioserve_rollout_state_writes_total{result="error"} 0.0' in before
    # this run wrote nothing: it only read the decision
    assert 'trioserve_rollout_state_writes_total{result="ok"} 0.0' in after
    assert 'trioserve_rollout_share{model="m",version="2"} 0.0' in after
