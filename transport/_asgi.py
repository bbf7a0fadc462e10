"""The control plane: a request that is not the data plane's, run through the ASGI app
(quart-trio) in the connection's task, its whole answer collected."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import h11
import trio
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound

from ._answers import Answer, error_answer

if TYPE_CHECKING:
    from ._gateway import Gateway

log = logging.getLogger("trioserve.transport")

_DROPPED_HEADERS = frozenset((b"content-length", b"transfer-encoding", b"connection"))


async def _call_asgi(
    gateway: Gateway, stream: trio.SocketStream, request: h11.Request, target: bytes,
    body: bytes,
) -> Answer:
    """Run one request (``target`` in origin-form) through the ASGI app in this task;
    return its whole answer."""
    raw_path, _, query = target.partition(b"?")
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": request.http_version.decode(),
        "method": request.method.decode("ascii"),
        "scheme": "http",
        "path": unquote(raw_path.decode("latin-1")),
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": list(request.headers),
        "client": _peer(stream, local=False),
        "server": _peer(stream, local=True),
        "extensions": {},
    }
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()  # the app cancels its reader once it has answered
        raise AssertionError("unreachable")

    answer: dict[str, Any] = {"status": 500, "headers": [], "chunks": []}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            answer["headers"] = [
                (name, value)
                for name, value in (
                    (bytes(n).lower(), bytes(v)) for n, v in message.get("headers", ())
                )
                if name not in _DROPPED_HEADERS
                # a sender of Upgrade lists it in Connection (RFC 9110 7.8)
                or (name == b"connection" and value.lower() == b"upgrade")
            ]
        elif message["type"] == "http.response.body":
            answer["chunks"].append(bytes(message.get("body", b"")))

    try:
        await gateway.app(scope, receive, send)
    except Exception as exc:
        log.exception("control plane: %s %s failed", scope["method"], scope["path"])
        return error_answer(exc)
    return answer["status"], answer["headers"], b"".join(answer["chunks"])


def routes_nothing(gateway: Gateway, method: bytes, target: bytes) -> bool:
    """Whether the control plane's app has no endpoint for ``method`` on ``target``
    (origin-form): it then answers 404 or 405 (or its key guard's 401 or 403) whatever
    the body, as its routing fails before a view would read one. Matched as the app
    matches (its werkzeug map; the path percent-decoded as in the ASGI scope).
    ``method`` is one of RFC 9110's (ASCII). Not a checkpoint."""
    path = unquote(target.partition(b"?")[0].decode("latin-1"))
    try:
        gateway.app.url_map.bind("").match(path, method.decode("ascii"))
    except (NotFound, MethodNotAllowed):
        return True
    except HTTPException:
        return False  # a redirect (none of the app's routes makes one): left to the app
    return False


def _peer(stream: trio.SocketStream, *, local: bool) -> tuple[str, int] | None:
    try:
        sock = stream.socket
        addr = sock.getsockname() if local else sock.getpeername()
        return addr[0], addr[1]
    except (AttributeError, OSError, IndexError):
        return None
