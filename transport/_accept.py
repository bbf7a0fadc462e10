"""Accepting connections within ``server.max_connections``.

One accept loop per listener. Every connection it accepts is counted
(``Gateway._open``) until its task ends, a ``/v2/stream`` WebSocket included (the
stream runs in the connection's task). Under the limit an accept costs one comparison
more than trio's ``serve_listeners`` did.

At the limit, a new connection

1. takes the place of the oldest idle keep-alive HTTP connection, if there is one: it
   has answered a request, and has no request begun, nothing buffered and nothing
   waiting in its socket (nginx closes its idle "reusable" connections the same way
   when it runs short). That one is closed as its keep-alive timeout would close it:
   at its next turn, with a FIN (its socket holds no unread byte). A connection with
   a request in flight, part of a request, a stream, or none answered yet (its
   client may be about to send its first request) is never chosen.
2. else is refused: answered at once, its request not read, ``503`` with
   ``{"error": ...}``, ``Retry-After: 1`` and ``Connection: close``; then its writing
   side is shut and what the client sends is drained (at most ``LINGER``, 1 s, and
   1 MiB) until it closes, so that it reads the answer rather than a reset, which
   closing a socket with unread input would send.
3. When ``MAX_REFUSING`` refusals are already under way and nothing has closed, the
   loop stops accepting until a refusal or a connection ends: clients wait in the
   listen backlog. So the sockets held are at most ``max_connections +
   MAX_REFUSING``, whatever the offered load.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from typing import TYPE_CHECKING, NoReturn

import trio

from ._http import LINGER, _close, _plain_response, serve_connection
from ._v2 import error_body
from ._wire import _readable, _write_some

if TYPE_CHECKING:
    from ._gateway import Gateway

log = logging.getLogger("trioserve.transport")

#: Refusals (503, then a drain of at most LINGER) under way at once; past it the
#: listeners stop accepting until one ends.
MAX_REFUSING = 64
#: accept's errors that say the process is short of a resource (as trio's
#: ``serve_listeners``): wait ``ACCEPT_RETRY_S`` and try again.
ACCEPT_CAPACITY_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS))
ACCEPT_RETRY_S = 0.1
#: The most connections the drain accepts from a listener's backlog as it closes it
#: (the kernel's own bound on a backlog, ``net.core.somaxconn``'s default).
MAX_BACKLOG = 4096


def accept_failed(exc: OSError) -> None:
    """After ``accept`` raised ``exc``: log a failure for want of resources
    (``ACCEPT_CAPACITY_ERRNOS``; the caller waits ``ACCEPT_RETRY_S`` and tries again),
    raise any other."""
    if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
        raise exc
    log.error(
        "accept failed: %s (%s); retrying in %g s",
        errno.errorcode[exc.errno], os.strerror(exc.errno), ACCEPT_RETRY_S,
    )


def _refusal(limit: int) -> bytes:
    body = error_body(
        f"the server is at its connection limit ({limit} open connections, "
        "server.max_connections); retry later"
    )
    return _plain_response(
        503,
        [
            (b"content-type", b"application/json"),
            (b"retry-after", b"1"),
            (b"connection", b"close"),
        ],
        body,
    )


async def accept_connections(
    gateway: Gateway, listeners: list[trio.SocketListener], nursery: trio.Nursery
) -> NoReturn:
    """Accept connections on ``listeners`` (closing them when cancelled) and serve
    each in a task of ``nursery``, within ``server.max_connections``. Runs until
    cancelled."""
    limit = gateway.server_config.max_connections
    _warn_past_open_files(limit)
    refusal = _refusal(limit)
    async with trio.open_nursery() as loops:
        for listener in listeners:
            loops.start_soon(_accept_loop, gateway, listener, nursery, refusal)
    raise AssertionError("the accept loops never return")


async def _accept_loop(
    gateway: Gateway, listener: trio.SocketListener, nursery: trio.Nursery, refusal: bytes
) -> NoReturn:
    limit = gateway.server_config.max_connections
    room = gateway._room
    async with listener:
        try:
            while True:
                while gateway._refusing >= MAX_REFUSING and gateway._open >= limit:
                    await room.park()  # woken when a refusal or a connection ends
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    accept_failed(exc)
                    await trio.sleep(ACCEPT_RETRY_S)
                    continue
                _place(gateway, stream, nursery, refusal)
        finally:
            if gateway.draining:
                _take_backlog(gateway, listener, nursery, refusal)


def _place(
    gateway: Gateway, stream: trio.SocketStream, nursery: trio.Nursery, refusal: bytes
) -> None:
    """Serve a connection just accepted, or refuse it at the limit. Not a checkpoint."""
    limit = gateway.server_config.max_connections
    if gateway._open < limit or _make_room(gateway):
        gateway._open += 1
        gateway._starting += 1
        nursery.start_soon(_serve, gateway, stream)
    else:
        if not gateway.connections_refused:
            log.warning(
                "%d connections open (server.max_connections): new ones are "
                "refused with 503 until one closes", limit,
            )
        gateway._refusing += 1
        gateway.connections_refused += 1
        nursery.start_soon(_refuse, gateway, stream, refusal)


def _take_backlog(
    gateway: Gateway, listener: trio.SocketListener, nursery: trio.Nursery, refusal: bytes
) -> None:
    """As the drain closes a listener: accept the connections waiting in its backlog,
    which closing it would reset, and serve them as accepted ones (a request already
    sent is answered, a connection with none is closed: ``serve_connection``).

    Not a checkpoint: nothing is answered meanwhile, so what it takes is what waited
    when the drain began (and what completed its handshake during these few
    microseconds each), at most ``MAX_BACKLOG``, not a flood's new arrivals. Past the
    limit and the refusals under way, the rest is reset by the close, as before."""
    limit = gateway.server_config.max_connections
    # A second descriptor of the listening socket, accepted on without waiting.
    try:
        fd = os.dup(listener.socket.fileno())
    except OSError:  # short of descriptors: the close resets the backlog, as before
        return
    with socket.socket(fileno=fd) as sock:
        sock.setblocking(False)  # never wait, whatever socket.setdefaulttimeout says
        for _ in range(MAX_BACKLOG):
            if gateway._refusing >= MAX_REFUSING and gateway._open >= limit:
                return
            try:
                client, _ = sock.accept()
            except (ConnectionAbortedError, InterruptedError):
                continue  # that one was reset while it waited; the next may not be
            except OSError:  # nothing waiting (BlockingIOError), or short of descriptors
                return
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(client))
            _place(gateway, stream, nursery, refusal)


async def _serve(gateway: Gateway, stream: trio.SocketStream) -> None:
    gateway._starting -= 1  # serve_connection counts it among the open connections
    try:
        await serve_connection(gateway, stream)
    finally:
        gateway._open -= 1
        if gateway._room:
            gateway._room.unpark_all()
        await trio.aclose_forcefully(stream)


async def _refuse(gateway: Gateway, stream: trio.SocketStream, refusal: bytes) -> None:
    """Answer 503 without reading the request, shut the writing side and drain what
    the client sends until it closes: at most LINGER. Cancelling it closes the
    socket at once."""
    try:
        with trio.move_on_after(LINGER):
            try:
                # A new socket's send buffer is empty: it takes these few hundred
                # bytes whole.
                _write_some(stream.socket.fileno(), refusal)
            except trio.BrokenResourceError:
                pass  # the client has gone; _close only closes
            await _close(stream, linger=True)
    finally:
        gateway._refusing -= 1
        if gateway._room:
            gateway._room.unpark_all()
        await trio.aclose_forcefully(stream)


def _make_room(gateway: Gateway) -> bool:
    """Close the oldest idle keep-alive HTTP connection to make room for a new one (see the
    module's docstring); whether there was one. Not a checkpoint. Only called at the
    limit: it looks at the open connections in the order they opened, up to the
    first idle one."""
    for conn in gateway._conns:
        if (
            conn.busy or not conn.kept or conn.stop_reading is not None or conn.evicted
            or conn.fd < 0 or _readable(conn.fd)
        ):
            continue
        conn.evicted = True
        conn.scope.cancel("server.max_connections reached: the oldest idle connection makes room")
        gateway.connections_evicted += 1
        return True
    return False


def _warn_past_open_files(limit: int) -> None:
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and limit >= soft:
        log.warning(
            "server.max_connections (%d) is not below the open-file limit (%d, "
            "ulimit -n): accept will fail with EMFILE before the limit is reached",
            limit, soft,
        )
