"""The gateway: one port serving the v2 REST protocol and the ``/v2/stream`` WebSocket
over a running :class:`trioserve.Runtime`.

The data plane (``POST .../infer``) is served by an h11 connection handler on
``trio.serve_tcp``-style listeners; everything else goes to a quart-trio app called
in-process (the control plane); ``/v2/stream`` upgrades go to trio-websocket. The
gateway adapts the wire onto ``Runtime.infer`` / ``infer_batch`` and owns no policy:
authenticate (API key -> tenant), validate, classify (priority, deadline), submit,
answer, count.

This module holds :class:`Gateway`'s data plane (``infer``: authenticate, decode,
idempotency, the edge cache, submit, encode) and :func:`open_gateway`; its
connections, readiness and drain are in ``._connections``, HTTP answers and error
answers in ``._answers``, a request body's Content-Encoding in ``._inflate``.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import trio
from trioserve import (
    Config,
    DeadlineExceeded,
    InvalidInput,
    Runtime,
    TrioserveError,
    UnknownModel,
)

from ._answers import JSON, OCTETS, Answer, error_answer
from ._auth import ANONYMOUS, Authenticator, ControlPlaneGuard
from ._coding import encode_answer, negotiate
from ._connections import Connections
from ._decode import Decoder
from ._idempotency import IdempotencyStore
from ._inflate import decode_body
from ._request import InferRequest
from ._response import encode_response
from ._signature import Signatures
from ._v2 import compact

log = logging.getLogger("trioserve.transport")

#: The model label of requests for a model that is not served (bounded label values).
UNKNOWN_MODEL = "-"


def _form(accept_encoding: bytes) -> bytes:
    """What an answer to ``accept_encoding`` looks like, as an edge cache key's
    variant: the coding negotiated (identity for none) and whether plain is
    acceptable (a small answer goes plain only then). Each form carries
    ``Vary: Accept-Encoding``, which an answer to a request without the header lacks."""
    coding, plain_ok = negotiate(accept_encoding)
    return (coding or b"identity") + (b"" if plain_ok else b";q0")


class Gateway(Connections):
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
        self._init_connections()
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

    def answers_before_body(
        self,
        model: str,
        version: str | None,
        idempotency_key: bytes | tuple[bytes, ...] | None,
        content_encoding: bytes | None,
    ) -> bool:
        """Whether :meth:`infer`'s answer to a request for ``model`` and ``version``
        is known before its body arrives: the model is not served, or not that version
        (404; both are fixed for the server's life), and nothing :meth:`infer` does
        before it looks the model up reads the body (a Content-Encoding is decoded
        first; an Idempotency-Key's replay compares bodies). ``infer`` of an empty body
        then gives that answer (401 or 403 first, for a refused key). For a request
        that asked to send its body only after a 100 (Continue). Not a checkpoint."""
        if idempotency_key is not None or content_encoding:
            return False
        sig = self.signatures.get(model)
        return sig is None or (version is not None and version not in sig.versions)

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
            self.runtime.keep_response(rkey, answer, len(answer[2]), tenant)
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
