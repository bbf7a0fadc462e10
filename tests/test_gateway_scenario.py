"""The gateway scenario's lean WebSocket load client: its handshake and frames against
wsproto, and a short run against a real server."""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import random

import orjson
import pytest
import trio
from http_helpers import config, echo_model, serving
from trioserve.scenarios._gateway import (
    OP_CONT,
    OP_PING,
    OP_TEXT,
    answer_id,
    check_handshake_response,
    encode_frame,
    handshake_request,
    parse_frames,
    request_frames,
    ws_load,
)
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Ping, Request, TextMessage

KEY = base64.b64encode(b"0123456789abcdef")


def open_server() -> tuple[WSConnection, bytes]:
    """A wsproto server after our handshake; the bytes of its 101 answer."""
    ws = WSConnection(ConnectionType.SERVER)
    ws.receive_data(handshake_request("127.0.0.1", 8000, "/v2/stream", KEY))
    (request,) = ws.events()
    assert isinstance(request, Request)
    assert request.target == "/v2/stream"
    return ws, ws.send(AcceptConnection())


def test_the_handshake_is_accepted_and_its_answer_checked():
    _, answer = open_server()
    head, sep, rest = answer.partition(b"\r\n\r\n")
    assert sep == b"\r\n\r\n"
    assert rest == b""
    check_handshake_response(head, KEY)
    with pytest.raises(ConnectionError, match="Accept"):
        check_handshake_response(head, base64.b64encode(b"fedcba9876543210"))
    with pytest.raises(ConnectionError, match="refused"):
        check_handshake_response(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0", KEY)


@pytest.mark.parametrize("size", [0, 5, 125, 126, 300, 65535, 65536, 70_000])
def test_client_frames_decode_in_wsproto(size):
    ws, _ = open_server()
    payload = bytes(random.Random(size).choices(b"abcdefgh{}:,0123456789", k=size))
    ws.receive_data(encode_frame(payload))
    events = list(ws.events())
    assert [type(e) for e in events] == [TextMessage] * len(events)
    assert events[-1].message_finished
    assert "".join(e.data for e in events).encode() == payload


def test_request_frames_carry_their_ids_model_and_body():
    ws, _ = open_server()
    body = b'{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1.5,2]}]}'
    ws.receive_data(b"".join(request_frames([body, body.replace(b"1.5", b"3")], "mlp", 3)))
    docs = [json.loads(e.data) for e in ws.events()]
    assert [(d["id"], d["model"], d["inputs"][0]["data"][0]) for d in docs] == [
        (0, "mlp", 1.5), (1, "mlp", 3), (2, "mlp", 1.5),
    ]


def test_server_frames_parse_in_any_chunking():
    ws, _ = open_server()
    sizes = [3, 125, 126, 65535, 65536, 70_000]
    messages = [("m%d:" % n + "x" * n) for n in sizes]
    wire = b"".join(ws.send(TextMessage(data=m)) for m in messages)
    wire += ws.send(TextMessage(data="part one ", message_finished=False))
    wire += ws.send(TextMessage(data="and two"))
    wire += ws.send(Ping(payload=b"hi"))
    rng = random.Random(1)
    buf = bytearray()
    got = []
    i = 0
    while i < len(wire):
        step = rng.choice([1, 2, 7, 100, 4096, 70_000])
        buf += wire[i:i + step]
        i += step
        frames, pos = parse_frames(buf)
        got += [(fin, op, bytes(buf[a:b])) for fin, op, a, b in frames]
        del buf[:pos]
    assert not buf
    assert got == [(1, OP_TEXT, m.encode()) for m in messages] + [
        (0, OP_TEXT, b"part one "), (1, OP_CONT, b"and two"), (1, OP_PING, b"hi"),
    ]


def test_answer_ids_from_results_and_error_frames():
    result = orjson.dumps({"model_name": "mlp", "model_version": "1", "id": 17,
                           "outputs": [{"name": "y", "data": [1.0]}]})
    error = orjson.dumps({"id": 250, "error": "no", "status": 503})
    assert answer_id(result[:96]) == (17, False)
    assert answer_id(error[:96]) == (250, True)
    assert answer_id(b'{"id":null,"error":"x"}') is None
    assert answer_id(b'{"model_name":"mlp"') is None


async def test_ws_load_keeps_requests_in_flight_against_a_real_server():
    body = b'{"inputs":[{"name":"x","shape":[1,3],"datatype":"FP32","data":[1,2,3]}]}'
    async with serving(config(echo_model())) as gw:
        url = gw.url.replace("http://", "ws://", 1) + "/v2/stream"
        res = await trio.to_thread.run_sync(
            # a warm-up long enough to see answers even when the machine stalls (0.2 s
            # once saw none)
            lambda: ws_load(url, [body], model="echo", in_flight=32, warmup=1.0,
                            duration=0.5)
        )
        bad = await trio.to_thread.run_sync(
            lambda: ws_load(url, [body], model="nope", in_flight=4, warmup=0.1,
                            duration=0.5)
        )
    assert res["items"] > 0
    assert res["warmup_items"] > 0
    assert (res["errors"], res["warmup_errors"], res["unmatched"]) == (0, 0, 0)
    assert res["closed_early"] is None
    assert res["p50_us"] is not None
    assert bad["items"] == bad["warmup_items"] == 0
    assert bad["errors"] > 0
    assert "nope" in bad["first_error"]


def test_binary_bodies_are_v2_requests_in_the_binary_tensor_extension(tmp_path):
    import numpy as np
    from trioserve import TensorSpec
    from trioserve.scenarios._gateway import _binary_bodies, _bodies
    from trioserve.transport import InferRequest, ModelSignature
    from trioserve.transport._v2 import loads

    class _Served:
        def __init__(self):
            import trioserve

            x = TensorSpec(name="x", datatype="FP32", shape=(256,))
            self.backend = trioserve.CallableBackend(lambda items: items, inputs=[x], outputs=[x])
            self.config = trioserve.ModelConfig(name="mlp", backend=self.backend)

    sig = ModelSignature.of(_Served())
    lines = _binary_bodies(tmp_path / "b.hex", rows=4, count=2, seed=3).read_text().splitlines()
    texts = _bodies(tmp_path / "b.jsonl", rows=4, count=2, seed=3).read_text().splitlines()
    assert len(lines) == 2
    for line, text in zip(lines, texts, strict=True):
        hlen, hexed = line.split(" ")
        body = bytes.fromhex(hexed)
        req = InferRequest.from_v2_json(body, sig, header_length=int(hlen))
        rows = np.stack([it["x"] for it in req.items])
        assert rows.shape == (4, 256)
        # the same draws as the JSON bodies (which round to 5 decimals)
        want = np.asarray(loads(text)["inputs"][0]["data"], np.float32).reshape(4, 256)
        np.testing.assert_allclose(rows, want, atol=1e-5)


@pytest.mark.parametrize("module", ["_gateway", "_cache_http"])
def test_the_http_scenarios_remove_their_work_directory(monkeypatch, module):
    mod = importlib.import_module(f"trioserve.scenarios.{module}")
    seen = []

    def failing_run(name, args, workdir):
        seen.append(workdir)
        (workdir / "bodies.jsonl").write_text("{}\n")
        raise RuntimeError("the server did not become ready")

    monkeypatch.setattr(mod, "_run", failing_run)
    monkeypatch.setattr(mod.shutil, "which", lambda _: "/usr/bin/wrk")
    with pytest.raises(RuntimeError, match="did not become ready"):
        mod.run(module, argparse.Namespace(duration=None, json=None))
    assert len(seen) == 1
    assert not seen[0].exists()
