"""The answer side of a ``/v2/stream`` session (:class:`_Answers`): a request run and
its answer framed and queued on the stream, the drain's refusals, and the close."""

from __future__ import annotations

import functools
from typing import Any

import trio
from trioserve import InvalidInput, TrioserveError, UnknownModel
from wsproto.connection import ConnectionState
from wsproto.events import CloseConnection, TextMessage
from wsproto.utilities import RemoteProtocolError

from ._answers import retry_after_of
from ._gateway import UNKNOWN_MODEL, log
from ._replay import RECEIVE_SIZE
from ._request import InferRequest
from ._request_json import loads_request
from ._response import encode_response
from ._v2 import error_frame, id_problem, id_type_problem, shown


class _Answers:
    """The answer side of :class:`_Session` (whose state it uses): each message's
    request and answer, the drain's refusals, the close."""

    async def _refuse_unstarted(self) -> None:
        """Answer each message a drain left read but not started with a 503 frame
        (its id as read, null when it has none): it was not run. The pongs of the
        pings read with them go first."""
        unstarted, self._unstarted = self._unstarted, []
        pongs, self._pongs = self._pongs, b""
        if self._close_answer is not None:
            await self._send(self._close_answer)
            return
        if pongs:
            await self._send(pongs)
        for message in unstarted:
            try:
                doc = loads_request(message)
            except Exception:  # not JSON: its id is null, as its 400 would say
                doc = None
            frame = error_frame(doc.get("id") if type(doc) is dict else None, _NOT_RUN, 503, 1)
            await self._send(self.ws.send(TextMessage(data=frame.decode())))

    async def _send(self, data: bytes) -> None:
        """Queue ``data`` on the stream (whole frames), waiting while the stream's
        buffer is over its limit; a peer that left is the read loop's to see. A
        checkpoint. ``data`` is not held while this waits: once queued it is the
        flusher's, let go of when written (a caller must not keep it either)."""
        sending = self.stream.send_all(data)
        del data
        try:
            await sending
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer left; the read loop sees it

    async def _close(self, peer_closed: bool) -> None:
        ws = self.ws
        if ws.state is not ConnectionState.OPEN or self._gone:
            return
        if self._closing is not None:
            # Failing the connection (RFC 6455 7.1.7): the close frame, and no wait for
            # the client's (nothing more is read). After a stall, the close frame
            # follows the rest of the cut answer, if the client takes it in time.
            code, reason = self._closing
            frame = ws.send(CloseConnection(code=code, reason=reason))
            try:
                if self._stalled:
                    await self.stream.send_final(frame)
                else:
                    await self.stream.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            return
        # Requests cancelled by the end of a drain's grace period: tell the client.
        for rid in self.pending.values():
            frame = error_frame(rid, _NOT_COMPLETED, 503, 1)
            await self._send(ws.send(TextMessage(data=frame.decode())))
        if self.gateway.draining:
            code, reason = 1001, "server shutting down"
        else:
            code, reason = 1000, ""
        await self._send(ws.send(CloseConnection(code=code, reason=reason)))
        # Wait (briefly, see the caller) for the client's close frame.
        try:
            while ws.state is ConnectionState.LOCAL_CLOSING:
                data = await self.stream.receive_some(RECEIVE_SIZE)
                if not data:
                    return
                ws.receive_data(data)
                for _ in ws.events():
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, RemoteProtocolError):
            pass

    async def _one(self) -> None:
        """Answer the oldest message read and not yet begun (its bytes counted in
        ``in_flight_bytes`` until it is answered).

        The read loop spawns a task per message; trio runs new tasks in no set order
        (it reverses a batch of them half the time), so each task takes the oldest
        message rather than its own. A request is admitted (credits, the queue) in
        its task's first steps, before any checkpoint, so the messages of a stream
        are queued in the order they came (a message decoded in a worker thread, of
        ``DECODE_IN_THREAD_MIN`` bytes or more, takes its place once decoded)."""
        message, n = self._spawned.popleft()
        token = next(self._tokens)
        self.pending[token] = None
        try:
            # While the answer waits for the client (one that reads slowly) only its
            # frame is held: the request, the model's outputs and the encoded JSON
            # (orjson's output keeps a buffer up to ~4 times its length) are let go
            # when _answer returns. They were held too: ~6 times the answer's bytes.
            frame = await self._answer(message, token)
            # Answered from here on: once framed, the answer is in the stream's bytes
            # (a cancellation while it waits to be written must not add a 503 frame
            # for the same id at close).
            del self.pending[token]
            if self.ws.state is ConnectionState.OPEN:
                data = self.ws.send(TextMessage(data=frame.decode()))
                del frame
                # The frame is passed on, not kept: a task waiting for room holding
                # it would hold it past its join and its write (see _send).
                sending = self._send(data)
                del data
                await sending
        finally:
            self.in_flight -= 1
            self.in_flight_bytes -= n
            self._unpark()

    async def _answer(self, message: str | bytes, token: int) -> bytes:
        """Run one message's request and return its answer's JSON (an error frame for
        a bad message or a failed request), counted in the gateway's requests. Sets
        ``pending[token]`` to its id once read."""
        gateway = self.gateway
        rid: Any = None
        label = UNKNOWN_MODEL
        # a large message is decoded in a worker thread, as a large HTTP body
        large = gateway.decoder.large(len(message))
        try:
            if large:
                doc = await gateway.decoder.run(functools.partial(loads_request, message))
            else:
                doc = loads_request(message)
            if type(doc) is not dict:
                raise InvalidInput(
                    f"a stream message must be a JSON object, got {shown(doc, message)}"
                )
            rid = doc.get("id")
            self.pending[token] = rid
            if rid is None or type(rid) not in (str, int):
                # JSON parsers read a larger integer as a float (10**30 as 1e30)
                raise InvalidInput(
                    "a stream message needs an 'id' (string or integer)"
                    if rid is None else
                    f"a stream message's 'id' {id_type_problem(rid, message)}"
                )
            why = id_problem(rid)
            if why is not None:  # it cannot be echoed: the answer's id is null
                rid = self.pending[token] = None
                raise InvalidInput(f"a stream message's 'id': {why}")
            model = doc.get("model")
            if type(model) is not str:
                raise InvalidInput(
                    "a stream message needs a 'model' (string)" if "model" not in doc
                    else "a stream message's 'model' must be a string, got "
                    f"{shown(model, message)}"
                )
            sig = gateway.signatures.get(model)
            if sig is None:
                raise UnknownModel.not_served(model, gateway.runtime.models)
            label = model
            version = doc.get("version")
            if version is not None and type(version) is not str:
                raise InvalidInput(
                    "a stream message's 'version' must be a string, got "
                    f"{shown(version, message)}"
                )
            # held until the request is answered, as over HTTP
            served = sig.served
            sig.check_version(version)  # before "not loaded", as over HTTP
            if not served.loaded:  # explicit model control
                gateway.runtime.check_loaded(model)
            if large:
                request = await gateway.decoder.run(functools.partial(
                    InferRequest.from_v2_json, message, sig, version=version, doc=doc,
                    classes=gateway.class_names,
                ))
            else:
                request = InferRequest.from_v2_json(
                    message, sig, version=version, doc=doc, classes=gateway.class_names
                )
            answered: list[str] = []
            results = await gateway.run_request(request, self.tenant, answered)
            if gateway.runtime.models[model] is not served:  # reloaded
                sig = gateway.signatures.answering(sig, served, request.outputs, results)
            if gateway.decoder.large_results(results):  # as over HTTP
                frame = (await gateway.decoder.run(functools.partial(
                    encode_response, request, results, sig, binary=False, answered=answered
                )))[0]
            else:
                frame = encode_response(
                    request, results, sig, binary=False, answered=answered
                )[0]
            status = 200
        except Exception as exc:
            if not isinstance(exc, TrioserveError):
                log.exception("stream request %r: unexpected error", rid)
            frame = _error_frame(rid, exc)
            status = exc.status if isinstance(exc, TrioserveError) else 500
        gateway.requests[(label, self.tenant, status)] += 1
        return frame

#: The drain's refusals of the requests it did not run, or did not let finish.
_NOT_RUN = "the server is shutting down; request not run"
_NOT_COMPLETED = "the server is shutting down; request not completed"


def _error_frame(rid: Any, exc: Exception) -> bytes:
    """The error frame answering request ``rid`` with ``exc``: its status as over HTTP
    (``error_answer``: 500 for a foreign exception), its message, and with 429 and
    503 ``retry_after`` as HTTP's Retry-After (whole seconds). Written without
    orjson (``error_frame``: its output holds a 4 KiB buffer, and a frame is held
    until the client takes it). Not a checkpoint."""
    if not isinstance(exc, TrioserveError):
        return error_frame(rid, str(exc), 500)
    status = exc.status
    if status in (429, 503):
        return error_frame(rid, str(exc), status, retry_after_of(exc))
    return error_frame(rid, str(exc), status)

