"""A lean HTTP/1.1 client on trio and h11: one keep-alive connection per object.

For the HTTP bench (closed loop, C connections) and the tests; not a general client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote, urlsplit

import attrs
import h11
import orjson
import trio
from trioserve import ModelError, TrioserveError

from ._request import encode_inputs
from ._response import decode_outputs
from ._v2 import dumps, json_loads

RECEIVE_SIZE = 64 * 1024


@attrs.frozen(kw_only=True)
class HttpResponse:
    status: int
    #: header names lower-cased; a repeated header keeps its last value.
    headers: dict[str, str]
    body: bytes = attrs.field(repr=False)

    def json(self) -> Any:
        return json_loads(self.body)

    def outputs(self) -> dict[str, Any]:
        """The outputs of a v2 infer response as numpy arrays (JSON or binary data).
        An error response raises its trioserve error (by status) with its message."""
        if self.status != 200:
            from ._stream_client import ERROR_OF_STATUS

            try:
                message = self.json().get("error", "")
            except (orjson.JSONDecodeError, AttributeError):
                message = bytes(self.body[:200]).decode("utf-8", "replace")
            cls = ERROR_OF_STATUS.get(
                self.status, ModelError if self.status == 500 else TrioserveError
            )
            raise cls(f"HTTP {self.status}: {message}")
        hlen = self.headers.get("inference-header-content-length")
        if hlen is None:
            return decode_outputs(self.json())
        n = int(hlen)
        return decode_outputs(json_loads(self.body[:n]), self.body[n:])


def infer_body(
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    *,
    id: Any = None,
    outputs: Sequence[str] | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> bytes:
    """A v2 JSON infer request body (inputs: name -> array-like, shapes as given)."""
    doc: dict[str, Any] = {"inputs": encode_inputs(inputs)}
    if id is not None:
        doc["id"] = id
    if outputs is not None:
        doc["outputs"] = [{"name": n} for n in outputs]
    if parameters:
        doc["parameters"] = dict(parameters)
    return dumps(doc)


class HttpClient:
    """One keep-alive connection to ``url``'s host; reconnects when the server closes."""

    def __init__(self, url: str, *, api_key: str | None = None) -> None:
        parts = urlsplit(url if "//" in url else f"http://{url}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._host_header = (parts.netloc or self.host).encode()
        self._auth = b"Bearer " + api_key.encode() if api_key else None
        self._stream: trio.SocketStream | None = None
        self._h: h11.Connection | None = None
        self._received = False  # whether the request in flight has had any answer

    async def connect(self) -> None:
        """Open the connection now (otherwise the first request opens it)."""
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self.host, self.port)
            self._h = h11.Connection(h11.CLIENT)

    async def request(
        self,
        method: str,
        target: str,
        body: bytes = b"",
        headers: Iterable[tuple[str, str]] = (),
    ) -> HttpResponse:
        """Send one request and read its whole response. A checkpoint; cancelling it
        closes the connection (the next request reconnects). A kept-alive connection
        the server has closed meanwhile (its idle timeout) is found out when nothing
        comes back on it: the request is sent again once, on a new connection."""
        reused = self._stream is not None
        self._received = False
        try:
            return await self._request(method, target, body, headers)
        except (trio.BrokenResourceError, h11.RemoteProtocolError):
            if not reused or self._received:
                raise
        return await self._request(method, target, body, headers)

    async def _request(
        self, method: str, target: str, body: bytes, headers: Iterable[tuple[str, str]]
    ) -> HttpResponse:
        await self.connect()
        stream, h = self._stream, self._h
        assert stream is not None
        assert h is not None
        hdrs = [(b"host", self._host_header)]
        if body or method in ("POST", "PUT"):
            hdrs.append((b"content-length", b"%d" % len(body)))
            hdrs.append((b"content-type", b"application/json"))
        if self._auth is not None:
            hdrs.append((b"authorization", self._auth))
        hdrs.extend((n.encode(), v.encode()) for n, v in headers)
        ok = False
        try:
            out = h.send(h11.Request(method=method, target=target, headers=hdrs))
            if body:
                out += h.send(h11.Data(data=body))
            out += h.send(h11.EndOfMessage())
            await stream.send_all(out)
            status, rheaders, chunks = 0, {}, []
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(RECEIVE_SIZE)
                    if data:
                        self._received = True
                    h.receive_data(data)
                    continue
                kind = type(event)
                if kind is h11.Response:
                    status = event.status_code
                    rheaders = {n.decode(): v.decode("latin-1") for n, v in event.headers}
                elif kind is h11.Data:
                    chunks.append(event.data)
                elif kind is h11.EndOfMessage:
                    break
                elif kind is h11.ConnectionClosed:
                    raise trio.BrokenResourceError("the server closed the connection")
            ok = h.our_state is h11.DONE and h.their_state is h11.DONE
            if ok:
                h.start_next_cycle()
        finally:
            if not ok:
                await self.aclose()
        body = bytes(chunks[0]) if len(chunks) == 1 else b"".join(chunks)
        return HttpResponse(status=status, headers=rheaders, body=body)

    async def get(self, target: str) -> HttpResponse:
        return await self.request("GET", target)

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        version: str | None = None,
        **kw: Any,
    ) -> HttpResponse:
        """POST a v2 JSON infer request (see :func:`infer_body`) and return the response."""
        target = f"/v2/models/{quote(model, safe='')}" + (
            f"/versions/{quote(version, safe='')}" if version else ""
        ) + "/infer"
        return await self.request("POST", target, infer_body(inputs, **kw))

    async def aclose(self) -> None:
        stream, self._stream, self._h = self._stream, None, None
        if stream is not None:
            with trio.CancelScope(shield=True):
                await stream.aclose()


@asynccontextmanager
async def open_http(url: str, *, api_key: str | None = None) -> AsyncIterator[HttpClient]:
    """An :class:`HttpClient` connected to ``url``, closed on leaving the block."""
    client = HttpClient(url, api_key=api_key)
    await client.connect()
    try:
        yield client
    finally:
        await client.aclose()
