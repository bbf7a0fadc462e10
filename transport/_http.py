"""The HTTP/1.1 connection handler: h11 (and llhttp) over a trio stream, one task per
connection, keep-alive.

The data plane's usual request (a keep-alive HTTP/1.1 ``POST`` to an infer route,
one Content-Length, head and body already received) is parsed by llhttp
(``httptools``, ``_data_plane_request``) in ~2 us; h11 took ~20 us, and with it the
server answered ~25-40% fewer such requests a second. h11 parses every other
request, so its refusals (400, 413, 414, 431, 501, 505), 100-continue, chunked
bodies and its error messages stay as they were.
``POST /v2/models/{name}[/versions/{v}]/infer`` (the data plane) is answered here
directly; a ``/v2/stream`` WebSocket upgrade is handed to the
stream server (``._stream``, on wsproto) over the same socket; every other request goes
to the control plane's ASGI app, called in-process. Each response leaves in one write
when the socket buffer takes it; the connection's own reads and writes (``_receive``,
``_send_all``) go to its descriptor with one trip through the scheduler per request:
a checkpoint before the read, or, for a data-plane answer that waited to be written
with others of its pass (:class:`Outbox`), that wait.

The data plane's keep-alive answers (a status, the gateway's own headers, a body)
are written from a template and the next request gets a fresh h11 state: h11's
writer and its state machine cost ~20 µs a request, more than a fifth of the
handler's time. Everything else (control plane, ``Connection: close``, HTTP/1.0,
the drain delay and the drain) is written by h11, except the answers to a request
llhttp parsed, which h11 never saw (``_Connection.bare``): those are written from the
template, with ``Connection: close`` when the connection then ends. A data-plane body that h11 has
framed by its Content-Length and already holds whole is taken from h11's buffer rather
than through its two body events (~5 µs); one that has not all arrived is read
through h11.

While a data-plane request waits for its answer the connection does not read its
socket; the gateway's hang-up watch (``._hangup``) notices a client that closes it
meanwhile and cancels the connection, so the request is withdrawn (or its answer
dropped) and nothing is written.

Here: the connection loop (``_Connection``) and its answers. The socket reads and
writes and the :class:`Outbox` are ``._wire``'s, the llhttp parse and the infer route
``._data_plane``'s, the control plane's ASGI call ``._asgi``'s.
"""

from __future__ import annotations

import logging
import math
from http import HTTPStatus
from typing import TYPE_CHECKING

import h11
import trio

from ._answers import JSON, Answer, Headers
from ._asgi import _call_asgi, _peer, routes_nothing
from ._auth import another_field_line
from ._coding import encode_answer
from ._data_plane import _FAST_PREFIX, MAX_HEAD, _data_plane_request, _infer_route
from ._target import MAX_TARGET, check_target, unusual
from ._v2 import error_body
from ._wire import (
    KIB,
    RECEIVE_SIZE,
    _checkpoint,
    _readable,
    _ReadTimeout,
    _receive,
    _send_all,
    _WriteStalled,
)

if TYPE_CHECKING:
    from ._connections import _Conn
    from ._gateway import Gateway
    from ._hangup import HangupWatch

log = logging.getLogger("trioserve.transport")

#: After an error answer, how long unread request bytes are drained before closing
#: (closing with unread data would reset the connection before the client reads).
LINGER = 1.0
_LONG_TARGET = f"request target too long: over {MAX_TARGET} bytes (path and query)"
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_NEED_DATA = h11.NEED_DATA
_Request = h11.Request
_Data = h11.Data
_EndOfMessage = h11.EndOfMessage
_CLOSE = (b"connection", b"close")
#: The drain's refusals, written once (each connection left at its end gets one).
_NOT_COMPLETED = error_body("the server is shutting down; the request was not completed")
_NO_NEW_STREAM = error_body(
    "the server is shutting down; open the stream again elsewhere or later"
)
#: The methods of RFC 9110 (and PATCH); any other gets 501.
_METHODS = frozenset(
    (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS", b"TRACE", b"PATCH")
)


class _Close(Exception):
    """End the connection after answering (``linger``: drain unread request bytes)."""

    def __init__(self, linger: bool = False) -> None:
        self.linger = linger


async def serve_connection(gateway: Gateway, stream: trio.SocketStream) -> None:
    """Serve one client connection until it closes, errs, or the gateway drains.

    A request still unanswered when the drain's grace period ends gets a 503. A client
    that takes no byte of an answer for ``server.write_timeout_s`` is cut: the
    connection closes (requests it pipelined behind that answer are never read, so
    never admitted) and ``Gateway.http_write_timeouts`` counts it.
    """
    c = _Connection(gateway, stream)
    linger = False
    handed_off = False
    with trio.CancelScope() as scope:
        c.conn = gateway._open_conn(scope, c.fd)
        try:
            handed_off = await c.serve()
        except _Close as close:
            linger = close.linger
        except _WriteStalled:
            c.stalled = True
        except _ReadTimeout as timeout:
            if not timeout.idle:
                linger = True
                body = error_body(
                    "request timeout: the request did not arrive whole within "
                    f"{gateway.server_config.request_timeout_s:g} s (server.request_timeout_s)"
                )
                await _send_quietly_raw(c, 408, body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away
        except h11.RemoteProtocolError as exc:
            linger = True
            if c.h.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                status = exc.error_status_hint
                body = error_body(f"bad HTTP request: {exc}")
                if status == 431:  # h11: "Receive buffer too long"
                    body = error_body(f"bad HTTP request: request head over {MAX_HEAD} bytes")
                    if b"\n" not in c.h.trailing_data[0][:MAX_TARGET + 32]:
                        # the request line alone is over the limit: its target is long
                        status, body = 414, error_body(_LONG_TARGET)
                await _send_quietly(c, status, [JSON], body)
        except Exception as exc:
            # A bug, not bad input: fail this connection only, never the server.
            log.exception("connection %s: unexpected error", _peer(stream, local=False))
            linger = True
            if c.bare or c.h.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                body = error_body(f"internal error: {type(exc).__name__}: {exc}")
                await _send_quietly(c, 500, [JSON], body)
    try:
        if c.stalled:
            # Cut: nothing more is written, and what it sent is not drained.
            gateway.http_write_timeouts += 1
            linger = False
        elif c.conn.gone and scope.cancelled_caught:
            pass  # the client hung up while its request waited: nobody to answer
        elif scope.cancelled_caught and not handed_off and (
            c.bare or c.h.our_state is h11.SEND_RESPONSE
        ):
            # Drained past the grace period with this request unanswered: say so.
            body = _NOT_COMPLETED
            with trio.CancelScope(shield=True), trio.move_on_after(LINGER):
                await _send_quietly(c, 503, [JSON, (b"retry-after", b"1")], body)
        if not handed_off:
            with trio.CancelScope(shield=True), trio.move_on_after(LINGER):
                await _close(stream, linger)
    finally:
        gateway._close_conn(c.conn)


def _new_h11() -> h11.Connection:
    return h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)


class _Connection:
    """One client connection: its stream, its h11 state, its place in the drain, and
    the bound on each of its writes (``server.write_timeout_s``)."""

    __slots__ = ("bare", "conn", "fd", "gateway", "h", "stalled", "stream", "write_timeout")

    def __init__(self, gateway: Gateway, stream: trio.SocketStream) -> None:
        self.gateway = gateway
        self.stream = stream
        self.fd = stream.socket.fileno()
        self.h = _new_h11()
        #: the request being answered was parsed by llhttp (``_data_plane_request``):
        #: ``h`` is fresh, and an answer to it is written without h11
        self.bare = False
        self.conn: _Conn
        self.write_timeout = gateway.server_config.write_timeout_s
        #: a write was cut: the client took no byte of it for ``write_timeout``
        self.stalled = False

    async def serve(self) -> bool:
        """The keep-alive loop. Returns True when a WebSocket took the connection over.

        While an infer request waits, the gateway's hang-up watch (``._hangup``) may
        cancel the connection's scope: its client has gone.
        """
        fd = self.fd
        watch = self.gateway.hangups
        try:
            return await self._serve(fd, watch)
        finally:
            if watch is not None:
                watch.forget(fd, self.conn)

    async def _serve(self, fd: int, watch: HangupWatch | None) -> bool:
        gateway, stream, conn = self.gateway, self.stream, self.conn
        infer = gateway.infer
        max_body = gateway.server_config.max_body_bytes
        idle = gateway.server_config.keep_alive_timeout_s
        patience = gateway.server_config.request_timeout_s
        stall = self.write_timeout
        h = self.h  # fresh: nothing buffered in it between requests
        buf = b""  # bytes received and not yet parsed: the next request(s), pipelined
        outbox = gateway.outbox
        waited = False  # the last answer waited for the outbox: no checkpoint needed
        while True:
            # ---- the request head (between requests the connection is idle)
            fresh = True  # nothing read yet for this request
            deadline = math.inf  # set when a request needs a second read
            if not buf:
                conn.busy = False
                if gateway.draining and not _readable(fd):
                    return False  # idle (a request already in its socket is served)
                buf = await _receive(fd, True, idle, checkpoint=not waited)
                waited = False
                conn.busy = True
                fresh = False
                if not buf:
                    return False  # the client closed between requests
            if buf[:1] == b"\r" or buf[:1] == b"\n":
                # Empty lines before a request line are ignored (RFC 9112 2.2; h11
                # refuses them). Only those that begin the request's bytes.
                buf = buf.lstrip(b"\r\n")
                if not buf:
                    continue
            conn.busy = True
            fast = _data_plane_request(buf, max_body) if buf[:16] == _FAST_PREFIX else None
            if fast is not None:
                # parsed by llhttp, answered from the template (see the module's
                # docstring); h stays fresh
                route, body, buf, auth, hlen, idem, encoding, accept = fast
                keep_alive = self.bare = True
            else:
                h.receive_data(buf)
                buf = b""
                event = h.next_event()
            while fast is None and event is _NEED_DATA:
                if fresh:
                    # part of a pipelined request head is buffered: the request has
                    # begun, so it has server.request_timeout_s to arrive whole (an
                    # idle wait here closed it quietly after keep_alive_timeout_s)
                    if gateway.draining:
                        return False
                    if not waited:
                        await _checkpoint()  # the loop's one checkpoint a request
                    waited = False
                    fresh = False
                if deadline == math.inf:
                    deadline = trio.current_time() + patience
                data = await _receive(fd, False, deadline=deadline)
                h.receive_data(data)  # b"" (EOF): h11 reports ConnectionClosed or raises
                event = h.next_event()
            if fast is None:
                if type(event) is not _Request:
                    return False  # ConnectionClosed
                conn.busy = True
                request = event
                auth = hlen = upgrade = idem = encoding = accept = expect = None
                length = -1
                chunked = False
                version = request.http_version
                keep_alive = version == b"1.1"
                if not keep_alive and version != b"1.0":
                    raise await _refuse(self, 505, f"HTTP/{version.decode()} is not supported")
                head = len(request.target)
                for raw_name, value in request.headers.raw_items():
                    name = raw_name.lower()
                    head += len(name) + len(value) + 4
                    if name == b"content-length":
                        length = int(value)  # h11 checked it: digits, one value
                        if length > max_body:
                            raise await _too_large(self, max_body)
                    elif name == b"transfer-encoding":
                        chunked = True
                    elif name == b"authorization":
                        auth = value if auth is None else another_field_line(auth, value)
                    elif name == b"inference-header-content-length":
                        # two lines are one list (RFC 9110 5.3), refused as not digits
                        hlen = value if hlen is None else hlen + b", " + value
                    elif name == b"idempotency-key":
                        idem = value if idem is None else another_field_line(idem, value)
                    elif name == b"content-encoding":
                        encoding = value
                    elif name == b"accept-encoding":
                        accept = value if accept is None else accept + b", " + value
                    elif name == b"upgrade":
                        upgrade = value
                    elif name == b"expect":
                        expect = value if expect is None else expect + b", " + value
                    elif name == b"connection" and b"close" in [
                        t.strip() for t in value.lower().split(b",")
                    ]:
                        keep_alive = False
                if head > MAX_HEAD:
                    if len(request.target) > MAX_TARGET:
                        raise await _refuse(self, 414, _LONG_TARGET)
                    raise await _refuse(
                        self, 431, f"bad HTTP request: request head over {MAX_HEAD} bytes"
                    )
                if length >= 0 and chunked:
                    # A body framed two ways is how requests are smuggled past a proxy:
                    # refuse it and close (RFC 9112 6.1).
                    raise await _refuse(
                        self, 400, "bad HTTP request: both Transfer-Encoding and Content-Length"
                    )
                if expect is not None and _unmet(expect):
                    # RFC 9110 10.1.1: 417 rather than going on as if it were met;
                    # before the body, so no 100 is sent (llhttp hands any Expect here)
                    raise await _refuse(
                        self, 417,
                        "expectation failed: only 100-continue can be met, got Expect: "
                        f"{expect.decode('latin-1')!r}",
                    )

                method = request.method
                target = request.target
                route = verdict = None
                if unusual(target):
                    # asterisk- or absolute-form, a long target, or a path that may name
                    # nothing: answered after the body (so the connection stays usable)
                    target, verdict = check_target(method, target)
                if verdict is None and method == b"POST" and target.startswith(b"/v2/models/"):
                    route = _infer_route(target)

                # ---- the body
                if expect is not None and (length > 0 or chunked) and (
                    h.they_are_waiting_for_100_continue and not h.trailing_data[0]
                ):
                    # The client waits for a 100 before it sends its body: an answer
                    # the body cannot change is sent instead (RFC 9110 10.1.1), and
                    # the connection closes, as the next bytes may be that body or
                    # the next request (see docs/gateway.md).
                    early = await _answer_before_body(
                        gateway, stream, request, target, route, verdict, upgrade,
                        auth, idem, encoding,
                    )
                    if early is not None:
                        status, headers, out = early
                        if method == b"HEAD" and status != 204:
                            headers.append((b"content-length", b"%d" % len(out)))
                            out = b""
                        await _send_all(fd, _response(h, status, headers, out, True), stall)
                        raise _Close(linger=True)
                body = rest = None
                if route is not None and length >= 0:
                    # The data plane's usual case: h11 has framed the body (one
                    # Content-Length; chunked as well is refused above) and often holds it
                    # whole already. Then it is taken from h11's buffer, without h11's two
                    # body events (~5 us a request), and the bytes after it go to the next
                    # request's fresh h11 state.
                    held = h.trailing_data[0]
                    if len(held) >= length:
                        body, rest = held[:length], held[length:]
                if body is None:
                    chunks: list[bytes] = []
                    size = 0
                    while True:
                        event = h.next_event()
                        kind = type(event)
                        if kind is _Data:
                            chunks.append(event.data)
                            size += len(event.data)
                            if size > max_body:
                                raise await _too_large(self, max_body)
                        elif kind is _EndOfMessage:
                            break
                        elif event is _NEED_DATA:
                            if chunked and size + _chunk_left(h) > max_body:
                                # a chunk-size line over the limit: refused before its data
                                raise await _too_large(self, max_body)
                            if h.they_are_waiting_for_100_continue:
                                go_on = h11.InformationalResponse(status_code=100, headers=[])
                                await _send_all(fd, h.send(go_on), stall)
                            if deadline == math.inf:
                                deadline = trio.current_time() + patience
                            h.receive_data(await _receive(fd, False, deadline=deadline))
                        else:
                            return False
                    # bytes, as the rest expects (h11 may hand a bytearray: unhashable
                    # in a cache key, and not taken by the numeric decoder)
                    body = bytes(chunks[0]) if len(chunks) == 1 else b"".join(chunks)

            # ---- route
            if route is not None:
                if watch is not None and not conn.armed:
                    watch.arm(fd, conn)  # once a connection, unless it hung up since
                # A keyed request is carried out whoever leaves: its client asked for
                # one run, and the retry it sends after a lost connection waits for it
                # and gets its answer (cancelled, it would run again for the retry).
                conn.waiting = idem is None
                try:
                    status, headers, out = await infer(
                        route[0], route[1], body, authorization=auth, header_length=hlen,
                        idempotency_key=idem, content_encoding=encoding,
                        accept_encoding=accept,  # 200s come back compressed so
                    )
                except trio.Cancelled:
                    if conn.gone:  # by the watch: withdrawn if queued, else dropped
                        gateway.clients_gone += 1
                    raise
                finally:
                    conn.waiting = False
                if keep_alive and gateway.keep_alive:
                    # Written from the template (see the module's docstring); the
                    # bytes already received after this request begin the next.
                    answer = _plain_response(status, headers, out)
                    if outbox is None:
                        await _send_all(fd, answer, stall)
                    else:
                        waited = await outbox.send(fd, answer, stall)
                    if fast is None:
                        buf = h.trailing_data[0] if rest is None else rest
                        h = self.h = _new_h11()
                    self.bare = False
                    conn.kept = True
                    continue
                if self.bare:
                    answer = _plain_response(status, [*headers, _CLOSE], out)
                else:
                    answer = _response(h, status, headers, out, True)
                await _send_all(fd, answer, stall)
                raise _Close()
            if upgrade is not None and b"websocket" in upgrade.lower() and (
                method == b"GET" and keep_alive and version == b"1.1"
                and target.partition(b"?")[0] == b"/v2/stream"
            ):
                from ._replay import ReplayStream
                from ._stream import serve_stream

                if gateway.draining:
                    # Its head was still arriving when the drain began: no new stream
                    # (it would read and run messages for the whole grace period).
                    body = _NO_NEW_STREAM
                    headers = [JSON, (b"retry-after", b"1")]
                    await _send_all(fd, _response(h, 503, headers, body, True), stall)
                    raise _Close()
                if watch is not None:
                    watch.forget(fd, conn)  # the stream reads its socket, and closes it
                replay = ReplayStream(stream, _head_bytes(request), held=h.trailing_data[0])
                await serve_stream(gateway, replay, conn)
                return True
            if verdict is not None:
                status, headers, out = verdict
            elif method in _METHODS:
                status, headers, out = await _call_asgi(gateway, stream, request, target, body)
                if accept is not None and status == 200 and out and not any(
                    name == b"content-encoding" for name, _ in headers
                ):
                    status, headers, out = await encode_answer((status, headers, out), accept)
            else:
                status, headers, out = _not_implemented(method)
            if method == b"HEAD" and status != 204:
                headers.append((b"content-length", b"%d" % len(out)))
                out = b""

            # ---- answer through h11; keep the connection unless it must close
            close = not gateway.keep_alive  # the drain delay, or the drain
            await _send_all(fd, _response(h, status, headers, out, close), stall)
            if close or h.our_state is not h11.DONE or h.their_state is not h11.DONE:
                raise _Close()
            buf = h.trailing_data[0]
            h = self.h = _new_h11()
            conn.kept = True
            waited = False  # this answer did not go through the scheduler


async def _answer_before_body(
    gateway: Gateway, stream: trio.SocketStream, request: h11.Request, target: bytes,
    route: tuple[str, str | None] | None, verdict: Answer | None, upgrade: bytes | None,
    auth: bytes | None, idem: bytes | tuple[bytes, ...] | None, encoding: bytes | None,
) -> Answer | None:
    """The answer to a request that its body cannot change, known from its head
    (``target`` in origin-form, ``route`` and ``verdict`` as the loop found them), or
    None when the body is to be read: an infer of a model or version not served, a
    target answered without routing (404 for a path that names nothing, 414 ...), a
    method not implemented (501), a path or method no endpoint of the control plane
    takes (404, 405). Answered as after the body (by the same code, given an empty
    body), so 401 or 403 still come first where they do. A checkpoint only where
    ``infer`` or the control plane's app is called."""
    method = request.method
    if route is not None:
        if not gateway.answers_before_body(route[0], route[1], idem, encoding):
            return None
        return await gateway.infer(route[0], route[1], b"", authorization=auth)
    if verdict is not None:
        return verdict
    if upgrade is not None:
        return None  # a WebSocket handshake, or its refusal, is the stream's
    if method not in _METHODS:
        return _not_implemented(method)
    if routes_nothing(gateway, method, target):
        return await _call_asgi(gateway, stream, request, target, b"")
    return None


def _not_implemented(method: bytes) -> Answer:
    # Methods are case-sensitive (RFC 9110 9.1): "post" is not POST.
    return 501, [JSON], error_body(
        f"method {method.decode('latin-1')!r} is not implemented "
        f"(methods are case-sensitive; this server knows "
        f"{', '.join(m.decode() for m in sorted(_METHODS))})"
    )


def _unmet(expect: bytes) -> bool:
    """Whether an Expect field value (its lines joined) has a member other than
    100-continue (case-insensitive; an empty member asks for nothing)."""
    return any(t.strip() not in (b"", b"100-continue") for t in expect.lower().split(b","))


def _chunk_left(h: h11.Connection) -> int:
    """The bytes of the chunk being read that h11 has not yet handed over: the size
    its chunk-size line announced, less what arrived. h11 does not publish it, so
    this reads its reader's state; were that to change, 0, and a chunk over the limit
    is refused as its data arrives, as before."""
    left = getattr(getattr(h, "_reader", None), "_bytes_in_chunk", 0)
    return left if type(left) is int else 0


_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, phrase) for code, phrase in _REASONS.items()}


def _plain_response(status: int, headers: Headers, body: bytes) -> bytes:
    """A keep-alive HTTP/1.1 response with a Content-Length, from trusted parts."""
    parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
    for name, value in headers:
        parts.append(b"%s: %s\r\n" % (name, value))
    parts.append(b"content-length: %d\r\n\r\n" % len(body))
    parts.append(body)
    return b"".join(parts)


def _response(h: h11.Connection, status: int, headers: Headers, body: bytes, close: bool) -> bytes:
    # A new list: ``headers`` may be a kept answer's (the edge cache), shared by every
    # later hit; appending to it once made each hit say "Connection: close".
    headers = list(headers)
    # RFC 9110 8.6: no Content-Length with a 204
    if status != 204 and not any(name == b"content-length" for name, _ in headers):
        headers.append((b"content-length", b"%d" % len(body)))
    if close:
        headers.append((b"connection", b"close"))
    reason = _REASONS.get(status, b"")
    head = h.send(h11.Response(status_code=status, headers=headers, reason=reason))
    data = h.send(_Data(data=body)) if body else b""
    end = h.send(_EndOfMessage())
    # Several Connection lines come only from h11 closing the connection (``close``,
    # or a request that asked it to close, or of HTTP/1.0: h11 is then MUST_CLOSE),
    # as it writes a line per option: a keep-alive answer's head is not searched.
    if (close or h.our_state is not h11.DONE) and head.lower().count(b"\r\nconnection:") > 1:
        head = _one_connection_line(head)
    return b"".join((head, data, end))


def _one_connection_line(head: bytes) -> bytes:
    """``head`` (a response's head, as h11 wrote it) with its Connection field lines
    made one, their options joined in order. An answer that names an option of its
    own (the 426's ``upgrade``) and closes the connection had two: h11 writes a line
    per option when it closes (``Connection: close``, ``Connection: upgrade``), and a
    ``close`` added for a drain was a line of its own. RFC 9110 5.3 lets a recipient
    join them, but a client that reads one line sees only one option."""
    kept: list[bytes] = []
    options: list[bytes] = []
    at = -1
    for line in head[:-4].split(b"\r\n"):  # the head ends with an empty line
        name, colon, value = line.partition(b":")
        if colon and name.strip().lower() == b"connection":
            if at < 0:
                at = len(kept)
                kept.append(b"")
            options.append(value.strip())
        else:
            kept.append(line)
    kept[at] = b"Connection: " + b", ".join(options)
    return b"\r\n".join(kept) + b"\r\n\r\n"


async def _send_quietly(c: _Connection, status: int, headers: Headers, body: bytes) -> None:
    """Send an error answer (the connection then closes), ignoring a client that has
    gone; one that takes none of it within the write timeout is marked stalled."""
    if c.bare:
        data = _plain_response(status, [*headers, _CLOSE], body)
    else:
        try:
            data = _response(c.h, status, headers, body, True)
        except h11.LocalProtocolError:
            return
    await _send_closing(c, data)


async def _send_closing(c: _Connection, data: bytes) -> None:
    try:
        await _send_all(c.fd, data, c.write_timeout)
    except _WriteStalled:
        c.stalled = True
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    await _checkpoint()  # a checkpoint, as trio's send_all was


async def _too_large(c: _Connection, limit: int) -> _Close:
    message = f"request body too large: the limit is {limit} bytes (server.max_body_bytes)"
    return await _refuse(c, 413, message)


async def _send_quietly_raw(c: _Connection, status: int, body: bytes) -> None:
    """An error answer written without h11 (whose state may not allow one: a head not
    yet whole), then the connection closes; a client that has gone is ignored."""
    await _send_closing(c, _plain_response(status, [JSON, (b"connection", b"close")], body))


async def _refuse(c: _Connection, status: int, message: str) -> _Close:
    """Answer ``status`` with the error ``message`` (a request refused before its body
    is read, or while reading it) and close the connection."""
    await _send_quietly(c, status, [JSON], error_body(message))
    return _Close(linger=True)


async def _close(stream: trio.SocketStream, linger: bool) -> None:
    """Close the connection; with ``linger``, first half-close and drain what the
    client still sends (bounded), so it reads our answer rather than a reset."""
    try:
        if linger:
            await stream.send_eof()
            budget = 1024 * KIB
            while budget > 0:
                data = await stream.receive_some(RECEIVE_SIZE)
                if not data:
                    break
                budget -= len(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


def _head_bytes(request: h11.Request) -> bytes:
    """The request head again, as the client sent it (for the WebSocket handshake)."""
    lines = [b"%s %s HTTP/%s\r\n" % (request.method, request.target, request.http_version)]
    lines.extend(b"%s: %s\r\n" % (name, value) for name, value in request.headers.raw_items())
    lines.append(b"\r\n")
    return b"".join(lines)
