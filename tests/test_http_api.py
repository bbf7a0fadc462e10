"""The v2 REST endpoints against a real server on a loopback port."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import attrs
import numpy as np
import orjson
import pytest
import trio
import trioserve
from http_helpers import (
    GATE_LIMIT_S,
    Gate,
    X,
    Y,
    config,
    echo_model,
    held_model,
    mlp_model,
    serving,
    settle,
    v2_input,
)
from prometheus_client.parser import text_string_to_metric_families
from trioserve.transport import open_http, open_stream


@pytest.fixture
async def mlp_server():
    async with serving(config(mlp_model(versions=("1", "2")), echo_model())) as gw:
        yield gw


async def test_health_and_server_metadata(mlp_server):
    async with open_http(mlp_server.url) as http:
        live = await http.get("/v2/health/live")
        ready = await http.get("/v2/health/ready")
        meta = await http.get("/v2")
    assert (live.status, live.json()) == (200, {"live": True})
    assert (ready.status, ready.json()) == (200, {"ready": True})
    assert meta.status == 200
    doc = meta.json()
    assert doc["name"] == "trioserve"
    assert doc["version"] == trioserve.__version__
    assert "binary_tensor_data" in doc["extensions"]
    assert "classification" in doc["extensions"]


async def test_model_metadata_reports_a_leading_dynamic_batch_dimension(mlp_server):
    async with open_http(mlp_server.url) as http:
        res = await http.get("/v2/models/mlp")
        by_version = await http.get("/v2/models/mlp/versions/2")
        unknown = await http.get("/v2/models/mlp/versions/3")
        echo = await http.get("/v2/models/echo")
    assert res.status == 200
    doc = res.json()
    assert doc["name"] == "mlp"
    assert doc["versions"] == ["1", "2"]
    assert doc["platform"] == "pytorch"
    assert doc["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}]
    assert doc["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 16]}]
    # one version asked: that version only, as Triton answers
    assert by_version.json() == {**doc, "versions": ["2"]}
    assert unknown.status == 404
    assert echo.json()["inputs"][0]["shape"] == [-1, -1]


async def test_model_ready_and_version_ready(mlp_server):
    async with open_http(mlp_server.url) as http:
        ready = await http.get("/v2/models/mlp/ready")
        v_ready = await http.get("/v2/models/mlp/versions/1/ready")
    assert (ready.status, ready.json()) == (200, {"name": "mlp", "ready": True})
    assert v_ready.status == 200


async def test_repository_index_lists_every_version_with_its_state(mlp_server, monkeypatch):
    """Triton's model repository extension as Triton answers it with model control
    off: the index of what is served; load and unload refused with 400."""
    rt = mlp_server.runtime
    async with open_http(mlp_server.url) as http:
        every = await http.request("POST", "/v2/repository/index")
        monkeypatch.setattr(rt, "model_ready", lambda name: name != "echo")
        while_down = await http.request("POST", "/v2/repository/index", b"{}")
        only_ready = await http.request("POST", "/v2/repository/index", b'{"ready": true}')
        bad = [
            await http.request("POST", "/v2/repository/index", body)
            for body in (b'{"ready": 1}', b"[]", b"{")
        ]
        load = await http.request("POST", "/v2/repository/models/mlp/load")
        unload = await http.request("POST", "/v2/repository/models/mlp/unload", b"{}")
        get = await http.get("/v2/repository/index")
    assert every.status == 200, every.body
    assert every.json() == [
        {"name": "echo", "version": "1", "state": "READY", "reason": ""},
        {"name": "mlp", "version": "1", "state": "READY", "reason": ""},
        {"name": "mlp", "version": "2", "state": "READY", "reason": ""},
    ]
    assert while_down.json()[0] == {
        "name": "echo", "version": "1", "state": "UNAVAILABLE", "reason": "no replica ready"
    }
    assert [(e["name"], e["version"]) for e in only_ready.json()] == [("mlp", "1"), ("mlp", "2")]
    assert [r.status for r in bad] == [400, 400, 400]
    assert bad[0].json() == {"error": "repository index request: 'ready' must be true or false"}
    assert (load.status, unload.status) == (400, 400)
    assert load.json() == {
        "error": "cannot load model 'mlp': model control is off; the models served are "
        "the configuration's, loaded at start"
    }
    assert unload.json()["error"].startswith("cannot unload model 'mlp'")
    assert get.status == 405
    assert get.headers["allow"] == "OPTIONS, POST"


async def test_infer_one_item_with_a_batch_of_one(mlp_server, mlp_input):
    rt = mlp_server.runtime
    want = (await rt.infer("mlp", mlp_input))["y"]
    async with open_http(mlp_server.url) as http:
        res = await http.infer("mlp", {"x": mlp_input[None]}, id="req-7")
    assert res.status == 200, res.body
    doc = res.json()
    assert doc["model_name"] == "mlp"
    assert doc["model_version"] == "2"  # the latest when none is named
    assert doc["id"] == "req-7"
    (out,) = doc["outputs"]
    assert (out["name"], out["datatype"], out["shape"]) == ("y", "FP32", [1, 16])
    np.testing.assert_allclose(out["data"], want, rtol=1e-5, atol=1e-6)


async def test_infer_without_a_batch_dimension_answers_without_one(mlp_server, mlp_input):
    async with open_http(mlp_server.url) as http:
        res = await http.infer("mlp", {"x": mlp_input}, version="1")
    assert res.status == 200, res.body
    doc = res.json()
    assert doc["model_version"] == "1"
    assert doc["outputs"][0]["shape"] == [16]
    assert res.outputs()["y"].shape == (16,)


async def test_a_batch_dimension_is_split_into_items_and_reassembled(mlp_server):
    rt = mlp_server.runtime
    x = np.random.default_rng(3).standard_normal((32, 256)).astype(np.float32)
    want = np.stack([r["y"] for r in await rt.infer_batch("mlp", list(x))])
    items0 = rt.models["mlp"].metrics.items
    async with open_http(mlp_server.url) as http:
        res = await http.infer("mlp", {"x": x})
    assert res.status == 200, res.body
    out = res.outputs()["y"]
    assert out.shape == (32, 16)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    # 32 items went through the batcher, not one tensor of 32.
    assert rt.models["mlp"].metrics.items - items0 == 32


async def test_nested_data_is_accepted(mlp_server, mlp_input):
    body = {"inputs": [{"name": "x", "shape": [2, 256], "datatype": "FP32",
                        "data": [mlp_input.tolist(), mlp_input.tolist()]}]}
    async with open_http(mlp_server.url) as http:
        res = await http.request("POST", "/v2/models/mlp/infer", orjson.dumps(body))
    assert res.status == 200, res.body
    out = res.outputs()["y"]
    np.testing.assert_allclose(out[0], out[1])


async def test_binary_tensor_data_in_and_out(mlp_server, mlp_input):
    x = np.stack([mlp_input, -mlp_input])
    header = orjson.dumps({
        "inputs": [{"name": "x", "shape": [2, 256], "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    })
    async with open_http(mlp_server.url) as http:
        res = await http.request(
            "POST", "/v2/models/mlp/infer", header + x.tobytes(),
            headers=[("Inference-Header-Content-Length", str(len(header)))],
        )
        plain = await http.infer("mlp", {"x": x})
    assert res.status == 200, res.body
    assert res.headers["content-type"] == "application/octet-stream"
    n = int(res.headers["inference-header-content-length"])
    doc = orjson.loads(res.body[:n])
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 2 * 16 * 4}
    np.testing.assert_array_equal(res.outputs()["y"], plain.outputs()["y"])


async def test_echo_keeps_datatypes_and_requested_outputs(mlp_server):
    body = {"inputs": [v2_input([[1, 2, 3]], "a", "INT32"), v2_input([[0.5, 1.5]], "b")],
            "outputs": [{"name": "a"}]}
    async with open_http(mlp_server.url) as http:
        res = await http.request("POST", "/v2/models/echo/infer", orjson.dumps(body))
    assert res.status == 200, res.body
    (out,) = res.json()["outputs"]
    assert out == {"name": "a", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]}


async def test_bytes_tensors_round_trip_through_echo(mlp_server):
    body = {"inputs": [{"name": "s", "shape": [1, 2], "datatype": "BYTES", "data": ["hé", "x"]}]}
    async with open_http(mlp_server.url) as http:
        res = await http.request("POST", "/v2/models/echo/infer", orjson.dumps(body))
    assert res.status == 200, res.body
    assert res.json()["outputs"][0] == {"name": "s", "datatype": "BYTES", "shape": [1, 2],
                                        "data": ["hé", "x"]}


async def test_many_requests_on_one_keep_alive_connection(mlp_server):
    async with open_http(mlp_server.url) as http:
        for i in range(50):
            res = await http.infer("echo", {"x": np.full((1, 3), i, np.float32)})
            assert res.status == 200
            assert res.json()["outputs"][0]["data"] == [i, i, i]
        assert mlp_server.statistics().connections == 1


async def test_concurrent_connections_each_get_their_own_answer(mlp_server):
    results = {}

    async def one(i: int) -> None:
        async with open_http(mlp_server.url) as http:
            for j in range(5):
                res = await http.infer("echo", {"x": np.array([[i, j]], np.float32)})
                results[i, j] = res.json()["outputs"][0]["data"]

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(one, i)
    assert results == {(i, j): [i, j] for i in range(20) for j in range(5)}


async def test_priority_and_timeout_parameters_are_accepted(mlp_server):
    async with open_http(mlp_server.url) as http:
        res = await http.infer("echo", {"x": [[1.0]]},
                               parameters={"priority": "batch", "timeout_ms": 5000})
    assert res.status == 200, res.body


async def test_api_keys_map_to_tenants_counted_in_metrics():
    tenants = (
        trioserve.TenantConfig(name="acme", api_keys=("k-acme",)),
        trioserve.TenantConfig(name="open", default=True),
    )
    async with serving(config(echo_model(), tenants=tenants)) as gw:
        async with open_http(gw.url, api_key="k-acme") as acme, open_http(gw.url) as anon:
            assert (await acme.infer("echo", {"x": [[1.0]]})).status == 200
            assert (await anon.infer("echo", {"x": [[1.0]]})).status == 200
            assert (await anon.infer("echo", {"x": [[1.0]]})).status == 200
        assert gw.requests[("echo", "acme", 200)] == 1
        assert gw.requests[("echo", "open", 200)] == 2


async def test_metrics_expose_counts_latency_quantiles_fill_and_queue_depth():
    gate = Gate()
    async with serving(config(held_model(gate, max_batch_size=1), echo_model())) as gw:
        async with open_http(gw.url) as http, trio.open_nursery() as nursery:
            for _ in range(3):
                assert (await http.infer("echo", {"x": [[1.0]]})).status == 200
            assert (await http.infer("echo", {"y": "bad"})).status == 400

            async def held() -> None:
                async with open_http(gw.url) as h:
                    assert (await h.infer("held", {"x": np.ones((1, 1), np.float32)})).status == 200

            for _ in range(3):
                nursery.start_soon(held)
            await settle()
            res = await http.get("/metrics")
            gate.release()
    assert res.status == 200
    assert res.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(res.body.decode()):
        for s in family.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    assert samples["trioserve_requests_total", (("model", "echo"), ("status", "200"),
                                                ("tenant", "t"))] == 3
    assert samples["trioserve_requests_total", (("model", "echo"), ("status", "400"),
                                                ("tenant", "t"))] == 1
    e2e = ("trioserve_latency_seconds", (("model", "echo"), ("quantile", "0.99"),
                                         ("stage", "end_to_end")))
    assert samples[e2e] > 0
    assert samples["trioserve_latency_seconds_count", (("model", "echo"),
                                                       ("stage", "end_to_end"))] == 3
    for stage in ("queue_wait", "batch_exec"):
        assert ("trioserve_latency_seconds", (("model", "echo"), ("quantile", "0.5"),
                                              ("stage", stage))) in samples
    assert samples["trioserve_batch_fill_ratio", (("model", "echo"),)] > 0
    # One held request runs, two wait in the queue.
    assert samples["trioserve_queue_depth", (("model", "held"),)] == 2
    assert samples["trioserve_requests_in_flight", ()] == 3
    # Every abnormal outcome has its series from the start, at 0 until it happens.
    for model in ("echo", "held"):
        for outcome in (
            "invalid_input", "model_error", "poison", "retried", "straggler",
            "worker_broken", "worker_lost",
        ):
            key = ("trioserve_batcher_outcomes_total", (("model", model), ("outcome", outcome)))
            assert samples[key] == 0


async def test_the_control_plane_in_memory_with_quarts_test_client():
    async with trioserve.open_runtime(config(echo_model())) as rt:
        from trioserve.transport import Gateway

        app = Gateway(rt).app
        client = app.test_client()
        meta = await client.get("/v2/models/echo")
        infer = await client.post("/v2/models/echo/infer",
                                  data=orjson.dumps({"inputs": [v2_input([[2.0]])]}))
        missing = await client.get("/v2/models/nope")
    assert meta.status_code == 200
    assert (await meta.get_json())["name"] == "echo"
    assert infer.status_code == 200
    assert (await infer.get_json())["outputs"][0]["data"] == [2.0]
    assert missing.status_code == 404


async def test_the_client_sends_again_when_the_server_closed_its_idle_connection():
    """A server that closes a kept-alive connection (its idle timeout) is found out
    when nothing comes back: the request goes again, once, on a new connection."""
    import h11
    from trioserve.transport import HttpClient

    connections = 0

    async def one_answer_then_close(stream):
        nonlocal connections
        connections += 1
        h = h11.Connection(h11.SERVER)
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                h.receive_data(await stream.receive_some(65536))
            elif type(event) is h11.EndOfMessage:
                break
        body = b'{"ok":true}'
        await stream.send_all(
            h.send(h11.Response(status_code=200, headers=[("content-length", str(len(body)))]))
            + h.send(h11.Data(data=body)) + h.send(h11.EndOfMessage())
        )
        await stream.aclose()  # as an idle timeout would, later

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, one_answer_then_close, 0)
        port = listeners[0].socket.getsockname()[1]
        client = HttpClient(f"http://127.0.0.1:{port}")
        try:
            for _ in range(3):
                res = await client.get("/v2/health/live")
                assert (res.status, res.json()) == (200, {"ok": True})
                assert type(res.body) is bytes
        finally:
            await client.aclose()
        nursery.cancel_scope.cancel()
    assert connections == 3


async def test_outputs_of_an_error_response_raise_its_error(mlp_server):
    from trioserve.transport import open_http

    async with open_http(mlp_server.url) as http:
        res = await http.infer("nope", {"x": np.zeros((1, 256), np.float32)})
        with pytest.raises(trioserve.UnknownModel, match="HTTP 404: unknown model 'nope'"):
            res.outputs()


async def test_classification_of_integer_outputs_and_of_fewer_classes_than_asked(mlp_server):
    body = {
        "inputs": [v2_input(np.array([[3, 9, 9, -1], [0, 1, 2, 3]], np.int64), datatype="INT64")],
        "outputs": [{"name": "x", "parameters": {"classification": 6}}],
    }
    async with open_http(mlp_server.url) as http:
        res = await http.request("POST", "/v2/models/echo/infer", orjson.dumps(body))
    assert res.status == 200
    # highest first, the lower index first among equals; all 4 when 6 are asked for
    assert res.json()["outputs"] == [{
        "name": "x", "datatype": "BYTES", "shape": [2, 4],
        "data": ["9:1", "9:2", "3:0", "-1:3", "3:3", "2:2", "1:1", "0:0"],
    }]


@pytest.mark.parametrize(("datatype", "data", "ranked"), [
    # a boolean's value as C++'s std::to_string prints it (it was "True:0")
    ("BOOL", [True, False, True], ["1:0", "1:2", "0:1"]),
    # integers compared as they are: as float64 the three were equal (index order)
    ("UINT64", [2**63, 2**63 + 2, 2**63 + 1], ["9223372036854775810:1", "9223372036854775809:2",
                                             "9223372036854775808:0"]),
    ("INT64", [2**62, 2**62 + 1, -(2**63)], ["4611686018427387905:1", "4611686018427387904:0",
                                            "-9223372036854775808:2"]),
])
async def test_classes_of_booleans_and_of_large_integers(mlp_server, datatype, data, ranked):
    """Each ranked value reads back as the number it is, in the order of the values."""
    body = {
        "inputs": [{"name": "x", "shape": [1, 3], "datatype": datatype, "data": data}],
        "outputs": [{"name": "x", "parameters": {"classification": 3}}],
    }
    async with open_http(mlp_server.url) as http:
        res = await http.request("POST", "/v2/models/echo/infer", orjson.dumps(body))
    assert res.status == 200
    assert res.json()["outputs"] == [
        {"name": "x", "datatype": "BYTES", "shape": [1, 3], "data": ranked}
    ]


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, 70_000])
async def test_a_bad_classification_count_is_400(mlp_server, bad):
    body = {
        "inputs": [v2_input(np.zeros((1, 256), np.float32))],
        "outputs": [{"name": "y", "parameters": {"classification": bad}}],
    }
    async with open_http(mlp_server.url) as http:
        res = await http.request("POST", "/v2/models/mlp/infer", orjson.dumps(body))
    assert res.status == 400
    assert res.json()["error"] == (
        f"output 'y': parameters.classification must be a count of classes, 1 to 65536, "
        f"got {orjson.dumps(bad).decode()}"  # as JSON writes it: "3", true
    )


async def test_ambiguous_output_and_input_requests_are_400_on_a_kept_connection(mlp_server):
    """As Triton: an output named twice, a binary_data that is not a boolean, an input
    sent both as data and as binary data. Each was answered 200 (twice the output, the
    parameter read as false, the binary data taken); now each is a 400 and the
    connection serves the next request."""
    x = np.arange(256, dtype=np.float32)[None]
    head = orjson.dumps({"inputs": [{**v2_input(x), "parameters": {"binary_data_size": 1024}}]})
    bad = [
        ({"inputs": [v2_input(x)], "outputs": [{"name": "y"}, {"name": "y"}]}, None,
         "model 'mlp': output 'y' requested twice"),
        ({"inputs": [v2_input(x)], "outputs": [{"name": "y", "parameters": {"binary_data": 1}}]},
         None, "output 'y': parameters.binary_data must be true or false, got 1"),
        ({"inputs": [v2_input(x)], "parameters": {"binary_data_output": "yes"}}, None,
         'parameters.binary_data_output must be true or false, got "yes"'),
        (head + x.tobytes(), len(head),
         "input 'x': both 'data' and parameters.binary_data_size are given; "
         "send the tensor one way"),
    ]
    async with open_http(mlp_server.url) as http:
        for body, hlen, error in bad:
            headers = [] if hlen is None else [("Inference-Header-Content-Length", str(hlen))]
            raw = body if hlen is not None else orjson.dumps(body)
            res = await http.request("POST", "/v2/models/mlp/infer", raw, headers)
            assert (res.status, res.json()) == (400, {"error": error})
        res = await http.request("POST", "/v2/models/mlp/infer",
                                 orjson.dumps({"inputs": [v2_input(x)]}))
        assert res.status == 200


async def test_strings_have_no_classes_to_rank(mlp_server):
    body = {
        "inputs": [{"name": "s", "shape": [1, 2], "datatype": "BYTES", "data": ["a", "b"]}],
        "outputs": [{"name": "s", "parameters": {"classification": 1}}],
    }
    async with open_http(mlp_server.url) as http:
        res = await http.request("POST", "/v2/models/echo/infer", orjson.dumps(body))
    assert res.status == 500
    assert res.json()["error"] == (
        "model 'echo': output 's' holds Python objects: it has no classes to rank "
        "(parameters.classification)"
    )


async def test_an_open_model_answers_the_datatype_it_was_given(mlp_server):
    """echo declares an FP32 output for its default input, but answers what it gets:
    its INT64 answer is not converted to the declaration."""
    body = {"inputs": [v2_input(np.array([[3, 2**40]], np.int64), datatype="INT64")]}
    async with open_http(mlp_server.url) as http:
        res = await http.request("POST", "/v2/models/echo/infer", orjson.dumps(body))
    assert res.json()["outputs"] == [
        {"name": "x", "datatype": "INT64", "shape": [1, 2], "data": [3, 2**40]}
    ]


async def test_summary_counts_and_sums_are_exact_and_agree_with_the_statistics():
    """``/metrics``' latency summaries take their ``_count`` and ``_sum`` from the exact
    totals, as ``.../stats`` does: they were read from the hdrhistogram (a sum off by
    its precision, a value past its range not counted), so the two
    endpoints disagreed about the same requests."""
    async with trioserve.open_runtime(config(echo_model())) as rt:
        from prometheus_client import generate_latest
        from trioserve.transport import Gateway

        gw = Gateway(rt)
        client = gw.app.test_client()
        infer = await client.post("/v2/models/echo/infer",
                                  data=orjson.dumps({"inputs": [v2_input([[2.0]])]}))
        assert infer.status_code == 200
        m = rt.models["echo"].metrics
        for s in (0.552838, 0.249853, 10_000.0):  # the last one past the histogram
            m.end_to_end.record(s)
        want_count, want_us = m.end_to_end.totals()
        stats = orjson.loads(await (await client.get("/v2/models/echo/stats")).get_data())
        text = generate_latest(gw.registry).decode()
    samples = {
        (s.name, s.labels.get("stage")): s.value
        for f in text_string_to_metric_families(text) for s in f.samples
        if s.labels.get("model") == "echo"
    }
    assert want_count == 4
    assert samples["trioserve_latency_seconds_count", "end_to_end"] == want_count
    assert samples["trioserve_latency_seconds_sum", "end_to_end"] == want_us / 1e6
    success = stats["model_stats"][0]["inference_stats"]["success"]
    assert (success["count"], success["ns"]) == (want_count, want_us * 1000)


#: A tenant name whose label value must be escaped (a quote, a backslash, a newline).
ODD_TENANT = 'we"ird\\ten\nant'


def check_exposition(text: str) -> dict[tuple[str, tuple], float]:
    """Check a Prometheus text exposition as a scraper reads it (prometheus_client's
    parser) and return its samples by (name, sorted labels): every family has HELP
    and TYPE, no sample is repeated, counters' samples end in ``_total``, each
    summary's or histogram's label set has its ``_count`` and ``_sum``, a summary's
    quantiles are NaN exactly when it observed nothing, and a histogram's buckets
    rise to ``+Inf``, which equals its ``_count``."""
    lines = text.splitlines()
    helps = [line.split()[2] for line in lines if line.startswith("# HELP ")]
    types = dict(line.split()[2:4] for line in lines if line.startswith("# TYPE "))
    assert len(set(helps)) == len(helps), "a HELP given twice"
    assert len(types) == len([line for line in lines if line.startswith("# TYPE ")])
    assert set(helps) == set(types), f"HELP and TYPE differ: {set(helps) ^ set(types)}"
    samples: dict[tuple[str, tuple], float] = {}
    families = list(text_string_to_metric_families(text))
    assert len({f.name for f in families}) == len(families), "a family given twice"
    for family in families:
        assert family.documentation, f"{family.name} has no HELP"
        assert family.type in ("counter", "gauge", "summary", "histogram"), family
        exposed = family.name + "_total" if family.type == "counter" else family.name
        assert types.get(exposed) == family.type, f"{family.name}: TYPE {types.get(exposed)}"
        # per label set (quantile and le aside): suffix -> values
        parts: dict[tuple, dict[str, list[tuple[str | None, float]]]] = {}
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = s.value
            assert s.value == s.value or "quantile" in s.labels, f"{key} is NaN"
            if family.type == "counter":
                assert s.name == family.name + "_total", f"counter sample {s.name}"
                assert s.value >= 0
            rest = tuple(sorted(
                (k, v) for k, v in s.labels.items() if k not in ("quantile", "le")
            ))
            bound = s.labels.get("quantile", s.labels.get("le"))
            suffix = s.name[len(family.name):]
            parts.setdefault(rest, {}).setdefault(suffix, []).append((bound, s.value))
        if family.type not in ("summary", "histogram"):
            continue
        for rest, got in parts.items():
            where = f"{family.name}{rest}"
            assert len(got.get("_count", [])) == 1, f"{where}: no _count"
            assert len(got.get("_sum", [])) == 1, f"{where}: no _sum"
            count, total = got["_count"][0][1], got["_sum"][0][1]
            assert count >= 0, where
            assert total >= 0, where
            if family.type == "summary":
                quantiles = got.get("", [])
                assert quantiles, f"{where}: no quantiles"
                for q, v in quantiles:
                    assert 0 <= float(q) <= 1, where
                    assert (v != v) == (count == 0), f"{where}: quantile {q} = {v}"
            else:
                bs = sorted((float(le), v) for le, v in got.get("_bucket", []))
                assert bs, f"{where}: no buckets"
                assert bs[-1][0] == float("inf"), f"{where}: no +Inf bucket"
                assert all(a[1] <= b[1] for a, b in itertools.pairwise(bs)), where
                assert bs[-1][1] == count, f"{where}: +Inf bucket is not _count"
    return samples


def documented_series() -> set[str]:
    """Every ``trioserve_*`` series name docs/*.md mention, with ``{a,b}`` expanded
    (``trioserve_cache_{hits,misses}_total``); a brace without a comma is a label
    (``trioserve_cache_expirations_total{model}``)."""
    docs = Path(__file__).resolve().parent.parent / "docs"
    text = "\n".join(p.read_text() for p in sorted(docs.glob("*.md")))
    names = set()
    for token in re.findall(r"trioserve_[a-z0-9_{},]+", text):
        head, _, rest = token.partition("{")
        alternatives, _, tail = rest.partition("}")
        if "," not in alternatives:
            names.add(head)
            continue
        names.update(head + a + tail for a in alternatives.split(","))
    return names


async def test_the_metrics_exposition_is_valid_after_traffic_through_every_feature():
    """``/metrics`` read back by prometheus_client's parser after answers of every
    kind (ok, 400, model error, edge cache hit and miss, the stream, 429, 503, an
    Idempotency-Key and its replay) from a tenant whose name needs escaping."""
    gate = Gate()
    tenants = (
        trioserve.TenantConfig(name="t", default=True),
        trioserve.TenantConfig(name=ODD_TENANT, api_keys=("k-odd",)),
        trioserve.TenantConfig(name="metered", api_keys=("k-m",), credit_rate=1.0,
                               credit_burst=1.0),
    )

    def poison(items):
        if any(float(it["x"][0]) < 0 for it in items):
            raise ValueError("negative input")
        return [{"y": it["x"]} for it in items]

    cfg = attrs.evolve(
        config(
            held_model(gate, max_batch_size=1, cache=False),
            echo_model(),
            attrs.evolve(echo_model(), name="idle"),
            trioserve.ModelConfig(
                name="poison", max_wait_ms=0.0, slo_ms=100.0,
                backend=trioserve.CallableBackend(
                    poison, inputs=[X], outputs=[Y], execution="inline"),
            ),
            tenants=tenants, queue_bound=1,
        ),
        cache=trioserve.CacheConfig(capacity_bytes=1 << 20),
    )
    one = {"x": np.ones((1, 1), np.float32)}
    async with serving(cfg) as gw:
        async with open_http(gw.url, api_key="k-odd") as odd, open_http(gw.url) as anon:
            assert (await odd.infer("echo", {"x": [[1.0]]})).status == 200  # a miss
            assert (await odd.infer("echo", {"x": [[1.0]]})).status == 200  # a hit
            assert (await odd.infer("echo", {"y": "bad"})).status == 400
            bad = await anon.infer("poison", {"x": -one["x"]})
            assert bad.status == 500, bad.body
            assert (await anon.infer("poison", one)).status == 200
            raw = orjson.dumps({"inputs": [v2_input([[3.0]])]})
            keyed = [("idempotency-key", "k1")]
            for _ in range(2):  # the first run, then its replay
                res = await odd.request("POST", "/v2/models/echo/infer", raw, headers=keyed)
                assert res.status == 200
        async with open_http(gw.url, api_key="k-m") as metered:
            assert (await metered.infer("echo", {"x": [[5.0]]})).status == 200
            assert (await metered.infer("echo", {"x": [[6.0]]})).status == 429
        async with open_stream(gw.url, api_key="k-odd") as stream:
            await stream.send("s1", "echo", {"x": np.ones((1, 2), np.float32)})
            await stream.send("s2", "poison", {"x": -np.ones((1, 2), np.float32)})
            replies = {r.id: r for r in [await stream.receive(), await stream.receive()]}
        assert replies["s1"].error is None
        assert replies["s2"].status == 500
        async with trio.open_nursery() as nursery:
            statuses = []

            async def held() -> None:
                async with open_http(gw.url) as h:
                    statuses.append((await h.infer("held", one)).status)

            nursery.start_soon(held)  # runs, held by the gate
            await settle()
            nursery.start_soon(held)  # waits in the queue (bound 1)
            await settle()
            async with open_http(gw.url) as http:
                assert (await http.infer("held", one)).status == 503
                scrape = await http.get("/metrics")
            gate.release()
        assert sorted(statuses) == [200, 200]
        async with open_http(gw.url) as http:
            final = await http.get("/metrics")
    for res in (scrape, final):
        assert res.status == 200
        samples = check_exposition(res.body.decode())
    # every series a scraper sees is described in docs/ (gateway.md's table, cache.md)
    exposed = {
        f.name + "_total" if f.type == "counter" else f.name
        for f in text_string_to_metric_families(final.body.decode())
    }
    assert len(exposed) == 53  # 8 of them the Idempotency-Key store's
    assert exposed - documented_series() == set()
    requests = {
        (dict(labels)["model"], dict(labels)["tenant"], dict(labels)["status"]): v
        for (name, labels), v in samples.items() if name == "trioserve_requests_total"
    }
    assert requests[("echo", ODD_TENANT, "200")] == 5  # miss, hit, key, replay, stream
    assert requests[("echo", ODD_TENANT, "400")] == 1
    assert requests[("poison", ODD_TENANT, "500")] == 1  # over the stream
    assert requests[("poison", "t", "500")] == 1
    assert requests[("echo", "metered", "429")] == 1
    assert requests[("held", "t", "503")] == 1
    assert requests[("held", "t", "200")] == 2
    assert samples["trioserve_cache_hits_total", ()] >= 1
    assert samples["trioserve_idempotency_replays_total", ()] == 1
    assert samples["trioserve_idempotency_keys", ()] == 1
    # nothing observed: count 0 and NaN quantiles (they were 0.0, a latency of 0 s)
    idle = (("model", "idle"), ("stage", "end_to_end"))
    assert samples["trioserve_latency_seconds_count", idle] == 0
    p99 = samples["trioserve_latency_seconds", (*idle[:1], ("quantile", "0.99"), idle[1])]
    assert math.isnan(p99)


@pytest.mark.parametrize("path", [
    "/v2/models/stats", "/v2/models/held/stats", "/v2/models/held/versions/1/stats",
])
async def test_statistics_count_requests_items_and_batches_as_triton_does(path):
    """Triton's statistics extension: ``inference_stats`` count requests (``queue``
    and ``compute_infer`` counted items: 6 here), ``inference_count`` items,
    ``execution_count`` batches, and ``fail`` requests that failed inside the server
    (it counted every 4xx too). Request A ([2, 1]) runs alone, held; B ([3, 1]) and
    C ([1, 1]) queue meanwhile and then run as one batch; D expires queued (504);
    E has a wrong input (400)."""
    gate = Gate()
    async with serving(config(held_model(gate, max_batch_size=8))) as gw:
        served = gw.runtime.models["held"]
        statuses: dict[str, int] = {}

        async def send(name: str, rows: int, **kw) -> None:
            async with open_http(gw.url) as h:
                res = await h.infer("held", {"x": np.ones((rows, 1), np.float32)}, **kw)
                statuses[name] = res.status

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "A", 2)
            await trio.to_thread.run_sync(gate.holding.wait, GATE_LIMIT_S)
            nursery.start_soon(send, "B", 3)
            nursery.start_soon(send, "C", 1)
            await settle()
            assert sum(q.queue_depth() for q in served.schedulers) == 4
            await send("D", 1, parameters={"timeout_ms": 5})
            async with open_http(gw.url) as h:
                statuses["E"] = (await h.infer("held", {"z": [[1.0]]})).status
            gate.release()
        async with open_http(gw.url) as h:
            res = await h.get(path)
        batch_us = served.metrics.batch_exec.totals()[1]
    assert statuses == {"A": 200, "B": 200, "C": 200, "D": 504, "E": 400}
    assert res.status == 200, res.body
    (stats,) = res.json()["model_stats"]
    assert stats["name"] == "held"
    assert stats["inference_count"] == 6
    assert stats["execution_count"] == 2
    s = stats["inference_stats"]
    assert s["success"]["count"] == 3
    assert s["queue"]["count"] == 3
    assert s["compute_infer"]["count"] == 3
    assert (s["fail"]["count"], s["fail"]["ns"]) == (1, 0)  # D; E is the client's error
    # B and C waited while A ran: their waits are most of the queue time.
    assert s["queue"]["ns"] > 0
    # A with the first batch's time, B and C each with the whole second one's (shorter:
    # the gate was open by then).
    assert batch_us * 1000 < s["compute_infer"]["ns"] < 1.5 * batch_us * 1000
    assert s["compute_input"] == s["compute_output"] == {"count": 0, "ns": 0}
