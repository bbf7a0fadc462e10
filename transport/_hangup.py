"""Noticing that an HTTP client has gone while its infer request waits.

A connection task awaiting ``Gateway.infer`` does not read its socket, so a client
that closes its connection would go unnoticed until the answer is written: its
request would stay queued, run and be charged. :class:`HangupWatch` is one task per
gateway holding a private epoll object. A connection's socket is registered with it
once, at its first data-plane request, for hang-ups only (``EPOLLRDHUP``, ``EPOLLHUP``,
``EPOLLERR``; never ``EPOLLIN``: a client pipelining its next request is not leaving),
and stays registered until the connection closes. When a client hangs up while its
connection awaits an infer, the watch cancels the connection's scope: ``Runtime.infer``
withdraws the request if it is still queued (and refunds its credits) or drops its
answer if it is running, and the connection closes without an answer. A request with
an ``Idempotency-Key`` is not watched: it runs, and its answer waits in the key's
store for the retry of a client that lost its connection.

The hot path pays no system call: a request only sets and clears ``_Conn.waiting``.
The registration is ``EPOLLONESHOT``: a hang-up reported while the connection was not
waiting (it then reads the EOF itself) disarms it, and the next wait re-arms it (the
kernel reports a hang-up already there at once). Without ``select.epoll`` (not Linux)
nothing is watched: a gone client's request runs, and only its answer's write fails.

A ``/v2/stream`` WebSocket reads its socket itself, so it sees a close as it reads; it
arms the watch only while it has stopped reading at ``server.stream_in_flight``, and
a hang-up then calls its ``_Conn.hang_up`` instead of cancelling the connection.
"""

from __future__ import annotations

import select
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from ._connections import _Conn

_epoll = getattr(select, "epoll", None)
#: Hang-ups only (a peer's FIN or the shutdown of its writing side, a reset, an
#: error), reported once until re-armed.
_HANGUP = 0
if _epoll is not None:
    _HANGUP = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR | select.EPOLLONESHOT


class HangupWatch:
    """Cancels the connections whose client hangs up while they await an infer.

    Make it with :meth:`open` (None without epoll), run :meth:`run` in the gateway's
    nursery, and :meth:`close` it once its connections and its task have ended.
    """

    __slots__ = ("_conns", "_ep")

    def __init__(self, ep: select.epoll) -> None:
        self._ep = ep
        self._conns: dict[int, _Conn] = {}  # by socket descriptor

    @classmethod
    def open(cls) -> HangupWatch | None:
        """A watch with its own epoll object, or None where the platform has none."""
        return None if _epoll is None else cls(_epoll())

    def arm(self, fd: int, conn: _Conn) -> None:
        """Watch ``fd`` (``conn``'s socket) for a hang-up: register it on first use,
        re-arm it after a hang-up reported while ``conn`` was not waiting. Not a
        checkpoint."""
        if self._conns.get(fd) is conn:
            self._ep.modify(fd, _HANGUP)
        else:
            self._ep.register(fd, _HANGUP)
            self._conns[fd] = conn
        conn.armed = True

    def forget(self, fd: int, conn: _Conn) -> None:
        """Stop watching ``fd``. Call it before the socket closes (the descriptor's
        number may then be reused by another connection). Not a checkpoint."""
        if self._conns.get(fd) is conn:
            del self._conns[fd]
            try:
                self._ep.unregister(fd)
            except OSError:
                pass  # already closed: the kernel dropped it
        conn.armed = False

    async def run(self) -> None:
        """Wait for hang-ups and cancel the connections concerned. Runs until
        cancelled; cancelling it stops the watching (nothing else)."""
        ep = self._ep
        conns = self._conns
        while True:
            await trio.lowlevel.wait_readable(ep.fileno())
            for fd, _ in ep.poll(0):
                conn = conns.get(fd)
                if conn is None:
                    continue
                conn.armed = False  # EPOLLONESHOT: reported once until re-armed
                if not conn.waiting:
                    continue
                if conn.hang_up is not None:
                    conn.hang_up()  # a WebSocket stream withdraws its own requests
                elif not conn.scope.cancel_called:
                    # Our cancellation: the connection checks ``gone`` to tell it from
                    # a drain's.
                    conn.gone = True
                    conn.scope.cancel("the client closed its connection")

    def close(self) -> None:
        """Close the epoll object. Not a checkpoint."""
        self._conns.clear()
        self._ep.close()
