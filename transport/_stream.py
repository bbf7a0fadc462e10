"""``/v2/stream``: many v2 infer requests over one WebSocket, answered out of order.

Each client message is a v2 infer request (JSON text) with its own ``id`` and
``model`` (and optional ``version``); each answer is the v2 response tagged with that
``id``, sent as soon as it is ready, or an error frame ``{"id", "error", "status"}``
(and ``retry_after`` with 429 and 503).
At most ``server.stream_in_flight`` requests of one connection are in flight, and
while their messages and the answers not yet written hold more than
``server.stream_in_flight_bytes`` no other is read: at either bound the server stops
reading the socket once it holds one read's bytes past the bound (the next message
and the bytes behind it, unparsed), so TCP pushes back on the client, and a close
frame within those bytes, or before that message, is seen at once.
Closing the socket cancels the connection's requests not yet dispatched.

The server side: the handshake, and a session per connection (:class:`_Session`).
The stream it writes through is ``._replay``'s; the client is ``._stream_client``'s.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio
from trioserve import (
    InvalidInput,
    TrioserveError,
    Unauthorized,
    UnknownModel,
)
from wsproto import ConnectionType, WSConnection
from wsproto.connection import Connection, ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    TextMessage,
)
from wsproto.events import Request as WsRequest
from wsproto.utilities import RemoteProtocolError

from ._auth import another_field_line
from ._gateway import UNKNOWN_MODEL, WWW_AUTHENTICATE, log, retry_after_of
from ._replay import CLOSE_GRACE, RECEIVE_SIZE
from ._request import InferRequest
from ._request_json import loads_request
from ._response import encode_response
from ._v2 import error_body, error_frame, id_problem, shown
from ._ws_decoder import _begun, _close_in, _unparsed, _unread

if TYPE_CHECKING:
    from ._gateway import Gateway, _Conn
    from ._hangup import HangupWatch
    from ._replay import ReplayStream


async def serve_stream(gateway: Gateway, stream: ReplayStream, conn: _Conn) -> None:
    """Run the WebSocket handshake on ``stream`` and serve the stream until either
    side closes it or the gateway drains. A 401 rejects the handshake."""
    timeout = gateway.server_config.stream_write_timeout_s
    stream.write_timeout = (
        gateway.server_config.write_timeout_s if timeout is None else timeout
    )
    try:
        async with trio.open_nursery() as flushing:
            flushing.start_soon(stream.run_flusher)
            try:
                session = await _handshake(gateway, stream, conn)
                if session is not None:
                    gateway._streams += 1
                    try:
                        await session.run()
                    finally:
                        gateway._streams -= 1
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_GRACE):
                    await stream.stop_flusher()
                flushing.cancel_scope.cancel("stream closed")
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_GRACE):
            await stream.aclose()


async def _handshake(gateway: Gateway, stream: ReplayStream, conn: _Conn) -> _Session | None:
    """The opening handshake (the request head is replayed from the front end).
    Returns the session, or None when the key was refused or the peer left."""
    ws = WSConnection(ConnectionType.SERVER)
    request = None
    head = b""
    while request is None:
        data = await stream.receive_some(RECEIVE_SIZE)
        if not data:
            return None
        head += data
        try:
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, WsRequest):
                    request = event
        except UnicodeError:
            # wsproto reads a few headers as text and lets the decoding error out
            await stream.send_all(_reject(ws, 400, _undecodable(head)))
            return None
        except RemoteProtocolError as exc:
            # A malformed handshake: wsproto's status (400, or 426 for a version other
            # than 13, with the Sec-WebSocket-Version it speaks), with a JSON error.
            hint = exc.event_hint
            if hint is not None:
                status = getattr(hint, "status_code", 400)
                headers = list(getattr(hint, "headers", None) or ())
                message = (
                    "unsupported WebSocket version (Sec-WebSocket-Version); this server "
                    "speaks 13" if status == 426 else f"bad WebSocket handshake: {exc}"
                )
                await stream.send_all(_reject(ws, status, message, headers))
            return None
    authorization = None
    keys = []
    for name, value in request.extra_headers:
        if name == b"authorization":  # wsproto lowercases the names
            authorization = another_field_line(authorization, value)
        elif name == b"sec-websocket-key":
            keys.append(value)
    refused = _bad_key(keys)
    if refused is not None:
        await stream.send_all(_reject(ws, 400, f"bad WebSocket handshake: {refused}"))
        return None
    try:
        tenant = gateway.auth.tenant(authorization)
    except Unauthorized as exc:
        await stream.send_all(_reject(ws, exc.status, str(exc), [WWW_AUTHENTICATE]))
        return None
    await stream.send_all(ws.send(AcceptConnection()))
    stream.release_held()
    # The handshake's connection, without extensions: any extension, even one that
    # only reads frame headers, makes wsproto copy every payload twice.
    return _Session(gateway, Connection(ConnectionType.SERVER), stream, tenant, conn)


#: the handshake headers wsproto decodes: the Host as IDNA, the others as ASCII
_TEXT_HEADERS = (b"host", b"connection", b"sec-websocket-extensions", b"sec-websocket-protocol")


def _undecodable(head: bytes) -> str:
    """The error for a handshake ``head`` wsproto could not decode: it names the
    header."""
    for line in head.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.lower() not in _TEXT_HEADERS:
            continue
        try:
            value.strip().decode("idna" if name.lower() == b"host" else "ascii")
        except UnicodeError:
            field = name.decode("latin-1")
            return (f"bad WebSocket handshake: the {field} header is not a valid host "
                    "name" if name.lower() == b"host" else
                    f"bad WebSocket handshake: the {field} header must be ASCII")
    return "bad WebSocket handshake: a header could not be decoded"


def _bad_key(keys: Sequence[bytes]) -> str | None:
    """Why the Sec-WebSocket-Key field lines ``keys`` are refused, or None: one line,
    the base64 of 16 bytes (RFC 6455 4.2.1, 11.3.1)."""
    if len(keys) != 1:
        return f"Sec-WebSocket-Key appears {len(keys)} times; send it once"
    key = keys[0]
    try:
        ok = len(key) == 24 and len(base64.b64decode(key, validate=True)) == 16
    except binascii.Error:
        ok = False
    if ok:
        return None
    shown = key[:40].decode("latin-1") + ("..." if len(key) > 40 else "")
    return (f"Sec-WebSocket-Key must be 16 bytes in base64 (24 characters), "
            f"got {shown!r}")


def _reject(
    ws: WSConnection, status: int, message: str, extra: Sequence[tuple[bytes, bytes]] = ()
) -> bytes:
    """A refused handshake: ``status`` with the gateway's JSON error body (and the
    ``extra`` headers)."""
    body = error_body(message)
    headers = [
        *extra,
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
    ]
    return ws.send(
        RejectConnection(status_code=status, headers=headers, has_body=True)
    ) + ws.send(RejectData(data=body))


class _Session:
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

    def _over_budget(self, n: int) -> bool:
        """Whether a message of ``n`` bytes must wait for bytes held to be freed: those
        held (see ``byte_budget``) and ``n`` would pass the budget. With nothing held it
        never waits, so a message larger than the budget is served, alone."""
        held = self.in_flight_bytes + self.stream.unsent
        return held > 0 and held + n > self.byte_budget

    async def _wait_for_room(self, n: int) -> bool | None:
        """Wait until fewer than ``bound`` requests are in flight and a message of
        ``n`` bytes fits the byte budget, reading ahead as far as the next message
        (:meth:`_look_ahead`), which is held, and then on behind it, unparsed, up to
        one read's bytes (:meth:`_read_behind`), so a close frame the client sends
        meanwhile is seen at once, as is one after that message in the bytes already
        read. Returns None when there is room (``_events``, and ``_ahead`` if found,
        are what the loop handles next), or what ``_read`` returns when the client
        closed or the connection failed meanwhile. A checkpoint. The gateway's hang-up
        watch also looks out for the client leaving (once the bytes held behind the
        bound reach one read's, the loop reads no more): a hang-up cancels the read
        loop, and ``run`` withdraws what is in flight."""
        conn, watch, fd = self.conn, self.gateway.hangups, self._fd
        if watch is not None and fd is not None and not conn.armed:
            watch.arm(fd, conn)  # once a stream, unless a hang-up was reported since
            self._watch = watch
        if self.in_flight < self.bound:
            self.gateway.stream_byte_budget_waits += 1
        conn.waiting = True
        try:
            while self.in_flight >= self.bound or self._over_budget(n):
                if self._ahead is None:
                    done = await self._look_ahead()
                else:
                    done = await self._read_behind()
                if done is not None:
                    return done
        finally:
            conn.waiting = False
        return None

    async def _look_ahead(self) -> bool | None:
        """At a bound: handle what follows the waiting message up to the next message
        event (a ping gets its pong), which is held in ``_ahead`` and not handled; a
        close frame in the rest of the bytes read, unparsed, is handled at once
        (:meth:`_close_ahead`). When the events of the reads so far hold no message,
        read the socket once, until room frees (:meth:`_unpark` ends that read).
        Returns as :meth:`_wait_for_room` does."""
        ws = self.ws
        for event in self._events:
            kind = type(event)
            if kind is TextMessage or kind is BytesMessage:
                self._ahead = event
                self._behind = True
                # the bytes read since the last walk, if any
                found, self._unwalked = _close_in(self._frames, self._unwalked)
                if found:
                    return await self._close_ahead()
                return None
            if kind is Ping:
                await self._send(ws.send(event.response()))
            elif kind is CloseConnection:
                return await self._closed(event)
        data = await self._read_waiting(RECEIVE_SIZE)
        if data is True:
            return True
        if data is not None:
            ws.receive_data(data or None)  # b"": EOF, reported as a close (1006)
            self._unwalked += len(data)
            self._events = ws.events()
        return None

    async def _read_waiting(self, n: int) -> bytes | bool | None:
        """Read at most ``n`` bytes of the socket while waiting for room: the bytes
        (b"" at EOF), None when room freed first (:meth:`_unpark` cancels the read),
        or True when the peer reset the connection (it is gone, as at EOF)."""
        with trio.CancelScope() as self._reading_ahead:
            try:
                return await self.stream.receive_some(n)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return True
            finally:
                self._reading_ahead = None
        return None

    def _room_behind(self) -> int:
        """How many bytes :meth:`_read_behind` may read: one read's bytes
        (``RECEIVE_SIZE``) less the held message's (``_ahead``, as received) and those
        wsproto holds unparsed; 0 when reading behind is off or the decoder's state
        cannot be read."""
        unparsed = _unparsed(self._frames) if self._behind else None
        if unparsed is None:
            return 0
        data = self._ahead.data
        held = len(data) if type(data) is not str or data.isascii() else len(data.encode())
        return RECEIVE_SIZE - held - unparsed

    async def _read_behind(self) -> bool | None:
        """At a bound, with the next message held (``_ahead``): read the socket on,
        the bytes fed to wsproto and left unparsed behind that message, and walk them
        for a close frame (:func:`_close_in`, each byte once), which is answered at
        once (:meth:`_close_ahead`). Only while the held message and the bytes behind
        it stay within one read's bytes (:meth:`_room_behind`): past that, the loop
        waits for room without reading, so what the client sends further waits in
        its socket (the bound's backpressure). A read is cancelled when room frees.
        Returns as :meth:`_wait_for_room` does."""
        room = self._room_behind()
        if room <= 0:
            await self._room.park()
            return None
        data = await self._read_waiting(room)
        if data is None or data is True:
            return data  # room freed, or the peer is gone
        if not data:
            self.ws.receive_data(None)  # EOF: the client is gone (1006)
            return True
        self.ws.receive_data(data)
        self._unwalked += len(data)
        found, self._unwalked = _close_in(self._frames, self._unwalked)
        if found:
            return await self._close_ahead()
        return None

    async def _close_ahead(self) -> bool | None:
        """A message is held at a bound and the bytes already read hold a close frame
        after it (:func:`_holds_close`): handle the events up to the close and answer
        it, as at any close the messages before it are never run; a ping among them
        gets its pong first, in order (RFC 6455 5.5.2: no close has been sent yet).
        Returns as :meth:`_wait_for_room` does. Were there no close among them after
        all, the messages are kept (``_events``) and handled once room frees (their
        pings already answered), and nothing more is read behind them until then:
        what is kept is no longer wsproto's, so no longer counted by
        :meth:`_room_behind`. Bytes read later are parsed after them."""
        ws = self.ws
        held = []
        for event in self._events:
            kind = type(event)
            if kind is CloseConnection:
                return await self._closed(event)
            if kind is Ping:
                # now, while the connection is open: wsproto sends no pong once the
                # close is parsed
                await self._send(ws.send(event.response()))
                continue
            held.append(event)
        self._events = itertools.chain(held, ws.events())
        self._behind = False
        return None

    async def _closed(self, event: CloseConnection) -> bool:
        """A close frame read (or wsproto's report of a protocol error or of EOF):
        answer the client's close. Returns what ``_read`` returns: True when the peer
        closed, False when the connection must fail with ``_closing``."""
        ws = self.ws
        if ws.state is ConnectionState.REMOTE_CLOSING:
            await self._send(ws.send(event.response()))
            return True
        if ws.state is ConnectionState.OPEN:
            # wsproto found a protocol error (bad framing, text that is not UTF-8):
            # fail with its code (1002, 1007), not 1000.
            self._closing = (event.code, event.reason or "")
            return False
        return True

    async def _read(self, requests: trio.Nursery) -> bool:
        """Read and dispatch messages until the peer closes (returns True) or the
        session must close (a protocol error, an oversize message: returns False)."""
        ws, stream, bound = self.ws, self.stream, self.bound
        gateway = self.gateway
        # A message that came in pieces (fragments, or a frame over several reads) is
        # gathered as UTF-8 in one buffer: a list of its pieces would hold an object
        # per piece (~50 bytes for a fragment of one byte, and a list slot for an
        # empty one, which adds nothing to the size checked against the limit), and
        # so would io.StringIO before Python 3.12. Its JSON is then read from bytes,
        # as a binary message's is.
        partial: bytearray | None = None
        # The message's size so far (UTF-8 bytes, not characters), against the limit
        # as its bytes arrive and, after each read's events, with what its pending
        # frame header announced: a frame that takes the message past the limit is
        # refused once its header is read, its payload never read. (A wsproto
        # extension would see each header, but its mere presence copies every payload
        # twice.)
        size = 0
        limit = self.max_message
        frames = self._frames
        texts = getattr(getattr(ws, "_proto", None), "_message_decoder", None)
        # A message begun must arrive whole within server.request_timeout_s, as an
        # HTTP request must: counted from the read that brought its first bytes (or
        # from the end of a wait at the in-flight bound, when the server read none).
        patience = gateway.server_config.request_timeout_s
        deadline = math.inf
        # A stream that sends nothing for ping_every is pinged; nothing again for as
        # long (not even the pong), and the peer is taken for gone: a client whose
        # host or network went away without a FIN would hold its connection (and its
        # place under max_connections) for ever.
        ping_every = gateway.server_config.stream_ping_interval_s or math.inf
        quiet_at = trio.current_time() + ping_every
        pinged = False
        while True:
            try:
                wake = deadline if deadline < quiet_at else quiet_at
                if wake == math.inf:
                    data = await stream.receive_some(RECEIVE_SIZE)
                else:
                    with trio.move_on_at(wake) as waiting:
                        data = await stream.receive_some(RECEIVE_SIZE)
                    if waiting.cancelled_caught:
                        if wake == deadline:
                            self._closing = (1008, f"a message not received whole within "
                                                   f"{patience:g} s (server.request_timeout_s)")
                            return False
                        if pinged:
                            self._closing = (1011, f"no answer to a ping within "
                                                   f"{ping_every:g} s "
                                                   f"(server.stream_ping_interval_s)")
                            gateway.stream_ping_timeouts += 1
                            return False
                        pinged = True
                        quiet_at = trio.current_time() + ping_every
                        await self._send(ws.send(Ping(payload=b"trioserve")))
                        continue
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return True  # reset by the peer: it is gone, as at EOF
            if ping_every != math.inf:
                pinged = False
                quiet_at = trio.current_time() + ping_every
            ws.receive_data(data or None)  # b"": EOF, reported as a close (1006)
            self._unwalked += len(data)
            events: Any = ws.events()
            waiting: str | bytes | None = None  # a message read, waiting for room
            try:
                while events is not None:
                    more, events = events, None
                    for event in more:
                        kind = type(event)
                        if kind is TextMessage or kind is BytesMessage:
                            n = len(event.data)
                            if kind is TextMessage and not event.data.isascii():  # O(1)
                                # UTF-8 bytes, not characters: the limit and the budget
                                n = len(event.data.encode())
                            size += n
                            if size > limit:
                                self._closing = (1009, f"message over {limit} bytes")
                                return False
                            message: str | bytes = event.data
                            if partial is not None or not event.message_finished:
                                if partial is None:
                                    partial = bytearray()
                                partial += message.encode() if isinstance(message, str) else message
                                if not event.message_finished:
                                    continue
                                message = bytes(partial)
                                partial = None
                            n, size = size, 0
                            if self.in_flight >= bound or self._over_budget(n):
                                waiting = message
                                self._events, self._ahead = more, None
                                done = await self._wait_for_room(n)
                                if done is not None:
                                    return done  # closed: the waiting message is not run
                                waiting = None
                                # what the wait read ahead is handled next
                                ahead, rest = self._ahead, self._events
                                self._events = self._ahead = None
                                if ahead is not None:
                                    events = itertools.chain((ahead,), rest)
                                elif rest is not more:
                                    events = rest
                                deadline = math.inf  # counted afresh from the wait's end
                                if ping_every != math.inf:
                                    quiet_at = trio.current_time() + ping_every
                            self.in_flight += 1
                            self.in_flight_bytes += n
                            if self.in_flight > gateway.stream_in_flight_peak:
                                gateway.stream_in_flight_peak = self.in_flight
                            held = self.in_flight_bytes + stream.unsent
                            if held > gateway.stream_in_flight_bytes_peak:
                                gateway.stream_in_flight_bytes_peak = held
                            requests.start_soon(self._one, message, n)
                            if events is not None:
                                break  # go on with what the wait read ahead
                        elif kind is Ping:
                            await self._send(ws.send(event.response()))
                        elif kind is CloseConnection:
                            return await self._closed(event)
                        # Pong: nothing to do.
            except trio.Cancelled:
                # A drain stopped the loop: the messages read and not started get
                # their 503 (see _refuse_unstarted), as those it cancels do.
                if gateway.draining and not self._gone:
                    if waiting is not None:  # in the wait: what it read ahead follows
                        ahead, rest = self._ahead, self._events
                        more = rest if ahead is None else itertools.chain((ahead,), rest)
                    self._unread_rest(waiting, more, partial)
                raise
            if frames is not None and size + _unread(frames, texts) > limit:
                self._closing = (1009, f"message over {limit} bytes")
                return False
            if not _begun(frames, partial, size):
                deadline = math.inf
            elif deadline == math.inf:
                deadline = trio.current_time() + patience

    def _unread_rest(self, waiting: str | bytes | None, events: Any,
                     partial: bytearray | None) -> None:
        """A drain stopped the read loop with ``waiting`` (a message read, waiting for
        room) or None, the rest of the read's ``events`` not handled and ``partial``
        the message being gathered: keep the whole messages for
        :meth:`_refuse_unstarted`, and the pongs of the pings among them, sent
        there first; a close frame among them (the client is leaving) is answered
        there, after those pongs, and its messages, as at any close, withdrawn."""
        found = [] if waiting is None else [waiting]
        pongs = bytearray()
        for event in events:
            kind = type(event)
            if kind is CloseConnection:
                if self.ws.state is ConnectionState.REMOTE_CLOSING:
                    self._close_answer = bytes(pongs) + self.ws.send(event.response())
                self._gone = True
                return
            if kind is Ping:
                # framed now, while the connection is open (wsproto frames no pong
                # once a close is parsed): RFC 6455 5.5.2, no close has been sent yet
                pongs += self.ws.send(event.response())
                continue
            if kind is not TextMessage and kind is not BytesMessage:
                continue
            data = event.data
            if partial is None and event.message_finished:
                found.append(data)
                continue
            if partial is None:
                partial = bytearray()
            partial += data.encode() if isinstance(data, str) else data
            if event.message_finished:
                found.append(bytes(partial))
                partial = None
        self._unstarted = found
        self._pongs = bytes(pongs)

    async def _refuse_unstarted(self) -> None:
        """Answer each message a drain left read but not started with a 503 frame
        (its id as read, null when it has none): it was not run. The pongs of the
        pings read with them go first."""
        unstarted, self._unstarted = self._unstarted, []
        pongs, self._pongs = self._pongs, b""
        if self._close_answer is not None:
            await self._send(self._close_answer)
            return
        if pongs:
            await self._send(pongs)
        for message in unstarted:
            try:
                doc = loads_request(message)
            except Exception:  # not JSON: its id is null, as its 400 would say
                doc = None
            frame = error_frame(doc.get("id") if type(doc) is dict else None, _NOT_RUN, 503, 1)
            await self._send(self.ws.send(TextMessage(data=frame.decode())))

    async def _send(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer left; the read loop sees it

    async def _close(self, peer_closed: bool) -> None:
        ws = self.ws
        if ws.state is not ConnectionState.OPEN or self._gone:
            return
        if self._closing is not None:
            # Failing the connection (RFC 6455 7.1.7): the close frame, and no wait for
            # the client's (nothing more is read). After a stall, the close frame
            # follows the rest of the cut answer, if the client takes it in time.
            code, reason = self._closing
            frame = ws.send(CloseConnection(code=code, reason=reason))
            try:
                if self._stalled:
                    await self.stream.send_final(frame)
                else:
                    await self.stream.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            return
        # Requests cancelled by the end of a drain's grace period: tell the client.
        for rid in self.pending.values():
            frame = error_frame(rid, _NOT_COMPLETED, 503, 1)
            await self._send(ws.send(TextMessage(data=frame.decode())))
        if self.gateway.draining:
            code, reason = 1001, "server shutting down"
        else:
            code, reason = 1000, ""
        await self._send(ws.send(CloseConnection(code=code, reason=reason)))
        # Wait (briefly, see the caller) for the client's close frame.
        try:
            while ws.state is ConnectionState.LOCAL_CLOSING:
                data = await self.stream.receive_some(RECEIVE_SIZE)
                if not data:
                    return
                ws.receive_data(data)
                for _ in ws.events():
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, RemoteProtocolError):
            pass

    async def _one(self, message: str | bytes, n: int) -> None:
        """Answer one message of ``n`` bytes (counted in ``in_flight_bytes`` until it
        is answered)."""
        token = next(self._tokens)
        self.pending[token] = None
        try:
            # While the answer waits for the client (one that reads slowly) only its
            # frame is held: the request, the model's outputs and the encoded JSON
            # (orjson's output keeps a buffer up to ~4 times its length) are let go
            # when _answer returns. They were held too: ~6 times the answer's bytes.
            frame = await self._answer(message, token)
            # Answered from here on: once framed, the answer is in the stream's bytes
            # (a cancellation while it waits to be written must not add a 503 frame
            # for the same id at close).
            del self.pending[token]
            if self.ws.state is ConnectionState.OPEN:
                data = self.ws.send(TextMessage(data=frame.decode()))
                del frame
                await self._send(data)
        finally:
            self.in_flight -= 1
            self.in_flight_bytes -= n
            self._unpark()

    async def _answer(self, message: str | bytes, token: int) -> bytes:
        """Run one message's request and return its answer's JSON (an error frame for
        a bad message or a failed request), counted in the gateway's requests. Sets
        ``pending[token]`` to its id once read."""
        gateway = self.gateway
        rid: Any = None
        label = UNKNOWN_MODEL
        try:
            doc = loads_request(message)
            if type(doc) is not dict:
                raise InvalidInput(
                    f"a stream message must be a JSON object, got {shown(doc, message)}"
                )
            rid = doc.get("id")
            self.pending[token] = rid
            if rid is None or type(rid) not in (str, int):
                # JSON parsers read a larger integer as a float (10**30 as 1e30)
                raise InvalidInput(
                    "a stream message needs an 'id' (string or integer)"
                    if rid is None else
                    "a stream message's 'id' must be a string or an integer; an "
                    "integer id must be within 64 bits (-2**63 to 2**64-1): use a "
                    "string" if type(rid) is float and rid.is_integer()
                    and not -(2**63) <= rid < 2**64 else
                    "a stream message's 'id' must be a string or an integer, got "
                    f"{shown(rid, message)}"
                )
            why = id_problem(rid)
            if why is not None:  # it cannot be echoed: the answer's id is null
                rid = self.pending[token] = None
                raise InvalidInput(f"a stream message's 'id': {why}")
            model = doc.get("model")
            if type(model) is not str:
                raise InvalidInput(
                    "a stream message needs a 'model' (string)" if "model" not in doc
                    else "a stream message's 'model' must be a string, got "
                    f"{shown(model, message)}"
                )
            sig = gateway.signatures.get(model)
            if sig is None:
                raise UnknownModel.not_served(model, gateway.runtime.models)
            label = model
            version = doc.get("version")
            if version is not None and type(version) is not str:
                raise InvalidInput(
                    "a stream message's 'version' must be a string, got "
                    f"{shown(version, message)}"
                )
            # held until the request is answered, as over HTTP
            served = sig.served
            sig.check_version(version)  # before "not loaded", as over HTTP
            if not served.loaded:  # explicit model control
                gateway.runtime.check_loaded(model)
            request = InferRequest.from_v2_json(
                message, sig, version=version, doc=doc, classes=gateway.class_names
            )
            answered: list[str] = []
            results = await gateway.run_request(request, self.tenant, answered)
            if gateway.runtime.models[model] is not served:  # reloaded
                sig = gateway.signatures.answering(sig, served, request.outputs, results)
            frame = encode_response(
                request, results, sig, binary=False, answered=answered
            )[0]
            status = 200
        except Exception as exc:
            if not isinstance(exc, TrioserveError):
                log.exception("stream request %r: unexpected error", rid)
            frame = _error_frame(rid, exc)
            status = exc.status if isinstance(exc, TrioserveError) else 500
        gateway.requests[(label, self.tenant, status)] += 1
        return frame

    def _unpark(self) -> None:
        """Room may have freed: wake the read loop waiting at a bound (and end its read
        ahead, if it is reading the socket)."""
        self._room.unpark()
        if self._reading_ahead is not None:
            self._reading_ahead.cancel("room freed")


#: The drain's refusals of the requests it did not run, or did not let finish.
_NOT_RUN = "the server is shutting down; request not run"
_NOT_COMPLETED = "the server is shutting down; request not completed"


def _error_frame(rid: Any, exc: Exception) -> bytes:
    """The error frame answering request ``rid`` with ``exc``: its status as over HTTP
    (``error_answer``: 500 for a foreign exception), its message, and with 429 and
    503 ``retry_after`` as HTTP's Retry-After (whole seconds). Written without
    orjson (``error_frame``: its output holds a 4 KiB buffer, and a frame is held
    until the client takes it). Not a checkpoint."""
    if not isinstance(exc, TrioserveError):
        return error_frame(rid, str(exc), 500)
    status = exc.status
    if status in (429, 503):
        return error_frame(rid, str(exc), status, retry_after_of(exc))
    return error_frame(rid, str(exc), status)


__all__ = [
    "serve_stream",
]
