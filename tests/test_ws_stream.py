"""The /v2/stream WebSocket: many requests on one socket, answered out of order and
tagged by id; per-connection backpressure; bad messages; closing cancels."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import trio
import trioserve
from http_helpers import Gate, config, echo_model, held_model, mlp_model, serving, settle
from trio_websocket import ConnectionRejected
from trioserve import InvalidInput, UnknownModel
from trioserve.transport import open_stream


def f32(*values: float) -> np.ndarray:
    return np.asarray(values, np.float32)


async def test_each_answer_is_tagged_with_its_requests_id(mlp_input):
    async with serving(config(mlp_model(), echo_model())) as gw:
        xs = {f"r{i}": mlp_input * i for i in range(20)}
        want = {k: (await gw.runtime.infer("mlp", x))["y"] for k, x in xs.items()}
        async with open_stream(gw.url) as stream:
            for rid, x in xs.items():
                await stream.send(rid, "mlp", {"x": x[None]})
            replies = [await stream.receive() for _ in xs]
    assert sorted(r.id for r in replies) == sorted(xs)
    for r in replies:
        assert r.error is None
        assert r.model_name == "mlp"
        np.testing.assert_allclose(r.outputs["y"], want[r.id][None], rtol=1e-5, atol=1e-6)


async def test_a_large_batch_message_is_split_and_answered_like_a_small_one():
    # Messages of 16 KiB and more are decoded another way first (transport/_request_json.py).
    x = np.random.default_rng(5).standard_normal((24, 256)).astype(np.float32)
    async with serving(config(mlp_model())) as gw:
        want = np.stack([(await gw.runtime.infer("mlp", row))["y"] for row in x])
        async with open_stream(gw.url) as stream:
            await stream.send("big", "mlp", {"x": x})
            bad = x.tolist()
            bad[3][9] = None
            await stream.send_raw(json.dumps(
                {"id": "bad", "model": "mlp",
                 "inputs": [{"name": "x", "shape": [24, 256], "datatype": "FP32", "data": bad}]}
            ))
            replies = {r.id: r for r in [await stream.receive(), await stream.receive()]}
    assert replies["big"].error is None
    np.testing.assert_allclose(replies["big"].outputs["y"], want, rtol=1e-5, atol=1e-6)
    assert "mixed values" in replies["bad"].error


async def test_a_slow_request_is_answered_after_a_later_fast_one():
    # x[0] of the sleep model is an extra delay in ms; two replicas run both at once.
    sleep = trioserve.ModelConfig(name="sleep", backend="sleep", execution="thread",
                                  replicas=2, max_batch_size=1, max_wait_ms=0.0)
    async with serving(config(sleep)) as gw, open_stream(gw.url) as stream:
        await stream.send("slow", "sleep", {"x": f32(300, 1)})
        await stream.send("fast", "sleep", {"x": f32(0, 2)})
        first = await stream.receive()
        second = await stream.receive()
    assert (first.id, second.id) == ("fast", "slow")
    np.testing.assert_array_equal(first.outputs["y"], [0, 2])
    np.testing.assert_array_equal(second.outputs["y"], [300, 1])


async def test_infer_matches_answers_to_concurrent_callers():
    async with serving(config(echo_model())) as gw, open_stream(gw.url) as stream:
        results = {}

        async def caller(i: int) -> None:
            results[i] = (await stream.infer("echo", {"x": f32(i, i + 1)}))["x"]

        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(caller, i)
    assert {i: r.tolist() for i, r in results.items()} == {i: [i, i + 1] for i in range(100)}


async def test_a_bad_message_gets_an_error_frame_and_the_stream_goes_on():
    async with serving(config(echo_model(), mlp_model())) as gw, open_stream(gw.url) as stream:
        await stream.send_raw("{not json")
        await stream.send_raw('{"model": "echo", "inputs": []}')
        await stream.send("m1", "nope", {"x": f32(1)})
        await stream.send("m2", "mlp", {"x": f32(1, 2, 3)})
        await stream.send("m3", "mlp", {"x": f32(1)}, version="7")
        await stream.send("ok", "echo", {"x": f32(4, 5)})
        await stream.send_raw('{"id": "m4", "model": "echo", "inputs": [{"name": "x", '
                              '"shape": [2], "datatype": "FP32", "data": [1.5, true]}]}')
        replies = {}
        for _ in range(7):
            r = await stream.receive()
            replies.setdefault(r.id, []).append(r)
        with pytest.raises(UnknownModel):
            await stream.infer("nope", {"x": f32(1)})
        with pytest.raises(InvalidInput, match="expected shape"):
            await stream.infer("mlp", {"x": f32(1)})
        assert (await stream.infer("echo", {"x": f32(6)}))["x"].tolist() == [6]
    malformed, no_id = sorted(replies.pop(None), key=lambda r: "malformed" not in r.error)
    assert malformed.status == 400
    assert malformed.error.startswith("malformed JSON body")
    assert no_id.status == 400
    assert no_id.error == "a stream message needs an 'id' (string or integer)"
    assert replies["m1"][0].status == 404
    assert replies["m2"][0].status == 400
    assert "expected shape [256] or [N, 256]" in replies["m2"][0].error
    assert (replies["m3"][0].status, replies["m3"][0].error) == (
        404, "model 'mlp' has no version '7'; versions: 1")
    assert replies["ok"][0].outputs["x"].tolist() == [4, 5]
    assert (replies["m4"][0].status, replies["m4"][0].error) == (
        400, "input 'x': expected FP32 values, got a boolean in 'data'")


async def test_at_the_in_flight_bound_the_server_stops_reading_the_socket():
    gate = Gate()
    bound, sent_total = 4, 40
    cfg = config(held_model(gate), server={"stream_in_flight": bound})
    big = np.ones(100_000, np.float32)  # ~0.7 MB of JSON per message
    async with serving(cfg) as gw, open_stream(gw.url, max_in_flight=sent_total) as stream:
        sent = 0

        async def sender() -> None:
            nonlocal sent
            for i in range(sent_total):
                await stream.send(i, "held", {"x": big})
                sent += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            await settle()
            # The server holds `bound` requests; the rest wait in socket buffers, so
            # the client's sends block: nothing is buffered without limit.
            assert gw.statistics().stream_in_flight_peak == bound
            assert sent < sent_total
            assert gw.runtime.models["held"].scheduler.queue_depth() <= bound
            gate.release()
            replies = [await stream.receive() for _ in range(sent_total)]
    assert sorted(r.id for r in replies) == list(range(sent_total))
    assert all(r.error is None for r in replies)
    assert gw.statistics().stream_in_flight_peak == bound


async def test_closing_the_socket_cancels_requests_not_yet_dispatched():
    gate = Gate()
    async with serving(config(held_model(gate, max_batch_size=1))) as gw:
        async with open_stream(gw.url) as stream:
            for i in range(5):
                await stream.send(i, "held", {"x": f32(1)})
            await settle()
            assert gw.statistics().streams == 1
        await settle()
        gate.release()
        # One replica, batches of one: this request runs after the held batch ends.
        async with open_stream(gw.url) as stream:
            assert (await stream.infer("held", {"x": f32(0)}))["y"].tolist() == [0]
        metrics = gw.runtime.models["held"].metrics
        assert metrics.items == 2  # the dispatched one and the last: 4 were withdrawn
        await settle()
        assert gw.statistics().streams == 0
        assert gw.statistics().connections == 0


async def test_a_refused_api_key_rejects_the_handshake_with_401():
    tenants = (trioserve.TenantConfig(name="acme", api_keys=("k1",)),)
    async with serving(config(echo_model(), tenants=tenants)) as gw:
        with pytest.raises(ConnectionRejected) as refused:
            async with open_stream(gw.url):
                pass
        assert refused.value.status_code == 401
        assert b"missing API key" in refused.value.body
        async with open_stream(gw.url, api_key="k1") as stream:
            assert (await stream.infer("echo", {"x": f32(1)}))["x"].tolist() == [1]
        assert gw.requests[("echo", "acme", 200)] == 1


async def test_a_class_the_tenant_may_not_use_is_forbidden_on_the_stream():
    tenants = (trioserve.TenantConfig(name="acme", api_keys=("k1",), classes=("realtime",)),)
    async with serving(config(echo_model(), tenants=tenants)) as gw, \
            open_stream(gw.url, api_key="k1") as stream:
        with pytest.raises(trioserve.Forbidden, match="may not use request class 'batch'"):
            await stream.infer("echo", {"x": f32(1)}, parameters={"priority": "batch"})


async def test_a_level_and_the_class_it_names_agree_on_the_stream():
    async with serving(config(echo_model())) as gw, open_stream(gw.url) as stream:
        both = {"priority": 1, "class": "realtime"}
        assert (await stream.infer("echo", {"x": f32(1)}, parameters=both))["x"].tolist() == [1]
        with pytest.raises(InvalidInput, match=r"\(class 'realtime'\) disagree"):
            await stream.infer("echo", {"x": f32(1)}, parameters={"priority": 1, "class": "batch"})
        stats = gw.runtime.models["echo"].scheduler.policy.stats
        assert {k: f.admitted for k, f in stats.items()} == {("t", "realtime"): 1}


async def test_a_plain_get_of_the_stream_endpoint_is_426():
    from trioserve.transport import open_http

    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        res = await http.get("/v2/stream")
    assert res.status == 426
    assert res.headers["upgrade"] == "websocket"
    assert res.headers["connection"] == "upgrade"  # a sender of Upgrade lists it


async def test_a_cancelled_infer_frees_its_slot_when_its_answer_comes():
    gate = Gate()
    async with serving(config(held_model(gate))) as gw, \
            open_stream(gw.url, max_in_flight=1) as stream:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.infer, "held", {"x": f32(1)})
            await settle()
            nursery.cancel_scope.cancel()
        gate.release()
        # The only slot comes back when the abandoned answer arrives (and is dropped).
        assert (await stream.infer("held", {"x": f32(0)}))["y"].tolist() == [0]


# ---------------------------------------------------------------- the protocol, raw
async def _raw_client(gw, head: bytes | None = None):
    """A bare TCP stream and a wsproto client that has completed the handshake."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, Request

    sock = await trio.open_tcp_stream(*gw.addresses[0])
    ws = WSConnection(ConnectionType.CLIENT)
    await sock.send_all(ws.send(Request(host="localhost", target="/v2/stream")))
    accepted = False
    while not accepted:
        ws.receive_data(await sock.receive_some(65536))
        accepted = any(isinstance(e, AcceptConnection) for e in ws.events())
    return sock, ws


async def _events_until(sock, ws, kind, limit: int = 100):
    seen = []
    for _ in range(limit):
        data = await sock.receive_some(65536)
        ws.receive_data(data or None)
        for event in ws.events():
            seen.append(event)
            if isinstance(event, kind):
                return seen
        if not data:
            break
    raise AssertionError(f"no {kind.__name__} in {seen}")


async def test_a_ping_is_answered_with_a_pong_carrying_its_payload():
    from wsproto.events import Ping, Pong

    async with serving(config(echo_model())) as gw:
        sock, ws = await _raw_client(gw)
        await sock.send_all(ws.send(Ping(payload=b"hello")))
        events = await _events_until(sock, ws, Pong)
        assert events[-1].payload == b"hello"
        await sock.aclose()


async def test_a_message_split_over_frames_and_reads_is_one_request():
    from wsproto.events import TextMessage

    async with serving(config(echo_model())) as gw:
        sock, ws = await _raw_client(gw)
        text = '{"id": "split", "model": "echo", "inputs": ' \
               '[{"name": "x", "shape": [2], "datatype": "FP32", "data": [7, 8]}]}'
        frames = ws.send(TextMessage(data=text[:20], message_finished=False)) + ws.send(
            TextMessage(data=text[20:], message_finished=True))
        for i in range(0, len(frames), 7):  # a few bytes at a time
            await sock.send_all(frames[i:i + 7])
            await settle()
        events = await _events_until(sock, ws, TextMessage)
        doc = __import__("json").loads(events[-1].data)
        assert doc["id"] == "split"
        assert doc["outputs"][0]["data"] == [7, 8]
        await sock.aclose()


@pytest.mark.parametrize("text", ["x" * 2000, "€" * 400], ids=["ascii", "utf-8"])
async def test_a_message_over_the_size_limit_closes_the_stream_with_1009(text):
    """The limit is in bytes: 400 euro signs are 1,200 bytes of UTF-8."""
    from wsproto.events import CloseConnection, TextMessage

    async with serving(config(echo_model(), server={"max_body_bytes": 1000})) as gw:
        sock, ws = await _raw_client(gw)
        await sock.send_all(ws.send(TextMessage(data=text)))
        events = await _events_until(sock, ws, CloseConnection)
        assert events[-1].code == 1009
        await sock.aclose()
        await settle()
        assert gw.statistics().streams == 0


async def test_a_handshake_without_a_key_is_refused_with_400():
    async with serving(config(echo_model())) as gw:
        sock = await trio.open_tcp_stream(*gw.addresses[0])
        await sock.send_all(b"GET /v2/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                            b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\r\n")
        data = b""
        while chunk := await sock.receive_some(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 400 ")
        assert b"content-type: application/json" in data.lower()
        assert b'{"error":"bad WebSocket handshake: ' in data
        await sock.aclose()
        await settle()
        assert gw.statistics().connections == 0


_HANDSHAKE = (b"GET /v2/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
              b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")


async def _handshake_answer(gw, head: bytes) -> bytes:
    sock = await trio.open_tcp_stream(*gw.addresses[0])
    await sock.send_all(head)
    data = b""
    while chunk := await sock.receive_some(65536):
        data += chunk
    await sock.aclose()
    return data


async def test_another_websocket_version_is_426_naming_the_one_spoken():
    async with serving(config(echo_model())) as gw:
        data = await _handshake_answer(
            gw, _HANDSHAKE.replace(b"Sec-WebSocket-Version: 13", b"Sec-WebSocket-Version: 8")
        )
    assert data.startswith(b"HTTP/1.1 426 ")
    assert b"\r\nsec-websocket-version: 13\r\n" in data.lower()  # RFC 6455 4.4
    assert b"unsupported WebSocket version" in data


_KEY = b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"


@pytest.mark.parametrize(
    ("head", "error"),
    [
        (_HANDSHAKE.replace(_KEY, b"Sec-WebSocket-Key: abc\r\n"),
         "Sec-WebSocket-Key must be 16 bytes in base64 (24 characters), got 'abc'"),
        (_HANDSHAKE.replace(_KEY, b"Sec-WebSocket-Key: !!!!!!!!!!!!!!!!!!!!!!!!\r\n"),
         "Sec-WebSocket-Key must be 16 bytes in base64 (24 characters), "
         "got '!!!!!!!!!!!!!!!!!!!!!!!!'"),
        (_HANDSHAKE.replace(_KEY, b"Sec-WebSocket-Key: \r\n"),
         "Sec-WebSocket-Key must be 16 bytes in base64 (24 characters), got ''"),
        (_HANDSHAKE.replace(_KEY, _KEY + _KEY), "Sec-WebSocket-Key appears 2 times; send it once"),
        (_HANDSHAKE.replace(b"Connection: Upgrade", b"Connection: Upgrade, \xff"),
         "the Connection header must be ASCII"),
        (_HANDSHAKE.replace(_KEY, _KEY + b"Sec-WebSocket-Protocol: v2, \xe9\r\n"),
         "the Sec-WebSocket-Protocol header must be ASCII"),
        (_HANDSHAKE.replace(_KEY, _KEY + b"Sec-WebSocket-Extensions: \xff\r\n"),
         "the Sec-WebSocket-Extensions header must be ASCII"),
        (_HANDSHAKE.replace(b"Host: x", b"Host: xn--zz"),
         "the Host header is not a valid host name"),
        (_HANDSHAKE.replace(b"Host: x", b"Host: \xc3\xa9"),
         "the Host header is not a valid host name"),
    ],
    ids=["short-key", "key-not-base64", "empty-key", "two-keys", "connection-not-ascii",
         "protocol-not-ascii", "extensions-not-ascii", "host-not-idna", "host-not-ascii"],
)
async def test_a_malformed_handshake_header_is_400_naming_it(head, error, caplog):
    """RFC 6455 4.2.1: one key, the base64 of 16 bytes (any key was accepted). A
    header wsproto decodes as text failed the connection with a logged traceback
    and no answer."""
    async with serving(config(echo_model())) as gw:
        data = await _handshake_answer(gw, head)
        await settle()
        assert gw.statistics().connections == 0
        assert gw.statistics().streams == 0
    assert data.startswith(b"HTTP/1.1 400 ")
    body = data.partition(b"\r\n\r\n")[2]
    assert json.loads(body) == {"error": f"bad WebSocket handshake: {error}"}
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


async def test_a_refused_key_on_the_stream_says_how_to_authenticate():
    tenants = (trioserve.TenantConfig(name="acme", api_keys=("k1",)),)
    async with serving(config(echo_model(), tenants=tenants)) as gw:
        data = await _handshake_answer(gw, _HANDSHAKE)
    assert data.startswith(b"HTTP/1.1 401 ")
    assert b'\r\nwww-authenticate: bearer realm="trioserve"\r\n' in data.lower()


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (_HANDSHAKE.replace(b"HTTP/1.1", b"HTTP/1.0"), b"needs HTTP/1.1"),
        (_HANDSHAKE.replace(b"Connection: Upgrade", b"Connection: Upgrade, close"),
         b"'Connection: close' ends the connection"),
    ],
    ids=["http-1.0", "connection-close"],
)
async def test_an_upgrade_that_cannot_happen_says_why(head, why):
    async with serving(config(echo_model())) as gw:
        data = await _handshake_answer(gw, head)
    assert data.startswith(b"HTTP/1.1 426 ")
    assert why in data
    head_lines = data.split(b"\r\n\r\n")[0].lower().split(b"\r\n")
    assert [v for v in head_lines if v.startswith(b"connection:")] == [b"connection: close"]


async def test_a_websocket_upgrade_needs_http_1_1():
    async with serving(config(echo_model())) as gw:
        sock = await trio.open_tcp_stream(*gw.addresses[0])
        await sock.send_all(_HANDSHAKE.replace(b"HTTP/1.1", b"HTTP/1.0"))
        data = b""
        while chunk := await sock.receive_some(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 426 ")
        assert b'"error"' in data
        await sock.aclose()




def _client_frame(payload: bytes, opcode: int = 0x1, *, masked: bool = True) -> bytes:
    """One final client frame (payload under 126 bytes), masked unless told."""
    assert len(payload) < 126
    mask = b"\x01\x02\x03\x04"
    if not masked:
        return bytes([0x80 | opcode, len(payload)]) + payload
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + body


async def _raw_handshake(gw, extra: bytes = b""):
    """A raw socket that sent the handshake (and ``extra`` in the same write) and a
    wsproto client fed the server's 101; returns (sock, ws, bytes after the 101)."""
    from wsproto import ConnectionType
    from wsproto.connection import Connection

    sock = await trio.open_tcp_stream(*gw.addresses[0])
    await sock.send_all(_HANDSHAKE + extra)
    data = b""
    while b"\r\n\r\n" not in data:
        data += await sock.receive_some(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 ")
    ws = Connection(ConnectionType.CLIENT)
    ws.receive_data(rest)
    return sock, ws


async def test_frames_sent_with_the_handshake_are_served():
    from wsproto.events import Pong, TextMessage

    text = b'{"id": "early", "model": "echo", "inputs": ' \
           b'[{"name": "x", "shape": [1], "datatype": "FP32", "data": [5]}]}'
    assert len(text) < 126
    async with serving(config(echo_model())) as gw:
        sock, ws = await _raw_handshake(
            gw, _client_frame(b"hi", opcode=0x9) + _client_frame(text)
        )
        seen = await _events_until(sock, ws, TextMessage)
        assert any(isinstance(e, Pong) and e.payload == b"hi" for e in seen)
        doc = json.loads(seen[-1].data)
        assert (doc["id"], doc["outputs"][0]["data"]) == ("early", [5])
        await sock.aclose()


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (_client_frame(b"{}", masked=False), 1002),  # a client frame must be masked
        (_client_frame(b"\xff\xfe"), 1007),  # text that is not UTF-8
        (_client_frame(b"x", opcode=0x3), 1002),  # a reserved opcode
    ],
)
async def test_a_protocol_error_closes_the_stream_with_its_code(frame, code):
    async with serving(config(echo_model())) as gw:
        sock, _ = await _raw_handshake(gw)
        await sock.send_all(frame)
        data = b""
        while len(data) < 4:
            chunk = await sock.receive_some(65536)
            assert chunk, "closed without a close frame"
            data += chunk
        assert data[0] == 0x88  # a close frame; its code:
        assert int.from_bytes(data[2:4], "big") == code
        await sock.aclose()


async def test_a_reset_stream_is_not_logged_as_an_error(caplog):
    import socket
    import struct

    async with serving(config(echo_model())) as gw:
        sock, _ = await _raw_handshake(gw)
        await settle()
        assert gw.statistics().streams == 1
        sock.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await sock.aclose()  # RST, not FIN
        for _ in range(100):  # until the server's read has seen the reset
            await settle()
            if gw.statistics().streams == 0:
                break
        assert gw.statistics().streams == 0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


# ---------------------------------------------------------------- leaving, draining, memory
def _infer_text(rid, x=(1.0,), model: str = "echo") -> str:
    """One request's message (ASCII: its length is its size in bytes)."""
    return json.dumps(
        {"id": rid, "model": model,
         "inputs": [{"name": "x", "shape": [len(x)], "datatype": "FP32", "data": list(x)}]}
    )


def _infer_frame(rid, x=(1.0,), model: str = "echo") -> bytes:
    """A raw client's frame for one request."""
    from wsproto.events import TextMessage

    return _raw_ws().send(TextMessage(data=_infer_text(rid, x, model)))


def _raw_ws():
    from wsproto import ConnectionType
    from wsproto.connection import Connection

    return Connection(ConnectionType.CLIENT)


async def test_a_client_that_leaves_at_the_in_flight_bound_is_seen_at_once():
    """At the bound the server does not read; the client's leaving is still noticed:
    its queued requests are withdrawn and refunded, and the requests it sent past the
    bound are never read or run."""
    gate = Gate()
    tenants = (trioserve.TenantConfig(name="t", default=True, credit_rate=1000.0),)
    cfg = config(held_model(gate, max_batch_size=1), tenants=tenants,
                 server={"stream_in_flight": 4})
    async with serving(cfg) as gw:
        rt = gw.runtime
        sock, _ = await _raw_handshake(gw)
        await sock.send_all(b"".join(_infer_frame(i, model="held") for i in range(10)))
        await settle()
        scheduler = rt.models["held"].scheduler
        assert scheduler.queue_depth() == 3  # and one running, held by the gate
        assert gw.statistics().stream_in_flight_peak == 4
        await sock.aclose()
        await settle()
        assert scheduler.queue_depth() == 0
        assert rt.credits_refunded["t"] == 3
        assert gw.statistics().streams == 0
        gate.release()
        # One replica, batches of one: this request runs after the held batch ends.
        async with open_stream(gw.url) as stream:
            assert (await stream.infer("held", {"x": f32(0)}))["y"].tolist() == [0]
        assert rt.models["held"].metrics.items == 2
        assert rt.credits_refunded["t"] == 3


async def test_an_answer_waiting_to_be_written_when_the_grace_ends_is_not_also_a_503():
    """A client that does not read during a drain: answers already framed are its
    answers (sent once it reads), never followed by a 503 frame for the same id."""
    from wsproto.events import CloseConnection, TextMessage

    x = np.random.default_rng(3).standard_normal(100_000).astype(np.float32).tolist()
    async with serving(config(echo_model())) as gw:
        raw = trio.socket.socket()
        raw.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
        await raw.connect(gw.addresses[0])
        sock = trio.SocketStream(raw)
        await sock.send_all(_HANDSHAKE + b"".join(_infer_frame(i, x) for i in range(4)))
        # The answers (~1 MB each) wait: the client does not read. Until all four are
        # framed (the last of the 4.8 MB may still be in the kernel's buffers when the
        # server's tasks first block), a drain would rightly answer one 503.
        with trio.fail_after(30):
            while sum(n for (_, _, st), n in gw.requests.items() if st == 200) < 4:
                await settle()
                await trio.sleep(0.001)  # real socket data in flight: poll, bounded
        ids: list[tuple[object, int]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gw.drain, 0)  # the grace ends at once
            await settle()
            data = b""
            while b"\r\n\r\n" not in data:
                data += await sock.receive_some(65536)
            ws = _raw_ws()
            ws.receive_data(data.partition(b"\r\n\r\n")[2])
            pieces: list[str] = []
            closed = None
            while closed is None:
                for event in ws.events():
                    if isinstance(event, TextMessage):
                        pieces.append(event.data)
                        if event.message_finished:
                            doc = json.loads("".join(pieces))
                            pieces.clear()
                            ids.append((doc["id"], doc.get("status", 200)))
                    elif isinstance(event, CloseConnection):
                        closed = event
                        await sock.send_all(ws.send(event.response()))
                if closed is None:
                    ws.receive_data(await sock.receive_some(1 << 20) or None)
        await sock.aclose()
    assert closed.code == 1001
    assert sorted(ids) == [(i, 200) for i in range(4)]


class _CutOnce(trio.abc.HalfCloseableStream):
    """A socket whose first write sends 10 bytes, then blocks until cancelled; later
    writes send everything."""

    def __init__(self) -> None:
        self.sent = b""
        self.writes = 0

    async def send_all(self, data) -> None:
        self.writes += 1
        if self.writes == 1:
            self.sent += bytes(data[:10])
            await trio.sleep_forever()
        self.sent += bytes(data)
        await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes=None) -> bytes:
        await trio.lowlevel.checkpoint()
        return b""

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_a_write_cancelled_part_way_breaks_the_stream():
    """Nothing is written after a cut frame: it would be read as the frame's rest."""
    from trioserve.transport._replay import ReplayStream

    socket = _CutOnce()
    stream = ReplayStream(socket, b"")
    async with trio.open_nursery() as nursery:
        flushing = trio.CancelScope()

        async def flusher() -> None:
            with flushing:
                await stream.run_flusher()

        nursery.start_soon(flusher)
        await settle()
        await stream.send_all(b"A" * 100)
        await settle()
        assert socket.sent == b"A" * 10  # and the write waits
        flushing.cancel()  # as a drain does to a client that does not read
    with pytest.raises(trio.BrokenResourceError):
        await stream.send_all(b"B" * 10)
    await stream.aclose()
    assert socket.sent == b"A" * 10


async def test_a_message_in_many_small_fragments_holds_only_its_size():
    """A message's pieces are gathered in one buffer: 20,000 fragments of 2 bytes and
    20,000 empty ones hold ~40 KB, not an object (or a list slot) per fragment."""
    import tracemalloc

    from wsproto.events import TextMessage

    ws = _raw_ws()
    frames = [ws.send(TextMessage(data='{"id": "', message_finished=False))]
    for _ in range(20_000):
        frames.append(ws.send(TextMessage(data="ab", message_finished=False)))
        frames.append(ws.send(TextMessage(data="", message_finished=False)))
    body = b"".join(frames)
    last = ws.send(TextMessage(data='", "model": "echo", "inputs": [{"name": "x", '
                               '"shape": [1], "datatype": "FP32", "data": [3]}]}'))
    async with serving(config(echo_model())) as gw:
        sock, reader = await _raw_handshake(gw)
        await settle()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            await sock.send_all(body)
            await settle()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert held < 300_000  # the pieces as a list: ~1.4 MB
        await sock.send_all(last)
        seen = await _events_until(sock, reader, TextMessage)
        doc = json.loads(seen[-1].data)
        assert (doc["id"], doc["outputs"][0]["data"]) == ("ab" * 20_000, [3])
        await sock.aclose()


async def test_an_integer_id_past_64_bits_is_refused_saying_so():
    """JSON parsers read it as a float: the error says what an integer id may be."""
    async with serving(config(echo_model())) as gw, open_stream(gw.url) as stream:
        for rid in (2**64 - 1, 10**30, 1.5):
            await stream.send_raw(json.dumps({"id": rid, "model": "echo", "inputs": [
                {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}))
        replies = sorted([await stream.receive() for _ in range(3)], key=lambda r: r.id)
    assert [r.id for r in replies] == [1.5, 2**64 - 1, 1e30]
    assert replies[1].error is None
    assert (replies[0].status, replies[0].error) == (
        400, "a stream message needs an 'id' (string or integer)")
    assert replies[2].status == 400
    assert "within 64 bits" in replies[2].error


@pytest.mark.parametrize(("rate", "retry_after"), [(1.0, 1), (1e-320, 86_400)])
async def test_a_429_frame_says_when_to_retry_and_the_stream_goes_on(rate, retry_after):
    # An infinite refill time (1e-320) crashed the connection (OverflowError turning
    # it into whole seconds); the client read "the server is shutting down".
    tenants = (trioserve.TenantConfig(name="acme", api_keys=("k1",), credit_rate=rate,
                                      credit_burst=1.0),)
    async with serving(config(echo_model(), tenants=tenants)) as gw, \
            open_stream(gw.url, api_key="k1") as stream:
        await stream.send("a", "echo", {"x": f32(1)})
        assert (await stream.receive()).error is None
        await stream.send("b", "echo", {"x": f32(1)})
        refused = await stream.receive()
        assert (refused.id, refused.status, refused.retry_after) == ("b", 429, retry_after)
        with pytest.raises(trioserve.QuotaExceeded) as over:
            await stream.infer("echo", {"x": f32(1)})
        assert over.value.retry_after == retry_after
        await stream.send("c", "missing", {"x": f32(1)})
        assert ((await stream.receive()).id, gw.statistics().streams) == ("c", 1)


# ---------------------------------------------------------------- failing the connection
def _frame_header(length: int, opcode: int = 0x1, *, fin: bool = True) -> bytes:
    """A masked client frame's header (and mask) announcing ``length`` bytes."""
    import struct

    first = bytes([(0x80 if fin else 0) | opcode])
    if length < 126:
        size = bytes([0x80 | length])
    elif length < 1 << 16:
        size = bytes([0x80 | 126]) + struct.pack("!H", length)
    else:
        size = bytes([0x80 | 127]) + struct.pack("!Q", length)
    return first + size + b"\x01\x02\x03\x04"


async def _read_to_eof(sock) -> bytes:
    data = b""
    while chunk := await sock.receive_some(1 << 20):
        data += chunk
    return data


@pytest.mark.parametrize(
    "frames",
    [
        _frame_header(1 << 40),  # one frame, its payload never sent
        _frame_header(1001),
        # a first fragment within the limit, then a continuation announcing too much
        _frame_header(600, fin=False) + bytes(600) + _frame_header(401, opcode=0x0),
    ],
    ids=["1-tib", "one-byte-over", "fragments"],
)
async def test_a_frame_announcing_more_than_the_limit_is_refused_from_its_header(
    autojump_clock, frames
):
    """1009 as soon as the header is read, without waiting for (or reading) its
    payload, and without waiting for the client's close frame: the socket closes at
    once."""
    from wsproto.events import CloseConnection

    async with serving(config(echo_model(), server={"max_body_bytes": 1000})) as gw:
        sock, ws = await _raw_handshake(gw)
        t0 = trio.current_time()
        await sock.send_all(frames)
        ws.receive_data(await _read_to_eof(sock))
        closes = [e for e in ws.events() if isinstance(e, CloseConnection)]
        assert trio.current_time() == t0  # no wait for the payload or a close frame
        assert [(e.code, e.reason) for e in closes] == [(1009, "message over 1000 bytes")]
        await sock.aclose()
        await settle()
        assert gw.statistics().streams == 0


async def test_a_protocol_error_closes_at_once_and_withdraws_requests_in_flight(autojump_clock):
    """Failing the connection (RFC 6455 7.1.7): the close frame is not held back until
    the requests in flight are answered, and the server does not wait for the client's
    close frame; a queued request is withdrawn (refunded), nothing answers it."""
    from wsproto.events import CloseConnection, TextMessage

    gate = Gate()
    tenants = (trioserve.TenantConfig(name="t", default=True, credit_rate=1000.0),)
    cfg = config(held_model(gate, max_batch_size=1, timeout_ms=None), tenants=tenants)
    try:
        async with serving(cfg) as gw:
            sock, ws = await _raw_handshake(gw)
            await sock.send_all(_infer_frame("running", model="held")
                                + _infer_frame("queued", model="held"))
            await trio.to_thread.run_sync(gate.holding.wait)
            await settle()
            assert gw.runtime.models["held"].scheduler.queue_depth() == 1
            t0 = trio.current_time()
            await sock.send_all(_client_frame(b"{}", masked=False))
            ws.receive_data(await _read_to_eof(sock))
            events = list(ws.events())
            assert trio.current_time() == t0
            assert [type(e) for e in events] == [CloseConnection]
            assert events[0].code == 1002
            assert not any(isinstance(e, TextMessage) for e in events)
            await sock.aclose()
            await settle()
            assert gw.runtime.models["held"].scheduler.queue_depth() == 0
            assert gw.runtime.credits_refunded["t"] == 1
            assert gw.statistics().streams == 0
    finally:
        gate.release()


@pytest.mark.parametrize(
    ("server", "key"),
    [
        ({"stream_write_timeout_s": 20}, "stream_write_timeout_s"),
        ({"write_timeout_s": 20}, "write_timeout_s"),  # the stream's bound by default
        ({"write_timeout_s": 5, "stream_write_timeout_s": 20}, "stream_write_timeout_s"),
    ],
    ids=["stream", "general", "stream-over-general"],
)
async def test_a_client_that_takes_no_answers_is_closed_with_1008_after_the_timeout(
    autojump_clock, server, key
):
    """Its answers fill the socket; after its write timeout (``server.stream_write_timeout_s``,
    else ``server.write_timeout_s``) with none
    of them taken the stream closes with 1008 and its requests in flight are withdrawn
    (a queued one refunded). A client that reads again then sees whole answers, then
    the close frame: the answer cut by the timeout is finished first."""
    from wsproto.events import CloseConnection, TextMessage

    gate = Gate()
    tenants = (trioserve.TenantConfig(name="t", default=True, credit_rate=1000.0),)
    cfg = config(echo_model(), held_model(gate, max_batch_size=1, timeout_ms=None),
                 tenants=tenants, server=server)
    from trioserve.transport._http import serve_connection

    x = np.random.default_rng(4).standard_normal(100_000).astype(np.float32).tolist()
    try:
        async with serving(cfg) as gw, trio.open_nursery() as nursery:
            # A socket pair, not TCP: no delayed acknowledgement makes a write wait on
            # the wall clock while the mock clock jumps, so the client not reading is
            # the only thing that stops the server's writes.
            server, client = trio.socket.socketpair()
            server.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, 4096)
            nursery.start_soon(serve_connection, gw, trio.SocketStream(server))
            sock = trio.SocketStream(client)
            await sock.send_all(_HANDSHAKE + _infer_frame("running", model="held")
                                + _infer_frame("queued", model="held"))
            await trio.to_thread.run_sync(gate.holding.wait)
            await sock.send_all(b"".join(_infer_frame(i, x) for i in range(4)))
            await settle()  # the answers (~1 MB each) wait: the client does not read
            t0 = trio.current_time()
            await trio.sleep(19.75)
            assert gw.statistics().streams == 1
            assert gw.statistics().stream_write_timeouts == 0
            assert gw.runtime.models["held"].scheduler.queue_depth() == 1
            await trio.sleep(0.5)
            assert trio.current_time() == t0 + 20.25
            assert gw.statistics().stream_write_timeouts == 1
            assert gw.runtime.models["held"].scheduler.queue_depth() == 0
            assert gw.runtime.credits_refunded["t"] == 1
            ws = _raw_ws()
            ws.receive_data((await _read_to_eof(sock)).partition(b"\r\n\r\n")[2])
            events = list(ws.events())
            answers, pieces = [], []
            for event in events[:-1]:
                assert isinstance(event, TextMessage)
                pieces.append(event.data)
                if event.message_finished:
                    answers.append(json.loads("".join(pieces)))
                    pieces.clear()
            assert not pieces  # the cut answer was finished
            assert answers
            assert all(a["outputs"][0]["shape"] == [100_000] for a in answers)
            assert isinstance(events[-1], CloseConnection)
            assert (events[-1].code, events[-1].reason) == (
                1008, f"answers not read for 20 s (server.{key})")
            await sock.aclose()
            await settle()
            assert gw.statistics().streams == 0
    finally:
        gate.release()


def _masked(payload: bytes) -> bytes:
    """``payload`` masked with the key of :func:`_frame_header`."""
    mask = b"\x01\x02\x03\x04"
    return bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


@pytest.mark.parametrize("decoder_state", ["read", "unreadable"])
async def test_a_message_of_exactly_the_limit_arriving_slowly_is_served(
    autojump_clock, monkeypatch, decoder_state
):
    """The check of the pending frame header counts what the message has brought and
    what the header still announces, to the byte: a euro sign cut between two reads
    (held by the UTF-8 decoder) is not lost nor counted twice. Were wsproto's decoder
    state unreadable, the bytes are counted as they come, as before."""
    from trioserve.transport import _stream
    from wsproto.events import TextMessage

    if decoder_state == "unreadable":
        monkeypatch.setattr(_stream, "_unread", lambda frames, texts: 0)
    doc = json.dumps({"id": "€", "model": "echo", "inputs": [
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [2.0]}]}, ensure_ascii=False)
    text = (doc + " " * 1000).encode()[:1000]  # padded with spaces to 1,000 bytes
    cut = text.index("€".encode()) + 1  # inside the first euro sign
    async with serving(config(echo_model(), server={"max_body_bytes": 1000})) as gw:
        sock, ws = await _raw_handshake(gw)
        payload = _masked(text)
        await sock.send_all(_frame_header(1000) + payload[:cut])
        await settle()
        assert gw.statistics().streams == 1  # not refused: exactly the limit
        await sock.send_all(payload[cut:])
        events = await _events_until(sock, ws, TextMessage)
        answer = json.loads(events[-1].data)
        assert answer["id"] == "€"
        assert answer["outputs"][0]["data"] == [2.0]
        await sock.aclose()


async def test_without_the_decoder_state_a_message_is_refused_as_its_bytes_come(
    autojump_clock, monkeypatch
):
    """The fallback: a frame announcing one byte over the limit is read until its
    bytes pass the limit, then refused (1009) all the same."""
    from trioserve.transport import _stream
    from wsproto.events import CloseConnection

    monkeypatch.setattr(_stream, "_unread", lambda frames, texts: 0)
    async with serving(config(echo_model(), server={"max_body_bytes": 1000})) as gw:
        sock, ws = await _raw_handshake(gw)
        payload = _masked(b"x" * 1001)
        await sock.send_all(_frame_header(1001) + payload[:600])
        await settle()
        assert gw.statistics().streams == 1  # the header alone is not seen
        await sock.send_all(payload[600:])
        ws.receive_data(await _read_to_eof(sock))
        closes = [e for e in ws.events() if isinstance(e, CloseConnection)]
        assert [(e.code, e.reason) for e in closes] == [(1009, "message over 1000 bytes")]
        await sock.aclose()


async def test_two_authorization_headers_refuse_the_handshake():
    """The last of two Authorization field lines chose the stream's tenant; now a
    handshake with more than one is refused with 401, as HTTP refuses it."""
    tenants = (trioserve.TenantConfig(name="acme", api_keys=("k1",)),
               trioserve.TenantConfig(name="other", api_keys=("k2",)))
    head = _HANDSHAKE.replace(
        b"\r\n\r\n", b"\r\nAuthorization: Bearer k2\r\nAuthorization: Bearer k1\r\n\r\n"
    )
    async with serving(config(echo_model(), tenants=tenants)) as gw:
        sock = await trio.open_tcp_stream(*gw.addresses[0])
        await sock.send_all(head)
        data = b""
        while b"\r\n\r\n" not in data:  # the answer's head (a 101 keeps it open)
            data += await sock.receive_some(65536)
        await sock.aclose()
        assert data.startswith(b"HTTP/1.1 401 "), data
        assert b"more than one Authorization header" in data
        assert b'\r\nwww-authenticate: bearer realm="trioserve"\r\n' in data.lower()
        async with open_stream(gw.url, api_key="k1") as stream:  # one is fine
            assert (await stream.infer("echo", {"x": f32(1)}))["x"].tolist() == [1]
        assert dict(gw.requests) == {("echo", "acme", 200): 1}


_LATE = _infer_frame("late")  # one frame: each call masks with a key of its own


def _fragments(n: int) -> list[bytes]:
    """A text message's first fragment, then ``n - 1`` continuations, none final."""
    first = _frame_header(2, fin=False) + _masked(b"{ ")
    return [first] + [_frame_header(1, opcode=0x0, fin=False) + _masked(b" ")] * (n - 1)


@pytest.mark.parametrize(
    "pieces",
    [
        [_LATE[i:i + 1] for i in range(4)],  # a frame header, a byte at a time
        [_LATE[i:i + 12] for i in range(0, 48, 12)],  # into its payload
        _fragments(4),  # a fragmented message, never finished
    ],
    ids=["header", "payload", "fragments"],
)
async def test_a_message_not_received_whole_in_time_closes_the_stream_with_1008(
    autojump_clock, pieces
):
    """A message begun must arrive whole within ``server.request_timeout_s``, as an
    HTTP request must (it held the connection, and its bytes so far, for ever);
    counted from its first bytes, not afresh with each. An idle stream is not
    closed."""
    from wsproto.events import CloseConnection, TextMessage

    cfg = config(echo_model(), server={"request_timeout_s": 10})
    async with serving(cfg) as gw:
        sock, ws = await _raw_handshake(gw)
        await sock.send_all(_infer_frame("whole"))
        events = await _events_until(sock, ws, TextMessage)
        assert json.loads(events[-1].data)["id"] == "whole"
        await trio.sleep(100)  # idle, nothing begun
        assert gw.statistics().streams == 1
        t0 = trio.current_time()
        for i, piece in enumerate(pieces):  # at t0, t0 + 3, t0 + 6, t0 + 9
            if i:
                await trio.sleep_until(t0 + 3 * i)
            await sock.send_all(piece)
            await settle()
        await trio.sleep_until(t0 + 9.9)
        assert gw.statistics().streams == 1
        await trio.sleep_until(t0 + 10.1)
        assert gw.statistics().streams == 0
        ws.receive_data(await _read_to_eof(sock))
        closes = [e for e in ws.events() if isinstance(e, CloseConnection)]
        assert [(e.code, e.reason) for e in closes] == [
            (1008, "a message not received whole within 10 s (server.request_timeout_s)")]
        await sock.aclose()


async def _quiet_until(sock, when: float) -> None:
    """Assert that the server sends nothing before ``when``."""
    with trio.move_on_at(when):
        data = await sock.receive_some(65536)
        raise AssertionError(f"the server sent {data!r} at {trio.current_time()}")


async def test_a_silent_stream_is_pinged_then_closed_with_1011(autojump_clock):
    """A stream that sends nothing for ``server.stream_ping_interval_s`` is pinged;
    nothing again for as long, not even the pong, and it is closed with 1011 (a peer
    gone without a FIN held its connection for ever)."""
    from wsproto.events import CloseConnection, Ping, TextMessage

    cfg = config(echo_model(), server={"stream_ping_interval_s": 20})
    async with serving(cfg) as gw:
        sock, ws = await _raw_handshake(gw)
        await sock.send_all(_infer_frame("r"))
        t0 = trio.current_time()  # the server read the request now
        events = await _events_until(sock, ws, TextMessage)
        assert json.loads(events[-1].data)["id"] == "r"
        await _quiet_until(sock, t0 + 19.9)
        pings = await _events_until(sock, ws, Ping)
        assert [e.payload for e in pings] == [b"trioserve"]
        assert trio.current_time() == pytest.approx(t0 + 20)
        await trio.sleep_until(t0 + 39.9)
        assert gw.statistics().streams == 1
        await trio.sleep_until(t0 + 40.1)
        assert gw.statistics().streams == 0
        assert gw.statistics().stream_ping_timeouts == 1
        ws.receive_data(await _read_to_eof(sock))
        closes = [e for e in ws.events() if isinstance(e, CloseConnection)]
        assert [(e.code, e.reason) for e in closes] == [
            (1011, "no answer to a ping within 20 s (server.stream_ping_interval_s)")]
        await sock.aclose()


async def test_a_stream_that_answers_pings_or_sends_is_never_closed(autojump_clock):
    """A pong, or any message, counts: each starts the quiet interval again, so an
    idle client that answers pings stays open, and a busy one is never pinged."""
    from wsproto.events import Ping, TextMessage

    cfg = config(echo_model(), server={"stream_ping_interval_s": 20})
    async with serving(cfg) as gw:
        sock, ws = await _raw_handshake(gw)
        t = trio.current_time()
        for _ in range(5):  # a request every 15 s: never pinged
            await _quiet_until(sock, t + 15)
            await sock.send_all(_infer_frame("busy"))
            t = trio.current_time()
            events = await _events_until(sock, ws, TextMessage)
            assert not any(isinstance(e, Ping) for e in events)
        for _ in range(5):  # idle, answering each ping at once: one ping every 20 s
            pings = await _events_until(sock, ws, Ping)
            assert trio.current_time() == pytest.approx(t + 20)
            await sock.send_all(ws.send(pings[-1].response()))
            t = trio.current_time()
        assert gw.statistics().streams == 1
        assert gw.statistics().stream_ping_timeouts == 0
        await sock.aclose()


async def test_streams_are_not_pinged_with_the_interval_at_0(autojump_clock):
    cfg = config(echo_model(), server={"stream_ping_interval_s": 0})
    async with serving(cfg) as gw:
        sock, _ = await _raw_handshake(gw)
        await _quiet_until(sock, trio.current_time() + 10_000)
        assert gw.statistics().streams == 1
        await sock.aclose()


def test_the_default_stream_ping_interval_is_20_s():
    assert trioserve.ServerConfig().stream_ping_interval_s == 20.0


# ---------------------------------------------------------------- the byte budget
async def _answers(sock, ws, count: int) -> list[dict]:
    """Read ``count`` whole answers from a raw client's socket."""
    from wsproto.events import TextMessage

    answers, pieces = [], []
    while len(answers) < count:
        data = await sock.receive_some(1 << 20)
        assert data, f"closed after {len(answers)} answers"
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, TextMessage):
                pieces.append(event.data)
                if event.message_finished:
                    answers.append(json.loads("".join(pieces)))
                    pieces.clear()
    return answers


def _flow_is_whole(gw, model: str, count: int) -> None:
    """``count`` requests admitted and dispatched on ``model``, none lost, shed or
    withdrawn, all answered 200 on the stream."""
    stats = gw.runtime.models[model].scheduler.policy.stats[("t", "realtime")]
    assert (stats.admitted, stats.dispatched) == (count, count)
    assert (stats.shed, stats.withdrawn, stats.expired) == (0, 0, 0)
    assert gw.requests == {(model, "t", 200): count}


async def test_at_the_byte_budget_the_server_stops_reading_until_requests_end():
    """Messages are read while the bytes of those in flight fit
    ``server.stream_in_flight_bytes``; the next one waits, not read further, well
    under ``server.stream_in_flight``, and is read when a request ends."""
    gate = Gate()
    x = [1.0] * 1000
    size = len(_infer_text(0, x, "held"))  # ids 0-9: all the same size
    budget = 3 * size + size // 2  # three messages fit, not four
    cfg = config(held_model(gate, max_batch_size=1), server={"stream_in_flight_bytes": budget})
    try:
        async with serving(cfg) as gw:
            sock, ws = await _raw_handshake(gw)
            await sock.send_all(b"".join(_infer_frame(i, x, "held") for i in range(10)))
            await trio.to_thread.run_sync(gate.holding.wait)
            await settle()
            stats = gw.statistics()
            assert gw.runtime.models["held"].scheduler.queue_depth() == 2  # and one running
            assert stats.stream_in_flight_peak == 3
            assert stats.stream_in_flight_bytes_peak == 3 * size
            assert stats.stream_byte_budget_waits == 1
            gate.release()
            answers = await _answers(sock, ws, 10)
            assert sorted(a["id"] for a in answers) == list(range(10))
            stats = gw.statistics()
            assert stats.stream_in_flight_peak == 3
            assert stats.stream_in_flight_bytes_peak <= budget
            _flow_is_whole(gw, "held", 10)
            await sock.aclose()
    finally:
        gate.release()


async def test_answers_not_yet_written_count_in_the_byte_budget():
    """A client that does not read: once the answers waiting for it hold the budget
    the server reads no more (no request in flight); it reads again as the client
    takes its answers."""
    from trioserve.transport._http import serve_connection

    x = [0.5] * 20_000
    size = len(_infer_text(0, x))  # an answer is a little smaller (no spaces)
    budget = 2 * size
    cfg = config(echo_model(), server={"stream_in_flight_bytes": budget})
    async with serving(cfg) as gw, trio.open_nursery() as nursery:
        server, client = trio.socket.socketpair()
        server.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, 4096)
        client.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
        nursery.start_soon(serve_connection, gw, trio.SocketStream(server))
        sock = trio.SocketStream(client)
        await sock.send_all(_HANDSHAKE)
        head = b""
        while b"\r\n\r\n" not in head:
            head += await sock.receive_some(1)
        nursery.start_soon(sock.send_all, b"".join(_infer_frame(i, x) for i in range(8)))
        await settle()
        # Two fit (2 * size); both answered at once; their answers wait for the client
        # and hold more than the budget leaves for a third.
        assert gw.runtime.models["echo"].metrics.items == 2
        assert gw.statistics().stream_byte_budget_waits == 1
        assert gw.statistics().stream_in_flight_bytes_peak == 2 * size
        answers = await _answers(sock, _raw_ws(), 8)
        assert sorted(a["id"] for a in answers) == list(range(8))
        assert gw.statistics().stream_in_flight_bytes_peak <= budget
        _flow_is_whole(gw, "echo", 8)
        await sock.aclose()


async def test_a_message_larger_than_the_byte_budget_is_served_alone():
    """With nothing held a message is read whatever its size: one over the budget is
    served, and nothing else is in flight with it."""
    gate = Gate()
    x = [1.0] * 500
    size = len(_infer_text(0, x, "held"))
    cfg = config(held_model(gate, max_batch_size=1), server={"stream_in_flight_bytes": 1000})
    assert size > 1000
    try:
        async with serving(cfg) as gw:
            sock, ws = await _raw_handshake(gw)
            await sock.send_all(b"".join(_infer_frame(i, x, "held") for i in range(3)))
            await trio.to_thread.run_sync(gate.holding.wait)
            await settle()
            assert gw.runtime.models["held"].scheduler.queue_depth() == 0
            assert gw.statistics().stream_in_flight_peak == 1
            assert gw.statistics().stream_byte_budget_waits == 1
            gate.release()
            answers = await _answers(sock, ws, 3)
            assert sorted(a["id"] for a in answers) == [0, 1, 2]
            assert all(a["outputs"][0]["shape"] == [500] for a in answers)
            stats = gw.statistics()
            assert (stats.stream_in_flight_peak, stats.stream_in_flight_bytes_peak) == (1, size)
            _flow_is_whole(gw, "held", 3)
            await sock.aclose()
    finally:
        gate.release()


async def test_a_client_that_never_reads_is_cut_by_the_write_timeout_at_the_byte_budget(
    autojump_clock,
):
    """The read loop waits at the byte budget for answers the client never takes: the
    write timeout still closes the stream (1008), the message it held back unread."""
    from trioserve.transport._http import serve_connection
    from wsproto.events import CloseConnection

    x = np.random.default_rng(6).standard_normal(100_000).astype(np.float32).tolist()
    cfg = config(echo_model(), server={"write_timeout_s": 20,
                                       "stream_in_flight_bytes": 1 << 20})
    async with serving(cfg) as gw, trio.open_nursery() as nursery:
        server, client = trio.socket.socketpair()
        server.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, 4096)
        nursery.start_soon(serve_connection, gw, trio.SocketStream(server))
        sock = trio.SocketStream(client)
        frames = _HANDSHAKE + b"".join(_infer_frame(i, x) for i in range(3))

        async def send() -> None:
            with contextlib.suppress(trio.BrokenResourceError):
                await sock.send_all(frames)

        nursery.start_soon(send)
        await settle()
        t0 = trio.current_time()
        await trio.sleep(19.75)
        stats = gw.statistics()
        assert (stats.streams, stats.stream_write_timeouts) == (1, 0)
        assert stats.stream_byte_budget_waits == 1
        assert gw.runtime.models["echo"].metrics.items == 1  # the others never read
        await trio.sleep(0.5)
        assert trio.current_time() == t0 + 20.25
        assert gw.statistics().stream_write_timeouts == 1
        # What the server wrote, then a reset, not EOF: it closed with the client's
        # messages unread.
        data, reset = b"", False
        while not reset:
            try:
                chunk = await sock.receive_some(1 << 20)
            except trio.BrokenResourceError:
                reset = True
            else:
                assert chunk, "EOF, not a reset"
                data += chunk
        ws = _raw_ws()
        ws.receive_data(data.partition(b"\r\n\r\n")[2])
        events = list(ws.events())
        assert isinstance(events[-1], CloseConnection)
        assert events[-1].code == 1008
        await settle()  # the sender fails too: the server is gone
        await sock.aclose()
        await settle()
        assert gw.statistics().streams == 0
        assert gw.requests == {("echo", "t", 200): 1}
