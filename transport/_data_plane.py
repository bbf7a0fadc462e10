"""The data plane's request as the connection loop first sees it: the infer route of a
request target, and the usual infer request (keep-alive HTTP/1.1, one Content-Length,
head and body received whole) parsed by llhttp (``httptools``) in ~2 us, where h11
takes ~20 us. Any other request is left to h11 (``._http``)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote_to_bytes

import httptools

from ._auth import another_field_line
from ._target import unusual
from ._wire import KIB

#: The largest request head (request line and headers) accepted.
MAX_HEAD = 16 * KIB
#: How a data-plane request begins; only such a request is tried by llhttp.
_FAST_PREFIX = b"POST /v2/models/"
_VERSION_LINE_END = b" HTTP/1.1\r\n"
_OWS = b" \t"
#: Headers that make a request h11's to parse (or, for Connection, ``close``).
_H11_FRAMING = frozenset((b"transfer-encoding", b"expect", b"upgrade", b"connection"))


class _Head:
    """Collects a request head's target and headers from llhttp's callbacks."""

    __slots__ = ("headers", "target")

    def __init__(self) -> None:
        self.target = b""
        self.headers: list[tuple[bytes, bytes]] = []

    def on_url(self, url: bytes) -> None:
        self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))


def _data_plane_request(
    buf: bytes, max_body: int
) -> tuple[tuple[str, str | None], bytes, bytes, Any, Any, Any, Any, Any] | None:
    """The data plane's usual request, parsed by llhttp (httptools): a keep-alive
    HTTP/1.1 ``POST`` to an infer route, framed by one Content-Length, whose head and
    body ``buf`` holds whole. Returns (route, body, the bytes after it, and the values
    of Authorization, Inference-Header-Content-Length, Idempotency-Key,
    Content-Encoding and Accept-Encoding: several Accept-Encoding lines as one list,
    several Authorization or Idempotency-Key lines as a tuple, refused),
    or None for any other request, which h11 then parses as before: its answers,
    refusals and error messages stay h11's. llhttp parses such a head in ~2 us where
    h11 takes ~20 us.

    What llhttp accepts and h11 would refuse is not taken here: more than one space
    in the request line, a missing or repeated Host; values lose trailing whitespace
    as h11's do. Not a checkpoint."""
    end = buf.find(b"\r\n\r\n", 0, MAX_HEAD)
    if end < 0:
        return None
    end += 4
    head = _Head()
    try:
        httptools.HttpRequestParser(head).feed_data(buf[:end])
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return None
    target = head.target
    n = 5 + len(target)
    if buf[n:n + 11] != _VERSION_LINE_END or unusual(target):
        return None
    route = _infer_route(target)
    if route is None:
        return None
    length = -1
    hosts = 0
    auth = hlen = idem = encoding = accept = None
    for raw_name, value in head.headers:
        name = raw_name.lower()
        if name == b"content-length":
            length = int(value)  # llhttp checked it: digits, one value
        elif name == b"host":
            hosts += 1
        elif name == b"authorization":
            value = value.rstrip(_OWS)
            auth = value if auth is None else another_field_line(auth, value)
        elif name == b"inference-header-content-length":
            value = value.rstrip(_OWS)
            hlen = value if hlen is None else hlen + b", " + value  # refused
        elif name == b"idempotency-key":
            value = value.rstrip(_OWS)
            idem = value if idem is None else another_field_line(idem, value)
        elif name == b"content-encoding":
            encoding = value.rstrip(_OWS)
        elif name == b"accept-encoding":
            value = value.rstrip(_OWS)
            accept = value if accept is None else accept + b", " + value
        elif name in _H11_FRAMING and (
            name != b"connection" or b"close" in [t.strip() for t in value.lower().split(b",")]
        ):
            return None  # framing, an upgrade or 100-continue, or the last request
    if hosts != 1 or length < 0 or length > max_body or end + length > len(buf):
        return None
    return (
        route, buf[end:end + length], buf[end + length:], auth, hlen, idem, encoding, accept
    )


def _infer_route(target: bytes) -> tuple[str, str | None] | None:
    """(model, version) of ``/v2/models/{name}[/versions/{v}]/infer``, else None."""
    path = target.partition(b"?")[0] if b"?" in target else target
    parts = path.split(b"/")
    n = len(parts)
    if n == 5 and parts[4] == b"infer":
        version = None
    elif n == 7 and parts[4] == b"versions" and parts[6] == b"infer":
        version = _text(parts[5])
    else:
        return None
    return _text(parts[3]), version


def _text(segment: bytes) -> str:
    if b"%" in segment:
        segment = unquote_to_bytes(segment)
    return segment.decode("utf-8", "replace")


__all__ = [
    "MAX_HEAD",
]
