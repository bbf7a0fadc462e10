"""The /v2/stream WebSocket's bounds on what a connection holds: the in-flight bound
and the byte budget (at either the server stops reading the socket), and the message
size limit (1009), checked from a frame's header and to the byte."""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio
from http_helpers import (
    _HANDSHAKE,
    Gate,
    _events_until,
    _frame_header,
    _infer_frame,
    _infer_text,
    _masked,
    _raw_client,
    _raw_handshake,
    _raw_ws,
    _read_to_eof,
    config,
    echo_model,
    held_model,
    serving,
    settle,
)
from runtime_helpers import callable_model
from trioserve.transport import open_stream


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


@pytest.mark.parametrize("decoder_state", ["read", "unreadable"])
async def test_a_message_of_exactly_the_limit_arriving_slowly_is_served(
    autojump_clock, monkeypatch, decoder_state
):
    """The check of the pending frame header counts what the message has brought and
    what the header still announces, to the byte: a euro sign cut between two reads
    (held by the UTF-8 decoder) is not lost nor counted twice. Were wsproto's decoder
    state unreadable, the bytes are counted as they come, as before."""
    from trioserve.transport import _stream_read
    from wsproto.events import TextMessage

    if decoder_state == "unreadable":
        monkeypatch.setattr(_stream_read, "_unread", lambda frames, texts: 0)
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
    from trioserve.transport import _stream_read
    from wsproto.events import CloseConnection

    monkeypatch.setattr(_stream_read, "_unread", lambda frames, texts: 0)
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


async def test_the_byte_budget_counts_a_text_messages_utf_8_bytes_not_characters():
    """A text message's size was its length in characters: messages of 4-byte
    characters held four times the budget."""
    from wsproto.events import TextMessage

    gate = Gate()
    texts = [json.dumps({"id": "\U0001F600" * 3000 + str(i), "model": "held", "inputs": [
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, ensure_ascii=False)
        for i in range(4)]
    size = len(texts[0].encode())  # ~12 KB, ~3,100 characters
    budget = 2 * size  # two messages fit, not three
    cfg = config(held_model(gate, max_batch_size=1), server={"stream_in_flight_bytes": budget})
    try:
        async with serving(cfg) as gw:
            sock, ws = await _raw_handshake(gw)
            await sock.send_all(b"".join(ws.send(TextMessage(data=t)) for t in texts))
            await trio.to_thread.run_sync(gate.holding.wait)
            await settle()
            stats = gw.statistics()
            assert stats.stream_in_flight_peak == 2
            assert stats.stream_in_flight_bytes_peak == 2 * size
            gate.release()
            answers = await _answers(sock, ws, 4)
            assert len(answers) == 4
            assert gw.statistics().stream_in_flight_bytes_peak <= budget
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


async def test_an_answer_waiting_for_a_slow_reader_holds_only_its_frame():
    """A client that does not read: the answers framed and waiting for its socket hold
    their frames' bytes, not also the model's outputs and the encoded JSON they came
    from, whose orjson buffer is up to ~4 times its length (8 answers of 195 KiB, one
    a batch, held 8.7 MiB where their frames are 1.5 MiB; a stream's 256 answers of
    1 MiB at the byte budget held over a GiB)."""
    import gc
    import tracemalloc
    import weakref

    from trioserve.transport._http import serve_connection

    outputs: list[weakref.ref] = []

    def big(items):
        out = []
        for _ in items:
            y = np.ones(50_000, np.float32)
            outputs.append(weakref.ref(y))
            out.append({"y": y})
        return out

    model = callable_model("big", big, max_wait_ms=0.0, max_batch_size=1)
    async with serving(config(model)) as gw, trio.open_nursery() as nursery:
        server, client = trio.socket.socketpair()
        server.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, 4096)
        client.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
        nursery.start_soon(serve_connection, gw, trio.SocketStream(server))
        sock = trio.SocketStream(client)
        await sock.send_all(_HANDSHAKE)
        head = b""
        while b"\r\n\r\n" not in head:
            head += await sock.receive_some(1)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            await sock.send_all(b"".join(_infer_frame(i, [1.0], "big") for i in range(8)))
            await settle()
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        # every request ran, one a batch, and was answered: its answer waits for the
        # client, which has taken next to none of it (4 KiB socket buffers)
        assert len(outputs) == 8
        assert gw.requests == {("big", "t", 200): 8}
        assert [ref for ref in outputs if ref() is not None] == []
        ws = _raw_ws()
        answers = await _answers(sock, ws, 8)
        assert sorted(a["id"] for a in answers) == list(range(8))
        assert all(a["outputs"][0]["data"] == [1.0] * 50_000 for a in answers)
        framed = sum(len(json.dumps(a, separators=(",", ":"))) for a in answers)
        # the frames, and at most the write buffer's limit (256 KiB) of them joined
        # for the write under way (the flusher's; it joined all that was queued, 1.3
        # times the frames here): they were ~6 times that
        assert held < framed + 256 * 1024
        await sock.aclose()
