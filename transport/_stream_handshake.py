"""``/v2/stream``'s opening handshake: the request head read and checked, a refusal
written with the gateway's JSON error, or the session (``._stream_session``) begun."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trioserve import Unauthorized
from wsproto import ConnectionType, WSConnection
from wsproto.connection import Connection
from wsproto.events import AcceptConnection, RejectConnection, RejectData
from wsproto.events import Request as WsRequest
from wsproto.utilities import RemoteProtocolError

from ._answers import WWW_AUTHENTICATE
from ._auth import another_field_line
from ._replay import RECEIVE_SIZE
from ._stream_session import _Session
from ._v2 import error_body

if TYPE_CHECKING:
    from ._connections import _Conn
    from ._gateway import Gateway
    from ._replay import ReplayStream


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
