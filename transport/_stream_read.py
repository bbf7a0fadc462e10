"""The read side of a ``/v2/stream`` session (:class:`_Reader`): the read loop over
wsproto, the waits at the in-flight and byte bounds, and what it reads ahead."""

from __future__ import annotations

import itertools
import math
from typing import Any

import trio
from wsproto.connection import ConnectionState
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage

from ._replay import RECEIVE_SIZE
from ._ws_decoder import _begun, _close_in, _unparsed, _unread


class _Reader:
    """The read side of :class:`_Session` (whose state it uses): the read loop and
    its waits for room."""

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
                            # whole: the time of a message begun after it in this
                            # read is its own, counted afresh below
                            deadline = math.inf
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
                            # its task takes the oldest message spawned, not this
                            # one: trio runs new tasks in no set order
                            self._spawned.append((message, n))
                            requests.start_soon(self._one)
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

    def _unpark(self) -> None:
        """Room may have freed: wake the read loop waiting at a bound (and end its read
        ahead, if it is reading the socket)."""
        self._room.unpark()
        if self._reading_ahead is not None:
            self._reading_ahead.cancel("room freed")
