"""The gateway: one port serving the v2 REST protocol and the ``/v2/stream`` WebSocket
over a running :class:`trioserve.Runtime`.

The data plane (``POST .../infer``) is served by an h11 connection handler on
``trio.serve_tcp``-style listeners; everything else goes to a quart-trio app called
in-process (the control plane); ``/v2/stream`` upgrades go to trio-websocket. The
gateway adapts the wire onto ``Runtime.infer`` / ``infer_batch`` and owns no policy:
authenticate (API key -> tenant), validate, classify (priority, deadline), submit,
answer, count.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import zlib
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio
from trioserve import (
    Config,
    DeadlineExceeded,
    InvalidInput,
    Overloaded,
    Runtime,
    TrioserveError,
    UnknownModel,
)

from ._auth import ANONYMOUS, Authenticator, ControlPlaneGuard
from ._coding import encode_answer, negotiate
from ._decode import Decoder
from ._idempotency import IdempotencyStore
from ._listeners import open_listeners
from ._request import InferRequest
from ._response import encode_response
from ._signature import Signatures
from ._v2 import compact, error_body

if TYPE_CHECKING:
    from ._hangup import HangupWatch
    from ._wire import Outbox

log = logging.getLogger("trioserve.transport")

#: The model label of requests for a model that is not served (bounded label values).
UNKNOWN_MODEL = "-"

#: After the grace period, how long connections get to send their 503s and close.
CLOSE_GRACE = 1.0
JSON = (b"content-type", b"application/json")
OCTETS = (b"content-type", b"application/octet-stream")

Headers = list[tuple[bytes, bytes]]
#: An HTTP answer: (status, headers without content-length, body).
Answer = tuple[int, Headers, bytes]


WWW_AUTHENTICATE = (b"www-authenticate", b'Bearer realm="trioserve"')
#: The content codings a request body may come in (RFC 9110 §8.4.1).
ACCEPT_ENCODING = (b"accept-encoding", b"gzip, deflate")


class UnsupportedEncoding(TrioserveError):
    """The request body's Content-Encoding is not one the server decodes."""

    status = 415


class BodyTooLarge(TrioserveError):
    """The request body is over the size limit once decompressed."""

    status = 413


#: Output one step of a request body's inflate produces: the size limit is checked
#: after each step, and the loop checkpoints between steps. A 16 MiB inflate takes
#: ~50 ms here (48 ms for a JSON body of floats compressed to 7.3 MiB, 53 ms for
#: 16 MiB of spaces in 16 KiB): in one call it stalled every other connection that
#: long; a step of 256 KiB takes ~0.3-0.5 ms. (A worker thread was tried: with the loop
#: busy the two contend for the GIL, and the loop's longest stall was 5-25 ms.)
INFLATE_STEP = 256 * 1024
_checkpoint = trio.lowlevel.checkpoint


async def decode_body(body: bytes, coding: bytes | str, limit: int) -> bytes:
    """``body`` decoded from its Content-Encoding ``coding`` (gzip, x-gzip, deflate,
    identity, or a list of them in the order applied), at most ``limit`` bytes of it:
    BodyTooLarge as soon as the output passes it (a small body may inflate a
    thousandfold), UnsupportedEncoding for another coding, InvalidInput for corrupt data.

    Inflates in steps of :data:`INFLATE_STEP` bytes of output with a checkpoint
    between them, so only a body that inflates past one step is a checkpoint.
    Cancelling it abandons the inflate.
    """
    if isinstance(coding, bytes):
        coding = coding.decode("latin-1")
    for c in reversed([c.strip().lower() for c in coding.split(",") if c.strip()]):
        if c == "identity":
            continue
        if c in ("gzip", "x-gzip"):
            body = await _inflate(body, 31, c, limit)
        elif c == "deflate":
            try:  # RFC 9110's deflate is zlib-wrapped; some clients send it raw
                body = await _inflate(body, 15, c, limit)
            except InvalidInput:
                body = await _inflate(body, -15, c, limit)
        else:
            raise UnsupportedEncoding(
                f"Content-Encoding {c!r} is not supported; send gzip, deflate or identity"
            )
    return body


async def _inflate(body: bytes, wbits: int, coding: str, limit: int) -> bytes:
    inflater = _Inflater(body, wbits, coding, limit)
    while not inflater.step():
        await _checkpoint()
    return inflater.result()


class _Inflater:
    """One body's inflate, a step of at most :data:`INFLATE_STEP` bytes of output at a
    time, the size limit checked after each (never more than ``limit + 1`` bytes held)."""

    __slots__ = ("_coding", "_d", "_input", "_limit", "_out", "_size")

    def __init__(self, body: bytes, wbits: int, coding: str, limit: int) -> None:
        self._d = zlib.decompressobj(wbits)
        self._input = body
        self._coding = coding
        self._limit = limit
        self._out: list[bytes] = []
        self._size = 0

    def step(self) -> bool:
        """Inflate the next step; returns whether the inflate is over. Raises
        BodyTooLarge or InvalidInput."""
        d = self._d
        step = min(INFLATE_STEP, self._limit + 1 - self._size)
        try:
            part = d.decompress(self._input, step)
        except zlib.error as exc:
            raise InvalidInput(f"the body is not valid {self._coding} data: {exc}") from None
        self._out.append(part)
        self._size += len(part)
        if self._size > self._limit:
            raise BodyTooLarge(f"request body over {self._limit} bytes once decompressed")
        self._input = d.unconsumed_tail
        # output short of the step with no input left: nothing is pending in zlib
        return d.eof or (not self._input and len(part) < step)

    def result(self) -> bytes:
        d = self._d
        if not d.eof or d.unused_data:
            raise InvalidInput(
                f"the body is not valid {self._coding} data: it ends early or late"
            )
        return self._out[0] if len(self._out) == 1 else b"".join(self._out)


#: The longest Retry-After sent, in seconds (a day): a refill slower than that (a tiny
#: ``credit_rate``; an infinite wait) is told to come back then, not in 10**300 s,
#: which neither a header parser nor a stream frame's 64-bit integer would take.
RETRY_AFTER_MAX = 86_400


def _form(accept_encoding: bytes) -> bytes:
    """What an answer to ``accept_encoding`` looks like, as an edge cache key's
    variant: the coding negotiated (identity for none) and whether plain is
    acceptable (a small answer goes plain only then). Each form carries
    ``Vary: Accept-Encoding``, which an answer to a request without the header lacks."""
    coding, plain_ok = negotiate(accept_encoding)
    return (coding or b"identity") + (b"" if plain_ok else b";q0")


def retry_after_seconds(retry_after: float) -> int:
    """``retry_after`` as HTTP's Retry-After (RFC 9110 §10.2.3): whole seconds,
    rounded up, at least 1 and at most :data:`RETRY_AFTER_MAX` (also for inf or NaN)."""
    if not retry_after <= RETRY_AFTER_MAX:  # inf and NaN too
        return RETRY_AFTER_MAX
    return max(1, math.ceil(retry_after))


#: The bodies of the last refusals (429, 503) by message, at most ``REFUSAL_BODIES``.
_refusal_bodies: dict[str, bytes] = {}
REFUSAL_BODIES = 64


def _refusal_body(message: str) -> bytes:
    """A 429's or 503's body, written once per message: under a flood the same few
    messages repeat (a full queue, a tenant's share), and each answer wrote its own.
    Messages that vary (a wait in ms) fill the table, which then starts over, so it
    holds at most ``REFUSAL_BODIES``. Not a checkpoint."""
    body = _refusal_bodies.get(message)
    if body is None:
        body = error_body(message)
        if len(_refusal_bodies) >= REFUSAL_BODIES:
            _refusal_bodies.clear()
        _refusal_bodies[message] = body
    return body


def retry_after_of(exc: TrioserveError) -> int:
    """A 429's or 503's Retry-After in whole seconds (:func:`retry_after_seconds`):
    Overloaded's ``retry_after``, 1 s for any other refusal."""
    return retry_after_seconds(exc.retry_after if isinstance(exc, Overloaded) else 1.0)


def error_answer(exc: BaseException) -> Answer:
    """The JSON error answer of an exception: its ``status`` (500 for foreign ones),
    ``{"error": message}`` and, with 429 and 503, a Retry-After header (whole seconds,
    from Overloaded's ``retry_after``, 1 to a day); with 401, WWW-Authenticate (a
    bearer key)."""
    if isinstance(exc, TrioserveError):
        headers = [JSON]
        if exc.status == 401:  # RFC 9110 §15.5.2: how to authenticate
            headers.append(WWW_AUTHENTICATE)
        elif exc.status == 415:  # RFC 9110 §15.5.16: the codings it takes
            headers.append(ACCEPT_ENCODING)
        elif exc.status in (429, 503):
            headers.append((b"retry-after", b"%d" % retry_after_of(exc)))
            return exc.status, headers, _refusal_body(str(exc))
        return exc.status, headers, error_body(str(exc))
    return 500, [JSON], error_body(f"internal error: {type(exc).__name__}: {exc}")


@attrs.frozen(kw_only=True)
class GatewayStatistics:
    """A snapshot of the gateway: open connections (of which WebSocket streams), HTTP
    infer requests being answered, the most stream requests one connection has had
    in flight, HTTP infer requests given up because their client closed its
    connection while they waited, whether it is draining, streams closed (1008)
    because their client took none of their answers for their write timeout, the
    most bytes one stream held when it took a message (``stream_in_flight_bytes_peak``,
    see ``server.stream_in_flight_bytes``) and the times a stream stopped reading at
    that byte budget, HTTP connections closed for the same reason (``server.write_timeout_s``), and,
    at ``server.max_connections``, connections refused with 503 and idle ones closed
    to make room for a new one."""

    connections: int
    streams: int
    requests_in_flight: int
    stream_in_flight_peak: int
    clients_gone: int
    draining: bool
    stream_write_timeouts: int = 0
    stream_ping_timeouts: int = 0
    stream_in_flight_bytes_peak: int = 0
    stream_byte_budget_waits: int = 0
    http_write_timeouts: int = 0
    connections_refused: int = 0
    connections_evicted: int = 0


@attrs.define(eq=False, slots=True)
class _Conn:
    """One client connection, as the drain sees it."""

    scope: trio.CancelScope
    #: its socket's descriptor (-1: not known)
    fd: int = -1
    #: between a request's first byte and its answer (an idle connection is closed at
    #: once on drain; a busy one gets the grace period).
    busy: bool = False
    #: set by a WebSocket stream: called on drain to stop reading new messages, and
    #: when the grace period ends to cancel its requests (it then closes itself).
    stop_reading: Any = None
    cancel_requests: Any = None
    #: awaiting ``Gateway.infer`` (the hang-up watch cancels only then)
    waiting: bool = False
    #: its socket is watched for a hang-up (see ``._hangup``)
    armed: bool = False
    #: the hang-up watch cancelled ``scope``: the client went while a request waited
    gone: bool = False
    #: set by a WebSocket stream: what the hang-up watch calls (instead of cancelling
    #: ``scope``) when the client goes while ``waiting``
    hang_up: Any = None
    #: it has answered a request and stays open (keep-alive): only then may it be
    #: closed to make room for a new connection
    kept: bool = False
    #: closed to make room for a new connection (``._accept``)
    evicted: bool = False


class Gateway:
    """The network front of a runtime. Start it with :func:`open_gateway`."""

    def __init__(self, runtime: Runtime, config: Config | None = None) -> None:
        self.runtime = runtime
        self.config = config if config is not None else runtime.config
        self.server_config = self.config.server
        self.auth = Authenticator(self.config.tenants, self.server_config.control_plane_keys)
        self.control_plane = ControlPlaneGuard(self.server_config.control_plane_keys, self.auth)
        #: each model's, as its serving copy has it (a load's config may change it)
        self.signatures = Signatures(runtime.models)
        #: the request classes' names, highest first (a Triton priority level's order)
        self.class_names = tuple(c.name for c in runtime.config.classes)
        #: decodes a large request, and encodes a large answer, in a worker thread
        #: (``._decode``)
        self.decoder = Decoder()
        #: answered infer requests by (model, tenant, status): the gateway's own count.
        self.requests: collections.Counter[tuple[str, str, int]] = collections.Counter()
        self.draining = False
        #: readiness answers 503 (:meth:`leave`): the drain is about to begin
        self.leaving = False
        #: HTTP/1.1 answers keep their connection open; False from :meth:`leave` or
        #: :meth:`drain` on: each answer says ``Connection: close`` and the connection
        #: closes, so a kept-alive client reconnects elsewhere while this one answers
        self.keep_alive = True
        #: set when :meth:`drain` begins (a model load under way is answered then)
        self.drain_begun = trio.Event()
        self.in_flight = 0
        self.stream_in_flight_peak = 0
        #: the most bytes one stream held when it took a message (its messages in
        #: flight and its answers not yet written, the new message counted)
        self.stream_in_flight_bytes_peak = 0
        #: times a stream stopped reading at ``server.stream_in_flight_bytes`` (with
        #: fewer than ``server.stream_in_flight`` requests in flight)
        self.stream_byte_budget_waits = 0
        #: HTTP infer requests withdrawn (queued) or dropped (running) because their
        #: client closed its connection while they waited; never answered or counted
        #: in ``requests``.
        self.clients_gone = 0
        #: streams closed because their client did not take their answers in time
        self.stream_write_timeouts = 0
        #: streams closed (1011) because they answered no ping (a peer gone silently)
        self.stream_ping_timeouts = 0
        #: HTTP connections closed because their client did not take an answer in time
        self.http_write_timeouts = 0
        #: connections refused (503) at ``server.max_connections``, and idle ones
        #: closed at the limit to make room for a new one (``._accept``)
        self.connections_refused = 0
        self.connections_evicted = 0
        #: the open connections, in the order they opened (the oldest idle one makes
        #: room at the limit)
        self._conns: dict[_Conn, None] = {}
        #: connections accepted and not yet closed, and refusals under way; the accept
        #: loops wait in ``_room`` when both are full
        self._open = 0
        self._refusing = 0
        self._room = trio.lowlevel.ParkingLot()
        self._streams = 0
        self._all_closed = trio.Event()
        self._accept_scope: trio.CancelScope | None = None
        #: Writes the data plane's keep-alive answers (``serve`` starts it).
        self.outbox: Outbox | None = None
        #: Cancels the infer of a client that hangs up (``serve`` starts it; None
        #: without epoll).
        self.hangups: HangupWatch | None = None
        self.addresses: list[tuple[str, int]] = []
        from ._control import control_app
        from ._metrics import metrics_registry

        self.idempotency = IdempotencyStore(
            window=self.server_config.idempotency_window_s,
            max_keys=self.server_config.idempotency_max_keys,
            max_bytes=self.server_config.idempotency_max_bytes,
        )
        self.registry = metrics_registry(self)
        self.app = control_app(self)

    # ------------------------------------------------------------ the data plane
    async def infer(
        self,
        model: str,
        version: str | None,
        body: bytes,
        *,
        authorization: bytes | str | None = None,
        header_length: bytes | str | None = None,
        idempotency_key: bytes | str | tuple[bytes | str, ...] | None = None,
        content_encoding: bytes | str | None = None,
        accept_encoding: bytes | None = None,
    ) -> Answer:
        """Answer one v2 infer request (``POST /v2/models/{model}[/versions/{v}]/infer``).

        Never raises for bad input: every failure is an error answer with its status.
        A checkpoint. Cancelling it withdraws the request's items not yet dispatched.
        With ``idempotency_key``, a repeat of the same request by the same tenant gets
        the first answer (see :mod:`._idempotency`); a tuple (several Idempotency-Key
        field lines) is 400, as a proxy and the server could take different ones. A
        body sent with
        ``Content-Encoding`` gzip or deflate (as ``tritonclient`` compresses requests)
        is decompressed first, within ``server.max_body_bytes`` (413 past it); any
        other coding is 415. With ``accept_encoding`` (the request's Accept-Encoding)
        a 200 is compressed as :func:`._coding.encode_answer` says, and the edge cache
        keeps it so: a hit in the same coding is not compressed again.
        """
        label = model if model in self.signatures else UNKNOWN_MODEL
        try:
            tenant = self.auth.tenant(authorization)  # once a request
        except TrioserveError as exc:
            answer = error_answer(exc)
            self.requests[(label, ANONYMOUS, answer[0])] += 1
            return answer
        if type(idempotency_key) is tuple:
            # a singleton field, as Authorization: a proxy keying its retries on one
            # line and the server on another would disagree on what is a repeat
            answer = error_answer(
                InvalidInput("more than one Idempotency-Key header: send one key")
            )
            self.requests[(label, tenant, answer[0])] += 1
            return answer
        if content_encoding:
            # Only for a known tenant (a few KiB may inflate to the body limit), and
            # counted as any answer is.
            try:
                body = await decode_body(
                    body, content_encoding, self.server_config.max_body_bytes
                )
            except TrioserveError as exc:
                answer = error_answer(exc)
                self.requests[(label, tenant, answer[0])] += 1
                return answer
        if idempotency_key:
            if isinstance(idempotency_key, bytes):
                idempotency_key = idempotency_key.decode("latin-1")
            # The request is the version it runs, its body and where its JSON ends:
            # the same bytes split elsewhere (or all JSON) are another request, and
            # so is another version (a key names one request to the model, so a
            # second version under it is 422, never a second run).
            hl = b"-" if header_length is None else header_length
            if isinstance(hl, str):
                hl = hl.encode("latin-1")
            scope = self._idempotent_version(model, version)
            v = b"-" if scope is None else b"v" + scope.encode()
            ident = b"%d|%b%d|%b%b" % (len(v), v, len(hl), hl, body)
            ran = False

            def first() -> Awaitable[Answer]:
                nonlocal ran
                ran = True  # the answer is this call's own, counted as it is made
                return self._infer(model, version, body, tenant, label, header_length)

            answer = await self.idempotency.run(
                (tenant, model, idempotency_key), ident, first
            )
            if not ran:  # a replay, or 422 for the key used with another body
                self.requests[(label, tenant, answer[0])] += 1
            # The store keeps the plain answer: a retry may take another coding.
            if accept_encoding is not None and answer[0] == 200:
                answer = await encode_answer(answer, accept_encoding)
            return answer
        return await self._infer(
            model, version, body, tenant, label, header_length, accept_encoding
        )

    def _idempotent_version(self, model: str, version: str | None) -> str | None:
        """The version an infer of ``model`` naming ``version`` runs, as its
        Idempotency-Key counts it: the one named, else the model's last when that is
        fixed (no rollout: a rollout may run either of two); None when not fixed.
        The same for the server's life: a load changes neither the versions nor the
        rollout (they are refused in its config), and a rollout's moves are not read
        here, so an identical retry (same path and body) after a reload or a
        promotion is a replay of the first answer, not a 422."""
        if version is not None:
            return version
        served = self.runtime.models.get(model)
        sig = self.signatures.get(model)
        if served is None or sig is None or served.config.rollout is not None:
            return None
        return sig.versions[-1]

    async def _infer(
        self,
        model: str,
        version: str | None,
        body: bytes,
        tenant: str,
        label: str,
        header_length: bytes | str | None,
        accept_encoding: bytes | None = None,
    ) -> Answer:
        """:meth:`infer` for an authenticated ``tenant`` and a decoded body; ``label``
        is the model's in the counters."""
        self.in_flight += 1
        try:
            sig = self.signatures.get(model)
            if sig is None:
                raise UnknownModel.not_served(model, self.runtime.models)
            # a version the model has not: whether it is loaded or not (the same
            # answer as every other entry point's), then a model not loaded
            # held until the request is answered: the copy it is checked against,
            # and those that replace it meanwhile, any of which may run it
            # (``Signatures.answering``)
            served = sig.served
            sig.check_version(version)
            if not served.loaded:  # explicit model control
                self.runtime.check_loaded(model)
            hlen = None
            if header_length is not None:
                # digits only, as HTTP's Content-Length: int() would also take "1_0",
                # " 10" or "+10"; several field lines come as one list ("5, 6"), and
                # are refused: a proxy that reads the first would split the body elsewhere
                if not (
                    header_length.isdigit() and header_length.isascii()
                    and len(header_length) <= 18  # int() refuses past 4,300 digits
                ):
                    if isinstance(header_length, bytes):
                        header_length = header_length.decode("latin-1")
                    raise InvalidInput(
                        "Inference-Header-Content-Length must be an integer, 0 or more "
                        "in plain digits, given once (the length of the body's JSON "
                        f"part), got {header_length!r}"
                    )
                hlen = int(header_length)
            rt = self.runtime
            rkey = None
            if rt.cache is not None:
                raw = body if hlen is None else b"%d|" % hlen + body
                # Kept as it is sent: compressed for a client that takes a coding
                # (compressing a 5 KiB answer costs more than the hit itself).
                form = b""
                if accept_encoding is not None:
                    form = _form(accept_encoding)
                rkey = rt.response_key(model, version, tenant, raw, form)
                if rkey is not None:
                    hit = rt.cached_response(rkey)
                    if hit is not None:
                        self.requests[(label, tenant, 200)] += 1
                        return hit
            if self.decoder.large(len(body)):
                request = await self.decoder.run(functools.partial(
                    InferRequest.from_v2_json, body, sig, version=version,
                    header_length=hlen, classes=self.class_names,
                ))
            else:
                request = InferRequest.from_v2_json(
                    body, sig, version=version, header_length=hlen, classes=self.class_names
                )
            answered: list[str] = []
            results = await self.run_request(request, tenant, answered)
            if rt.models[model] is not served:  # reloaded meanwhile
                sig = self.signatures.answering(sig, served, request.outputs, results)
            if self.decoder.large_results(results):
                out, json_len = await self.decoder.run(functools.partial(
                    encode_response, request, results, sig, answered=answered
                ))
            else:
                out, json_len = encode_response(request, results, sig, answered=answered)
        except Exception as exc:
            if not isinstance(exc, TrioserveError):
                log.exception("infer %s: unexpected error", model)
            answer = error_answer(exc)
            self.requests[(label, tenant, answer[0])] += 1
            return answer
        finally:
            self.in_flight -= 1
        self.requests[(label, tenant, 200)] += 1
        if json_len is None:
            answer = 200, [JSON], out
        else:
            answer = 200, [OCTETS, (b"inference-header-content-length", b"%d" % json_len)], out
        if accept_encoding is not None:
            answer = await encode_answer(answer, accept_encoding)
        if rkey is not None:
            # kept in a block of its own length: the bytes the cache counts (compact)
            answer = answer[0], answer[1], compact(answer[2])
            self.runtime.keep_response(rkey, answer, len(answer[2]) + 256, tenant)
        return answer

    async def run_request(
        self, request: InferRequest, tenant: str, answered: list[str] | None = None
    ) -> list[Any]:
        """Submit a validated request's items and return their outputs in order.

        Its ``timeout`` (parameters.timeout_ms) bounds the wait: DeadlineExceeded (504).
        An unversioned request of a model whose versions are routed (a rollout)
        appends the version each item went to to ``answered``, when given.
        """
        if request.timeout is None:
            return await self._submit(request, tenant, answered)
        with trio.move_on_after(request.timeout):
            return await self._submit(request, tenant, answered)
        raise DeadlineExceeded(
            f"model {request.model!r}: no answer within the request's timeout "
            f"({request.timeout * 1e3:g} ms)"
        )

    async def _submit(
        self, request: InferRequest, tenant: str, answered: list[str] | None = None
    ) -> list[Any]:
        rt = self.runtime
        if answered is not None and request.version is None and rt._routed(request.model):
            if request.count == 1:
                return [await rt._infer_routed(
                    request.model, request.items[0], tenant, request.priority, answered
                )]
            return await rt._batch_routed(
                request.model, request.items if request.stacked is None else request.stacked,
                tenant, request.priority, answered,
            )
        if request.count == 1:
            out = await rt.infer(
                request.model,
                request.items[0],
                tenant=tenant,
                priority=request.priority,
                version=request.version,
            )
            return [out]
        return await rt.infer_batch(
            request.model,
            request.items if request.stacked is None else request.stacked,
            tenant=tenant,
            priority=request.priority,
            version=request.version,
        )

    # ------------------------------------------------------------ connections and drain
    def _open_conn(self, scope: trio.CancelScope, fd: int = -1) -> _Conn:
        conn = _Conn(scope=scope, fd=fd)
        self._conns[conn] = None
        return conn

    def _close_conn(self, conn: _Conn) -> None:
        self._conns.pop(conn, None)
        if self.draining and not self._conns:
            self._all_closed.set()

    @property
    def ready(self) -> bool:
        """Taking new requests, and saying so to readiness probes: not leaving (the
        drain delay), not draining, and the runtime is open."""
        return not self.leaving and not self.draining and not self.runtime.closed

    async def leave(self, delay: float) -> None:
        """Answer readiness probes (the server's and each model's) 503 from now on,
        serving all else as usual (new connections too) for ``delay`` seconds, while
        load balancers stop sending here; then the caller drains. HTTP answers say
        ``Connection: close`` meanwhile (as Envoy's do while it drains), so a kept-alive
        client moves to another server rather than race the drain's close of its idle
        connection; WebSocket streams are left as they are. A checkpoint.
        Cancelling it ends the delay (the gateway stays not ready)."""
        self.leaving = True
        self.keep_alive = False
        await trio.sleep(delay)

    async def serve(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        listeners: list[trio.SocketListener] | None = None,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (the server config's by default; port 0 picks a free
        one), or on ``listeners`` already open, and serve connections until
        :meth:`drain` or cancellation, at most ``server.max_connections`` at once
        (see ``._accept``).

        Reports ``started(addresses)`` once listening. Returns after a drain, when the
        last connection has closed.
        """
        from ._accept import accept_connections
        from ._hangup import HangupWatch
        from ._wire import Outbox

        if listeners is None:
            listeners = await open_listeners(self.server_config, host, port)
        self.addresses = [ls.socket.getsockname()[:2] for ls in listeners]

        self.hangups = hangups = HangupWatch.open()
        try:
            async with trio.open_nursery() as flushing:
                self.outbox = Outbox()
                flushing.start_soon(self.outbox.run)
                if hangups is not None:
                    flushing.start_soon(hangups.run)
                async with trio.open_nursery() as connections:
                    with trio.CancelScope() as accept:
                        self._accept_scope = accept
                        task_status.started(self.addresses)
                        await accept_connections(self, listeners, connections)
                # every connection has closed: the flusher has nothing left to write,
                # the watch nothing left to watch
                flushing.cancel_scope.cancel("gateway closed")
        finally:
            self.hangups = None
            if hangups is not None:
                hangups.close()

    async def drain(self, grace: float) -> None:
        """Stop accepting, close idle connections, give requests in flight up to
        ``grace`` seconds (no later than the runtime's ``grace_deadline``, when its
        shutdown has begun), then answer what is left with 503 and close.

        Idempotent. A checkpoint. Returns when every connection has closed (or, at
        worst, ``CLOSE_GRACE`` after the grace period, closing what is left).
        """
        self.draining = True
        self.keep_alive = False
        self.drain_begun.set()
        if self._accept_scope is not None:
            self._accept_scope.cancel("gateway draining: stop accepting")
        if not self._conns:
            self._all_closed.set()
        for conn in list(self._conns):
            if conn.stop_reading is not None:
                conn.stop_reading()
            elif not conn.busy:
                conn.scope.cancel("gateway draining: idle connection")
        with trio.move_on_at(min(trio.current_time() + grace, self.runtime.grace_deadline)):
            await self._all_closed.wait()
        # Grace over: what is left is answered 503 (HTTP) or with error frames (streams).
        for conn in list(self._conns):
            if conn.cancel_requests is not None:
                conn.cancel_requests()
            else:
                conn.scope.cancel("gateway draining: grace period over")
        with trio.move_on_after(CLOSE_GRACE):
            await self._all_closed.wait()
        for conn in list(self._conns):
            conn.scope.cancel("gateway draining: closing")

    def statistics(self) -> GatewayStatistics:
        return GatewayStatistics(
            connections=len(self._conns),
            streams=self._streams,
            requests_in_flight=self.in_flight,
            stream_in_flight_peak=self.stream_in_flight_peak,
            clients_gone=self.clients_gone,
            draining=self.draining,
            stream_write_timeouts=self.stream_write_timeouts,
            stream_ping_timeouts=self.stream_ping_timeouts,
            stream_in_flight_bytes_peak=self.stream_in_flight_bytes_peak,
            stream_byte_budget_waits=self.stream_byte_budget_waits,
            http_write_timeouts=self.http_write_timeouts,
            connections_refused=self.connections_refused,
            connections_evicted=self.connections_evicted,
        )

    @property
    def url(self) -> str:
        """``http://host:port`` of the first listener."""
        host, port = self.addresses[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"


@asynccontextmanager
async def open_gateway(
    runtime: Runtime,
    *,
    host: str | None = None,
    port: int | None = None,
    config: Config | None = None,
    listeners: list[trio.SocketListener] | None = None,
) -> AsyncIterator[Gateway]:
    """Serve ``runtime`` over HTTP and WebSocket for the duration of the block, on
    ``host:port`` or on ``listeners`` already bound (:func:`open_listeners`).

    Listening when it yields (``gateway.url``). Leaving the block normally first
    answers readiness probes 503 for ``server.drain_delay_s`` while serving as usual,
    HTTP answers with ``Connection: close`` (:meth:`Gateway.leave`; 0 by default), then
    drains:
    requests in flight get ``runtime.graceful_timeout_s`` to be answered (no later than
    ``runtime.grace_deadline``, when the shutdown began sooner); leaving it
    with an exception closes every connection at once.
    """
    gateway = Gateway(runtime, config)
    async with trio.open_nursery() as nursery, trio.open_nursery() as app_tasks:
        gateway.app.nursery = app_tasks  # the Quart app's background tasks
        await gateway.app.startup()
        try:
            await nursery.start(
                functools.partial(gateway.serve, host, port, listeners=listeners)
            )
            yield gateway
            if gateway.server_config.drain_delay_s:
                await gateway.leave(gateway.server_config.drain_delay_s)
            await gateway.drain(gateway.config.runtime.graceful_timeout_s)
        finally:
            nursery.cancel_scope.cancel("gateway closed")
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await gateway.app.shutdown()
