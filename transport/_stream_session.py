"""A ``/v2/stream`` connection's session (:class:`_Session`): its state, and ``run``,
which serves it with the read loop (``._stream_read``) and the answers
(``._stream_answer``)."""

from __future__ import annotations

import collections
import itertools
from typing import TYPE_CHECKING, Any

import trio
from wsproto.connection import Connection

from ._replay import CLOSE_GRACE
from ._stream_answer import _Answers
from ._stream_read import _Reader

if TYPE_CHECKING:
    from ._connections import _Conn
    from ._gateway import Gateway
    from ._hangup import HangupWatch
    from ._replay import ReplayStream


class _Session(_Reader, _Answers):
    """One stream connection: a read loop over wsproto and a task per request.

    Frames are parsed straight from the socket's bytes (every message in a read is
    handled before the next read), answers are framed at once and leave through the
    stream's flusher, several to a write. At ``stream_in_flight`` requests, or when a
    message would take the bytes held past ``stream_in_flight_bytes``, the loop stops
    reading once it holds one read's bytes past the bound (looking through them for a
    close frame), so TCP pushes back on the client.
    """

    def __init__(self, gateway: Gateway, ws: Connection, stream: ReplayStream, tenant: str,
                 conn: _Conn) -> None:
        self.gateway = gateway
        self.ws = ws
        self.stream = stream
        self.tenant = tenant
        self.conn = conn
        self.bound = gateway.server_config.stream_in_flight
        self.max_message = gateway.server_config.max_body_bytes
        self.in_flight = 0
        #: the byte budget: messages of the requests in flight (their bytes as
        #: received) plus the answers framed and not yet written (``stream.unsent``)
        self.byte_budget = gateway.server_config.stream_in_flight_bytes
        self.in_flight_bytes = 0
        self._room = trio.lowlevel.ParkingLot()  # the read loop waits here at a bound
        #: while the loop waits at a bound: the events of its read not yet handled
        #: (advanced by :meth:`_look_ahead`), the first message event among them once
        #: found (held until room frees), and the scope of a socket read that room
        #: ends (see :meth:`_wait_for_room`)
        self._events: Any = ()
        self._ahead: Any = None
        self._reading_ahead: trio.CancelScope | None = None
        #: wsproto's frame decoder (private: see _holds_close), and the bytes at the
        #: end of its buffer not yet looked through for a close frame (see _close_in:
        #: each read adds its bytes, each walk leaves the frame it stopped at)
        self._frames = getattr(getattr(ws, "_proto", None), "_frame_decoder", None)
        self._unwalked = 0
        #: with a message held (``_ahead``): whether the socket may be read on behind
        #: it (:meth:`_read_behind`)
        self._behind = False
        self.pending: dict[int, Any] = {}  # token -> id of requests not yet answered
        #: (message, bytes) of the requests whose task is spawned and not yet begun:
        #: each task takes the oldest (see :meth:`_one`), at most ``bound`` of them
        self._spawned: collections.deque[tuple[str | bytes, int]] = collections.deque()
        self._tokens = itertools.count()
        #: (code, reason) we fail the connection with: a protocol error, a message
        #: over the limit, a client that does not take its answers
        self._closing: tuple[int, str] | None = None
        #: the client took none of its answers for the write timeout (see ``run``)
        self._stalled = False
        sock = getattr(stream.transport_stream, "socket", None)
        self._fd: int | None = sock.fileno() if sock is not None else None
        #: the gateway's hang-up watch, once armed for this socket (see _wait_for_room)
        self._watch: HangupWatch | None = None
        #: the hang-up watch found the client gone while the loop was not reading
        self._gone = False
        #: messages read but not started when a drain stopped the read loop
        self._unstarted: list[str | bytes] = []
        #: the pongs of the pings among them (sent first)
        self._pongs = b""
        #: the answer to a close frame found among them (the client is leaving),
        #: after the pongs of the pings before it
        self._close_answer: bytes | None = None

    async def run(self) -> None:
        reading = trio.CancelScope()
        self.conn.stop_reading = lambda: reading.cancel("gateway draining: stop reading")
        if self.gateway.draining:  # began during the handshake: read nothing, close (1001)
            reading.cancel("gateway draining: stop reading")

        def hang_up() -> None:
            self._gone = True
            reading.cancel("the client closed its connection")

        self.conn.hang_up = hang_up
        peer_closed = False
        try:
            async with trio.open_nursery() as requests:
                self.conn.cancel_requests = lambda: requests.cancel_scope.cancel(
                    "gateway draining: grace period over"
                )

                def stalled() -> None:
                    timeout = self.stream.write_timeout
                    key = ("write_timeout_s" if self.gateway.server_config
                           .stream_write_timeout_s is None else "stream_write_timeout_s")
                    self._stalled = True
                    self._closing = (1008, f"answers not read for {timeout:g} s "
                                           f"(server.{key})")
                    self.gateway.stream_write_timeouts += 1
                    reading.cancel("the client does not read its answers")
                    requests.cancel_scope.cancel("the client does not read its answers")

                self.stream.on_stall = stalled
                self.stream.on_sent = self._unpark  # answers left: bytes freed
                with reading:
                    peer_closed = await self._read(requests)
                if self._unstarted or self._pongs or self._close_answer is not None:
                    await self._refuse_unstarted()
                if peer_closed or self._gone or self._closing is not None:
                    # The client is gone or closing, or the connection failed: withdraw
                    # what is in flight (no answer may follow a close frame).
                    requests.cancel_scope.cancel("stream closed")
        finally:
            self.stream.on_stall = None
            self.stream.on_sent = None
            self.conn.hang_up = None
            if self._watch is not None and self._fd is not None:
                self._watch.forget(self._fd, self.conn)  # before the socket closes
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_GRACE):
                await self._close(peer_closed)
