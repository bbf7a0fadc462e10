"""The /v2/stream WebSocket's opening handshake: API keys, the Upgrade and
Sec-WebSocket-* headers, what a refused or impossible upgrade answers, and frames
sent with the handshake."""

from __future__ import annotations

import json

import pytest
import trio
import trioserve
from http_helpers import (
    _HANDSHAKE,
    _client_frame,
    _events_until,
    _raw_handshake,
    config,
    echo_model,
    f32,
    serving,
    settle,
)
from trio_websocket import ConnectionRejected
from trioserve.transport import open_stream


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


async def test_a_plain_get_of_the_stream_endpoint_is_426():
    from trioserve.transport import open_http

    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        res = await http.get("/v2/stream")
    assert res.status == 426
    assert res.headers["upgrade"] == "websocket"
    assert res.headers["connection"] == "upgrade"  # a sender of Upgrade lists it


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
    # it closes, and the Upgrade it advertises is listed in Connection (RFC 9110 7.8)
    found = [v for v in head_lines if v.startswith(b"connection:")]
    assert len(found) == 1, found
    assert {o.strip() for o in found[0].partition(b":")[2].split(b",")} == {
        b"close", b"upgrade"
    }
    assert b"upgrade: websocket" in head_lines


@pytest.mark.parametrize("closing", ["client-asks", "server-leaving"])
async def test_a_426_that_closes_the_connection_has_one_connection_line(closing):
    """A plain GET of /v2/stream is 426 with ``Upgrade`` and ``upgrade`` in
    ``Connection``; when the connection then closes (the client sent ``Connection:
    close``, or the server is leaving, its drain delay) ``close`` joins it in the
    same field line: there were two, ``Connection: close`` and ``Connection:
    upgrade``, which a client reading one line takes for one option."""
    head = b"GET /v2/stream HTTP/1.1\r\nHost: x\r\n"
    if closing == "client-asks":
        head += b"Connection: close\r\n"
    async with serving(config(echo_model())) as gw, trio.open_nursery() as nursery:
        if closing == "server-leaving":
            nursery.start_soon(gw.leave, 3600)
            await settle()
        data = await _handshake_answer(gw, head + b"\r\n")
        nursery.cancel_scope.cancel()
    assert data.startswith(b"HTTP/1.1 426 ")
    lines = data.partition(b"\r\n\r\n")[0].split(b"\r\n")
    found = [line for line in lines if line.lower().startswith(b"connection:")]
    assert len(found) == 1, found
    options = {o.strip().lower() for o in found[0].partition(b":")[2].split(b",")}
    assert options == {b"close", b"upgrade"}
    assert b"upgrade: websocket" in [line.lower() for line in lines]


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
