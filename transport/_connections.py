"""The gateway's connections, as :class:`Connections` (a part of
:class:`~trioserve.transport.Gateway`): the serve loop over its listeners, the open
connections and their state (:class:`_Conn`), readiness, the drain delay (``leave``)
and the drain, and the gateway's :class:`GatewayStatistics`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import trio

from ._listeners import open_listeners
from ._wire import _readable

if TYPE_CHECKING:
    from trioserve import Config, Runtime

    from ._hangup import HangupWatch
    from ._wire import Outbox

#: After the grace period, how long connections get to send their 503s and close.
CLOSE_GRACE = 1.0


@attrs.frozen(kw_only=True)
class GatewayStatistics:
    """A snapshot of the gateway: open connections (of which WebSocket streams), HTTP
    infer requests being answered, the most stream requests one connection has had
    in flight, HTTP infer requests given up because their client closed its
    connection while they waited, whether it is draining, streams closed (1008)
    because their client took none of their answers for their write timeout, the
    most bytes one stream held when it took a message (``stream_in_flight_bytes_peak``,
    see ``server.stream_in_flight_bytes``) and the times a stream stopped reading at
    that byte budget, HTTP connections closed for the same reason (``server.write_timeout_s``), and,
    at ``server.max_connections``, connections refused with 503 and idle ones closed
    to make room for a new one."""

    connections: int
    streams: int
    requests_in_flight: int
    stream_in_flight_peak: int
    clients_gone: int
    draining: bool
    stream_write_timeouts: int = 0
    stream_ping_timeouts: int = 0
    stream_in_flight_bytes_peak: int = 0
    stream_byte_budget_waits: int = 0
    http_write_timeouts: int = 0
    connections_refused: int = 0
    connections_evicted: int = 0


@attrs.define(eq=False, slots=True)
class _Conn:
    """One client connection, as the drain sees it."""

    scope: trio.CancelScope
    #: its socket's descriptor (-1: not known)
    fd: int = -1
    #: between a request's first byte and its answer (an idle connection is closed at
    #: once on drain; a busy one gets the grace period).
    busy: bool = False
    #: set by a WebSocket stream: called on drain to stop reading new messages, and
    #: when the grace period ends to cancel its requests (it then closes itself).
    stop_reading: Any = None
    cancel_requests: Any = None
    #: awaiting ``Gateway.infer`` (the hang-up watch cancels only then)
    waiting: bool = False
    #: its socket is watched for a hang-up (see ``._hangup``)
    armed: bool = False
    #: the hang-up watch cancelled ``scope``: the client went while a request waited
    gone: bool = False
    #: set by a WebSocket stream: what the hang-up watch calls (instead of cancelling
    #: ``scope``) when the client goes while ``waiting``
    hang_up: Any = None
    #: it has answered a request and stays open (keep-alive): only then may it be
    #: closed to make room for a new connection
    kept: bool = False
    #: closed to make room for a new connection (``._accept``)
    evicted: bool = False


class Connections:
    """The connection methods of a gateway (their state set up by
    ``_init_connections``); not used on its own."""

    if TYPE_CHECKING:
        runtime: Runtime
        config: Config
        server_config: Any
        in_flight: int
        stream_in_flight_peak: int
        clients_gone: int
        stream_write_timeouts: int
        stream_ping_timeouts: int
        stream_in_flight_bytes_peak: int
        stream_byte_budget_waits: int
        http_write_timeouts: int

    def _init_connections(self) -> None:
        self.draining = False
        #: readiness answers 503 (:meth:`leave`): the drain is about to begin
        self.leaving = False
        #: HTTP/1.1 answers keep their connection open; False from :meth:`leave` or
        #: :meth:`drain` on: each answer says ``Connection: close`` and the connection
        #: closes, so a kept-alive client reconnects elsewhere while this one answers
        self.keep_alive = True
        #: set when :meth:`drain` begins (a model load under way is answered then)
        self.drain_begun = trio.Event()
        #: connections refused (503) at ``server.max_connections``, and idle ones
        #: closed at the limit to make room for a new one (``._accept``)
        self.connections_refused = 0
        self.connections_evicted = 0
        #: the open connections, in the order they opened (the oldest idle one makes
        #: room at the limit)
        self._conns: dict[_Conn, None] = {}
        #: connections accepted and not yet closed, and refusals under way; the accept
        #: loops wait in ``_room`` when both are full
        self._open = 0
        self._refusing = 0
        self._room = trio.lowlevel.ParkingLot()
        self._streams = 0
        self._all_closed = trio.Event()
        self._accept_scope: trio.CancelScope | None = None
        #: set when the listeners have closed (the drain's take of their backlogs done)
        self._accept_done = trio.Event()
        #: connections accepted whose task has not begun yet (not in ``_conns``)
        self._starting = 0
        #: Writes the data plane's keep-alive answers (``serve`` starts it).
        self.outbox: Outbox | None = None
        #: Cancels the infer of a client that hangs up (``serve`` starts it; None
        #: without epoll).
        self.hangups: HangupWatch | None = None
        self.addresses: list[tuple[str, int]] = []

    def _open_conn(self, scope: trio.CancelScope, fd: int = -1) -> _Conn:
        conn = _Conn(scope=scope, fd=fd)
        self._conns[conn] = None
        return conn

    def _close_conn(self, conn: _Conn) -> None:
        self._conns.pop(conn, None)
        if (
            self.draining and not self._conns and not self._starting
            and (self._accept_done.is_set() or self._accept_scope is None)
        ):
            # not before the listeners have closed: they may yet take a connection
            # from their backlog (``drain`` decides then)
            self._all_closed.set()

    @property
    def ready(self) -> bool:
        """Taking new requests, and saying so to readiness probes: not leaving (the
        drain delay), not draining, and the runtime is open."""
        return not self.leaving and not self.draining and not self.runtime.closed

    async def leave(self, delay: float) -> None:
        """Answer readiness probes (the server's and each model's) 503 from now on,
        serving all else as usual (new connections too) for ``delay`` seconds, while
        load balancers stop sending here; then the caller drains. HTTP answers say
        ``Connection: close`` meanwhile (as Envoy's do while it drains), so a kept-alive
        client moves to another server rather than race the drain's close of its idle
        connection; WebSocket streams are left as they are. A checkpoint.
        Cancelling it ends the delay (the gateway stays not ready)."""
        self.leaving = True
        self.keep_alive = False
        await trio.sleep(delay)

    async def serve(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        listeners: list[trio.SocketListener] | None = None,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (the server config's by default; port 0 picks a free
        one), or on ``listeners`` already open, and serve connections until
        :meth:`drain` or cancellation, at most ``server.max_connections`` at once
        (see ``._accept``).

        Reports ``started(addresses)`` once listening. Returns after a drain, when the
        last connection has closed.
        """
        from ._accept import accept_connections
        from ._hangup import HangupWatch
        from ._wire import Outbox

        if listeners is None:
            listeners = await open_listeners(self.server_config, host, port)
        self.addresses = [ls.socket.getsockname()[:2] for ls in listeners]

        self.hangups = hangups = HangupWatch.open()
        try:
            async with trio.open_nursery() as flushing:
                self.outbox = Outbox()
                flushing.start_soon(self.outbox.run)
                if hangups is not None:
                    flushing.start_soon(hangups.run)
                async with trio.open_nursery() as connections:
                    try:
                        with trio.CancelScope() as accept:
                            self._accept_scope = accept
                            task_status.started(self.addresses)
                            await accept_connections(self, listeners, connections)
                    finally:
                        self._accept_done.set()
                # every connection has closed: the flusher has nothing left to write,
                # the watch nothing left to watch
                flushing.cancel_scope.cancel("gateway closed")
        finally:
            self.hangups = None
            if hangups is not None:
                hangups.close()

    async def drain(self, grace: float) -> None:
        """Stop accepting, close idle connections (not one whose request is already
        waiting in its socket, nor one waiting in a listener's backlog: each is served
        as a request in flight), give requests in flight up to
        ``grace`` seconds (no later than the runtime's ``grace_deadline``, when its
        shutdown has begun), then answer what is left with 503 and close.

        Idempotent. A checkpoint. Returns when every connection has closed (or, at
        worst, ``CLOSE_GRACE`` after the grace period, closing what is left).
        """
        self.draining = True
        self.keep_alive = False
        self.drain_begun.set()
        accepting = self._accept_scope is not None
        if accepting:
            self._accept_scope.cancel("gateway draining: stop accepting")
        for conn in list(self._conns):
            if conn.stop_reading is not None:
                conn.stop_reading()
            elif not conn.busy and not (conn.fd >= 0 and _readable(conn.fd)):
                # Idle. One whose next request is already in its socket, unread, is
                # not: it reads that request and answers it (Connection: close).
                conn.scope.cancel("gateway draining: idle connection")
        if accepting:
            # the listeners take what waits in their backlogs as they close
            await self._accept_done.wait()
        if not self._conns and not self._starting:
            self._all_closed.set()
        with trio.move_on_at(min(trio.current_time() + grace, self.runtime.grace_deadline)):
            await self._all_closed.wait()
        # Grace over: what is left is answered 503 (HTTP) or with error frames (streams).
        for conn in list(self._conns):
            if conn.cancel_requests is not None:
                conn.cancel_requests()
            else:
                conn.scope.cancel("gateway draining: grace period over")
        with trio.move_on_after(CLOSE_GRACE):
            await self._all_closed.wait()
        for conn in list(self._conns):
            conn.scope.cancel("gateway draining: closing")

    def statistics(self) -> GatewayStatistics:
        return GatewayStatistics(
            connections=len(self._conns),
            streams=self._streams,
            requests_in_flight=self.in_flight,
            stream_in_flight_peak=self.stream_in_flight_peak,
            clients_gone=self.clients_gone,
            draining=self.draining,
            stream_write_timeouts=self.stream_write_timeouts,
            stream_ping_timeouts=self.stream_ping_timeouts,
            stream_in_flight_bytes_peak=self.stream_in_flight_bytes_peak,
            stream_byte_budget_waits=self.stream_byte_budget_waits,
            http_write_timeouts=self.http_write_timeouts,
            connections_refused=self.connections_refused,
            connections_evicted=self.connections_evicted,
        )

    @property
    def url(self) -> str:
        """``http://host:port`` of the first listener."""
        host, port = self.addresses[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"
