"""The /v2/stream write buffer (``transport/_replay.py``) under a client that reads
slowly or not at all: what one write joins and holds, what the buffer's limit bounds
(one writer's pieces, and the join), and what the connection's byte budget bounds (the
answers' frames, however many tasks queue them)."""

from __future__ import annotations

import gc
import inspect
import json
import tracemalloc

import pytest
import trio
from http_helpers import (
    _HANDSHAKE,
    _infer_frame,
    _infer_text,
    _raw_ws,
    config,
    echo_model,
    serving,
    settle,
)
from test_ws_limits import _answers, _flow_is_whole
from trioserve.transport._replay import KIB, ReplayStream

#: socket buffers of 4 KiB: a client that does not read blocks the server's writes at once
SMALL = 4096


def _small_socketpair() -> tuple[trio.socket.SocketType, trio.socket.SocketType]:
    server, client = trio.socket.socketpair()
    server.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, SMALL)
    client.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, SMALL)
    return server, client


def _record_writes(stream: ReplayStream) -> list[int]:
    """The sizes of the writes ``stream`` makes on its transport, as it makes them."""
    writes: list[int] = []
    write = stream._write

    async def recording(data, **kw):
        writes.append(len(data))
        await write(data, **kw)

    stream._write = recording
    return writes


async def test_a_write_the_socket_blocks_joins_at_most_the_limit_and_holds_it_once():
    """32 writers queue 16 KiB each (512 KiB) on a stream whose limit is 64 KiB while
    the socket takes nothing: the flusher's write joins at most 64 KiB and lets go of
    the pieces it joined. It joined all 512 KiB, and held the pieces too: 1 MiB for
    512 KiB of frames. Read slowly, every byte arrives, each piece whole, once."""
    limit, piece, count = 64 * KIB, 16 * KIB, 32
    server, client = _small_socketpair()
    stream = ReplayStream(trio.SocketStream(server), b"", limit=limit)
    writes = _record_writes(stream)
    sock = trio.SocketStream(client)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.run_flusher)
        await settle()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            async with trio.open_nursery() as writers:
                for i in range(count):
                    writers.start_soon(stream.send_all, bytes([i]) * piece)
                await settle()
                gc.collect()
                held = tracemalloc.get_traced_memory()[0] - before
                tracemalloc.stop()
                total = piece * count
                assert stream.unsent == total  # nothing written yet (4 KiB buffers)
                assert writes == [limit]
                # the pieces, once, and the write under way: at most the limit
                assert held < total + limit + 64 * KIB
                received = bytearray()
                while len(received) < total:
                    received += await sock.receive_some(SMALL)
                    await settle()
        finally:
            tracemalloc.stop()
        assert len(received) == total
        runs = [bytes(received[i:i + piece]) for i in range(0, total, piece)]
        assert sorted(run[0] for run in runs) == list(range(count))
        assert all(run == run[:1] * piece for run in runs)
        assert sum(writes) == total
        assert max(writes) <= limit
        assert stream.unsent == 0
        await stream.stop_flusher()
    await stream.aclose()
    await sock.aclose()


async def test_one_writer_waits_once_more_than_the_limit_is_queued():
    """The limit bounds what one writer queues (the read loop's pongs and refusals
    among them, which the byte budget does not count): its piece is queued, and past
    the limit its ``send_all`` waits for the flusher, so with the socket taking
    nothing it holds at most the write under way (the limit) and the limit and a
    piece queued. Read slowly, its pieces arrive whole, in order."""
    limit, piece, count = 64 * KIB, 16 * KIB, 32
    server, client = _small_socketpair()
    stream = ReplayStream(trio.SocketStream(server), b"", limit=limit)
    writes = _record_writes(stream)
    sock = trio.SocketStream(client)
    sent = 0

    async def writer() -> None:
        nonlocal sent
        for i in range(count):
            await stream.send_all(bytes([i]) * piece)
            sent += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.run_flusher)
        await settle()
        nursery.start_soon(writer)
        await settle()
        # a write under way (at most the limit), the limit and a piece queued: the
        # piece that passed the limit is queued, and its writer waits
        assert sent < count
        assert max(writes) <= limit
        assert limit < stream.unsent <= writes[-1] + limit + piece
        received = bytearray()
        while len(received) < piece * count:
            received += await sock.receive_some(SMALL)
            await settle()
            assert stream.unsent <= 2 * limit + piece
        assert received == b"".join(bytes([i]) * piece for i in range(count))
        assert sent == count
        assert max(writes) <= limit
        await stream.stop_flusher()
    await stream.aclose()
    await sock.aclose()


@pytest.mark.parametrize("reads", ["nothing", "slowly"])
async def test_answers_waiting_for_the_client_are_bounded_by_the_byte_budget(reads, monkeypatch):
    """Answers framed for a client that reads nothing, or reads slowly, are bounded
    by ``server.stream_in_flight_bytes`` (1 MiB here), which counts every frame
    queued, not by the write buffer's 256 KiB: each answer's task queues its frame,
    then waits for room, so the frames of many tasks pass it (they are held either
    way, queued or by their tasks). Each write joins at most 256 KiB. Every answer
    arrives, once."""
    from trioserve.transport._http import serve_connection

    budget, count = 1 << 20, 96
    x = [0.5] * 4000
    size = len(_infer_text(0, x))  # ~20 KB; an answer is a little smaller (no spaces)
    peak, writes = 0, []
    send_all, write = ReplayStream.send_all, ReplayStream._write

    async def counting(self, data):
        nonlocal peak
        if self._flushing:  # an answer queued: what the stream holds, with it
            peak = max(peak, self.unsent + len(data))
        await send_all(self, data)

    async def recording(self, data, **kw):
        writes.append(len(data))
        await write(self, data, **kw)

    monkeypatch.setattr(ReplayStream, "send_all", counting)
    monkeypatch.setattr(ReplayStream, "_write", recording)
    cfg = config(echo_model(), server={"stream_in_flight_bytes": budget})
    async with serving(cfg) as gw, trio.open_nursery() as nursery:
        server, client = _small_socketpair()
        nursery.start_soon(serve_connection, gw, trio.SocketStream(server))
        sock = trio.SocketStream(client)
        await sock.send_all(_HANDSHAKE)
        head = b""
        while b"\r\n\r\n" not in head:
            head += await sock.receive_some(1)
        nursery.start_soon(sock.send_all, b"".join(_infer_frame(i, x) for i in range(count)))
        ws = _raw_ws()
        if reads == "nothing":
            await settle()
            # the server stopped reading at the budget, the answers it framed past
            # the write buffer's limit and within the budget
            answered = gw.runtime.models["echo"].metrics.items
            assert 256 * KIB // size < answered < count
            assert gw.statistics().stream_byte_budget_waits == 1
            assert 256 * KIB < peak <= budget
            answers = await _answers(sock, ws, count)
        else:
            from wsproto.events import TextMessage

            answers, pieces = [], []
            while len(answers) < count:  # 4 KiB a read, the server idle between reads
                data = await sock.receive_some(SMALL)
                assert data, f"closed after {len(answers)} answers"
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, TextMessage):
                        pieces.append(event.data)
                        if event.message_finished:
                            answers.append(json.loads("".join(pieces)))
                            pieces.clear()
                await settle()
        assert sorted(a["id"] for a in answers) == list(range(count))
        assert all(a["outputs"][0]["data"] == x for a in answers)
        assert 256 * KIB < peak <= budget
        assert max(writes) <= 256 * KIB
        assert gw.statistics().stream_in_flight_bytes_peak <= budget
        _flow_is_whole(gw, "echo", count)
        await sock.aclose()


async def test_a_piece_written_is_not_held_by_its_waiting_writer():
    """A writer waiting for room (more than the limit queued) no longer holds its
    piece once it is queued: the flusher's join is the only other copy, and once a
    write is done its bytes are gone, when ``unsent`` falls. The writers held their
    pieces while they waited, after the pieces were joined and even written: with
    the socket read slowly the memory held grew to about twice ``unsent``."""
    limit, piece, count = 64 * KIB, 16 * KIB, 32
    server, client = _small_socketpair()
    stream = ReplayStream(trio.SocketStream(server), b"", limit=limit)
    sock = trio.SocketStream(client)
    total = piece * count
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.run_flusher)
        await settle()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            excess = []
            async with trio.open_nursery() as writers:
                for i in range(count):
                    writers.start_soon(stream.send_all, bytes([i]) * piece)
                await settle()
                # the tasks and the traces' own bookkeeping: no piece is held twice
                # yet (the first write's writers did not wait, and have returned)
                tasks = tracemalloc.get_traced_memory()[0] - before - stream.unsent
                received = 0
                while received < total:
                    received += len(await sock.receive_some(SMALL))
                    await settle()
                    held = tracemalloc.get_traced_memory()[0] - before
                    excess.append(held - stream.unsent)
        finally:
            tracemalloc.stop()
        # what is held beyond the bytes not yet written grows by less than a piece
        # (16 KiB) as the pieces are written: it grew to ~400 KiB
        assert max(excess) - tasks < piece
        assert received == total
        await stream.stop_flusher()
    await stream.aclose()
    await sock.aclose()


async def test_an_answer_frame_queued_is_held_by_the_write_buffer_alone(monkeypatch):
    """Each answer's task queues its frame and, past the buffer's limit, waits: it
    holds the frame no more while it waits, so once the flusher has joined (and
    written) the frame its bytes are gone. Its task, and the helper it queued
    through, held it too, for as long as they waited."""
    streams: list[ReplayStream] = []
    run_flusher = ReplayStream.run_flusher

    async def recording(self):
        streams.append(self)
        await run_flusher(self)

    monkeypatch.setattr(ReplayStream, "run_flusher", recording)
    from trioserve.transport._http import serve_connection

    count = 48
    x = [0.5] * 4000  # ~20 KB a message, its answer a little smaller
    async with serving(config(echo_model())) as gw, trio.open_nursery() as nursery:
        server, client = _small_socketpair()
        nursery.start_soon(serve_connection, gw, trio.SocketStream(server))
        sock = trio.SocketStream(client)
        await sock.send_all(_HANDSHAKE)
        head = b""
        while b"\r\n\r\n" not in head:
            head += await sock.receive_some(1)
        nursery.start_soon(sock.send_all, b"".join(_infer_frame(i, x) for i in range(count)))
        await settle()
        [stream] = streams
        queued = list(stream._out)
        assert stream.unsent > 256 * KIB  # answers wait for room, their frames queued
        assert len(queued) > 1
        here = inspect.currentframe()  # this test's coroutine holds them in ``queued``
        for frame in queued:
            holders = [
                getattr(r, "__qualname__", type(r).__name__) for r in gc.get_referrers(frame)
                if r is not queued and r is not stream._out
                and getattr(r, "cr_frame", None) is not here
            ]
            assert holders == []
        del queued, frame, here
        answers = await _answers(sock, _raw_ws(), count)
        assert sorted(a["id"] for a in answers) == list(range(count))
        _flow_is_whole(gw, "echo", count)
        await sock.aclose()


class _FailsOnSecondWrite(trio.abc.HalfCloseableStream):
    """A transport whose first write waits for ``go`` and whose second fails, as a
    client's reset does."""

    def __init__(self) -> None:
        self.go = trio.Event()
        self.writes: list[bytes] = []

    async def send_all(self, data) -> None:
        self.writes.append(bytes(data))
        if len(self.writes) == 1:
            await self.go.wait()
            return
        await trio.lowlevel.checkpoint()
        raise trio.BrokenResourceError("connection reset by peer")

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes=None) -> bytes:
        await trio.lowlevel.checkpoint()
        return b""

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_a_flusher_that_fails_on_a_send_fails_its_waiting_writers():
    """A flusher write that fails (the client reset the connection) ends the flusher
    and wakes every writer waiting for room with BrokenResourceError, as it does each
    later writer: none waits for ever, none is told its piece left. A writer
    cancelled while it waits is cancelled (Cancelled, not swallowed); its piece,
    already queued, stays in order."""
    transport = _FailsOnSecondWrite()
    stream = ReplayStream(transport, b"", limit=10)
    outcomes: dict[int, str] = {}

    async def writer(i: int, scope: trio.CancelScope) -> None:
        with scope:
            try:
                await stream.send_all(bytes([i]) * 8)
                outcomes[i] = "queued"
            except trio.BrokenResourceError:
                outcomes[i] = "broken"
            except trio.Cancelled:
                outcomes[i] = "cancelled"
                raise

    async with trio.open_nursery() as nursery:
        flushed = trio.Event()

        async def flusher() -> None:
            await stream.run_flusher()
            flushed.set()

        nursery.start_soon(flusher)
        await settle()
        scopes = [trio.CancelScope() for _ in range(4)]
        for i, scope in enumerate(scopes):
            nursery.start_soon(writer, i, scope)
            await settle()
        # the first piece is in the write, which waits; the rest are queued, over
        # the limit: writers 2 and 3 wait for room (1 did not: 8 bytes queued)
        assert transport.writes == [bytes([0]) * 8]
        assert outcomes == {0: "queued", 1: "queued"}
        scopes[3].cancel("the answer's request was withdrawn")
        await settle()
        assert outcomes[3] == "cancelled"
        assert stream.unsent == 4 * 8  # its piece stays queued
        transport.go.set()
        await flushed.wait()
        await settle()
        assert outcomes == {0: "queued", 1: "queued", 2: "broken", 3: "cancelled"}
        # the second write (the next piece: two would pass the limit) failed
        assert transport.writes[1:] == [bytes([1]) * 8]
        with pytest.raises(trio.BrokenResourceError):
            await stream.send_all(b"late")
    await stream.aclose()


@pytest.mark.parametrize("ends", ["fails", "is cancelled"])
async def test_a_flusher_whose_write_fails_lets_go_of_what_is_queued(ends):
    """A flusher write that fails (the client reset the connection), or is cancelled
    part way, breaks the stream: nothing queued behind it will be written. Those
    pieces are let go as the flusher ends, so ``unsent`` (which the connection's
    byte budget counts) falls to nothing, and the writers waiting for room are
    woken with BrokenResourceError. The pieces stayed queued and counted until the
    stream closed."""
    transport = _FailsOnSecondWrite()
    stream = ReplayStream(transport, b"", limit=10)
    outcomes: dict[int, str] = {}

    async def writer(i: int) -> None:
        try:
            await stream.send_all(bytes([i]) * 8)
            outcomes[i] = "queued"
        except trio.BrokenResourceError:
            outcomes[i] = "broken"

    async with trio.open_nursery() as nursery:
        flushing = trio.CancelScope()

        async def flusher() -> None:
            with flushing:
                await stream.run_flusher()

        nursery.start_soon(flusher)
        await settle()
        for i in range(4):
            nursery.start_soon(writer, i)
            await settle()
        # the first piece in a write that waits, three queued behind it, past the
        # limit: writers 2 and 3 wait for room, and still do once the next write
        # has taken its piece (two remain queued, past the limit)
        assert outcomes == {0: "queued", 1: "queued"}
        assert stream.unsent == 4 * 8
        if ends == "fails":
            transport.go.set()  # the first write ends, the second fails
        else:
            flushing.cancel("the stream is closing")  # the first write, cut
        await settle()
        assert not stream._flushing
        assert outcomes == {0: "queued", 1: "queued", 2: "broken", 3: "broken"}
        assert stream.unsent == 0
        assert len(stream._out) == 0
        with pytest.raises(trio.BrokenResourceError):
            await stream.send_all(b"late")
        assert stream.unsent == 0
    await stream.aclose()
    assert transport.writes == [bytes([0]) * 8] + ([bytes([1]) * 8] if ends == "fails" else [])
