"""``Expect: 100-continue`` when the answer does not depend on the body: the final
answer comes without a 100 first (RFC 9110 10.1.1), and the connection closes, the
body the client may still send drained and never read as a request. Over a raw
socket, as what arrives before the client sends its body is the point."""

from __future__ import annotations

import gzip

import orjson
import pytest
import trio
from http_helpers import config, echo_model, serving, v2_input
from trioserve import TenantConfig

BODY = orjson.dumps({"inputs": [v2_input([[7.0]])]})
LIMIT = 64 * 1024
TENANTS = (TenantConfig(name="A", api_keys=("key-a",)), TenantConfig(name="t", default=True))


@pytest.fixture
async def server():
    async with serving(config(echo_model(), tenants=TENANTS,
                              server={"max_body_bytes": LIMIT})) as gw:
        yield gw


@pytest.fixture
async def guarded():
    cfg = config(echo_model(), tenants=TENANTS, server={"control_plane_keys": ("ops",)})
    async with serving(cfg) as gw:
        yield gw


def head(method: bytes, target: bytes, extra: bytes = b"", length: int = len(BODY)) -> bytes:
    framing = b"Content-Length: %d\r\n" % length
    if length < 0:
        framing = b"Transfer-Encoding: chunked\r\n"
    return (b"%s %s HTTP/1.1\r\nHost: t\r\n%sExpect: 100-continue\r\n%s\r\n"
            % (method, target, framing, extra))


def infer_request(value: float) -> bytes:
    body = orjson.dumps({"inputs": [v2_input([[value]])], "id": str(value)})
    return (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body))


async def first_bytes(gw, request_head: bytes) -> tuple[trio.SocketStream, bytes]:
    """Send ``request_head`` alone; return the stream and the first bytes answered."""
    stream = await trio.open_tcp_stream(*gw.addresses[0])
    await stream.send_all(request_head)
    return stream, await stream.receive_some(65536)


async def rest_to_eof(stream: trio.SocketStream, data: bytes) -> bytes:
    while chunk := await stream.receive_some(65536):
        data += chunk
    await stream.aclose()
    return data


def parse(data: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    head_part, _, body = data.partition(b"\r\n\r\n")
    lines = head_part.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    assert int(headers.get(b"content-length", b"0")) == len(body)  # one answer, whole
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize(
    ("request_head", "status", "message"),
    [
        (head(b"POST", b"/v2/models/NOPE/infer"), 404, "unknown model 'NOPE'"),
        (head(b"POST", b"/v2/models/echo/versions/9/infer"), 404, "version '9'"),
        (head(b"POST", b"/v2/models/NOPE/infer", length=-1), 404, "'NOPE'"),  # chunked
        (head(b"POST", b"/v2/nothing/here"), 404, "no such endpoint: POST /v2/nothing/here"),
        (head(b"PUT", b"/v2/models/echo/infer"), 405, "method PUT is not allowed"),
        (head(b"POST", b"/v2/health/live"), 405, "allowed: GET, HEAD, OPTIONS"),
        (head(b"POST", b"/v2//models/echo/infer"), 404, "paths are not normalised"),
        (head(b"post", b"/v2/models/echo/infer"), 501, "'post' is not implemented"),
        (head(b"POST", b"/v2/models/echo/infer", length=LIMIT + 1), 413, "request body too"),
    ],
    ids=["unknown-model", "unknown-version", "unknown-model-chunked", "unknown-route",
         "wrong-method", "wrong-method-control", "unusual-target", "unknown-method",
         "too-large"],
)
async def test_an_answer_known_from_the_head_comes_without_a_100(
    server, request_head, status, message
):
    """It came after a 100 and the body (curl waits a second for the 100, and a
    client that honours the final status sends no body at all); now at once, with
    ``Connection: close``. The body the client then sends anyway, and a request
    pipelined behind it, are drained, never read as a request."""
    stream, data = await first_bytes(server, request_head)
    assert data.startswith(b"HTTP/1.1 %d " % status), data[:40]
    # the client sends its body after all (as curl does past its wait), then another
    # request behind it, which is not answered: the connection is closed
    body = BODY if b"chunked" not in request_head else b"%x\r\n%s\r\n0\r\n\r\n" % (
        len(BODY), BODY)
    try:
        await stream.send_all(body + infer_request(1.0))
        await stream.send_eof()
    except trio.BrokenResourceError:
        pass  # (413 closed it)
    data = await rest_to_eof(stream, data)
    got, headers, out = parse(data)
    assert got == status
    assert headers[b"connection"] == b"close"
    assert message in orjson.loads(out)["error"]
    assert b" 100 " not in data
    assert b"HTTP/1.1 200" not in data


async def test_an_unknown_model_is_counted_as_after_its_body(server):
    stream, data = await first_bytes(server, head(b"POST", b"/v2/models/NOPE/infer"))
    await stream.aclose()
    assert data.startswith(b"HTTP/1.1 404 ")
    assert server.requests[("-", "t", 404)] == 1


async def test_a_refused_key_still_comes_first(server, guarded):
    """The answer is the one the body would have got: 401 before 404."""
    for gw, request_head in (
        (server, head(b"POST", b"/v2/models/NOPE/infer", b"Authorization: Bearer bad\r\n")),
        (guarded, head(b"POST", b"/v2/nothing")),  # no operator's key
        (guarded, head(b"PUT", b"/v2/models/echo/infer")),
    ):
        stream, data = await first_bytes(gw, request_head)
        data = await rest_to_eof(stream, data)
        status, headers, _ = parse(data)
        assert status == 401, request_head
        assert headers[b"connection"] == b"close"
    stream, data = await first_bytes(
        guarded, head(b"POST", b"/v2/nothing", b"Authorization: Bearer ops\r\n")
    )
    await stream.aclose()
    assert data.startswith(b"HTTP/1.1 404 ")


@pytest.mark.parametrize(
    ("request_head", "body", "status"),
    [
        (head(b"POST", b"/v2/models/echo/infer"), BODY, 200),
        (head(b"POST", b"/v2/repository/index", length=2), b"{}", 200),
        # the body may change the answer: a replay by its key compares bodies, a
        # coded body is decoded (and may be refused) before the model is looked up
        (head(b"POST", b"/v2/models/NOPE/infer", b"Idempotency-Key: k\r\n"), BODY, 404),
        (head(b"POST", b"/v2/models/NOPE/infer", b"Content-Encoding: gzip\r\n",
              length=len(gzip.compress(BODY))), gzip.compress(BODY), 404),
        # a route that takes the method: its view may read the body
        (head(b"POST", b"/v2/models/echo/versions/1/infer"), BODY, 200),
    ],
    ids=["infer", "control-plane", "idempotency-key", "content-encoding", "version"],
)
async def test_an_answer_that_may_depend_on_the_body_comes_after_a_100(
    server, request_head, body, status
):
    """As before: 100, the body, the answer, and the connection kept."""
    stream, data = await first_bytes(server, request_head)
    assert data.startswith(b"HTTP/1.1 100 "), data[:40]
    await stream.send_all(body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    assert data.startswith(b"HTTP/1.1 %d " % status)
    assert b"connection: close" not in data.lower()
    await stream.send_all(infer_request(2.0))
    data = await stream.receive_some(65536)
    while b'"2.0"' not in data:
        data += await stream.receive_some(65536)
    await stream.aclose()
    assert data.startswith(b"HTTP/1.1 200 ")


async def test_a_body_sent_with_its_head_is_read_and_the_connection_kept(server):
    """A client that did not wait for the 100 has sent its body: it is read as
    before, and the connection serves the next request."""
    request = head(b"POST", b"/v2/models/NOPE/infer") + BODY + infer_request(3.0)
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(request)
    data = b""
    while b'"3.0"' not in data:
        data += await stream.receive_some(65536)
    await stream.aclose()
    assert data.startswith(b"HTTP/1.1 404 ")
    assert b" 100 " not in data
    assert b"connection: close" not in data.lower()
    assert b"HTTP/1.1 200 " in data


async def test_http_1_0_gets_no_100_and_its_answer_after_the_body(server):
    """RFC 9110 10.1.1: a server ignores 100-continue from an HTTP/1.0 client, which
    sends its body without waiting; nothing is answered before it."""
    request = head(b"POST", b"/v2/models/NOPE/infer").replace(b"HTTP/1.1", b"HTTP/1.0")
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(request + BODY)
    data = await rest_to_eof(stream, b"")
    assert data.startswith(b"HTTP/1.1 404 ")
