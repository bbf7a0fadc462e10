"""How a /v2/stream WebSocket ends: a client that closes or leaves (its requests
withdrawn), draining, failing the connection on a protocol error, and the timeouts
that close it: answers not taken (1008), a message not received whole (1008), a
silent stream pinged then closed (1011), the write timeout."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import trio
import trioserve
from http_helpers import (
    _HANDSHAKE,
    GATE_LIMIT_S,
    Gate,
    _client_frame,
    _events_until,
    _frame_header,
    _infer_frame,
    _masked,
    _raw_handshake,
    _raw_ws,
    _read_to_eof,
    config,
    echo_model,
    f32,
    held_model,
    serving,
    settle,
)
from trioserve.transport import open_stream


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


async def test_a_drain_answers_messages_read_but_not_started_with_503():
    """Messages the server had read when a drain began, but not started (it waited
    at the in-flight bound), got no answer at all before the close (1001): on a
    stream each id gets one answer. They get a 503 frame at once, ahead of the
    requests in flight, which finish."""
    from wsproto.events import CloseConnection, TextMessage

    gate = Gate()
    cfg = config(held_model(gate, max_batch_size=8), server={"stream_in_flight": 2})
    async with serving(cfg) as gw:
        sock = await trio.open_tcp_stream(*gw.addresses[0])
        # One write: the server reads all six with the handshake.
        frames = [_infer_frame(i, (1.0,), model="held") for i in range(6)]
        await sock.send_all(_HANDSHAKE + b"".join(frames))
        await trio.to_thread.run_sync(gate.holding.wait)
        await settle()
        assert gw.stream_in_flight_peak == 2
        answers: list[tuple[object, int, str | None]] = []
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gw.drain, 30)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await sock.receive_some(65536)
                ws = _raw_ws()
                ws.receive_data(data.partition(b"\r\n\r\n")[2])
                closed = None
                while closed is None:
                    for event in ws.events():
                        if isinstance(event, TextMessage):
                            doc = json.loads(event.data)
                            answers.append((doc["id"], doc.get("status", 200),
                                            doc.get("error")))
                            if len(answers) == 4:  # the 503s come first: run the rest
                                gate.release()
                        elif isinstance(event, CloseConnection):
                            closed = event
                            await sock.send_all(ws.send(event.response()))
                    if closed is None:
                        ws.receive_data(await sock.receive_some(65536) or None)
        await sock.aclose()
    assert closed.code == 1001
    assert answers[:4] == [
        (i, 503, "the server is shutting down; request not run") for i in range(2, 6)]
    assert sorted(answers[4:]) == [(0, 200, None), (1, 200, None)]


async def test_pings_read_and_not_handled_when_a_drain_begins_get_their_pongs():
    """Pings the server had read behind the message held at the in-flight bound
    when a drain began got no pong before its close (1001): they get theirs, in
    order, ahead of the 503 frames of the messages not started."""
    from wsproto.events import CloseConnection, Ping, Pong, TextMessage

    gate = Gate()
    cfg = config(held_model(gate, max_batch_size=8), server={"stream_in_flight": 2})
    async with serving(cfg) as gw:
        sock = await trio.open_tcp_stream(*gw.addresses[0])
        client = _raw_ws()
        frames = [_infer_frame(i, (1.0,), model="held") for i in range(5)]
        # One write: the server reads it all with the handshake; 2 is waiting for
        # room, 3 held, the pings and 4 behind it.
        await sock.send_all(_HANDSHAKE + b"".join(frames[:4])
                            + client.send(Ping(payload=b"a")) + frames[4]
                            + client.send(Ping(payload=b"b")))
        await trio.to_thread.run_sync(gate.holding.wait)
        await settle()
        seen: list[object] = []
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gw.drain, 30)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await sock.receive_some(65536)
                ws = _raw_ws()
                ws.receive_data(data.partition(b"\r\n\r\n")[2])
                closed = None
                while closed is None:
                    for event in ws.events():
                        if isinstance(event, Pong):
                            seen.append(event.payload)
                        elif isinstance(event, TextMessage):
                            doc = json.loads(event.data)
                            seen.append((doc["id"], doc.get("status", 200)))
                            if len(seen) == 5:  # pongs and 503s: run the rest
                                gate.release()
                        elif isinstance(event, CloseConnection):
                            closed = event
                            await sock.send_all(ws.send(event.response()))
                    if closed is None:
                        ws.receive_data(await sock.receive_some(65536) or None)
        await sock.aclose()
    assert closed.code == 1001
    assert seen[:5] == [b"a", b"b", (2, 503), (3, 503), (4, 503)]
    assert sorted(seen[5:]) == [(0, 200), (1, 200)]


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


@pytest.mark.parametrize("sent", ["same-write", "later", "behind-held"])
async def test_a_close_frame_at_the_in_flight_bound_is_seen_at_once(sent):
    """A client at ``server.stream_in_flight`` with a message past the bound, which
    the server holds while it waits for room, sends a close frame (with its messages,
    or later): the server answers it at once (1000) rather than once an answer frees a
    place, and, as at any close, withdraws the requests in flight (the queued ones
    refunded, the running one's answer dropped); the held message is never run,
    nothing answers it. So too for a close frame that follows more messages (one
    held unread at the bound, a ping, one of a 16-bit length) in the bytes the
    server has read: the ping gets its pong, before the close's answer."""
    from wsproto.events import CloseConnection, Ping, Pong, TextMessage

    gate = Gate()
    tenants = (trioserve.TenantConfig(name="t", default=True, credit_rate=1000.0),)
    cfg = config(held_model(gate, max_batch_size=1, timeout_ms=None), tenants=tenants,
                 server={"stream_in_flight": 4})
    try:
        async with serving(cfg) as gw:
            rt = gw.runtime
            scheduler = rt.models["held"].scheduler
            sock, ws = await _raw_handshake(gw)
            # four in flight (one running, held by the gate, three queued), then a
            # fifth, past the bound, and the close: in one read, or in a later one
            await sock.send_all(b"".join(_infer_frame(i, model="held") for i in range(4)))
            await trio.to_thread.run_sync(gate.holding.wait)
            await settle()
            assert scheduler.queue_depth() == 3
            fifth = _infer_frame(4, model="held")
            ping = ws.send(Ping(payload=b"p"))
            close = ws.send(CloseConnection(code=1000, reason="bye"))
            if sent == "later":
                await sock.send_all(fifth)
                await settle()
                assert gw.statistics().streams == 1  # waiting for room
                await sock.send_all(close)
            elif sent == "behind-held":
                seventh = _infer_frame(6, x=[1.0] * 40, model="held")
                assert seventh[1] & 0x7F == 126  # its length in 16 bits
                await sock.send_all(fifth + _infer_frame(5, model="held")
                                    + ping + seventh + close)
            else:
                await sock.send_all(fifth + close)
            await settle()
            assert gw.statistics().stream_in_flight_peak == 4
            assert scheduler.queue_depth() == 0  # withdrawn at once
            assert rt.credits_refunded["t"] == 3
            assert gw.statistics().streams == 0
            ws.receive_data(await _read_to_eof(sock))
            events = list(ws.events())
            pongs = [Pong] if sent == "behind-held" else []  # the ping's, first
            assert [type(e) for e in events] == [*pongs, CloseConnection]
            assert events[-1].code == 1000
            assert not any(isinstance(e, TextMessage) for e in events)
            await sock.aclose()
            gate.release()
            # One replica, batches of one: this request runs after the held batch ends.
            async with open_stream(gw.url) as stream:
                assert (await stream.infer("held", {"x": f32(0)}))["y"].tolist() == [0]
            assert rt.models["held"].metrics.items == 2  # the held one and this one
            assert rt.credits_refunded["t"] == 3
    finally:
        gate.release()


async def test_pings_before_a_close_found_behind_the_held_message_get_their_pongs():
    """RFC 6455 5.5.2: a ping gets its pong unless a close was sent. Pings between
    the message held at the bound and a close frame the server finds in the bytes
    it read were dropped with the messages: each gets its pong, in order, before
    the close's answer; no message is answered."""
    from wsproto.events import CloseConnection, Ping, Pong, TextMessage

    gate = Gate()
    cfg = config(held_model(gate, max_batch_size=1, timeout_ms=None),
                 server={"stream_in_flight": 4})
    try:
        async with serving(cfg) as gw:
            sock, ws = await _raw_handshake(gw)
            await sock.send_all(b"".join(_infer_frame(i, model="held") for i in range(4)))
            await trio.to_thread.run_sync(gate.holding.wait)
            await settle()
            await sock.send_all(
                _infer_frame(4, model="held") + _infer_frame(5, model="held")
                + ws.send(Ping(payload=b"1")) + _infer_frame(6, model="held")
                + ws.send(Ping(payload=b"2")) + ws.send(CloseConnection(code=1000))
            )
            with trio.fail_after(GATE_LIMIT_S):
                ws.receive_data(await _read_to_eof(sock))
            events = list(ws.events())
            assert [type(e) for e in events] == [Pong, Pong, CloseConnection]
            assert [e.payload for e in events[:2]] == [b"1", b"2"]
            assert events[-1].code == 1000
            assert not any(isinstance(e, TextMessage) for e in events)
            await sock.aclose()
    finally:
        gate.release()


async def test_a_close_frame_sent_after_the_message_held_at_the_bound_is_answered_at_once():
    """A close frame the client sends later, behind the message the server holds at
    the bound (not in the read that found that message): the server reads on behind
    it while it waits for room, so the close is answered at once (1000) rather than
    once an answer frees a place, the requests in flight are withdrawn (the queued
    ones refunded) and the messages past the bound are never run."""
    from wsproto.events import CloseConnection, Ping, Pong, TextMessage

    gate = Gate()
    tenants = (trioserve.TenantConfig(name="t", default=True, credit_rate=1000.0),)
    cfg = config(held_model(gate, max_batch_size=1, timeout_ms=None), tenants=tenants,
                 server={"stream_in_flight": 4})
    try:
        async with serving(cfg) as gw:
            rt = gw.runtime
            scheduler = rt.models["held"].scheduler
            sock, ws = await _raw_handshake(gw)
            await sock.send_all(b"".join(_infer_frame(i, model="held") for i in range(4)))
            await trio.to_thread.run_sync(gate.holding.wait)
            await settle()
            # the fifth waits for room, the sixth is held
            await sock.send_all(_infer_frame(4, model="held") + _infer_frame(5, model="held"))
            await settle()
            await sock.send_all(_infer_frame(6, model="held") + ws.send(Ping(payload=b"p")))
            await settle()
            assert gw.statistics().streams == 1  # read behind, still waiting for room
            assert scheduler.queue_depth() == 3
            await sock.send_all(ws.send(CloseConnection(code=1000, reason="bye")))
            await settle()
            assert gw.statistics().streams == 0
            assert scheduler.queue_depth() == 0  # withdrawn at once
            assert rt.credits_refunded["t"] == 3
            ws.receive_data(await _read_to_eof(sock))
            events = list(ws.events())
            assert [type(e) for e in events] == [Pong, CloseConnection]
            assert events[-1].code == 1000
            assert not any(isinstance(e, TextMessage) for e in events)
            await sock.aclose()
            gate.release()
            # One replica, batches of one: this request runs after the held batch ends.
            async with open_stream(gw.url) as stream:
                assert (await stream.infer("held", {"x": f32(0)}))["y"].tolist() == [0]
            assert rt.models["held"].metrics.items == 2  # the held one and this one
    finally:
        gate.release()


async def test_a_close_frame_past_one_read_behind_the_held_message_waits_for_room():
    """Reading on behind the message held at the bound stops at one read's bytes
    (64 KiB, the held message's included): a close frame the client sends behind
    more than that is not read until room frees (the bound's backpressure), and
    withdraws nothing until then. Once room frees it is read and answered (1000)
    after the answers already written, and each request has at most one answer."""
    from trioserve.transport._replay import RECEIVE_SIZE
    from wsproto.events import CloseConnection, TextMessage

    gate = Gate()
    tenants = (trioserve.TenantConfig(name="t", default=True, credit_rate=1000.0),)
    cfg = config(held_model(gate, max_batch_size=1, timeout_ms=None), tenants=tenants,
                 server={"stream_in_flight": 4})
    try:
        async with serving(cfg) as gw:
            rt = gw.runtime
            scheduler = rt.models["held"].scheduler
            sock, ws = await _raw_handshake(gw)
            await sock.send_all(b"".join(_infer_frame(i, model="held") for i in range(4)))
            await trio.to_thread.run_sync(gate.holding.wait)
            await settle()
            await sock.send_all(_infer_frame(4, model="held") + _infer_frame(5, model="held"))
            await settle()
            behind = b"".join(_infer_frame(i, x=[1.0] * 6000, model="held")
                              for i in range(6, 9))
            assert len(behind) > RECEIVE_SIZE
            await sock.send_all(behind)
            await settle()
            await sock.send_all(ws.send(CloseConnection(code=1000)))
            await settle()
            assert gw.statistics().streams == 1  # the close is not read
            assert scheduler.queue_depth() == 3
            assert rt.credits_refunded["t"] == 0
            gate.release()
            with trio.fail_after(GATE_LIMIT_S):
                ws.receive_data(await _read_to_eof(sock))
            events = list(ws.events())
            assert type(events[-1]) is CloseConnection
            assert events[-1].code == 1000
            ids = [json.loads(e.data)["id"] for e in events if isinstance(e, TextMessage)]
            # the running one's answer, framed before its place freed, comes first
            assert ids
            assert len(ids) == len(set(ids))
            assert set(ids) <= set(range(9))
            await sock.aclose()
    finally:
        gate.release()


async def test_a_stream_client_that_sent_past_the_bound_and_closed_is_answered_at_once(
    autojump_clock,
):
    """``open_stream`` (trio-websocket) at the in-flight bound sends two more requests
    and leaves: its close frame follows them, and here reaches the server in the same
    read (a proxy holds the client's bytes and hands them over in one write). The
    server answers the close at once, the clock unmoved (the client does not wait
    out its close grace, then drop the connection), withdraws the queued requests
    (refunded) and runs neither message past the bound."""
    from wsproto import ConnectionType
    from wsproto.connection import Connection
    from wsproto.events import CloseConnection, TextMessage

    gate = Gate()
    tenants = (trioserve.TenantConfig(name="t", default=True, credit_rate=1000.0),)
    cfg = config(held_model(gate, max_batch_size=1, timeout_ms=None), tenants=tenants,
                 server={"stream_in_flight": 4})
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    holding, held, flush = False, bytearray(), trio.Event()
    more, closed = trio.Event(), trio.Event()

    async def client_to_server(client, server):
        async for data in client:
            if holding:
                held.extend(data)
            else:
                await server.send_all(data)

    async def server_to_client(server, client):
        async for data in server:
            await client.send_all(data)
        await client.aclose()

    async def proxy(gw, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        client = await listener.accept()
        server = await trio.open_tcp_stream(*gw.addresses[0])
        async with trio.open_nursery() as pumps:
            pumps.start_soon(client_to_server, client, server)
            pumps.start_soon(server_to_client, server, client)
            await flush.wait()
            await server.send_all(bytes(held))

    async def leaving_client():
        async with open_stream(f"http://127.0.0.1:{port}") as stream:
            for i in range(4):
                await stream.send(i, "held", {"x": f32(1)})
            await more.wait()
            for i in range(4, 6):
                await stream.send(i, "held", {"x": f32(1)})
        closed.set()

    try:
        async with serving(cfg) as gw:
            async with trio.open_nursery() as nursery:
                rt = gw.runtime
                scheduler = rt.models["held"].scheduler
                await nursery.start(proxy, gw)
                nursery.start_soon(leaving_client)
                try:
                    await trio.to_thread.run_sync(gate.holding.wait)
                    await settle()
                    assert scheduler.queue_depth() == 3
                    holding = True
                    more.set()
                    await settle()
                    server_side = Connection(ConnectionType.SERVER)
                    server_side.receive_data(bytes(held))
                    kinds = [type(e) for e in server_side.events()
                             if getattr(e, "message_finished", True)]
                    assert kinds == [TextMessage, TextMessage, CloseConnection]
                    assert gw.statistics().streams == 1
                    t0 = trio.current_time()
                    flush.set()
                    await settle()
                    assert closed.is_set()  # its close answered
                    assert trio.current_time() == t0
                    assert scheduler.queue_depth() == 0
                    assert rt.credits_refunded["t"] == 3
                    assert gw.statistics().streams == 0
                    assert gw.statistics().stream_in_flight_peak == 4
                finally:  # on failure, lets the stream (and the client) end
                    flush.set()
                    gate.release()
            # One replica, batches of one: the held request, then this one.
            async with open_stream(gw.url) as stream:
                assert (await stream.infer("held", {"x": f32(0)}))["y"].tolist() == [0]
            assert rt.models["held"].metrics.items == 2
    finally:
        gate.release()
        listener.socket.close()


def _decoder_after_first_message(data: bytes):
    """A server's wsproto connection fed ``data`` and its events taken up to the
    first message event (as the read loop holds one at the bound): its frame
    decoder, and whether that event ended its frame."""
    from wsproto import ConnectionType
    from wsproto.connection import Connection
    from wsproto.events import Message

    ws = Connection(ConnectionType.SERVER)
    ws.receive_data(data)
    event = next(e for e in ws.events() if isinstance(e, Message))
    return ws._proto._frame_decoder, event.frame_finished


@pytest.mark.parametrize(
    ("rest", "found"),
    [
        (_client_frame(b"", 0x8), True),
        (_client_frame(b"\x03\xe8bye", 0x8), True),
        (_client_frame(b"{}") + _client_frame(b"p", 0x9) + _client_frame(b"", 0x8), True),
        (_frame_header(300) + _masked(b"a" * 300) + _client_frame(b"", 0x8), True),
        (_frame_header(70_000) + _masked(b"a" * 70_000) + _client_frame(b"", 0x8), True),
        (b"", False),
        (_client_frame(b"{}"), False),
        (_client_frame(b"\x03\xe8bye", 0x8)[:-1], False),  # cut by the read
        (_client_frame(b"", 0x8)[:1], False),
        (_frame_header(300) + _masked(b"a" * 299), False),
        (_frame_header(70_000)[:5], False),
        (_client_frame(b"{}", masked=False) + _client_frame(b"", 0x8), False),
        (_client_frame(b"{}", 0x3) + _client_frame(b"", 0x8), False),  # no opcode 3
    ],
    ids=["close", "close-with-reason", "after-more", "16-bit-length", "64-bit-length",
         "nothing", "no-close", "close-cut", "header-cut", "payload-cut", "length-cut",
         "unmasked", "bad-opcode"],
)
def test_a_close_frame_in_the_bytes_read_is_found_behind_a_held_message(rest, found):
    """Behind the message held at the bound, the frames of the bytes already read are
    walked for a close frame: whole frames only, and none past one wsproto refuses."""
    from trioserve.transport._ws_decoder import _holds_close

    frames, whole = _decoder_after_first_message(_client_frame(b"{}") + rest)
    assert whole
    assert _holds_close(frames) is found


def test_the_walk_for_a_close_frame_starts_past_the_rest_of_the_held_frame():
    """A held message whose frame the read cut: the walk skips the payload it still
    announces (bytes that could read as a close frame's), and finds what follows."""
    from trioserve.transport._ws_decoder import _holds_close
    from wsproto import ConnectionType
    from wsproto.connection import Connection

    close = _client_frame(b"", 0x8)
    payload = _masked(b"a" * 10 + bytes(_masked(close)) + b"b" * 10)
    ws = Connection(ConnectionType.SERVER)
    ws.receive_data(_frame_header(len(payload)) + payload[:5])
    assert not next(ws.events()).frame_finished
    frames = ws._proto._frame_decoder
    ws.receive_data(payload[5:])  # unparsed, the rest of the held frame: no close
    assert not _holds_close(frames)
    ws.receive_data(close)
    assert _holds_close(frames)


def test_the_walk_for_a_close_frame_goes_on_from_where_it_stopped():
    """Bytes read behind the held message a few at a time: each walk goes on from
    the first frame the last one found not whole (each byte walked once), and finds
    what a walk from the decoder's place finds."""
    from trioserve.transport._ws_decoder import _close_in, _holds_close
    from wsproto import ConnectionType
    from wsproto.connection import Connection
    from wsproto.events import Message

    ws = Connection(ConnectionType.SERVER)
    ws.receive_data(_client_frame(b"{}"))
    assert isinstance(next(ws.events()), Message)
    frames = ws._proto._frame_decoder
    ping = _client_frame(b"p", 0x9)
    rest = ping + _frame_header(300) + _masked(b"a" * 300) + _client_frame(b"\x03\xe8", 0x8)
    unwalked = 0
    for i in range(len(rest)):
        ws.receive_data(rest[i:i + 1])
        found, unwalked = _close_in(frames, unwalked + 1)
        assert found is _holds_close(frames) is (i == len(rest) - 1)
        if not found:  # from the first frame not whole: the ping, then the long one
            fed = i + 1
            assert unwalked == (fed if fed < len(ping) else
                                fed - len(ping) if fed < len(ping) + 8 + 300 else
                                fed - len(ping) - 8 - 300)
    assert unwalked == 0
    assert _close_in(object(), 7) == (False, 7)


def test_without_the_decoder_state_no_close_frame_is_looked_for():
    from trioserve.transport._ws_decoder import _holds_close

    assert _holds_close(object()) is False
    assert _holds_close(None) is False


async def test_a_close_frame_wrongly_foreseen_loses_no_message(monkeypatch):
    """Were the walk wrong (a close foreseen where the bytes hold none), the messages
    the server handles looking for it are kept and served once room frees, and so
    are those the client sends after them (read once room frees, behind the kept
    ones): each request gets its answer."""
    from trioserve.transport import _stream_read
    from wsproto.events import TextMessage

    monkeypatch.setattr(_stream_read, "_close_in", lambda frames, unwalked: (True, 0))
    gate = Gate()
    cfg = config(held_model(gate, max_batch_size=1, timeout_ms=None),
                 server={"stream_in_flight": 4})
    try:
        async with serving(cfg) as gw:
            sock, ws = await _raw_handshake(gw)
            await sock.send_all(b"".join(_infer_frame(i, model="held") for i in range(4)))
            await trio.to_thread.run_sync(gate.holding.wait)
            await settle()
            await sock.send_all(b"".join(_infer_frame(i, model="held") for i in range(4, 8)))
            await settle()
            await sock.send_all(b"".join(_infer_frame(i, model="held") for i in range(8, 12)))
            await settle()
            assert gw.statistics().streams == 1
            gate.release()
            ids: list[int] = []
            with trio.fail_after(GATE_LIMIT_S):
                while len(ids) < 12:
                    events = await _events_until(sock, ws, TextMessage)
                    ids += [json.loads(e.data)["id"] for e in events
                            if isinstance(e, TextMessage)]
            assert sorted(ids) == list(range(12))
            await sock.aclose()
    finally:
        gate.release()


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


async def test_a_stream_whose_reads_each_end_inside_a_message_is_not_closed(autojump_clock):
    """Each message's time is counted from its own first bytes: a client with a
    backlog (every read ends inside a message, the next begun as one ends), each
    message whole 3 s after its first bytes, streams on well past
    ``server.request_timeout_s``. It was closed with 1008 10 s after the first read
    that ended inside a message, the deadline of that message kept for the next."""
    from wsproto.events import TextMessage

    cfg = config(echo_model(), server={"request_timeout_s": 10})
    async with serving(cfg) as gw:
        sock, ws = await _raw_handshake(gw)
        frames = [_infer_frame(f"r{i}") for i in range(12)]
        await sock.send_all(frames[0][:20])
        await settle()
        for i in range(1, 12):  # every 3 s: the end of one message, the start of the next
            await trio.sleep(3)
            await sock.send_all(frames[i - 1][20:] + frames[i][:20])
            await settle()
        assert trio.current_time() > 30
        assert gw.statistics().streams == 1
        await sock.send_all(frames[11][20:])
        ids = []
        while len(ids) < 12:
            data = await sock.receive_some(65536)
            assert data, f"closed with {ids} answered"
            ws.receive_data(data)
            ids += [json.loads(e.data)["id"] for e in ws.events() if isinstance(e, TextMessage)]
        assert sorted(ids) == sorted(f"r{i}" for i in range(12))
        assert gw.statistics().streams == 1
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
        # Its messages (~2 MB) are decoded on the loop, not in a worker thread: the
        # clock would jump while a thread decodes, and the first answer come late.
        gw.decoder.threshold = 1 << 40
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
