"""``server.max_connections``: at the limit a new connection takes the place of the
oldest idle HTTP connection, else it gets 503 with Retry-After and is closed; a
connection with a request in flight, a partial request or a WebSocket stream is never
closed to make room; past ``MAX_REFUSING`` refusals under way the server stops
accepting until one ends. Real sockets on a loopback port; the clock is trio's mock
clock, which stands still unless a test moves it, so no bound passes by itself."""

from __future__ import annotations

import h11
import orjson
import pytest
import trio
from http_helpers import Gate, config, echo_model, held_model, serving, settle, v2_input
from trio_websocket import ConnectionRejected
from trioserve.transport import Gateway, _accept, open_stream


class Client:
    """One HTTP/1.1 client connection; it may pipeline (h11 frames each request and
    parses each answer afresh)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.received = b""  # bytes after the last answer read

    @classmethod
    async def connect(cls, gw: Gateway) -> Client:
        return cls(await trio.open_tcp_stream(*gw.addresses[0]))

    async def send_infer(self, x: float) -> None:
        """A request for the held model (held by the gate when x > 0), or, with x 0,
        for ``echo`` (answered at once, whatever the held model holds)."""
        await self.stream.send_all(b"".join(self.infer_bytes(x)))

    @staticmethod
    def infer_bytes(x: float) -> tuple[bytes, bytes]:
        """The head and the rest of :meth:`send_infer`'s request, to send apart."""
        body = orjson.dumps({"inputs": [v2_input([x])]})
        target = b"/v2/models/%s/infer" % (b"held" if x else b"echo")
        headers = [(b"host", b"t"), (b"content-length", b"%d" % len(body)),
                   (b"content-type", b"application/json")]
        h = h11.Connection(h11.CLIENT)
        head = h.send(h11.Request(method=b"POST", target=target, headers=headers))
        return head, h.send(h11.Data(data=body)) + h.send(h11.EndOfMessage())

    async def get(self, target: bytes) -> None:
        await self.stream.send_all(b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % target)

    async def answer(self) -> tuple[int, dict[bytes, bytes], bytes]:
        """The next answer: status, headers, body."""
        h = h11.Connection(h11.CLIENT)
        h.send(h11.Request(method="GET", target="/", headers=[("Host", "t")]))  # state only
        h.send(h11.EndOfMessage())
        if self.received:  # (b"" would say the connection closed)
            h.receive_data(self.received)
        status, headers, body = 0, {}, b""
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                h.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status, headers = event.status_code, dict(event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.received = bytes(h.trailing_data[0])
                return status, headers, body
            else:
                raise AssertionError(f"unexpected {event!r}")

    async def at_eof(self) -> bool:
        """Whether the server has closed the connection (and sent nothing more)."""
        try:
            return await self.stream.receive_some(65536) == b""
        except trio.BrokenResourceError:
            return True

    async def aclose(self) -> None:
        await self.stream.aclose()


async def refused(client: Client) -> None:
    """``client`` reads a 503 answer saying why, with Retry-After, then the end."""
    status, headers, body = await client.answer()
    assert status == 503
    assert headers[b"retry-after"] == b"1"
    assert headers[b"connection"] == b"close"
    assert headers[b"content-type"] == b"application/json"
    assert "server.max_connections" in orjson.loads(body)["error"]
    assert await client.at_eof()


async def wait_holding(gate: Gate, n: int) -> None:
    """Until ``n`` batches are held by the gate."""
    while gate.entered < n:
        await trio.to_thread.run_sync(gate.holding.wait, 30.0)
        await trio.testing.wait_all_tasks_blocked()


def limited(gate: Gate, n: int) -> object:
    return config(
        held_model(gate, max_batch_size=1), echo_model(), server={"max_connections": n}
    )


async def test_at_the_limit_a_new_connection_gets_503_and_requests_in_flight_finish(
    mock_clock,
):
    gate = Gate()
    async with serving(limited(gate, 2)) as gw:
        a, b = await Client.connect(gw), await Client.connect(gw)
        await a.send_infer(1.0)
        await b.send_infer(2.0)
        await wait_holding(gate, 1)  # one held, the other queued behind it: both busy
        c = await Client.connect(gw)
        await c.send_infer(0.0)  # drained, never read as a request
        await refused(c)
        stats = gw.statistics()
        assert (stats.connections, stats.connections_refused, stats.connections_evicted) == (
            2, 1, 0)
        await c.aclose()
        await settle()
        assert gw._refusing == 0

        gate.release()
        assert (await a.answer())[0] == 200
        assert (await b.answer())[0] == 200
        await a.aclose()
        await settle()
        assert gw.statistics().connections == 1
        d = await Client.connect(gw)  # a place is free again: served
        await d.get(b"/metrics")
        status, _, text = await d.answer()
        assert status == 200
        assert b"\ntrioserve_http_connections_refused_total 1.0\n" in text
        assert b"\ntrioserve_http_connections_evicted_total 0.0\n" in text
        assert b"\ntrioserve_connections_limit 2.0\n" in text
        assert b"\ntrioserve_connections 2.0\n" in text
        assert dict(gw.requests) == {("held", "t", 200): 2}
        for client in (b, d):
            await client.aclose()


async def test_the_oldest_idle_connection_makes_room_and_busy_ones_are_kept(mock_clock):
    gate = Gate()
    async with serving(limited(gate, 3)) as gw:
        busy = await Client.connect(gw)  # the oldest, with a request in flight
        await busy.send_infer(1.0)
        await wait_holding(gate, 1)
        older, newer = await Client.connect(gw), await Client.connect(gw)
        for idle in (older, newer):  # each answered once, then idle (keep-alive)
            await idle.send_infer(0.0)
            assert (await idle.answer())[0] == 200
        await settle()

        new = await Client.connect(gw)
        await new.send_infer(0.0)
        assert (await new.answer())[0] == 200
        assert await older.at_eof()  # closed to make room, without an answer
        stats = gw.statistics()
        assert (stats.connections, stats.connections_refused, stats.connections_evicted) == (
            3, 0, 1)
        await newer.send_infer(0.0)  # the newer idle one is still served
        assert (await newer.answer())[0] == 200
        gate.release()
        assert (await busy.answer())[0] == 200  # never cut
        assert dict(gw.requests) == {("held", "t", 200): 1, ("echo", "t", 200): 4}
        for client in (busy, older, newer, new):
            await client.aclose()


async def test_a_connection_holding_part_of_a_pipelined_request_is_not_idle(mock_clock):
    gate = Gate()
    async with serving(limited(gate, 2)) as gw:
        partial = await Client.connect(gw)
        # one request whole, and half the head of the next
        first = b"".join(partial.infer_bytes(0.0))
        second = b"".join(partial.infer_bytes(0.0))
        half = len(second) // 4
        await partial.stream.send_all(first + second[:half])
        busy = await Client.connect(gw)
        await busy.send_infer(1.0)
        await wait_holding(gate, 1)
        assert (await partial.answer())[0] == 200
        await settle()  # the server holds part of the next head, waiting for the rest

        c = await Client.connect(gw)
        await c.send_infer(0.0)
        await refused(c)
        assert gw.statistics().connections_evicted == 0
        await partial.stream.send_all(second[half:])  # the rest of the request: served
        assert (await partial.answer())[0] == 200
        gate.release()
        assert (await busy.answer())[0] == 200
        for client in (partial, busy, c):
            await client.aclose()


async def test_a_connection_that_has_not_sent_its_first_request_is_not_idle(mock_clock):
    gate = Gate()
    async with serving(limited(gate, 1)) as gw:
        fresh = await Client.connect(gw)  # accepted; its request not sent yet
        await settle()
        c = await Client.connect(gw)
        await c.send_infer(0.0)
        await refused(c)
        await fresh.send_infer(0.0)
        assert (await fresh.answer())[0] == 200
        stats = gw.statistics()
        assert (stats.connections_refused, stats.connections_evicted) == (1, 0)
        for client in (fresh, c):
            await client.aclose()


async def test_websocket_streams_count_and_are_never_closed_to_make_room(mock_clock):
    gate = Gate()
    async with serving(limited(gate, 1)) as gw:
        async with open_stream(gw.url) as stream:
            assert (await stream.infer("echo", {"x": [0.0]}))["x"].tolist() == [0.0]
            await settle()  # the stream is idle
            assert gw.statistics().streams == 1
            c = await Client.connect(gw)
            await c.send_infer(0.0)
            await refused(c)
            await c.aclose()
            with pytest.raises(ConnectionRejected) as rejected:  # a second stream too
                async with open_stream(gw.url):
                    pass
            assert rejected.value.status_code == 503
            assert (await stream.infer("echo", {"x": [0.0]}))["x"].tolist() == [0.0]
            assert gw.statistics().connections_evicted == 0
        await settle()
        d = await Client.connect(gw)  # the stream closed: a place is free
        await d.send_infer(0.0)
        assert (await d.answer())[0] == 200
        assert gw.statistics().connections_refused == 2
        await d.aclose()


async def test_past_max_refusing_the_server_stops_accepting_until_a_refusal_ends(
    mock_clock, monkeypatch
):
    monkeypatch.setattr(_accept, "MAX_REFUSING", 1)
    gate = Gate()
    async with serving(limited(gate, 1)) as gw:
        busy = await Client.connect(gw)
        await busy.send_infer(1.0)
        await wait_holding(gate, 1)
        b = await Client.connect(gw)
        await b.send_infer(0.0)
        await refused(b)  # and b does not close: its refusal lingers
        c = await Client.connect(gw)  # in the listen backlog, not accepted
        await c.send_infer(0.0)
        await settle()
        assert (gw.connections_refused, gw._refusing) == (1, 1)

        mock_clock.jump(_accept.LINGER)  # b's refusal ends: its drain is bounded
        await settle()
        await refused(c)
        assert gw.connections_refused == 2
        gate.release()
        assert (await busy.answer())[0] == 200
        for client in (busy, b, c):
            await client.aclose()
