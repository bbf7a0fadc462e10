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

The server side: the handshake (``._stream_handshake``), and a session per connection
(``._stream_session``'s ``_Session``), which reads (``._stream_read``) and answers
(``._stream_answer``). The stream it writes through is ``._replay``'s; the client is
``._stream_client``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ._replay import CLOSE_GRACE
from ._stream_handshake import _handshake

if TYPE_CHECKING:
    from ._connections import _Conn
    from ._gateway import Gateway
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


__all__ = [
    "serve_stream",
]
