"""The stream a ``/v2/stream`` WebSocket is served over (:class:`ReplayStream`): it
replays the handshake bytes the HTTP front end already read, and coalesces writes: a
flusher task sends what the connection's answers queued, several to a write, bounded
in bytes and in how long the client may take none of them."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable

import trio

from ._wire import _wait_writable, _write_some

KIB = 1024
RECEIVE_SIZE = 64 * KIB
#: How long a closing stream may take to tell its pending requests it is shutting down.
CLOSE_GRACE = 1.0


class _Stalled(Exception):
    """A write the client took none of for the stream's ``write_timeout``; ``sent``
    bytes of it had gone."""

    def __init__(self, sent: int) -> None:
        super().__init__(sent)
        self.sent = sent


class ReplayStream(trio.abc.HalfCloseableStream):
    """The stream a WebSocket is served over, handed from the HTTP front end.

    Reading first returns ``buffered`` (the handshake bytes the front end already
    read), then reads ``stream``. ``held`` are bytes the front end read after the
    handshake (the client's first frames, sent without waiting for the 101): they are
    read after :meth:`release_held`, once the handshake is done (wsproto's server side
    would drop bytes that come with the handshake).

    Writing coalesces: while :meth:`run_flusher` runs, ``send_all`` only queues its
    bytes, and the flusher sends what is queued, at most ``limit`` bytes joined in one
    write (a larger piece is written alone, not copied), so the answers of one batch
    leave in one syscall; the pieces joined are let go, so a write the socket blocks
    adds at most ``limit`` bytes to the pieces' own. ``send_all`` queues its piece,
    then waits for the flusher while more than ``limit`` bytes are queued: that bounds
    what one writer queues (the read loop's pongs), not what many do, each queueing its
    piece before it waits (the connection's byte budget bounds those: every piece
    queued is in :attr:`unsent`, which counts the bytes queued and those of the write
    under way). ``on_sent`` is called (sync) after each flusher write.

    A write cancelled part way (a client that does not read, at the end of a drain)
    may have sent part of a frame: the stream is then broken, and nothing more is
    written (what followed would be read as the rest of the cut frame). A flusher
    write that fails or is cut so lets go of the pieces queued behind it as the
    flusher ends (``unsent`` falls to 0), and wakes the writers waiting for room with
    BrokenResourceError.

    A socket's writes are bounded by ``write_timeout``: a write the client takes no
    byte of for that long stalls. The flusher then stops, the stream is broken for
    other writers, ``on_stall`` is called, and :meth:`send_final` may still send the
    rest of the cut write's last frame and one more (the close frame): each
    ``send_all`` holds whole frames, so the stream stays framed.

    A piece queued is held by the queue alone: ``send_all`` lets go of it before it
    waits, and so must its callers (pass it, do not keep it: see
    ``_Answers._send``), so the bytes of a write are gone when ``unsent`` falls.
    """

    def __init__(
        self,
        stream: trio.abc.HalfCloseableStream,
        buffered: bytes,
        *,
        held: bytes = b"",
        limit: int = 256 * KIB,
        write_timeout: float = math.inf,
    ) -> None:
        self.transport_stream = stream
        self._buffered = buffered
        self._held = held
        self._limit = limit
        self.write_timeout = write_timeout
        #: called (sync) when a flusher write stalls
        self.on_stall: Callable[[], None] | None = None
        #: called (sync) when a flusher write is done (``unsent`` fell)
        self.on_sent: Callable[[], None] | None = None
        sock = getattr(stream, "socket", None)
        self._fd: int | None = sock.fileno() if sock is not None else None
        #: after a stall: the rest of the frame the stalled write cut
        self._rest: bytes | None = None
        #: the pieces queued (one per ``send_all``), oldest first, and their bytes
        self._out: deque[bytes] = deque()
        self._out_size = 0
        self._writing = 0  # bytes of the flusher's write under way
        self._flushing = False
        self._wake = trio.lowlevel.ParkingLot()  # the flusher waits here for bytes
        self._room = trio.lowlevel.ParkingLot()  # writers wait here when over the limit
        self._error: BaseException | None = None
        self._stopping = False
        self._stopped = trio.Event()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._buffered:
            return await self.transport_stream.receive_some(max_bytes)
        await trio.lowlevel.checkpoint()
        data = self._buffered
        if max_bytes is not None and max_bytes < len(data):
            data, self._buffered = data[:max_bytes], data[max_bytes:]
        else:
            self._buffered = b""
        return data

    @property
    def unsent(self) -> int:
        """Bytes given to :meth:`send_all` and not yet taken by the socket (queued, or in
        the flusher's write under way)."""
        return self._out_size + self._writing

    def release_held(self) -> None:
        """Make the ``held`` bytes the next to be read."""
        self._buffered += self._held
        self._held = b""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise trio.BrokenResourceError("the connection failed") from self._error
        if not self._flushing:
            if self._out:  # left by a flusher that has stopped: keep the order
                await self._write_queued()
            await self._write(data)
            return
        self._out.append(bytes(data))
        self._out_size += len(data)
        # Queued, the piece is the flusher's: held here too while this writer waits,
        # it would outlive its join and its write (up to twice ``unsent`` held).
        del data
        self._wake.unpark_all()
        if self._out_size > self._limit:
            await self._room.park()
            if self._error is not None:
                raise trio.BrokenResourceError("the connection failed") from self._error
        else:
            await trio.lowlevel.checkpoint()

    async def run_flusher(self) -> None:
        """Send queued bytes until :meth:`stop_flusher` (or cancellation, which may
        lose bytes taken for a write: stop it with :meth:`stop_flusher` instead)."""
        self._flushing = True
        try:
            while True:
                if not self._out:
                    if self._stopping:
                        return
                    await self._wake.park()
                    continue
                pieces = self._take_pieces()
                if len(pieces) == 1:
                    data, ends = pieces[0], None
                else:
                    # The pieces' bytes are in the join now: let them go, so a write
                    # the socket blocks holds them once (the ends of the pieces
                    # remain, to find where whole frames end after a stall).
                    data = b"".join(pieces)
                    ends = list(itertools.accumulate(map(len, pieces)))
                del pieces
                self._writing = len(data)
                try:
                    await self._write(data, report_stall=True)
                except _Stalled as stall:
                    self._stall(data, ends, stall.sent)
                    return
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                # the write's bytes are freed now, not when the next write comes
                del data, ends
                self._writing = 0
                if self.on_sent is not None:
                    self.on_sent()
        finally:
            self._writing = 0
            self._flushing = False
            if self._error is not None:
                # A write failed or was cut (the client left, a cancellation): the
                # stream is broken, nothing queued will be written. Let go of it now,
                # so ``unsent`` is right and it is not held until the stream closes.
                self._out.clear()
                self._out_size = 0
            self._room.unpark_all()  # each writer waiting for room sees the error
            self._stopped.set()

    async def stop_flusher(self) -> None:
        """Let the flusher send everything queued, then stop; later writes go straight
        to the transport. A checkpoint; returns once the flusher has stopped."""
        self._stopping = True
        self._wake.unpark_all()
        if self._flushing:
            await self._stopped.wait()
        else:
            await trio.lowlevel.checkpoint()

    def _take_pieces(self) -> deque[bytes] | list[bytes]:
        """The pieces of the next write: those queued first, as many as fit in
        ``limit`` bytes (at least one: a larger piece goes alone). Wakes the writers
        waiting for room once ``limit`` bytes or fewer remain queued."""
        out = self._out
        pieces: deque[bytes] | list[bytes]
        if self._out_size <= self._limit:  # all of it (a round of answers, usually)
            pieces, self._out = out, deque()
            self._out_size = 0
        else:
            pieces = [out.popleft()]
            size = len(pieces[0])
            while out and size + len(out[0]) <= self._limit:
                piece = out.popleft()
                size += len(piece)
                pieces.append(piece)
            self._out_size -= size
        if self._out_size <= self._limit:
            self._room.unpark_all()
        return pieces

    async def _write_queued(self) -> None:
        """Write what is queued, a write at a time (as the flusher does)."""
        while self._out:
            pieces = self._take_pieces()
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            del pieces
            await self._write(data)

    def _stall(self, data: bytes, ends: list[int] | None, sent: int) -> None:
        """A flusher write of ``data`` (pieces ending at ``ends``, or one piece: None)
        stalled after ``sent`` bytes: keep the rest of the piece it cut (whole frames
        end there), drop what is queued behind it, break the stream for other writers,
        report it."""
        start = 0
        for end in ends or (len(data),):
            if end > sent:
                self._rest = data[sent:end] if sent > start else b""
                break
            start = end
        self._out.clear()  # answers not yet written are dropped: let them go now
        self._out_size = 0
        self._error = trio.BrokenResourceError(
            f"the client took no data for {self.write_timeout:g} s"
        )
        if self.on_stall is not None:
            self.on_stall()

    async def send_final(self, data: bytes) -> None:
        """After a stall: send the rest of the cut frame, then ``data`` (whole
        frames), then nothing more. A checkpoint; bound it (the client may still not
        read). Raises BrokenResourceError when there was no stall, or it fails."""
        rest, self._rest = self._rest, None
        if rest is None:
            await trio.lowlevel.checkpoint()
            raise trio.BrokenResourceError("the stream did not stall")
        await self._write(rest + data)

    async def _write(
        self, data: bytes | bytearray | memoryview, *, report_stall: bool = False
    ) -> None:
        """Send ``data`` on the transport; a failure, a stall (BrokenResourceError, or
        _Stalled if ``report_stall``), or a cancellation (which may leave part of it
        sent), breaks the stream for later writes."""
        try:
            if self._fd is None or self.write_timeout == math.inf:
                await self.transport_stream.send_all(data)
            else:
                await self._send_timed(self._fd, data)
        except trio.Cancelled:
            self._error = trio.BrokenResourceError("a write was cancelled part way")
            raise
        except _Stalled:
            self._error = trio.BrokenResourceError("the client took no data")
            if report_stall:
                raise
            raise self._error from None
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._error = exc
            raise

    async def _send_timed(self, fd: int, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` to the socket ``fd``, waiting while its buffer is full, at
        most ``write_timeout`` at a time (each byte taken starts the wait afresh):
        past that, _Stalled. A checkpoint."""
        with memoryview(data) as view:
            n = _write_some(fd, view)
            if n == len(view):
                await trio.lowlevel.checkpoint()
                return
            while n < len(view):
                with trio.move_on_after(self.write_timeout):
                    await _wait_writable(fd)
                    n += _write_some(fd, view[n:])
                    continue
                raise _Stalled(n)

    async def _flush_rest(self) -> None:
        if self._out and self._error is None:
            with trio.move_on_after(CLOSE_GRACE):
                await self._write_queued()

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport_stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._flush_rest()
        await self.transport_stream.send_eof()

    async def aclose(self) -> None:
        try:
            with trio.CancelScope(shield=True):
                await self._flush_rest()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await self.transport_stream.aclose()


__all__ = [
    "CLOSE_GRACE",
    "KIB",
    "RECEIVE_SIZE",
    "ReplayStream",
]
