"""The client of ``/v2/stream``: :func:`open_stream` opens the WebSocket (on
trio-websocket) and yields a :class:`StreamClient`, which sends requests tagged with
ids (:func:`request_message`) and matches the answers (:class:`StreamReply`) to them."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import attrs
import numpy as np
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionTimeout,
    connect_websocket_url,
)
from trioserve import (
    DeadlineExceeded,
    Forbidden,
    InvalidInput,
    ModelError,
    Overloaded,
    QuotaExceeded,
    TrioserveError,
    Unauthorized,
    UnknownModel,
)

from ._replay import CLOSE_GRACE, KIB, RECEIVE_SIZE
from ._request import encode_inputs
from ._response import decode_outputs
from ._v2 import dumps, json_loads

_NO_ID = object()


ERROR_OF_STATUS: dict[int, type[TrioserveError]] = {
    400: InvalidInput,
    401: Unauthorized,
    403: Forbidden,
    404: UnknownModel,
    429: QuotaExceeded,
    503: Overloaded,
    504: DeadlineExceeded,
}


@attrs.frozen(kw_only=True)
class StreamReply:
    """One answer from the stream: outputs (name -> array) or an error (with 429 and
    503, ``retry_after``: seconds to wait before trying again)."""

    id: Any
    outputs: dict[str, np.ndarray] | None = attrs.field(default=None, eq=False)
    error: str | None = None
    status: int = 200
    model_name: str | None = None
    retry_after: float | None = None

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> StreamReply:
        if "error" in doc:
            status = int(doc.get("status", 500))
            retry = doc.get("retry_after")
            return cls(id=doc.get("id"), error=str(doc["error"]), status=status,
                       retry_after=None if retry is None else float(retry))
        return cls(id=doc.get("id"), outputs=decode_outputs(doc), model_name=doc.get("model_name"))

    def unwrap(self) -> dict[str, np.ndarray]:
        """The outputs, or the error raised as its trioserve error class."""
        if self.error is None:
            assert self.outputs is not None
            return self.outputs
        cls = ERROR_OF_STATUS.get(self.status, ModelError)
        if issubclass(cls, Overloaded) and self.retry_after is not None:
            raise cls(self.error, retry_after=self.retry_after)
        raise cls(self.error)


@attrs.define(eq=False, slots=True)
class _Waiter:
    """An :meth:`StreamClient.infer` caller waiting for the answer to its id."""

    event: trio.Event = attrs.Factory(trio.Event)
    doc: Any = None
    #: the caller left (cancelled): its answer, when it comes, is dropped.
    abandoned: bool = False


@attrs.define(eq=False, slots=True)
class _Outgoing:
    """A message handed to the client's writer task, and how its write ended."""

    message: str | bytes
    #: the infer caller, woken as well when the write fails
    waiter: _Waiter | None = None
    done: trio.Event = attrs.Factory(trio.Event)
    #: why the write failed (ConnectionClosed, or the message's own error)
    error: Exception | None = None


def request_message(
    id: Any,
    model: str,
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    *,
    version: str | None = None,
    outputs: Sequence[str] | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> str:
    """One stream message: a v2 infer request tagged with ``id`` and ``model``."""
    doc: dict[str, Any] = {"id": id, "model": model, "inputs": encode_inputs(inputs)}
    if version is not None:
        doc["version"] = version
    if outputs is not None:
        doc["outputs"] = [{"name": n} for n in outputs]
    if parameters:
        doc["parameters"] = dict(parameters)
    return dumps(doc).decode()


class StreamClient:
    """A client of ``/v2/stream``. Made by :func:`open_stream`.

    Use either :meth:`infer` (matches answers to callers by id; many tasks may call
    it at once) or :meth:`send` / :meth:`receive` (answers in completion order).
    At most ``max_in_flight`` requests are outstanding: beyond that, sending waits.

    :meth:`infer` tags its requests with ids of its own, ``"infer:0"``,
    ``"infer:1"``...: a string id given to :meth:`send` may not begin with
    :attr:`INFER_ID_PREFIX` (ValueError), so that its answer is never taken for an
    infer caller's, nor an infer caller's for its.

    Messages are written by one writer task (:meth:`run_writer`, started by
    :func:`open_stream`), each whole: a caller cancelled while its message waits for
    the writer withdraws it, and one cancelled once the writer has taken it leaves
    the write to finish. (A write cut part way, as a cancelled ``send_message``
    leaves it, would make the next message's bytes the rest of the cut frame and
    fail the stream for every caller.)
    """

    #: The prefix of the ids :meth:`infer` makes, refused in an id given to :meth:`send`.
    INFER_ID_PREFIX = "infer:"

    def __init__(self, ws: Any, max_in_flight: int) -> None:
        _check_max_in_flight(max_in_flight)
        self.ws = ws
        # Unbuffered: a message handed over is one the writer has taken.
        self._to_writer, self._outgoing = trio.open_memory_channel[_Outgoing](0)
        # A slot per request sent and not yet answered (and, for send, received).
        self._slots = trio.Semaphore(max_in_flight)
        self._waiters: dict[Any, _Waiter] = {}
        self._send_replies, self._replies = trio.open_memory_channel[Any](max_in_flight)
        self._ids = itertools.count()

    async def send(
        self,
        id: Any,
        model: str,
        inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        **kw: Any,
    ) -> None:
        """Send one request (keywords: version, outputs, parameters); its answer comes
        from :meth:`receive`. Waits while ``max_in_flight`` answers are outstanding.
        Raises ValueError, sending nothing, for a string id that begins with
        :attr:`INFER_ID_PREFIX` (the ids :meth:`infer` makes)."""
        if isinstance(id, str) and id.startswith(self.INFER_ID_PREFIX):
            raise ValueError(
                f"stream id {id!r} begins with {self.INFER_ID_PREFIX!r}, which is kept "
                "for the ids infer() makes (an answer to it would go to an infer "
                "caller); use another id"
            )
        await self.send_raw(request_message(id, model, inputs, **kw))

    async def send_raw(self, message: str | bytes) -> None:
        """Send a message as it is (it takes an in-flight slot until answered).
        Returns once it is written. Cancelled before the writer took it, it is not
        sent; after, it is still sent whole, and its answer comes to receive(). Its
        id is not checked: one beginning with :attr:`INFER_ID_PREFIX` may have its
        answer taken by an :meth:`infer` caller."""
        await self._slots.acquire()
        item = await self._hand_over(message)
        await item.done.wait()
        if item.error is not None:
            self._slots.release()  # no answer will come
            raise item.error

    async def _hand_over(self, message: str | bytes, waiter: _Waiter | None = None) -> _Outgoing:
        """Hand ``message`` to the writer (holding a slot); cancelled or failed
        before the writer took it, the slot is freed."""
        item = _Outgoing(message=message, waiter=waiter)
        taken = False
        try:
            await self._to_writer.send(item)
            taken = True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ConnectionClosed(self.ws.closed) from None
        finally:
            if not taken:
                self._slots.release()
        return item

    async def run_writer(self) -> None:
        """Write the messages handed over, one at a time and each whole, until
        cancelled. A failed write (the connection closed) fails its caller only."""
        with self._outgoing:
            async for item in self._outgoing:
                written = False
                try:
                    await self.ws.send_message(item.message)
                    written = True
                except Exception as exc:  # ConnectionClosed, or a message not str/bytes
                    item.error = exc
                finally:
                    if not written and item.error is None:  # cancelled: the client closes
                        item.error = ConnectionClosed(self.ws.closed)
                    item.done.set()
                    if item.error is not None and item.waiter is not None:
                        item.waiter.event.set()

    async def receive(self) -> StreamReply:
        """The next answer not claimed by :meth:`infer`, in completion order.

        Raises trio_websocket.ConnectionClosed once the stream has closed.
        """
        try:
            doc = await self._replies.receive()
        except trio.EndOfChannel:
            raise ConnectionClosed(self.ws.closed) from None
        self._slots.release()
        return StreamReply.from_doc(doc)

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        **kw: Any,
    ) -> dict[str, np.ndarray]:
        """Send one request (keywords: version, outputs, parameters) and wait for its
        answer: outputs name -> array, or the error raised as its trioserve class
        (InvalidInput, UnknownModel, ...). Cancelling it drops the answer."""
        rid = f"{self.INFER_ID_PREFIX}{next(self._ids)}"
        message = request_message(rid, model, inputs, **kw)
        await self._slots.acquire()
        waiter = self._waiters[rid] = _Waiter()
        item = None
        try:
            item = await self._hand_over(message, waiter)
            await waiter.event.wait()  # the answer, or the write failed
            if item.error is not None:
                raise item.error
        finally:
            if item is None or item.error is not None:
                # Not sent (withdrawn before the writer took it, or the write failed),
                # so no answer will come to free the slot (_hand_over freed it if the
                # writer never took it): forget the caller now.
                self._waiters.pop(rid, None)
                if item is not None:
                    self._slots.release()
            # Left before the answer: it may still come, and the dispatcher then drops
            # it and frees the slot.
            waiter.abandoned = waiter.doc is None
        if waiter.doc is None:
            raise ConnectionClosed(self.ws.closed)
        return StreamReply.from_doc(waiter.doc).unwrap()

    async def _dispatch(self) -> None:
        ws = self.ws
        try:
            while True:
                try:
                    message = await ws.get_message()
                except ConnectionClosed:
                    return
                doc = json_loads(message)
                rid = doc.get("id", _NO_ID)
                # infer's ids are strings; an id the server echoes as a list or an
                # object (refused, from send_raw) is not hashable: receive's
                waiter = self._waiters.pop(rid, None) if type(rid) is str else None
                if waiter is None:
                    await self._send_replies.send(doc)
                    continue
                self._slots.release()
                if not waiter.abandoned:
                    waiter.doc = doc
                    waiter.event.set()
        finally:
            self._send_replies.close()
            for waiter in self._waiters.values():
                waiter.event.set()


def _check_max_in_flight(max_in_flight: int) -> None:
    # 0 made every send wait for ever (no slot), a negative number a Semaphore error
    if type(max_in_flight) is not int or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be an integer of at least 1, "
                         f"got {max_in_flight!r}")


def stream_url(url: str) -> str:
    """The ``ws://`` (``wss://``) URL of the stream for ``url``.

    An ``http://`` or ``https://`` URL is the server's base URL: its path, if any, is
    the prefix the server's routes sit under (a proxy's route), so
    ``http://host/prefix`` gives ``ws://host/prefix/v2/stream``; one that already ends
    in ``/v2/stream`` is the stream's own. A ``ws://`` or ``wss://`` URL is the
    stream's own, taken as it is (with no path: ``/v2/stream``). A query is kept.
    """
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path
    if path in ("", "/"):
        path = "/v2/stream"
    elif scheme != parts.scheme and not path.endswith("/v2/stream"):
        path = path.rstrip("/") + "/v2/stream"
    query = f"?{parts.query}" if parts.query else ""
    return f"{scheme}://{parts.netloc}{path}{query}"


#: The client's default bound on one message from the server: the largest
#: ``server.max_body_bytes`` a server takes (4 GiB, ``trioserve._config.MAX_BODY_BYTES``),
#: for answers have no bound of their own. 16 MiB before: a legal answer larger than
#: that failed the stream (1009) on the client.
MAX_MESSAGE_SIZE = 4 * 1024 * 1024 * KIB


@asynccontextmanager
async def open_stream(
    url: str,
    *,
    api_key: str | None = None,
    max_in_flight: int = 256,
    max_message_size: int = MAX_MESSAGE_SIZE,
    connect_timeout: float = 10.0,
) -> AsyncIterator[StreamClient]:
    """Open a ``/v2/stream`` WebSocket to the server at ``url`` (its base URL,
    ``http://host:port`` or ``http://host/prefix`` for a server behind a path prefix,
    or the stream's ``ws://`` URL: :func:`stream_url`) and yield a
    :class:`StreamClient`; closed on leaving.

    ``max_message_size`` bounds one message from the server (a larger one closes the
    stream with 1009): by default as large as any server may take (MAX_MESSAGE_SIZE).

    Raises trio_websocket.ConnectionRejected (status 401) for a refused API key and
    trio_websocket.ConnectionTimeout when the handshake takes over ``connect_timeout``.
    """
    _check_max_in_flight(max_in_flight)
    headers = [(b"authorization", b"Bearer " + api_key.encode())] if api_key else None
    try:
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(connect_timeout) as connecting:
                ws = await connect_websocket_url(
                    nursery,
                    stream_url(url),
                    extra_headers=headers,
                    message_queue_size=max(1, max_in_flight),
                    max_message_size=max_message_size,
                    receive_buffer_size=RECEIVE_SIZE,
                )
            if connecting.cancelled_caught:
                raise ConnectionTimeout(f"no WebSocket handshake within {connect_timeout:g} s")
            client = StreamClient(ws, max_in_flight)
            nursery.start_soon(client._dispatch)
            nursery.start_soon(client.run_writer)
            try:
                yield client
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_GRACE):
                    await ws.aclose()
                nursery.cancel_scope.cancel("stream client closed")
    except BaseExceptionGroup as group:
        # A refused handshake fails trio-websocket's reader task: raise it unwrapped.
        leaves = [e for e in _leaves(group) if not isinstance(e, trio.Cancelled)]
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


__all__ = [
    "StreamClient",
    "StreamReply",
    "open_stream",
    "request_message",
]
