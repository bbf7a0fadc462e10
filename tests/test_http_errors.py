"""Every error status the gateway answers, with its message; bad input never crashes
a task or loses other requests."""

from __future__ import annotations

import json
import math
import re
import tracemalloc
from pathlib import Path

import numpy as np
import orjson
import pytest
import trio
import trioserve
from http_helpers import (
    Gate,
    _events_until,
    _infer_text,
    _raw_client,
    config,
    echo_model,
    held_model,
    mlp_model,
    serving,
    settle,
    v2_input,
)
from hypothesis import given
from hypothesis import strategies as st
from trioserve import QuotaExceeded
from trioserve.transport import _answers, _stream_answer, open_http, open_stream
from trioserve.transport._answers import error_answer
from trioserve.transport._v2 import error_body, error_frame

ONE = {"inputs": [v2_input(np.zeros((1, 256), np.float32))]}


@pytest.fixture
async def server():
    cfg = config(mlp_model(), echo_model(), server={"max_body_bytes": 64 * 1024})
    async with serving(cfg) as gw:
        yield gw


async def post(gw, path, body, headers=()):
    async with open_http(gw.url) as http:
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        return await http.request("POST", path, raw, headers=headers)


def error_of(res) -> str:
    doc = res.json()
    assert set(doc) == {"error"}
    return doc["error"]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "malformed JSON body"),
        # bytes that are not UTF-8 are named, with their place: orjson said "str is not
        # valid UTF-8: surrogates not allowed: line 1 column 1 (char 0)", whatever the
        # bytes and wherever they stood
        (b'{"id": "caf\xe9", "inputs": []}', 400,
         "malformed JSON body: not UTF-8 text (byte 0xe9 at offset 11); JSON is UTF-8"),
        (b"[1, 2]", 400, "must be a JSON object"),
        ({"inputs": []}, 400, "'inputs' must be a non-empty list of tensors, got an empty list"),
        ({"inputs": {"x": [1.0]}}, 400, "non-empty list of tensors, got a JSON object"),
        ({"inputs": None}, 400, "non-empty list of tensors, got null"),
        ({"input": [v2_input([1.0])], "id": "r"}, 400,
         "the request has no 'inputs' (its keys: 'input', 'id'); did you mean 'inputs' for "
         "'input'?"),
        ({"id": "r"}, 400, "the request has no 'inputs' (its keys: 'id')"),
        ({}, 400, "the request has no 'inputs' (its keys: none)"),
        ({"inputs": [{"name": "z", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
         400, "unknown input 'z'; expected x"),
        ({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "INT32",
                      "data": [0] * 256}]},
         400, "expected datatype FP32, got INT32"),
        ({"inputs": [{"name": "x", "shape": [1, 255], "datatype": "FP32",
                      "data": [0.0] * 255}]},
         400, "expected shape [256] or [N, 256]"),
        ({"inputs": [{"name": "x", "shape": [1, 1, 256], "datatype": "FP32",
                      "data": [0.0] * 256}]},
         400, "expected shape [256] or [N, 256]"),
        ({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                      "data": [0.0] * 255}]},
         400, "shape [1, 256] holds 256 values, 'data' has 255"),
        ({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                      "data": ["a"] * 256}]},
         400, "expected FP32 values, got strings"),
        ({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                      "data": [0.5] * 255 + [True]}]},
         400, "expected FP32 values, got a boolean in 'data'"),
        # a null or an object among the values is named, with its place: it was
        # "got mixed values", also for data that is all null
        ({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                      "data": [None] * 256}]},
         400, "expected FP32 values, got null (element 0) in 'data'"),
        ({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                      "data": [0.5] * 3 + [{"a": 1}] + [0.5] * 252}]},
         400, "expected FP32 values, got {\"a\": 1} (element 3) in 'data'"),
        ({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32"}]},
         400, "no 'data'"),
        ({"inputs": [{"name": "x", "shape": [0, 256], "datatype": "FP32", "data": []}]},
         400, "the batch dimension is 0"),
        ({**ONE, "outputs": [{"name": "nope"}]}, 400, "unknown output 'nope'; expected y"),
        ({**ONE, "parameters": {"timeout_ms": -1}}, 400, "parameters.timeout_ms must be"),
        ({**ONE, "parameters": {"priority": [1]}}, 400, "parameters.priority must be"),
    ],
)
async def test_invalid_requests_are_400_with_a_precise_message(server, body, status, message):
    res = await post(server, "/v2/models/mlp/infer", body)
    assert res.status == status
    assert message in error_of(res)


async def test_integer_data_out_of_range_is_400(server):
    body = {"inputs": [{"name": "a", "shape": [1, 1], "datatype": "INT8", "data": [300]}]}
    res = await post(server, "/v2/models/echo/infer", body)
    assert res.status == 400
    assert "out of range for INT8" in error_of(res)


@pytest.mark.parametrize(("datatype", "value"), [("FP32", 1e300), ("FP16", 70000.0)])
async def test_float_data_that_overflows_its_datatype_is_400(server, datatype, value):
    body = {"inputs": [{"name": "a", "shape": [1, 2], "datatype": datatype,
                        "data": [1.0, value]}]}
    res = await post(server, "/v2/models/echo/infer", body)
    assert res.status == 400
    assert f"out of range for {datatype}" in error_of(res)
    # a value at the edge of the range still goes through
    body["inputs"][0]["data"] = [1.0, 3.0e38 if datatype == "FP32" else 65504.0]
    res = await post(server, "/v2/models/echo/infer", body)
    assert res.status == 200


@pytest.mark.parametrize(
    ("poison", "message"),
    [
        (None, "got null (element 4552) in 'data'"),  # 17 * 256 + 200
        (False, "got a boolean"),
        ("1", "got strings"),
        (1e300, "out of range for FP32"),
        ([1.0, 2.0], "shape [24, 256] holds 6144 values, 'data' has 6145"),
    ],
)
async def test_large_bodies_get_the_same_refusals(server, poison, message):
    """Bodies of 16 KiB and more are decoded another way first; a bad value anywhere
    in them still gets its 400, and a good one of that size goes through."""
    rows = np.zeros((24, 256), np.float32).tolist()
    body = {"inputs": [{"name": "x", "shape": [24, 256], "datatype": "FP32", "data": rows}]}
    assert len(orjson.dumps(body)) >= 16 * 1024
    res = await post(server, "/v2/models/mlp/infer", body)
    assert res.status == 200
    assert res.json()["outputs"][0]["shape"] == [24, 16]
    rows[17][200] = poison
    res = await post(server, "/v2/models/mlp/infer", body)
    assert res.status == 400
    assert message in error_of(res)


@pytest.mark.parametrize("large", [False, True], ids=["small-body", "16KiB-body"])
@pytest.mark.parametrize(
    ("datatype", "token"),
    [("FP64", "1e309"), ("FP32", "-2.5e400"), ("INT64", "1" + "0" * 320)],
)
async def test_a_number_past_fp64_is_out_of_range_for_the_input(server, large, datatype,
                                                                token):
    """The JSON parser refuses a number past FP64's range in its own words ("number is
    infinity when parsed as double"): the 400 says which input and datatype."""
    data = "[" + "0.5, " * (4000 if large else 1) + token + "]"
    n = data.count(",") + 1
    body = ('{"inputs": [{"name": "a", "shape": [1, %d], "datatype": "%s", "data": %s}]}'
            % (n, datatype, data)).encode()
    assert (len(body) >= 16 * 1024) == large
    res = await post(server, "/v2/models/echo/infer", body)
    assert res.status == 400
    shown = token if len(token) <= 80 else token[:80] + "..."
    assert error_of(res) == f"input 'a': a value is out of range for {datatype} (got {shown})"


@pytest.mark.parametrize("large", [False, True], ids=["small-body", "16KiB-body"])
async def test_a_number_past_fp64_beside_a_nan_is_refused_too(server, large):
    """A body holding NaN or Infinity (Triton's words for non-finite floats) is read by
    the standard library's reader, which made inf of 1e309 silently and served it,
    while the same number beside 0.5 was a 400. Infinity itself is still taken."""
    pad = "0.5, " * (4000 if large else 1)
    for token, datatype in (("1e309", "FP64"), ("-1E+0400", "FP32")):
        body = ('{"inputs": [{"name": "a", "shape": [1, %d], "datatype": "%s", "data": '
                '[%sNaN, %s]}]}' % (pad.count(",") + 2, datatype, pad, token)).encode()
        res = await post(server, "/v2/models/echo/infer", body)
        assert res.status == 400
        assert error_of(res) == (
            f"input 'a': a value is out of range for {datatype} (got {token})"
        )
    body = ('{"inputs": [{"name": "a", "shape": [1, 3], "datatype": "BYTES", "data": '
            '["1e999", "NaN", "%s"]}, {"name": "b", "shape": [1, 2], "datatype": "FP64", '
            '"data": [NaN, -Infinity]}]}' % ("9" * 400)).encode()
    res = await post(server, "/v2/models/echo/infer", body)  # strings are no numbers
    assert res.status == 200, error_of(res)


async def test_a_number_past_fp64_outside_any_input_is_named_where_it_is(server):
    res = await post(server, "/v2/models/echo/infer",
                     b'{"parameters": {"p": 1e999},\n "inputs": [{"name": "a", "shape": '
                     b'[1], "datatype": "FP32", "data": [1.0]}]}')
    assert res.status == 400
    assert error_of(res) == ("the number 1e999 (line 1 column 22) is past the range of a "
                             "64-bit float, which JSON numbers are read as")


@pytest.mark.parametrize("large", [False, True], ids=["small-body", "16KiB-body"])
async def test_ragged_rows_are_served_as_triton_serves_them(server, large):
    """Rows of unequal lengths holding the shape's count of values are the values in
    row-major order (Triton's reader checks only the count); another count is a 400
    saying so. Bodies of 16 KiB and more are decoded by simdjson first."""
    n = 24 if large else 2
    # quarters: short numbers, so that 24 rows fit the server's 64 KiB bodies
    x = (np.random.default_rng(7).integers(-40, 40, (n, 256)) / 4).astype(np.float32)
    flat = x.reshape(-1).tolist()
    rows = [flat[:100], [], flat[100:-1], flat[-1:]]
    body = {"inputs": [{"name": "x", "shape": [n, 256], "datatype": "FP32", "data": rows}]}
    assert (len(orjson.dumps(body)) >= 16 * 1024) is large
    want = await post(server, "/v2/models/mlp/infer", {
        "inputs": [{"name": "x", "shape": [n, 256], "datatype": "FP32", "data": x.tolist()}]})
    res = await post(server, "/v2/models/mlp/infer", body)
    assert (res.status, want.status) == (200, 200)
    assert res.json()["outputs"] == want.json()["outputs"]
    res = await post(server, "/v2/models/echo/infer", {"inputs": [
        {"name": "a", "shape": [2, 3], "datatype": "INT32", "data": [[1, 2], [3, 4, 5, 6]]}]})
    assert res.status == 200
    assert res.json()["outputs"][0]["data"] == [1, 2, 3, 4, 5, 6]
    rows[2].pop()
    res = await post(server, "/v2/models/mlp/infer", body)
    assert res.status == 400
    assert error_of(res) == (
        f"input 'x': shape [{n}, 256] holds {n * 256} values, 'data' has {n * 256 - 1}")


async def test_bad_binary_data_is_400(server):
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 1024}}]})
    res = await post(server, "/v2/models/mlp/infer", header + b"\0" * 100,
                     headers=[("Inference-Header-Content-Length", str(len(header)))])
    assert res.status == 400
    assert "binary_data_size 1024 does not fit" in error_of(res)


@pytest.mark.parametrize(("size", "message"), [
    (-8, "parameters.binary_data_size must be a count of bytes (an integer, 0 or more), "
         "got -8"),
    ("8", "parameters.binary_data_size must be a count of bytes (an integer, 0 or more), "
          'got "8"'),
    (8.0, "parameters.binary_data_size must be a count of bytes (an integer, 0 or more), "
          "got 8.0"),
])
async def test_a_binary_data_size_that_is_no_byte_count_says_so(server, size, message):
    """It was told it "does not fit the 8 bytes of binary data left in the body",
    bytes that were there."""
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32",
                                       "parameters": {"binary_data_size": size}}]})
    res = await post(server, "/v2/models/echo/infer", header + b"\0" * 8,
                     headers=[("Inference-Header-Content-Length", str(len(header)))])
    assert res.status == 400
    assert error_of(res) == f"input 'x': {message}"


async def test_binary_data_without_a_binary_part_says_how_to_send_it(server):
    """Without Inference-Header-Content-Length (and on the stream, whose messages are
    JSON only) the refusal spoke of "the 0 bytes of binary data left in the body":
    it now says what is missing, for both."""
    doc = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32",
                       "parameters": {"binary_data_size": 8}}]}
    expected = (
        "input 'x': parameters.binary_data_size is given but the request has no binary "
        "data: over HTTP, send the tensors' bytes after the JSON with the JSON's length "
        "in Inference-Header-Content-Length; a /v2/stream message takes tensors as "
        "'data' only"
    )
    res = await post(server, "/v2/models/echo/infer", doc)
    assert res.status == 400
    assert error_of(res) == expected
    async with open_stream(server.url) as stream:
        await stream.send_raw(orjson.dumps({"id": "b", "model": "echo", **doc}).decode())
        reply = await stream.receive()
    assert (reply.id, reply.status, reply.error) == ("b", 400, expected)


@pytest.mark.parametrize(("params", "message"), [
    ({"timeout": 1.5},
     "parameters.timeout must be a whole number of microseconds, got 1.5"),
    ({"sequence_id": -3},
     "parameters.sequence_id must be an unsigned 64-bit integer or a string, got -3"),
    ({"sequence_end": "no"}, 'parameters.sequence_end must be true or false, got "no"'),
])
async def test_malformed_triton_parameters_are_400_over_json_binary_and_stream(
    server, params, message
):
    """A fractional ``timeout`` (Triton's: whole µs) was taken, a malformed
    ``sequence_*`` ignored: 400 now, as in Triton, over JSON, the binary tensor
    extension and /v2/stream alike; well-formed ones still answer."""
    x = {"name": "x", "shape": [1, 2], "datatype": "FP32"}
    doc = {"inputs": [{**x, "data": [[1.0, 2.0]]}], "parameters": params}
    res = await post(server, "/v2/models/echo/infer", doc)
    assert (res.status, error_of(res)) == (400, message)
    header = orjson.dumps({"inputs": [{**x, "parameters": {"binary_data_size": 8}}],
                           "parameters": params})
    binary = header + np.array([1.0, 2.0], np.float32).tobytes()
    res = await post(server, "/v2/models/echo/infer", binary,
                     headers=[("Inference-Header-Content-Length", str(len(header)))])
    assert (res.status, error_of(res)) == (400, message)
    async with open_stream(server.url) as stream:
        await stream.send_raw(orjson.dumps({"id": "s", "model": "echo", **doc}).decode())
        reply = await stream.receive()
    assert (reply.id, reply.status, reply.error) == ("s", 400, message)
    good = {"timeout": 2_000_000, "sequence_id": 9, "sequence_start": True,
            "sequence_end": False}
    res = await post(server, "/v2/models/echo/infer", {**doc, "parameters": good})
    assert res.status == 200


async def test_bool_binary_data_is_only_bytes_0_and_1(server):
    """The binary tensor extension: a BOOL element is one byte, 1 (true) or 0 (false).
    Another byte was taken as it came, into a numpy bool array holding it (torch
    reads such a byte as it pleases), and went back out in a binary answer, breaking
    the rule for the client too."""
    def body(data: bytes) -> tuple[bytes, list[tuple[str, str]]]:
        header = orjson.dumps({
            "inputs": [{"name": "x", "shape": [len(data)], "datatype": "BOOL",
                        "parameters": {"binary_data_size": len(data)}}],
            "parameters": {"binary_data_output": True},
        })
        return header + data, [("Inference-Header-Content-Length", str(len(header)))]

    res = await post(server, "/v2/models/echo/infer", *body(b"\x01\x00\x02"))
    assert res.status == 400
    assert error_of(res) == (
        "input 'x': BOOL binary data holds a byte other than 0 (false) and 1 (true)"
    )
    res = await post(server, "/v2/models/echo/infer", *body(b"\x01\x00\x01"))
    assert res.status == 200
    hlen = int(res.headers["inference-header-content-length"])
    assert res.body[hlen:] == b"\x01\x00\x01"
    np.testing.assert_array_equal(res.outputs()["x"], [True, False, True])


async def test_unknown_model_and_version_are_404(server):
    res = await post(server, "/v2/models/nope/infer", ONE)
    assert res.status == 404
    assert error_of(res) == "unknown model 'nope'; serving: echo, mlp"
    res = await post(server, "/v2/models/mlp/versions/9/infer", ONE)
    assert res.status == 404
    assert error_of(res) == "model 'mlp' has no version '9'; versions: 1"
    async with open_http(server.url) as http:
        meta = await http.get("/v2/models/nope")
        meta_v = await http.get("/v2/models/mlp/versions/9")
        ready = await http.get("/v2/models/nope/ready")
    assert [meta.status, meta_v.status, ready.status] == [404, 404, 404]
    assert "unknown model 'nope'" in error_of(meta)


async def test_unknown_route_is_404_and_wrong_method_is_405(server):
    async with open_http(server.url) as http:
        nothing = await http.get("/v3/whatever")
        get_infer = await http.get("/v2/models/mlp/infer")
        delete = await http.request("DELETE", "/v2/health/live")
        after = await http.get("/v2/health/live")  # the connection is still good
    assert nothing.status == 404
    assert error_of(nothing) == "no such endpoint: GET /v3/whatever"
    assert get_infer.status == 405
    assert "method GET is not allowed on /v2/models/mlp/infer" in error_of(get_infer)
    assert "POST" in get_infer.headers["allow"]
    assert delete.status == 405
    assert after.status == 200


async def test_a_body_over_the_limit_is_413_and_the_server_goes_on(server):
    body = {"inputs": [v2_input(np.zeros((1, 40_000), np.float32))]}
    res = await post(server, "/v2/models/echo/infer", body)
    assert res.status == 413
    assert error_of(res) == (
        "request body too large: the limit is 65536 bytes (server.max_body_bytes)"
    )
    assert (await post(server, "/v2/models/mlp/infer", ONE)).status == 200


async def test_a_chunked_body_over_the_limit_is_413(server):
    async with trio.open_nursery():
        stream = await trio.open_tcp_stream(*server.addresses[0])
        chunk = b"x" * 30_000
        head = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        await stream.send_all(head + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 3 + b"0\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        await stream.aclose()
    assert data.startswith(b"HTTP/1.1 413 ")


async def test_garbage_is_400_and_other_connections_are_unaffected(server):
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(b"THIS IS NOT HTTP\r\n\r\n")
    data = b""
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
    await stream.aclose()
    assert data.startswith(b"HTTP/1.1 400 ")
    assert b'{"error":"bad HTTP request:' in data
    assert (await post(server, "/v2/models/mlp/infer", ONE)).status == 200


async def test_missing_or_unknown_api_key_is_401():
    tenants = (trioserve.TenantConfig(name="acme", api_keys=("k1",)),)
    async with serving(config(echo_model(), tenants=tenants)) as gw:
        body = orjson.dumps({"inputs": [v2_input([[1.0]])]})
        async with open_http(gw.url) as anon, open_http(gw.url, api_key="wrong") as wrong, \
                open_http(gw.url, api_key="k1") as good:
            missing = await anon.request("POST", "/v2/models/echo/infer", body)
            unknown = await wrong.request("POST", "/v2/models/echo/infer", body)
            malformed = await anon.request("POST", "/v2/models/echo/infer", body,
                                           headers=[("Authorization", "Basic Zm9v")])
            ok = await good.request("POST", "/v2/models/echo/infer", body)
        assert missing.status == 401
        assert "missing API key" in error_of(missing)
        assert unknown.status == 401
        assert error_of(unknown) == "unknown API key"
        assert malformed.status == 401
        assert "expected 'Bearer <api key>'" in error_of(malformed)
        for res in (missing, unknown, malformed):  # RFC 9110 15.5.2: how to authenticate
            assert res.headers["www-authenticate"] == 'Bearer realm="trioserve"'
        assert ok.status == 200
        assert "www-authenticate" not in ok.headers
        assert gw.requests[("echo", "-", 401)] == 3


async def test_overloaded_is_503_with_retry_after():
    gate = Gate()
    cfg = config(held_model(gate, max_batch_size=1), queue_bound=1)
    async with serving(cfg) as gw, trio.open_nursery() as nursery:
        statuses = []

        async def one() -> None:
            async with open_http(gw.url) as http:
                res = await http.infer("held", {"x": np.ones((1, 1), np.float32)})
                statuses.append((res.status, res.headers.get("retry-after"), res.body))

        nursery.start_soon(one)  # runs, held by the gate
        await settle()
        nursery.start_soon(one)  # waits in the queue (bound 1)
        await settle()
        async with open_http(gw.url) as http:
            shed = await http.infer("held", {"x": np.ones((1, 1), np.float32)})
        gate.release()
    assert shed.status == 503
    assert shed.headers["retry-after"] == "1"
    assert "queue full" in error_of(shed)
    assert sorted(s for s, _, _ in statuses) == [200, 200]


async def test_quota_exceeded_is_429_with_retry_after(server, monkeypatch):
    async def over_quota(*args, **kwargs):
        raise QuotaExceeded("tenant 't' is over its quota", retry_after=2.5)

    monkeypatch.setattr(server.runtime, "infer", over_quota)
    res = await post(server, "/v2/models/mlp/infer", ONE)
    assert res.status == 429
    assert res.headers["retry-after"] == "3"
    assert error_of(res) == "tenant 't' is over its quota"


def test_error_answers_round_retry_after_up_to_whole_seconds():
    status, headers, body = error_answer(trioserve.Overloaded("busy", retry_after=0.05))
    assert (status, dict(headers)[b"retry-after"], orjson.loads(body)) == (
        503, b"1", {"error": "busy"})
    status, headers, _ = error_answer(ValueError("boom"))
    assert status == 500
    assert b"retry-after" not in dict(headers)


@pytest.mark.parametrize(
    ("retry_after", "header"),
    [
        (0.0, b"1"), (-5.0, b"1"), (1.0, b"1"), (1.2, b"2"), (86_400.0, b"86400"),
        (86_400.5, b"86400"), (1e300, b"86400"), (math.inf, b"86400"), (math.nan, b"86400"),
    ],
)
def test_retry_after_is_whole_seconds_from_one_second_to_a_day(retry_after, header):
    # An infinite wait (a subnormal credit_rate) raised OverflowError here: a 500.
    for exc in (trioserve.Overloaded("busy", retry_after=retry_after),
                trioserve.QuotaExceeded("over", retry_after=retry_after)):
        status, headers, _ = error_answer(exc)
        assert (status, dict(headers)[b"retry-after"]) == (exc.status, header)


async def test_a_refill_too_slow_to_wait_for_is_429_retry_after_a_day():
    tenants = (trioserve.TenantConfig(name="t", default=True, credit_rate=1e-320,
                                      credit_burst=1.0),)
    one = {"inputs": [v2_input(np.ones(1, np.float32))]}
    async with serving(config(echo_model(), tenants=tenants)) as gw:
        assert (await post(gw, "/v2/models/echo/infer", one)).status == 200
        for cls in ("realtime", "batch"):  # refused at once, and refused as too late
            res = await post(gw, "/v2/models/echo/infer", {**one, "parameters": {"class": cls}})
            assert (res.status, res.headers["retry-after"]) == (429, "86400")
            assert "tenant 't' is over its credit rate" in error_of(res)


async def test_timeout_ms_expiry_is_504_and_the_request_is_withdrawn():
    gate = Gate()
    async with serving(config(held_model(gate, max_batch_size=1))) as gw:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_held_request, gw)  # occupies the model
            await settle()
            async with open_http(gw.url) as http:
                res = await http.infer("held", {"x": np.ones((1, 1), np.float32)},
                                       parameters={"timeout_ms": 50})
            gate.release()
        await settle()
        # Only the first request ran: the expired one was withdrawn, never dispatched.
        assert gw.runtime.models["held"].metrics.items == 1
    assert res.status == 504
    assert error_of(res) == "model 'held': no answer within the request's timeout (50 ms)"


async def _held_request(gw) -> None:
    async with open_http(gw.url) as http:
        assert (await http.infer("held", {"x": np.ones((1, 1), np.float32)})).status == 200


async def test_a_model_error_is_500_and_only_its_request_fails():
    def fragile(items):
        if any(float(it["x"][0]) < 0 for it in items):
            raise ValueError("negative input")
        return [{"y": it["x"]} for it in items]

    backend = trioserve.CallableBackend(fragile, inputs=[trioserve.TensorSpec(
        name="x", datatype="FP32", shape=(-1,))], outputs=[trioserve.TensorSpec(
            name="y", datatype="FP32", shape=(-1,))], execution="inline")
    model = trioserve.ModelConfig(name="fragile", backend=backend, max_batch_size=1,
                                  max_wait_ms=0.0)
    async with serving(config(model)) as gw, open_http(gw.url) as http:
        bad = await http.infer("fragile", {"x": -np.ones((1, 1), np.float32)})
        good = await http.infer("fragile", {"x": np.ones((1, 1), np.float32)})
    assert bad.status == 500
    assert "negative input" in error_of(bad)
    assert good.status == 200


async def test_bad_requests_interleaved_with_good_ones_lose_nothing(server):
    good = orjson.dumps(ONE)
    bads = [b"{", b'{"inputs": 3}', orjson.dumps({"inputs": [{"name": "x"}]}),
            orjson.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                      "data": [[1.0]] * 256}]})]
    results = []

    async def client(i: int) -> None:
        async with open_http(server.url) as http:
            for j in range(10):
                body = good if (i + j) % 2 else bads[(i + j) % len(bads)]
                res = await http.request("POST", "/v2/models/mlp/infer", body)
                results.append((body is good, res.status))

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(client, i)
    assert len(results) == 80
    assert all((status == 200) == ok for ok, status in results)
    assert all(status in (200, 400) for _, status in results)
    assert math.isclose(sum(ok for ok, _ in results), 40)


async def test_a_batch_dimension_over_the_queue_bound_is_400_before_any_work(server):
    """A batch of empty items costs a few bytes to send whatever its size: it is
    refused before an item is made (it used to take the loop for seconds, or all
    memory), and the server goes on."""
    for n, status in ((1 << 40, 400), (4097, 400), (4096, 200)):
        body = {"inputs": [{"name": "a", "shape": [n, 0], "datatype": "FP32", "data": []}]}
        res = await post(server, "/v2/models/echo/infer", body)
        assert res.status == status, (n, res.body)
        if status == 400:
            assert f"{n} items in one request; at most 4096" in error_of(res)
    live = await post(server, "/v2/models/echo/infer",
                      {"inputs": [{"name": "a", "shape": [1, 2], "datatype": "FP32",
                                   "data": [1.0, 2.0]}]})
    assert live.status == 200


@pytest.mark.parametrize(
    "shape", [[1] * 65 + [0], [1, 9223372036854775808, 0], [1, 2**62, 2**62, 0]]
)
async def test_a_shape_numpy_cannot_hold_is_400(server, shape):
    body = {"inputs": [{"name": "a", "shape": shape, "datatype": "FP32", "data": []}]}
    res = await post(server, "/v2/models/echo/infer", body)
    assert res.status == 400
    assert "is not a valid array shape" in error_of(res)


@pytest.mark.parametrize("value", ["1_0", "+10", "1e1", "-1", "0x10", "9" * 5000])
async def test_the_header_length_must_be_plain_digits(server, value):
    body = orjson.dumps({"inputs": [v2_input([[1.0]], "a")]})
    res = await post(server, "/v2/models/echo/infer", body,
                     headers=[("Inference-Header-Content-Length", value)])
    assert res.status == 400
    assert "Inference-Header-Content-Length must be an integer" in error_of(res)


@pytest.mark.parametrize("coding", ["gzip", "x-gzip", "deflate", "raw-deflate", "identity"])
async def test_a_compressed_body_is_decompressed(server, coding):
    import gzip
    import zlib

    body = orjson.dumps({"inputs": [v2_input([[1.5, 2.5]], "a")]})
    packed = {
        "gzip": gzip.compress, "x-gzip": gzip.compress, "deflate": zlib.compress,
        "raw-deflate": _raw_deflate,  # zlib's header left out, as some clients do
        "identity": lambda b: b,
    }[coding](body)
    header = "deflate" if coding == "raw-deflate" else coding
    res = await post(server, "/v2/models/echo/infer", packed,
                     headers=[("Content-Encoding", header)])
    assert res.status == 200, res.body
    assert res.json()["outputs"][0]["data"] == [1.5, 2.5]


def _raw_deflate(data: bytes) -> bytes:
    import zlib

    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


async def test_bad_compressed_bodies_are_refused(server):
    import gzip

    body = orjson.dumps({"inputs": [v2_input([[1.0]], "a")]})
    res = await post(server, "/v2/models/echo/infer", body, headers=[("Content-Encoding", "br")])
    assert res.status == 415
    assert res.headers["accept-encoding"] == "gzip, deflate"
    assert "Content-Encoding 'br' is not supported" in error_of(res)
    res = await post(server, "/v2/models/echo/infer", b"not gzip",
                     headers=[("Content-Encoding", "gzip")])
    assert res.status == 400
    assert "not valid gzip data" in error_of(res)
    truncated = gzip.compress(body)[:-12]
    res = await post(server, "/v2/models/echo/infer", truncated,
                     headers=[("Content-Encoding", "gzip")])
    assert res.status == 400
    bomb = gzip.compress(b" " * (1024 * 1024))  # 1 MiB of spaces in ~1 KiB; the limit: 64 KiB
    res = await post(server, "/v2/models/echo/infer", bomb,
                     headers=[("Content-Encoding", "gzip")])
    assert res.status == 413
    assert "once decompressed" in error_of(res)


async def test_a_compressed_body_is_decoded_only_for_a_known_tenant():
    import gzip

    tenants = (trioserve.TenantConfig(name="acme", api_keys=("k1",)),)
    async with serving(config(echo_model(), tenants=tenants)) as gw:
        res = await post(gw, "/v2/models/echo/infer", gzip.compress(b" " * 100_000),
                         headers=[("Content-Encoding", "gzip")])
        assert res.status == 401  # not inflated for a caller without a key
        assert gw.requests[("echo", "-", 401)] == 1


# ---- a model's answer that contradicts its own metadata: 500, said precisely
def outputs_model(answer, *, outputs=None):
    """A model ``m`` (input x FP32 [-1]) whose output for each item is ``answer(item)``."""
    from runtime_helpers import callable_model

    kw = {} if outputs is None else {"outputs": outputs}
    return callable_model("m", lambda items: [answer(it) for it in items], **kw)


async def infer_m(gw, rows=1, *, binary=False):
    body = {"inputs": [v2_input(np.ones((rows, 2), np.float32))]}
    if binary:
        body["outputs"] = [{"name": "y", "parameters": {"binary_data": True}}]
    return await post(gw, "/v2/models/m/infer", body)


DECLARES = "the model declares"


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({}, "model 'm' returned no output 'y', which it declares (it returned none)"),
        (
            {"z": np.ones(2)},
            "model 'm' returned no output 'y', which it declares (it returned 'z')",
        ),
        ({"y": None}, f"model 'm': output 'y' holds Python objects, {DECLARES} FP32"),
        ({"y": "text"}, f"model 'm': output 'y' holds strings, {DECLARES} FP32"),
        ({"y": {"a": 1}}, f"model 'm': output 'y' holds Python objects, {DECLARES} FP32"),
        ({"y": 1.5}, f"model 'm': output 'y' has shape [] per item, {DECLARES} [-1]"),
        (
            {"y": np.ones((2, 2))},
            f"model 'm': output 'y' has shape [2, 2] per item, {DECLARES} [-1]",
        ),
        (
            {"y": np.ones(2, np.complex64)},
            f"model 'm': output 'y' is of numpy dtype complex64, {DECLARES} FP32",
        ),
    ],
)
async def test_a_model_answer_against_its_declared_outputs_is_500(answer, message):
    """A missing output was 400 (the caller's fault) with "it produced " and nothing
    after; None or a dict went out as BYTES [null] under a declared FP32; an object
    was an "internal error"."""
    async with serving(config(outputs_model(lambda it: answer))) as gw:
        for binary in (False, True):
            res = await infer_m(gw, binary=binary)
            assert res.status == 500
            assert error_of(res) == message


async def test_a_declared_output_is_sent_as_its_declared_datatype():
    """float64 (numpy's default) went out as FP64 while the metadata says FP32."""
    model = outputs_model(lambda it: {"y": it["x"].astype(np.float64) * 2})
    async with serving(config(model)) as gw:
        for binary in (False, True):
            res = await infer_m(gw, rows=3, binary=binary)
            assert res.status == 200
            out = res.json()["outputs"][0] if not binary else None
            if out is not None:
                assert (out["datatype"], out["shape"], out["data"]) == ("FP32", [3, 2], [2.0] * 6)
        async with open_http(gw.url) as http:
            meta = (await http.get("/v2/models/m")).json()
        assert meta["outputs"][0]["datatype"] == "FP32"


async def test_integer_outputs_are_converted_only_when_every_value_fits():
    from trioserve import TensorSpec

    out8 = (TensorSpec(name="y", datatype="INT8", shape=(-1,)),)
    fits = outputs_model(lambda it: {"y": np.array([-128, 127], np.int64)}, outputs=out8)
    async with serving(config(fits)) as gw:
        res = await infer_m(gw)
        assert res.status == 200
        assert res.json()["outputs"][0] == {
            "name": "y", "datatype": "INT8", "shape": [1, 2], "data": [-128, 127]
        }
    over = outputs_model(lambda it: {"y": np.array([128], np.int64)}, outputs=out8)
    async with serving(config(over)) as gw:
        res = await infer_m(gw)
        assert res.status == 500
        assert error_of(res) == (
            "model 'm': output 'y' holds values out of the range of INT8, which the model declares"
        )
    floats = outputs_model(lambda it: {"y": np.array([1.5])}, outputs=out8)
    async with serving(config(floats)) as gw:
        res = await infer_m(gw)
        assert error_of(res) == "model 'm': output 'y' is FP64, the model declares INT8"


async def test_bytes_outputs_hold_only_strings_or_bytes():
    from trioserve import TensorSpec

    text = (TensorSpec(name="y", datatype="BYTES", shape=(-1,)),)
    good = outputs_model(lambda it: {"y": np.array(["a", b"b"], dtype=object)}, outputs=text)
    async with serving(config(good)) as gw:
        res = await infer_m(gw)
        assert res.json()["outputs"][0]["data"] == ["a", "b"]
    for bad in (None, 3, {"a": 1}):
        model = outputs_model(
            lambda it, bad=bad: {"y": np.array(["a", bad], dtype=object)}, outputs=text
        )
        async with serving(config(model)) as gw:
            for binary in (False, True):
                res = await infer_m(gw, binary=binary)
                assert res.status == 500
                assert error_of(res).startswith(
                    "model 'm': output 'y': a BYTES element is "
                )
                assert error_of(res).endswith(", not a string or bytes")


async def test_items_whose_outputs_cannot_be_stacked_are_500():
    """Ragged outputs of a batched request were an "internal error"."""
    lengths = iter(range(1, 100))
    model = outputs_model(lambda it: {"y": np.ones(next(lengths), np.float32)})
    async with serving(config(model)) as gw:
        res = await infer_m(gw, rows=2)
        assert res.status == 500
        assert error_of(res).startswith(
            "model 'm': output 'y' cannot be stacked across the request's items ("
        )
    # An item without a declared output is refused as it leaves the model (its
    # caller is told which output), before the response is stacked.
    halves = iter([{"y": np.ones(2, np.float32)}, {}])
    model = outputs_model(lambda it: next(halves))
    async with serving(config(model)) as gw:
        res = await infer_m(gw, rows=2)
        assert res.status == 500
        assert error_of(res) == (
            "model 'm' returned no output 'y', which it declares (it returned none)"
        )


async def test_an_open_model_asked_for_an_output_it_has_not_is_still_400(server):
    body = {
        "inputs": [v2_input(np.ones((1, 2), np.float32))],
        "outputs": [{"name": "nope"}],
    }
    res = await post(server, "/v2/models/echo/infer", body)
    assert res.status == 400
    assert error_of(res) == "model 'echo': no output 'nope'; it produced 'x'"


def test_the_error_table_of_docs_embedding_md_gives_each_errors_status():
    """Each error ``trioserve`` exports has its row, and the HTTP status in it is the
    one the gateway answers the error with (``—``: raised before serving, never an
    answer)."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "embedding.md").read_text()
    rows = {}
    for line in page.split("## Errors", 1)[1].split("\n## ", 1)[0].splitlines():
        if line.startswith("| `"):
            names, _, status = (c.strip() for c in line.strip().strip("|").split("|"))
            for name, code in zip(re.findall(r"`(\w+)`", names), status.split(" / "), strict=True):
                rows[name] = code
    errors = {
        name for name, value in vars(trioserve).items()
        if isinstance(value, type) and issubclass(value, trioserve.TrioserveError)
    }
    assert set(rows) == errors - {"TrioserveError"}
    for name, code in rows.items():
        if code == "—":
            assert name in ("ConfigError", "ModelLoadError")
            continue
        status = error_answer(getattr(trioserve, name)("x"))[0]
        assert (name, status) == (name, int(code))



# ------------------------------------------------------------ error bodies' bytes


def _orjson_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


#: any text, lone surrogates included (st.text() leaves them out)
_ANY_TEXT = st.text(st.characters(blacklist_categories=()))


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()


@given(message=_ANY_TEXT)
def test_an_error_body_is_byte_for_byte_what_orjson_wrote(message):
    """``error_body`` no longer goes through orjson (whose output holds a 4 KiB
    buffer): its bytes are the same for any text, escapes and non-ASCII included;
    a lone surrogate, which orjson refuses, is written escaped (the answer is
    always written)."""
    try:
        expected = _orjson_body(message)
    except orjson.JSONEncodeError:  # a lone surrogate
        expected = _orjson_body(_escaped(message))
        assert b"\\\\ud" in expected  # the surrogate, escaped
    assert error_body(message) == expected


def test_an_error_body_is_orjson_s_for_every_code_point():
    every = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    assert error_body(every) == _orjson_body(every)
    for c in range(0x80):  # each ASCII one alone: the escapes
        assert error_body(chr(c)) == _orjson_body(chr(c)), c


def test_an_error_body_is_a_block_of_its_own_length():
    message = "model 'mlp': queue full (64 requests waiting)"
    tracemalloc.start()
    try:
        body = error_body(message)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert body == _orjson_body(message)
    assert peak < 1024, f"{peak} bytes allocated for a {len(body)}-byte body"


def test_a_refusal_s_body_is_written_once_per_message_and_the_table_is_bounded():
    """A 503 or 429 with a message seen before shares its body (nothing written);
    messages that vary never hold more than REFUSAL_BODIES bodies."""
    full = trioserve.Overloaded("model 'm': queue full (64 requests waiting)")
    first, again = error_answer(full), error_answer(full)
    assert first == again
    assert first[2] is again[2]
    assert first[2] == _orjson_body(str(full))
    for i in range(3 * _answers.REFUSAL_BODIES):
        exc = QuotaExceeded(f"tenant 't' is over its credit rate; 1 more in {i} ms")
        answer = error_answer(exc)
        assert answer[0] == 429
        assert answer[2] == _orjson_body(str(exc))
        assert len(_answers._refusal_bodies) <= _answers.REFUSAL_BODIES
    # other statuses are written each time (their messages are the request's)
    bad = trioserve.InvalidInput("bad")
    assert error_answer(bad)[2] == _orjson_body("bad")
    assert "bad" not in _answers._refusal_bodies


# ------------------------------------------------------------ stream error frames' bytes


def _orjson_frame(rid, message, status, retry_after=None) -> bytes:
    doc = {"id": rid, "error": message, "status": status}
    if retry_after is not None:
        doc["retry_after"] = retry_after
    return orjson.dumps(doc)


_IDS = (
    st.none()
    | _ANY_TEXT
    | st.integers()  # past 64 bits too: the stdlib's reader (a body with NaN) reads them
    # a bad message's id, echoed as it came (orjson writes it)
    | st.booleans()
    | st.floats()
    | st.lists(st.integers(), max_size=3)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)


@given(
    rid=_IDS,
    message=_ANY_TEXT,
    status=st.sampled_from([400, 401, 404, 429, 500, 503, 504]),
    retry_after=st.none() | st.integers(min_value=1, max_value=_answers.RETRY_AFTER_MAX),
)
def test_a_stream_error_frame_is_byte_for_byte_what_orjson_wrote(
    rid, message, status, retry_after
):
    """``error_frame`` no longer goes through orjson (whose output holds a 4 KiB
    buffer): its bytes are the same for any id and text; what orjson cannot write
    (an id past 64 bits or with a lone surrogate, a message with one) is written
    as null (the id) or escaped (the message): a frame is always written."""
    try:
        expected = _orjson_frame(rid, message, status, retry_after)
    except TypeError:  # orjson's JSONEncodeError too
        try:
            orjson.dumps(rid)
        except TypeError:
            rid = None
        expected = _orjson_frame(rid, _escaped(message), status, retry_after)
    assert error_frame(rid, message, status, retry_after) == expected


@pytest.mark.parametrize("exc", [
    trioserve.Overloaded("model 'm': queue full (64 requests waiting)", retry_after=0.2),
    trioserve.Overloaded("model 'm': draining", retry_after=math.inf),
    QuotaExceeded("tenant 't' is over its credit rate; 1 more in 1500 ms", retry_after=1.5),
    trioserve.InvalidInput('a stream message\'s \'model\' must be a string, got "\\n"'),
    trioserve.UnknownModel("unknown model 'x'; serving: echo, mlp"),
    trioserve.Unauthorized("missing API key"),
    trioserve.DeadlineExceeded("model 'm': deadline passed after 1.000s in the queue"),
    RuntimeError("a bug, with ünïcode"),
])
@pytest.mark.parametrize("rid", ["r1", 7, None, 2.5])
def test_a_stream_error_frame_holds_what_error_answer_says(exc, rid):
    """The stream's frame for an error: the status of its HTTP answer and, with 429
    and 503, that answer's Retry-After as ``retry_after``; the bytes orjson wrote."""
    status, headers, _ = error_answer(exc)
    retry = dict(headers).get(b"retry-after")
    expected = _orjson_frame(rid, str(exc), status, None if retry is None else int(retry))
    assert _stream_answer._error_frame(rid, exc) == expected


def test_a_stream_error_frame_is_a_block_of_its_own_length():
    exc = trioserve.Overloaded("model 'mlp': queue full (64 requests waiting)", retry_after=1)
    _stream_answer._error_frame("r1", exc)
    tracemalloc.start()
    try:
        frames = [_stream_answer._error_frame("r%d" % i, exc) for i in range(100)]
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert frames[1] == _orjson_frame("r1", str(exc), 503, 1)
    # orjson's frames held 4 KiB each: 100 of them, 400 KiB
    assert held < 100 * 256, f"{held} bytes held by 100 frames of {len(frames[1])} bytes"


# ------------------------------------------------ ids that JSON cannot echo (NaN bodies)
#: Bodies that hold NaN are read by the standard library's reader, which keeps an
#: integer past 64 bits and a lone surrogate, neither of which orjson writes.
_UNECHOABLE_IDS = [
    ("100000000000000000000", "an integer id must be within 64 bits"),
    ('"\\ud800"', "an id must be Unicode text: it holds a lone surrogate"),
]


@pytest.mark.parametrize(("rid", "why"), _UNECHOABLE_IDS)
async def test_an_id_json_cannot_echo_is_a_400_not_a_500(rid, why):
    async with serving(config(echo_model())) as gw:
        body = (
            '{"id": %s, "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", '
            '"data": [NaN]}]}' % rid
        ).encode()
        res = await post(gw, "/v2/models/echo/infer", body)
        assert res.status == 400
        assert error_of(res).startswith(f"'id': {why}")
        # an id it can echo, in a body with NaN, is answered
        res = await post(gw, "/v2/models/echo/infer", body.replace(rid.encode(), b'"r"'))
        assert res.status == 200
        assert res.json()["id"] == "r"


@pytest.mark.parametrize("rid", ["100000000000000000000", "18446744073709551616",
                                 "-9223372036854775809", "-9223372036854776832"])
async def test_an_integer_id_past_64_bits_is_refused_naming_the_bound_over_http_as_on_the_stream(
    rid,
):
    """Read as a float by the JSON parser, such an id got "must be a string or an
    integer, got 100000000000000000000" over HTTP (the stream named the bound; and
    over HTTP too once the body held NaN, its parser keeping the integer)."""
    bound = "an integer id must be within 64 bits (-2**63 to 2**64-1): use a string"
    body = ('{"id": %s, "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", '
            '"data": [1]}]}' % rid)
    async with serving(config(echo_model())) as gw:
        res = await post(gw, "/v2/models/echo/infer", body.encode())
        assert res.status == 400
        assert error_of(res) == f"'id' must be a string or an integer; {bound}"
        async with open_stream(gw.url) as stream:
            await stream.send_raw(body[:-1] + ', "model": "echo"}')
            refused = await stream.receive()
        assert refused.status == 400
        assert refused.error == (
            f"a stream message's 'id' must be a string or an integer; {bound}"
        )


@pytest.mark.parametrize(("rid", "why"), _UNECHOABLE_IDS)
@pytest.mark.parametrize("model", ['"echo"', "NaN"])
async def test_a_stream_message_whose_id_json_cannot_echo_is_answered_and_the_stream_goes_on(
    rid, why, model
):
    """Such an id ended the stream's connection (its error frame could not be
    written), the requests in flight on it unanswered; its 400 now has a null id."""
    from wsproto.events import TextMessage

    async with serving(config(echo_model())) as gw:
        sock, ws = await _raw_client(gw)
        bad = (
            '{"id": %s, "model": %s, "inputs": [{"name": "x", "shape": [1], '
            '"datatype": "FP32", "data": [NaN]}]}' % (rid, model)
        )
        await sock.send_all(ws.send(TextMessage(data=bad)))
        await sock.send_all(ws.send(TextMessage(data=_infer_text("after"))))
        got = []
        while len(got) < 2:
            events = await _events_until(sock, ws, TextMessage)
            got += [json.loads(e.data) for e in events if isinstance(e, TextMessage)]
        await sock.aclose()
    refused = next(d for d in got if d.get("id") != "after")
    assert refused["id"] is None
    assert refused["status"] == 400
    assert refused["error"].startswith(f"a stream message's 'id': {why}")
    answered = next(d for d in got if d.get("id") == "after")
    assert answered["outputs"][0]["data"] == [1.0]


def test_a_number_past_fp64_in_a_body_over_a_mib_is_named_by_where_it_is():
    """Only a body of at most 1 MiB is read again to name the input."""
    from trioserve.transport._request_json import loads_request

    for pad, named in ((1000, True), (1024 * 1024, False)):
        body = ('{"inputs": [{"name": "a", "shape": [1], "datatype": "FP64", "data": '
                '[1e309]}]}' + " " * pad).encode()
        with pytest.raises(trioserve.InvalidInput) as info:
            loads_request(body)
        assert str(info.value) == (
            "input 'a': a value is out of range for FP64 (got 1e309)" if named else
            "the number 1e309 (line 1 column 70) is past the range of a 64-bit float, "
            "which JSON numbers are read as"
        )
