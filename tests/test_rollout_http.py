"""A model with a rollout over the wire: v2 HTTP and the WebSocket stream
(docs/rollout.md)."""

from __future__ import annotations

import json

import numpy as np
import orjson
import trio
from http_helpers import _events_until, _raw_client, serving, v2_input
from http_helpers import config as http_config
from test_rollout_runtime import model
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
