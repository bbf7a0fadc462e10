"""A client that closes its connection while its infer request waits: the request is
withdrawn if still queued (it never runs, its credits are refunded) or its answer
dropped if running, the connection closes without an answer, and the gateway counts
it. A client that merely sends its next request meanwhile (pipelining) is not leaving.
A client that stops reading its answers is cut after ``server.write_timeout_s``.
Real sockets against a gateway on a loopback port (a Unix socket pair where the mock
clock drives the test)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import h11
import numpy as np
import orjson
import pytest
import trio
from http_helpers import GATE_LIMIT_S, X, Y, config, serving, settle, v2_input
from trioserve import CallableBackend, ModelConfig
from trioserve.transport import Gateway, open_http


class Held:
    """A thread-run model echoing ``x`` as ``y`` that records x[0] of every item it
    runs; a batch with an item whose x[0] > 0 waits until :meth:`release` (closed again
    by :meth:`close`)."""

    def __init__(self) -> None:
        self.seen: list[float] = []
        self._open = threading.Event()
        #: set when a batch is held
        self.holding = threading.Event()

    def __call__(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        keys = [float(it["x"][0]) for it in items]
        self.seen.extend(keys)
        if any(k > 0 for k in keys):
            self.holding.set()
            self._open.wait(GATE_LIMIT_S)
        return [{"y": it["x"]} for it in items]

    def release(self) -> None:
        self._open.set()

    def close(self) -> None:
        self.holding.clear()
        self._open.clear()

    async def wait_holding(self) -> None:
        await trio.to_thread.run_sync(self.holding.wait, GATE_LIMIT_S)


def held_config(model: Held) -> Any:
    """One replica, one item a batch: while a batch is held, the next request queues."""
    backend = CallableBackend(model, inputs=[X], outputs=[Y], execution="thread")
    return config(ModelConfig(name="held", backend=backend, max_batch_size=1, max_wait_ms=0.0))


def request(x: float) -> bytes:
    body = orjson.dumps({"id": str(x), "inputs": [v2_input([x])]})
    return (
        b"POST /v2/models/held/infer HTTP/1.1\r\nHost: t\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    )


async def connect(gw: Gateway) -> trio.SocketStream:
    return await trio.open_tcp_stream(*gw.addresses[0])


async def answers(stream: trio.SocketStream, n: int) -> list[tuple[int, str]]:
    """Read ``n`` answers: (status, id) each."""
    h = h11.Connection(h11.CLIENT)
    h.send(h11.Request(method="GET", target="/", headers=[("Host", "t")]))  # state only
    h.send(h11.EndOfMessage())
    out: list[tuple[int, str]] = []
    status, body = 0, b""
    while len(out) < n:
        event = h.next_event()
        if event is h11.NEED_DATA:
            h.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            status, body = event.status_code, b""
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            out.append((status, orjson.loads(body).get("id")))
            if len(out) == n:
                break
            h.start_next_cycle()
            h.send(h11.Request(method="GET", target="/", headers=[("Host", "t")]))
            h.send(h11.EndOfMessage())
        else:
            raise AssertionError(f"unexpected {event!r}")
    return out


def errors(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_queued_request_whose_client_hangs_up_is_withdrawn_and_refunded(caplog):
    model = Held()
    try:
        async with serving(held_config(model)) as gw:
            rt = gw.runtime
            first = await connect(gw)
            await first.send_all(request(1.0))  # runs, held
            await model.wait_holding()
            gone = await connect(gw)
            await gone.send_all(request(2.0))  # queued behind it
            await settle()
            assert rt.statistics()["held"]["queue_depth"] == 1
            assert gw.statistics().requests_in_flight == 2
            refunded = rt.credits_refunded["t"]

            await gone.aclose()
            await settle()
            assert rt.statistics()["held"]["queue_depth"] == 0
            assert rt.credits_refunded["t"] == refunded + 1
            stats = gw.statistics()
            assert (stats.clients_gone, stats.requests_in_flight, stats.connections) == (1, 1, 1)

            model.release()
            assert await answers(first, 1) == [(200, "1.0")]
            # Same tenant and class: had the withdrawn request stayed queued, it would
            # have run before this one.
            await first.send_all(request(3.0))
            assert await answers(first, 1) == [(200, "3.0")]
            await first.aclose()
            assert model.seen == [1.0, 3.0]
            assert dict(gw.requests) == {("held", "t", 200): 2}
            async with open_http(gw.url) as http:
                text = (await http.get("/metrics")).body.decode()
            assert "\ntrioserve_http_client_gone_total 1.0\n" in text
            # and its flow counts it withdrawn (it left before its deadline)
            flow = rt.statistics()["held"]["flows"]["t/realtime"]
            assert (flow["admitted"], flow["withdrawn"], flow["expired"]) == (3, 1, 0)
            assert (
                'trioserve_flow_requests_total{class="realtime",model="held",'
                'outcome="withdrawn",tenant="t"} 1.0'
            ) in text
    finally:
        model.release()
    assert errors(caplog) == []


async def test_a_pipelined_request_is_not_a_hang_up(caplog):
    """The next request arriving while one waits makes the socket readable: nothing is
    cancelled. The same connection closing later, while a request waits, is noticed."""
    model = Held()
    try:
        async with serving(held_config(model)) as gw:
            stream = await connect(gw)
            await stream.send_all(request(1.0))
            await model.wait_holding()
            await settle()
            await stream.send_all(request(2.0))  # while the first waits
            await settle()
            stats = gw.statistics()
            assert (stats.clients_gone, stats.requests_in_flight, stats.connections) == (0, 1, 1)
            model.release()
            assert await answers(stream, 2) == [(200, "1.0"), (200, "2.0")]
            assert model.seen == [1.0, 2.0]

            model.close()
            await stream.send_all(request(3.0))
            await model.wait_holding()
            await stream.send_all(request(4.0))
            await settle()
            assert gw.statistics().clients_gone == 0
            await stream.aclose()
            await settle()
            stats = gw.statistics()
            assert (stats.clients_gone, stats.requests_in_flight, stats.connections) == (1, 0, 0)
            model.release()
    finally:
        model.release()
    assert dict(gw.requests) == {("held", "t", 200): 2}
    assert errors(caplog) == []


async def test_a_running_request_whose_client_hangs_up_is_dropped(caplog):
    model = Held()
    try:
        async with serving(held_config(model)) as gw:
            rt = gw.runtime
            stream = await connect(gw)
            await stream.send_all(request(1.0))
            await model.wait_holding()
            await settle()
            await stream.aclose()
            await settle()
            stats = gw.statistics()
            assert (stats.clients_gone, stats.requests_in_flight, stats.connections) == (1, 0, 0)
            assert rt.credits_refunded["t"] == 0  # it ran: charged

            # The model finishes; its answer has nobody to go to, and the gateway serves on.
            model.release()
            other = await connect(gw)
            await other.send_all(request(-1.0))
            assert await answers(other, 1) == [(200, "-1.0")]
            await other.aclose()
            assert model.seen == [1.0, -1.0]
            assert dict(gw.requests) == {("held", "t", 200): 1}
    finally:
        model.release()
    assert errors(caplog) == []


def keyed(x: float, key: bytes) -> bytes:
    """``request(x)`` with ``Idempotency-Key: key``."""
    return request(x).replace(b"Host: t\r\n", b"Host: t\r\nIdempotency-Key: %b\r\n" % key)


@pytest.mark.parametrize("where", ["running", "queued"])
async def test_a_keyed_request_whose_client_hangs_up_runs_once_for_its_retry(caplog, where):
    """A client that loses its connection and retries with the same Idempotency-Key
    gets the first request's answer: the first is neither withdrawn nor dropped when
    its client hangs up (the key asks for one run), so the model runs it once. Its
    answer used to be dropped (or the request withdrawn) and the key forgotten, so
    the retry ran the model a second time."""
    model = Held()
    try:
        async with serving(held_config(model)) as gw:
            rt = gw.runtime
            blocker = None
            if where == "queued":
                blocker = await connect(gw)
                await blocker.send_all(request(5.0))  # runs, held
                await model.wait_holding()
            gone = await connect(gw)
            await gone.send_all(keyed(1.0, b"k1"))
            if where == "running":
                await model.wait_holding()
            await settle()
            await gone.aclose()
            await settle()
            assert gw.statistics().clients_gone == 0  # not cancelled: still waiting
            retry = await connect(gw)
            await retry.send_all(keyed(1.0, b"k1"))
            await settle()
            model.release()
            if blocker is not None:
                assert await answers(blocker, 1) == [(200, "5.0")]
                await blocker.aclose()
            assert await answers(retry, 1) == [(200, "1.0")]
            await retry.aclose()
            assert model.seen.count(1.0) == 1
            assert gw.idempotency.replayed == 1
            assert rt.credits_refunded["t"] == 0
            assert gw.statistics().requests_in_flight == 0
    finally:
        model.release()
    assert errors(caplog) == []


async def test_a_drain_past_its_grace_still_answers_503_and_is_no_hang_up():
    model = Held()
    try:
        async with serving(held_config(model)) as gw:
            stream = await connect(gw)
            await stream.send_all(request(1.0))
            await model.wait_holding()
            await settle()
            await gw.drain(0.05)
            assert await answers(stream, 1) == [(503, None)]
            await stream.aclose()
            model.release()
            assert gw.statistics().clients_gone == 0
    finally:
        model.release()


async def test_without_epoll_nothing_is_watched(monkeypatch):
    """Where the platform has no epoll, a gone client's request runs as before."""
    import trioserve.transport._hangup as hangup

    monkeypatch.setattr(hangup, "_epoll", None)
    model = Held()
    try:
        async with serving(held_config(model)) as gw:
            assert gw.hangups is None
            first = await connect(gw)
            await first.send_all(request(1.0))
            await model.wait_holding()
            gone = await connect(gw)
            await gone.send_all(request(2.0))
            await settle()
            await gone.aclose()
            await settle()
            model.release()
            assert await answers(first, 1) == [(200, "1.0")]
            await first.send_all(request(3.0))
            assert await answers(first, 1) == [(200, "3.0")]
            await first.aclose()
            assert model.seen == [1.0, 2.0, 3.0]
            assert gw.statistics().clients_gone == 0
    finally:
        model.release()


async def test_a_client_that_half_closes_is_treated_as_gone():
    """shutdown(SHUT_WR) after its request reads as a hang-up (as nginx's 499 does)."""
    model = Held()
    try:
        async with serving(held_config(model)) as gw:
            first = await connect(gw)
            await first.send_all(request(1.0))
            await model.wait_holding()
            half = await connect(gw)
            await half.send_all(request(2.0))
            await half.send_eof()
            await settle()
            assert gw.statistics().clients_gone == 1
            assert await half.receive_some(100) == b""  # closed without an answer
            await half.aclose()
            model.release()
            assert await answers(first, 1) == [(200, "1.0")]
            await first.aclose()
            assert model.seen == [1.0]
    finally:
        model.release()


async def test_the_watch_cancels_only_a_waiting_connection_and_rearms():
    """Over a socket pair, no server: a hang-up while the connection is not waiting
    cancels nothing and disarms the watch; re-armed, the hang-up already there is
    reported at once."""
    import socket

    from trioserve.transport._connections import _Conn
    from trioserve.transport._hangup import HangupWatch

    ours, theirs = socket.socketpair()
    watch = HangupWatch.open()
    assert watch is not None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            with trio.CancelScope() as scope:
                conn = _Conn(scope=scope)
                watch.arm(ours.fileno(), conn)
                theirs.send(b"more")  # readable: not a hang-up
                await settle()
                assert (conn.armed, scope.cancel_called) == (True, False)
                theirs.shutdown(socket.SHUT_WR)
                await settle()
                assert (conn.armed, conn.gone, scope.cancel_called) == (False, False, False)
                conn.waiting = True
                watch.arm(ours.fileno(), conn)
                await trio.sleep_forever()
            assert (conn.gone, scope.cancelled_caught) == (True, True)
            watch.forget(ours.fileno(), conn)
            nursery.cancel_scope.cancel()
    finally:
        watch.close()
        ours.close()
        theirs.close()


class Wide:
    """A model answering each item with ``WIDE`` copies of its x[0] (an answer far
    larger than any socket buffer of the tests' socket pairs); records every x[0]."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def __call__(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.seen.extend(float(it["x"][0]) for it in items)
        return [{"y": np.full(WIDE, it["x"][0], np.float32)} for it in items]


WIDE = 100_000


def wide_config(model: Wide) -> Any:
    backend = CallableBackend(model, inputs=[X], outputs=[Y], execution="inline")
    cfg = ModelConfig(name="held", backend=backend, max_batch_size=1, max_wait_ms=0.0)
    return config(cfg, server={"write_timeout_s": 20})


async def serve_pair(gw: Gateway, nursery: trio.Nursery) -> trio.SocketStream:
    """A connection served over a Unix socket pair, the server's send buffer small.
    Not TCP: no delayed acknowledgement makes a write wait on the wall clock while the
    mock clock jumps, so the client not reading is all that stops the server's writes."""
    from trioserve.transport._http import serve_connection

    server, client = trio.socket.socketpair()
    server.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, 4096)
    nursery.start_soon(serve_connection, gw, trio.SocketStream(server))
    return trio.SocketStream(client)


async def read_to_eof(stream: trio.SocketStream) -> bytes:
    data = b""
    try:
        while chunk := await stream.receive_some(1 << 20):
            data += chunk
    except trio.BrokenResourceError:
        pass  # a reset after the bytes that came: as EOF here
    return data


@pytest.mark.parametrize("pipelined", [1, 3], ids=["keep-alive", "pipelined"])
async def test_a_client_that_takes_no_answer_is_cut_after_the_write_timeout(
    autojump_clock, pipelined
):
    """Its answer fills the socket; after ``server.write_timeout_s`` with none of it
    taken the connection closes, the requests pipelined behind that answer are never
    admitted (nothing ran or was charged for them), and the gateway counts it."""
    model = Wide()
    async with serving(wide_config(model)) as gw, trio.open_nursery() as nursery:
        rt = gw.runtime
        sock = await serve_pair(gw, nursery)
        await sock.send_all(b"".join(request(float(i + 1)) for i in range(pipelined)))
        await settle()  # the first answer (~400 KB) waits: the client does not read
        t0 = trio.current_time()
        await trio.sleep(19.75)
        assert gw.statistics().connections == 1
        assert gw.statistics().http_write_timeouts == 0
        await trio.sleep(0.5)
        assert trio.current_time() == t0 + 20.25
        stats = gw.statistics()
        assert (stats.http_write_timeouts, stats.connections) == (1, 0)
        assert model.seen == [1.0]
        assert dict(gw.requests) == {("held", "t", 200): 1}
        flow = rt.statistics()["held"]["flows"]["t/realtime"]
        assert (flow["admitted"], flow["withdrawn"]) == (1, 0)
        # the client, reading at last, finds the answer cut short, then the end
        data = await read_to_eof(sock)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(head.lower().partition(b"content-length: ")[2].split(b"\r\n")[0])
        assert 0 < len(body) < length
        await sock.aclose()

        metrics = await serve_pair(gw, nursery)
        await metrics.send_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        text = (await read_to_eof(metrics)).decode()
        assert "\ntrioserve_http_write_timeouts_total 1.0\n" in text
        assert "\ntrioserve_stream_write_timeouts_total 0.0\n" in text


async def test_a_slow_client_that_keeps_reading_is_never_cut(autojump_clock):
    """Each byte the socket takes starts the wait afresh: a client that takes a little
    every 15 s gets both pipelined answers whole, though each takes far longer than
    ``server.write_timeout_s`` (20 s) to arrive."""
    model = Wide()
    async with serving(wide_config(model)) as gw, trio.open_nursery() as nursery:
        sock = await serve_pair(gw, nursery)
        await sock.send_all(request(1.0) + request(2.0))
        t0 = trio.current_time()
        h = h11.Connection(h11.CLIENT)
        got: list[tuple[int, bytes]] = []
        status, body = 0, b""
        for x in (1.0, 2.0):
            h.send(h11.Request(method="POST", target="/", headers=[("Host", "t"),
                                                                  ("Content-Length", "0")]))
            h.send(h11.EndOfMessage())
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    await trio.sleep(15)
                    h.receive_data(await sock.receive_some(16 * 1024))
                elif isinstance(event, h11.Response):
                    status, body = event.status_code, b""
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
            got.append((status, body))
            assert orjson.loads(body)["outputs"][0]["data"][:2] == [x, x]
            h.start_next_cycle()
        assert [s for s, _ in got] == [200, 200]
        assert all(len(orjson.loads(b)["outputs"][0]["data"]) == WIDE for _, b in got)
        assert trio.current_time() - t0 > 10 * 20  # both took many timeouts' worth
        assert gw.statistics().http_write_timeouts == 0
        assert gw.statistics().connections == 1
        await sock.aclose()
