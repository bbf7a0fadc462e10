"""The listeners' answers while the models load, until the gateway takes them over.

``trioserve serve`` binds its listeners before it loads the models, so that an address
in use fails at once. Until the gateway serves, :class:`LoadingAnswers` answers on the
same listeners, one request a connection, then ``Connection: close`` (the client's next
request reconnects, to the gateway once it serves):

- ``GET`` / ``HEAD /v2/health/live``: 200 ``{"live":true}``: the process is alive, so a
  liveness probe does not fail (and the pod is not killed) during a load of minutes;
- ``/v2/health/ready``: 503, not ready while loading;
- every other request: 503 with ``Retry-After`` and ``{"error": ...}`` saying that the
  server is loading models. A request body is not read.

The hand-over (:meth:`LoadingAnswers.hand_over`) stops accepting before the gateway
begins: the listeners stay open throughout, so a connection arriving then waits in the
listen backlog for the gateway, never refused; one accepted here is answered here.
It owns no policy and holds at most ``server.max_connections`` connections, each for at
most ``server.request_timeout_s`` (then ``LINGER`` to close).
"""

from __future__ import annotations

import logging
from typing import Any

import h11
import trio
from trioserve import ServerConfig

from ._accept import ACCEPT_RETRY_S, accept_failed
from ._answers import JSON, Answer
from ._http import LINGER, _close, _new_h11, _plain_response, _response
from ._v2 import error_body
from ._wire import RECEIVE_SIZE

log = logging.getLogger("trioserve.transport")

#: The answer to a readiness probe while the models load.
NOT_READY = "not ready: the server is loading models"
#: The answer to any other request (a probe of liveness aside) while they load.
LOADING = "the server is loading models; retry later"
_RETRY = (b"retry-after", b"1")
#: their bodies, written once: every request is refused so while the models load
_NOT_READY_BODY = error_body(NOT_READY)
_LOADING_BODY = error_body(LOADING)
_CLOSE = (b"connection", b"close")


def loading_answer(method: bytes, target: bytes) -> Answer:
    """The answer to a request for ``target`` while the models load (see the module)."""
    path = target.partition(b"?")[0]
    if method in (b"GET", b"HEAD"):
        if path == b"/v2/health/live":
            return 200, [JSON], b'{"live":true}'
        if path == b"/v2/health/ready":
            return 503, [JSON, _RETRY], _NOT_READY_BODY
    return 503, [JSON, _RETRY], _LOADING_BODY


class LoadingAnswers:
    """Answers on ``listeners`` while the models load (see the module). Start
    :meth:`run` in a nursery; :meth:`hand_over` before the gateway serves them."""

    def __init__(self, listeners: list[trio.SocketListener], server: ServerConfig) -> None:
        self._listeners = listeners
        self._server = server
        self._accepting = trio.CancelScope()
        self._stopped = trio.Event()
        #: the connections accepted, for tests and statistics
        self.accepted = 0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Accept connections and answer them until :meth:`hand_over`, then wait for
        those accepted to be answered. Reports ``started()`` once accepting. Never
        closes the listeners. Cancelling it closes its connections at once."""
        room = trio.Semaphore(self._server.max_connections)
        async with trio.open_nursery() as connections:
            with self._accepting:
                async with trio.open_nursery() as loops:
                    for listener in self._listeners:
                        loops.start_soon(self._accept_loop, listener, connections, room)
                    task_status.started()
            self._stopped.set()

    async def hand_over(self) -> None:
        """Stop accepting, so that the gateway may take the listeners over; returns
        once no accept is under way (a checkpoint). The connections accepted are still
        answered here."""
        self._accepting.cancel("the gateway takes the listeners over")
        await self._stopped.wait()

    async def _accept_loop(
        self, listener: trio.SocketListener, connections: trio.Nursery, room: trio.Semaphore
    ) -> None:
        while True:
            await room.acquire()  # released when its connection ends
            try:
                stream = await listener.accept()
            except OSError as exc:
                room.release()
                accept_failed(exc)
                await trio.sleep(ACCEPT_RETRY_S)
                continue
            except BaseException:
                room.release()
                raise
            self.accepted += 1
            connections.start_soon(self._serve, stream, room)

    async def _serve(self, stream: trio.SocketStream, room: trio.Semaphore) -> None:
        try:
            with trio.move_on_after(self._server.request_timeout_s):
                await _answer(stream)
            with trio.move_on_after(LINGER):
                # what the client still sends (a body) is drained, so that it reads
                # the answer rather than a reset
                await _close(stream, linger=True)
        finally:
            room.release()
            await trio.aclose_forcefully(stream)


async def _answer(stream: trio.SocketStream) -> None:
    """Read one request head and answer it (see :func:`loading_answer`); a client that
    has gone is ignored, a malformed request answered 4xx as the gateway does."""
    h = _new_h11()
    try:
        while (event := h.next_event()) is h11.NEED_DATA:
            h.receive_data(await stream.receive_some(RECEIVE_SIZE))
        if type(event) is not h11.Request:
            return  # the client closed before a whole request
        status, headers, body = loading_answer(event.method, event.target)
        if event.method == b"HEAD":
            headers.append((b"content-length", b"%d" % len(body)))
            body = b""
        await stream.send_all(_response(h, status, headers, body, True))
    except h11.RemoteProtocolError as exc:
        answer = _plain_response(
            exc.error_status_hint, [JSON, _CLOSE], error_body(f"bad HTTP request: {exc}")
        )
        try:
            await stream.send_all(answer)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the client went away
