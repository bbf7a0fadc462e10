"""HTTP/1.1 details of the front end, over a raw socket: pipelining, Connection: close,
HTTP/1.0, Expect: 100-continue, HEAD, OPTIONS, request targets."""

from __future__ import annotations

import h11
import numpy as np
import orjson
import pytest
import trio
from http_helpers import config, echo_model, serving, settle, v2_input


@pytest.fixture
async def server():
    async with serving(config(echo_model())) as gw:
        yield gw


def infer_request(value: float, *, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    body = orjson.dumps({"inputs": [v2_input([[value]])], "id": str(value)})
    return (
        b"POST /v2/models/echo/infer HTTP/%s\r\nHost: t\r\nContent-Length: %d\r\n%s\r\n%s"
        % (version, len(body), extra, body)
    )


async def read_responses(stream: trio.SocketStream, n: int | None = None) -> list[tuple]:
    """Parse responses (h11, client side) until ``n`` have arrived or the server closes."""
    h = h11.Connection(h11.CLIENT)
    h.send(h11.Request(method="GET", target="/", headers=[("Host", "t")]))  # state only
    h.send(h11.EndOfMessage())
    out: list[tuple] = []
    current: list = []
    while n is None or len(out) < n:
        event = h.next_event()
        if event is h11.NEED_DATA:
            h.receive_data(await stream.receive_some(65536))
            continue
        if isinstance(event, h11.InformationalResponse):
            out.append((event.status_code, {}, b""))
        elif isinstance(event, h11.Response):
            current = [event.status_code, dict(event.headers), b""]
        elif isinstance(event, h11.Data):
            current[2] += event.data
        elif isinstance(event, h11.EndOfMessage):
            out.append(tuple(current))
            if h.our_state is h11.MUST_CLOSE or h.their_state is h11.MUST_CLOSE:
                break
            h.start_next_cycle()
            h.send(h11.Request(method="GET", target="/", headers=[("Host", "t")]))
            h.send(h11.EndOfMessage())
        elif isinstance(event, h11.ConnectionClosed):
            break
    return out


async def test_pipelined_requests_are_answered_in_order(server):
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(b"".join(infer_request(float(i)) for i in range(5)))
    responses = await read_responses(stream, 5)
    await stream.aclose()
    assert [s for s, _, _ in responses] == [200] * 5
    assert [orjson.loads(b)["id"] for _, _, b in responses] == ["0.0", "1.0", "2.0", "3.0", "4.0"]


async def test_a_body_in_pieces_and_the_requests_behind_it_are_answered_in_order(server):
    first, second = infer_request(1.0), infer_request(2.0)
    health = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"
    empty = b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n"
    stream = await trio.open_tcp_stream(*server.addresses[0])
    # the head and part of the body, then the rest with two more requests behind it
    cut = len(first) - 5
    await stream.send_all(first[:cut])
    await settle()
    await stream.send_all(first[cut:] + health + second[:40])
    await settle()
    await stream.send_all(second[40:] + empty + second)
    responses = await read_responses(stream, 5)
    await stream.aclose()
    assert [s for s, _, _ in responses] == [200, 200, 200, 400, 200]
    assert orjson.loads(responses[0][2])["id"] == "1.0"
    assert orjson.loads(responses[2][2])["id"] == "2.0"
    assert "JSON" in orjson.loads(responses[3][2])["error"]
    assert orjson.loads(responses[4][2])["id"] == "2.0"


async def test_many_connections_each_get_their_own_answers(server):
    """Answers ready in the same scheduler pass leave together (the outbox): each still
    reaches its own connection, in order."""
    got: dict[int, list[str]] = {}

    async def client(c: int) -> None:
        stream = await trio.open_tcp_stream(*server.addresses[0])
        got[c] = []
        for i in range(4):
            await stream.send_all(infer_request(c * 100.0 + i))
            [(status, _, body)] = await read_responses(stream, 1)
            assert status == 200
            got[c].append(orjson.loads(body)["id"])
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        for c in range(24):
            nursery.start_soon(client, c)
    assert got == {c: [str(c * 100.0 + i) for i in range(4)] for c in range(24)}


@pytest.mark.parametrize("method", [b"post", b"Get", b"BREW"])
async def test_a_method_is_case_sensitive_and_an_unknown_one_is_501(server, method):
    stream = await trio.open_tcp_stream(*server.addresses[0])
    lowered = infer_request(1.0).replace(b"POST", method, 1)
    await stream.send_all(lowered + infer_request(2.0))
    responses = await read_responses(stream, 2)
    await stream.aclose()
    assert responses[0][0] == 501
    assert "case-sensitive" in orjson.loads(responses[0][2])["error"]
    # the body was read: the connection goes on with the next request
    assert responses[1][0] == 200
    assert orjson.loads(responses[1][2])["id"] == "2.0"


async def test_connection_close_and_http_1_0_close_after_the_answer(server):
    for request in (infer_request(1.0, extra=b"Connection: close\r\n"),
                    infer_request(2.0, version=b"1.0")):
        stream = await trio.open_tcp_stream(*server.addresses[0])
        await stream.send_all(request)
        data = b""
        while chunk := await stream.receive_some(65536):  # the server closes
            data += chunk
        await stream.aclose()
        assert data.startswith(b"HTTP/1.1 200 ")
        assert b"connection: close" in data.lower()


async def test_expect_100_continue_gets_an_interim_response(server):
    body = orjson.dumps({"inputs": [v2_input([[7.0]])]})
    head = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n"
            b"Expect: 100-continue\r\n\r\n" % len(body))
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(head)
    interim = await stream.receive_some(65536)
    assert interim.startswith(b"HTTP/1.1 100 ")
    await stream.send_all(body)
    data = await stream.receive_some(65536)
    await stream.aclose()
    assert data.startswith(b"HTTP/1.1 200 ")
    assert data.endswith(b"[7.0]}]}")


@pytest.mark.parametrize(
    ("request_bytes", "got"),
    [
        (infer_request(1.0, extra=b"Expect: 200-ok\r\n"), "200-ok"),  # llhttp's kind
        (infer_request(1.0, extra=b"Expect: 100-continue, x-fast\r\n"),
         "100-continue, x-fast"),
        (infer_request(1.0, extra=b"Expect: 100-continue\r\nExpect: gzip\r\n"),
         "100-continue, gzip"),
        (b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nExpect: x-later\r\n\r\n",
         "x-later"),  # h11's kind
    ],
    ids=["data-plane", "two-members", "two-lines", "control-plane"],
)
async def test_an_expectation_other_than_100_continue_is_417(server, request_bytes, got):
    """RFC 9110 10.1.1: a server may answer 417 to an expectation it cannot meet. It
    was ignored, so a client relying on one went on as if it had been met. Refused
    before the body is read (no 100 is sent), and the connection closes, whichever
    parser would have read the head; the request behind it is never read."""
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(request_bytes + infer_request(2.0))
    responses = await read_responses(stream)
    await stream.aclose()
    assert [s for s, _, _ in responses] == [417]
    _, headers, body = responses[0]
    assert headers[b"connection"] == b"close"
    assert orjson.loads(body)["error"] == (
        f"expectation failed: only 100-continue can be met, got Expect: {got!r}"
    )


async def test_100_continue_is_matched_case_insensitively_and_empty_expect_is_none(server):
    """The field's value is case-insensitive (RFC 9110 10.1.1); an empty one asks
    for nothing."""
    body = orjson.dumps({"inputs": [v2_input([[7.0]])]})
    head = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n"
            b"Expect: 100-Continue \r\n\r\n" % len(body))
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(head)
    interim = await stream.receive_some(65536)
    assert interim.startswith(b"HTTP/1.1 100 ")
    await stream.send_all(body + infer_request(2.0, extra=b"Expect:\r\n"))
    responses = await read_responses(stream, 2)
    await stream.aclose()
    assert [s for s, _, _ in responses] == [200, 200]


async def test_head_has_the_length_of_get_and_no_body(server):
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(b"HEAD /v2/models/echo HTTP/1.1\r\nHost: t\r\n\r\n"
                          b"GET /v2/models/echo HTTP/1.1\r\nHost: t\r\n\r\n")
    h = h11.Connection(h11.CLIENT)
    events = []
    for method in ("HEAD", "GET"):
        h.send(h11.Request(method=method, target="/v2/models/echo", headers=[("Host", "t")]))
        h.send(h11.EndOfMessage())
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                h.receive_data(await stream.receive_some(65536))
                continue
            events.append(event)
            if isinstance(event, h11.EndOfMessage):
                break
        h.start_next_cycle()
    await stream.aclose()
    head, get = events[0], events[2]
    assert head.status_code == get.status_code == 200
    assert dict(head.headers)[b"content-length"] == dict(get.headers)[b"content-length"]
    assert isinstance(events[1], h11.EndOfMessage)  # HEAD: no body
    assert orjson.loads(events[3].data)["name"] == "echo"


async def test_a_bug_in_a_handler_fails_its_connection_not_the_server(server, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server, "infer", broken)
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(infer_request(1.0))
    (status, _, body), = await read_responses(stream)
    await stream.aclose()
    assert status == 500
    assert orjson.loads(body) == {"error": "internal error: RuntimeError: a bug"}
    monkeypatch.undo()
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(infer_request(2.0))
    (status, _, _), = await read_responses(stream, 1)
    await stream.aclose()
    assert status == 200


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


@pytest.mark.parametrize("path", [b"/v2/models/echo/infer", b"/v2/health/ready"])
async def test_a_body_framed_both_ways_is_refused_and_the_connection_closed(server, path):
    # Content-Length covers a second request hidden after the chunked body: a proxy
    # trusting one framing and the server the other would disagree on where it ends.
    body = orjson.dumps({"inputs": [v2_input([[1.0]])]})
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    hidden = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(
        b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%s%s" % (path, len(chunked + hidden), chunked, hidden)
    )
    data = await read_until_closed(stream)
    assert data.startswith(b"HTTP/1.1 400 ")
    assert b"both Transfer-Encoding and Content-Length" in data
    assert data.count(b"HTTP/1.1 ") == 1  # the hidden request is not answered


async def test_empty_lines_before_a_request_line_are_ignored(server):
    stream = await trio.open_tcp_stream(*server.addresses[0])
    get = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
    await stream.send_all(b"\r\n\r\n" + infer_request(1.0) + b"\r\n" + get)
    responses = await read_responses(stream, 2)
    assert [status for status, _, _ in responses] == [200, 200]
    await stream.send_all(b"\r\n")  # alone in its read, then the request
    await stream.send_all(infer_request(2.0))
    (status, _, body), = await read_responses(stream, 1)
    assert status == 200
    assert orjson.loads(body)["id"] == "2.0"
    await stream.aclose()


@pytest.mark.parametrize("version", [b"2.0", b"1.2"])
async def test_an_http_version_other_than_1_x_is_505(server, version):
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(infer_request(1.0, version=version))
    data = await read_until_closed(stream)
    assert data.startswith(b"HTTP/1.1 505 ")


async def test_a_request_head_over_the_limit_is_431_however_it_arrives(server):
    stream = await trio.open_tcp_stream(*server.addresses[0])
    big = b"x-big: " + b"a" * 20_000 + b"\r\n"
    await stream.send_all(infer_request(1.0, extra=big))  # one write, complete
    data = await read_until_closed(stream)
    assert data.startswith(b"HTTP/1.1 431 ")


async def test_connection_close_is_a_token_not_a_substring(server):
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(infer_request(1.0, extra=b"Connection: x-closed\r\n")
                          + infer_request(2.0))
    responses = await read_responses(stream, 2)
    assert [status for status, _, _ in responses] == [200, 200]
    await stream.aclose()


@pytest.fixture
async def impatient():
    server = {"keep_alive_timeout_s": 0.2, "request_timeout_s": 0.2}
    async with serving(config(echo_model(), server=server)) as gw:
        yield gw


async def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(impatient):
    stream = await trio.open_tcp_stream(*impatient.addresses[0])
    await stream.send_all(infer_request(1.0))
    (status, _, _), = await read_responses(stream, 1)
    assert status == 200
    with trio.fail_after(10):
        assert await read_until_closed(stream) == b""  # closed quietly, no answer
    await settle()
    assert impatient.statistics().connections == 0


@pytest.mark.parametrize(
    "partial",
    [
        b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\n",  # the head never ends
        b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{",
    ],
)
async def test_a_request_that_does_not_arrive_whole_in_time_is_408(impatient, partial):
    stream = await trio.open_tcp_stream(*impatient.addresses[0])
    await stream.send_all(partial)
    with trio.fail_after(10):
        data = await read_until_closed(stream)
    assert data.startswith(b"HTTP/1.1 408 ")
    assert b"server.request_timeout_s" in data
    assert b"connection: close" in data.lower()


@pytest.fixture
async def patient_between_requests():
    # idle connections may wait long; a request begun may not
    server = {"keep_alive_timeout_s": 60, "request_timeout_s": 0.2}
    async with serving(config(echo_model(), server=server)) as gw:
        yield gw


@pytest.mark.parametrize(
    "first",
    [infer_request(1.0), b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"],
    ids=["after-infer", "after-control-plane"],
)
async def test_a_pipelined_request_that_does_not_arrive_whole_in_time_is_408(
    patient_between_requests, first
):
    # The next request's first bytes came with the one before: it has begun, so it has
    # server.request_timeout_s to arrive whole, as on a new connection. It was taken
    # for an idle connection and closed without an answer after keep_alive_timeout_s.
    stream = await trio.open_tcp_stream(*patient_between_requests.addresses[0])
    await stream.send_all(first + b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\n")
    with trio.fail_after(10):
        data = await read_until_closed(stream)
    assert data.startswith(b"HTTP/1.1 200 ")
    assert b"HTTP/1.1 408 " in data
    assert b"server.request_timeout_s" in data


# ---- request targets and OPTIONS
async def exchange(server, *requests: bytes) -> list[tuple]:
    """Send ``requests`` pipelined on one connection and read their answers."""
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(b"".join(requests))
    responses = await read_responses(stream, len(requests))
    await stream.aclose()
    return responses


def get(target: bytes, method: bytes = b"GET") -> bytes:
    return b"%s %s HTTP/1.1\r\nHost: t\r\n\r\n" % (method, target)


LIVE = get(b"/v2/health/live")


@pytest.mark.parametrize(
    ("target", "allow"),
    [
        (b"*", b"GET, HEAD, OPTIONS, POST"),
        (b"/v2/health/live", b"GET, HEAD, OPTIONS"),
        (b"/v2/models/echo", b"GET, HEAD, OPTIONS"),
        (b"/v2/models/echo/versions/1/ready", b"GET, HEAD, OPTIONS"),
        (b"/v2/models/echo/infer", b"OPTIONS, POST"),
        (b"/v2/models/echo/versions/1/infer", b"OPTIONS, POST"),
        (b"/metrics", b"GET, HEAD, OPTIONS"),
    ],
)
async def test_options_is_204_with_the_methods_the_path_takes(server, target, allow):
    (status, headers, body), after = await exchange(server, get(target, b"OPTIONS"), LIVE)
    assert (status, headers[b"allow"], body) == (204, allow, b"")
    assert b"content-type" not in headers
    assert b"content-length" not in headers  # RFC 9110 8.6
    assert after[0] == 200  # the connection goes on


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (b"/nope", "no such endpoint: OPTIONS /nope"),
        (b"/v2/models/nope/infer", "unknown model 'nope'"),
        (b"/v2/models/echo/versions/9/infer", "model 'echo' has no version '9'"),
    ],
)
async def test_options_on_what_is_not_served_is_404(server, target, message):
    (status, headers, body), after = await exchange(server, get(target, b"OPTIONS"), LIVE)
    assert status == 404
    assert headers[b"content-type"] == b"application/json"
    assert message in orjson.loads(body)["error"]
    assert after[0] == 200


@pytest.mark.parametrize(
    ("request_", "allow"),
    [
        (get(b"/v2/models/echo/infer"), b"OPTIONS, POST"),
        (get(b"/v2/health/ready", b"DELETE"), b"GET, HEAD, OPTIONS"),
        (infer_request(1.0).replace(b"/v2/models/echo/infer", b"/v2/models/echo", 1),
         b"GET, HEAD, OPTIONS"),
    ],
)
async def test_a_method_a_path_does_not_take_is_405_with_allow(server, request_, allow):
    (status, headers, body), after = await exchange(server, request_, LIVE)
    assert (status, headers[b"allow"]) == (405, allow)
    assert "is not allowed" in orjson.loads(body)["error"]
    assert after[0] == 200


@pytest.mark.parametrize(
    "target",
    [
        b"//v2/models/echo/infer",
        b"/v2//models/echo/infer",
        b"/v2/models//echo/infer",
        b"/v2/models/echo/infer/",
        b"/v2/models/./echo/infer",
        b"/v2/models/x/../echo/infer",
        b"/v2/models/%2e%2E/echo/infer",
        b"/v2/models/echo%2Finfer",
        b"/v2/models/echo%2finfer",
        b"/v2/models/a%2Fb/infer",
    ],
)
async def test_a_path_is_not_normalised_so_odd_segments_are_404(server, target):
    metadata = get(target.replace(b"/infer", b""))  # the same path on the control plane
    posted = infer_request(1.0).replace(b"/v2/models/echo/infer", target, 1)
    (status, _, body), (status2, _, body2), after = await exchange(
        server, posted, metadata, infer_request(2.0)
    )
    assert (status, status2) == (404, 404)
    assert "no such endpoint" in orjson.loads(body)["error"]
    assert "no such endpoint" in orjson.loads(body2)["error"]
    assert after[0] == 200  # the refused body was read: the connection goes on
    assert orjson.loads(after[2])["id"] == "2.0"


@pytest.mark.parametrize(
    "target",
    [
        b"/v2/models/echo/infer?x=1&y",
        b"/v2/models/%65cho/infer",  # an encoded letter is the letter
        b"/v2/models/echo/infer?next=//a/./b",  # the query is not a path
        b"http://example/v2/models/echo/infer",  # absolute-form (RFC 9112 3.2.2)
    ],
)
async def test_query_strings_encoded_names_and_the_absolute_form_are_served(server, target):
    (status, _, body), = await exchange(
        server, infer_request(1.0).replace(b"/v2/models/echo/infer", target, 1)
    )
    assert status == 200
    assert orjson.loads(body)["outputs"][0]["data"] == [1.0]


async def test_the_asterisk_form_is_for_options_only(server):
    (status, _, body), after = await exchange(server, get(b"*"), LIVE)
    assert status == 400
    assert "'*' is for OPTIONS only" in orjson.loads(body)["error"]
    assert after[0] == 200


async def test_a_long_target_is_414_with_a_bounded_json_error(server):
    long_query = b"/v2/models/echo/infer?" + b"q" * 9000
    (status, _, body), after = await exchange(
        server, infer_request(1.0).replace(b"/v2/models/echo/infer", long_query, 1), LIVE
    )
    assert status == 414
    assert len(body) < 200  # the target is not echoed
    assert "request target too long" in orjson.loads(body)["error"]
    assert after[0] == 200  # within the head limit: answered, the connection kept
    for request in (get(b"/" + b"a" * 20_000),  # whole, past the head limit
                    b"GET /" + b"a" * 20_000):  # its line not even ended
        stream = await trio.open_tcp_stream(*server.addresses[0])
        await stream.send_all(request)
        data = await read_until_closed(stream)
        assert data.startswith(b"HTTP/1.1 414 ")
        assert data.endswith(b'"request target too long: over 8192 bytes (path and query)"}')


async def test_a_long_header_is_still_431(server):
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nx-big: " + b"a" * 20_000)
    data = await read_until_closed(stream)
    assert data.startswith(b"HTTP/1.1 431 ")
    assert b"request head over 16384 bytes" in data


# ---- chunked bodies
@pytest.fixture
async def small():
    async with serving(config(echo_model(), server={"max_body_bytes": 64 * 1024})) as gw:
        yield gw


@pytest.mark.parametrize("path", [b"/v2/models/echo/infer", b"/v2/health/ready"])
@pytest.mark.parametrize(
    "chunks",
    [
        b"FFFFFFFFFFFF\r\n",  # the size line alone: no data ever follows
        b"10001\r\n" + b"a" * 100,  # one byte over the limit, some data with it
        b"8000\r\n" + b"a" * 0x8000 + b"\r\n8001\r\n",  # the second chunk passes it
    ],
)
async def test_a_chunk_size_over_the_limit_is_413_before_its_data(small, path, chunks):
    stream = await trio.open_tcp_stream(*small.addresses[0])
    await stream.send_all(
        b"POST %s HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n%s" % (path, chunks)
    )
    data = await read_until_closed(stream)  # nothing more is sent: no wait for the data
    assert data.startswith(b"HTTP/1.1 413 ")
    assert data.endswith(b'"request body too large: the limit is 65536 bytes '
                         b'(server.max_body_bytes)"}')


async def test_chunks_up_to_the_limit_are_taken(small):
    body = orjson.dumps({"inputs": [v2_input([[1.0]])], "id": "c"})
    body += b" " * (64 * 1024 - len(body))  # exactly the limit, in two chunks
    half = len(body) // 2
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half,
                                                      body[half:])
    request = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    (status, _, answer), after = await exchange(small, request + chunked, LIVE)
    assert status == 200
    assert orjson.loads(answer)["id"] == "c"
    assert after[0] == 200


@pytest.mark.parametrize(
    "request_bytes",
    [
        infer_request(1.0, extra=b"Host: u\r\n"),  # Host twice
        infer_request(1.0).replace(b"Host: t\r\n", b""),  # no Host
        infer_request(1.0).replace(b"POST ", b"POST  ", 1),  # two spaces
        infer_request(1.0).replace(b" HTTP/1.1", b"  HTTP/1.1", 1),
    ],
    ids=["two-hosts", "no-host", "space-before-target", "space-before-version"],
)
async def test_a_data_plane_request_h11_refuses_is_400_whichever_parser_reads_it(
    server, request_bytes
):
    """The data plane's usual requests are parsed by llhttp, which accepts these; they
    are still refused, as h11 refuses them, and the connection closes."""
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(request_bytes + infer_request(2.0))
    responses = await read_responses(stream)
    await stream.aclose()
    assert [s for s, _, _ in responses] == [400]
    assert orjson.loads(responses[0][2])["error"].startswith("bad HTTP request: ")


@pytest.mark.parametrize("close", [False, True], ids=["llhttp", "h11"])
async def test_the_inference_header_length_given_twice_is_400(server, close):
    """Two Inference-Header-Content-Length lines: the last was taken (Triton takes the
    first), so the JSON was cut where one reader of the request would not cut it. Now
    refused whichever parser reads the head; the request behind it is answered."""
    x = np.arange(2, dtype=np.float32)
    head = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}]})
    body = head + x.tobytes()
    twice = b"".join(
        b"Inference-Header-Content-Length: %d\r\n" % n for n in (len(head), len(head) - 1)
    )
    request = (
        b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n%s%s\r\n%s"
        % (len(body), twice, b"Connection: close\r\n" if close else b"", body)
    )
    once = request.replace(b"Inference-Header-Content-Length: %d\r\n" % (len(head) - 1), b"")
    stream = await trio.open_tcp_stream(*server.addresses[0])
    await stream.send_all(once.replace(b"Connection: close\r\n", b"") + request
                          + (b"" if close else infer_request(2.0)))
    responses = await read_responses(stream, 2 if close else 3)
    await stream.aclose()
    assert [s for s, _, _ in responses] == [200, 400] + ([] if close else [200])
    assert orjson.loads(responses[1][2])["error"] == (
        "Inference-Header-Content-Length must be an integer, 0 or more in plain digits, "
        f"given once (the length of the body's JSON part), got '{len(head)}, {len(head) - 1}'"
    )
