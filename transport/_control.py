"""The control plane: a quart-trio app for health, metadata and metrics.

The h11 front end answers ``POST .../infer`` itself and hands every other request to
this app in-process; the app also serves infer (the same core), so quart-trio's test
client can drive the whole protocol in memory.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import orjson
import trio
import trioserve
from quart import request
from quart.globals import request_ctx
from quart_trio import QuartTrio
from trioserve import (
    ActorClosed,
    ConfigError,
    ModelLoadError,
    Overloaded,
    TrioserveError,
    UnknownModel,
)
from trioserve._errors import without_model
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from ._answers import Answer, error_answer
from ._auth import another_field_line
from ._control_body import BodyRefused, control_body
from ._extensions import all_versions, model_statistics
from ._metrics import exposition
from ._rollout_http import rollout_routes
from ._signature import server_metadata
from ._v2 import error_body, shown

if TYPE_CHECKING:
    from ._gateway import Gateway

#: Readiness while draining: every probe is refused the same way.
_DRAINING_NOT_READY = error_body("not ready: the server is shutting down")


def control_app(gateway: Gateway) -> QuartTrio:
    """The Quart app of ``gateway``'s control plane."""
    app = QuartTrio("trioserve")
    app.config["MAX_CONTENT_LENGTH"] = gateway.server_config.max_body_bytes
    Response = app.response_class
    server_doc = server_metadata(trioserve.__version__)

    def json(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Any:
        return Response(body, status=status, headers=headers, content_type="application/json")

    def answer(a: Answer) -> Any:
        status, headers, body = a
        return Response(body, status=status, headers=[(n.decode(), v.decode()) for n, v in headers])

    def signature(name: str, version: str | None) -> Any:
        sig = gateway.signatures.get(name)
        if sig is None:
            raise UnknownModel.not_served(name, gateway.runtime.models)
        sig.check_version(version)
        return sig

    # Paths are matched as sent, never rewritten: werkzeug would answer '/v2//models'
    # with a redirect to '/v2/models' (the front end answers such a path 404 first).
    app.url_map.merge_slashes = False

    async def options() -> Any:
        # OPTIONS on an endpoint (RFC 9110 9.3.7): 204 and the methods it takes; a
        # model's endpoints only for a model (and version) that is served.
        args = request.view_args or {}
        if "name" in args:
            signature(args["name"], args.get("version"))
        methods = ", ".join(sorted(request_ctx.url_adapter.allowed_methods()))
        response = Response(b"", status=204, headers={"Allow": methods})
        del response.headers["Content-Type"]  # no content
        return response

    # Quart's own answers OPTIONS with an empty text/html 200
    app.make_default_options_response = options  # type: ignore[method-assign]

    @app.errorhandler(UnknownModel)
    async def unknown_model(exc: UnknownModel) -> Any:
        return json(error_body(str(exc)), exc.status)

    @app.errorhandler(Overloaded)
    async def not_now(exc: Overloaded) -> Any:
        # a model whose first load is under way (explicit model control): 503, to
        # retry after Retry-After
        return answer(error_answer(exc))

    @app.errorhandler(BodyRefused)
    async def body_refused(exc: BodyRefused) -> Any:
        return answer(exc.answer)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Any:
        headers = None
        if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
            allowed = ", ".join(sorted(exc.valid_methods))
            headers = {"Allow": allowed}
            message = (
                f"method {request.method} is not allowed on {request.path}; "
                f"allowed: {allowed}"
            )
        elif exc.code == 404:
            message = f"no such endpoint: {request.method} {request.path}"
        else:
            message = f"{exc.name}: {exc.description}"
        return json(error_body(message), exc.code or 500, headers)

    explicit = gateway.runtime.config.server.model_control == "explicit"
    guard = gateway.control_plane
    # What needs no operator's key: the health probes (they carry none: Kubernetes,
    # Triton's and KServe's clients), and the data plane's own methods, whose callers
    # are authenticated as tenants. Anything else (OPTIONS, an unknown route) needs it.
    unguarded = {("live", "GET"), ("live", "HEAD"), ("ready", "GET"), ("ready", "HEAD"),
                 ("infer", "POST"), ("stream_without_upgrade", "GET"),
                 ("stream_without_upgrade", "HEAD")}

    @app.before_request
    async def control_plane_key() -> Any:
        if guard.open or (request.endpoint, request.method) in unguarded:
            return None
        # what the 403 of a tenant's key says the request does
        endpoint = request.endpoint or ""
        doing = "read the control plane"
        if request.method == "POST" and endpoint == "repository_control":
            doing = "load or unload a model"
        elif request.method == "POST" and endpoint.startswith("rollout_"):
            doing = "act on a model's rollout"
        try:
            guard.check(_field_lines(request.headers.getlist("Authorization")), doing)
        except TrioserveError as exc:
            return answer(error_answer(exc))
        return None

    @app.get("/v2/health/live")
    async def live() -> Any:
        return json(b'{"live":true}')

    @app.get("/v2/health/ready")
    async def ready() -> Any:
        if not gateway.ready:
            return json(_DRAINING_NOT_READY, 503)
        rt = gateway.runtime
        # (a model not loaded, under explicit model control, is not awaited: Triton's)
        down = {
            name: _why(rt.readiness(name)) for name, served in sorted(rt.models.items())
            if served.loaded and not rt.model_ready(name)
        }
        if down:
            said = "; ".join(f"{name}: {_said(why)}" for name, why in down.items())
            return json(orjson.dumps(
                {"error": f"not ready: {said}", "ready": False, "models": down}
            ), 503)
        return json(b'{"ready":true}')

    @app.get("/v2")
    async def metadata() -> Any:
        return json(server_doc)

    def loaded(name: str, version: str | None) -> Any:
        """The signature of a model that is served and loaded (UnknownModel else)."""
        sig = signature(name, version)
        gateway.runtime.check_loaded(name)
        return sig

    @app.get("/v2/models/<name>")
    @app.get("/v2/models/<name>/versions/<version>")
    async def model_metadata(name: str, version: str | None = None) -> Any:
        return json(loaded(name, version).metadata(version))

    @app.get("/v2/models/<name>/ready")
    @app.get("/v2/models/<name>/versions/<version>/ready")
    async def model_ready(name: str, version: str | None = None) -> Any:
        signature(name, version)
        if not gateway.ready:
            return json(_DRAINING_NOT_READY, 503)
        if gateway.runtime.model_ready(name, version):
            return json(b'{"name":%s,"ready":true}' % _quote(name))
        why = _why(gateway.runtime.readiness(name, version))
        doc = {"error": f"model {name!r} is not ready: {_said(why)}", "name": name}
        if version is not None:
            doc["version"] = version
        return json(orjson.dumps({**doc, "ready": False, **why}), 503)

    @app.get("/v2/models/<name>/config")
    @app.get("/v2/models/<name>/versions/<version>/config")
    async def model_configuration(name: str, version: str | None = None) -> Any:
        loaded(name, version)
        # a version with weights of its own: its own backend and replicas
        return json(orjson.dumps(gateway.runtime.triton_config(name, version)))

    @app.get("/v2/models/stats")
    @app.get("/v2/models/<name>/stats")
    @app.get("/v2/models/<name>/versions/<version>/stats")
    async def statistics(name: str | None = None, version: str | None = None) -> Any:
        models = gateway.runtime.models
        if name is None:
            signatures = sorted(gateway.signatures.items())
            entries = [(models[n], all_versions(sig.versions)) for n, sig in signatures]
        else:
            sig = signature(name, version)
            entries = [(models[name], all_versions(sig.versions) if version is None
                        else version)]
        # Failed inside the server: a client's error (4xx, a tenant over its quota's
        # 429 included) is not the model's. A 5xx answer is never an Idempotency-Key
        # replay (those are not kept), so each counted here ran.
        failures: collections.Counter[str] = collections.Counter()
        for (model, _tenant, status), n in gateway.requests.items():
            if status >= 500:
                failures[model] += n
        return json(model_statistics(entries, failures))

    @app.post("/v2/repository/index")
    async def repository_index() -> Any:
        # Triton's model repository extension, as Triton with model control off
        # answers it: every served model's versions and whether they can serve.
        body = await control_body(gateway.server_config.max_body_bytes)
        only_ready = False
        if body.strip():
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                return json(error_body(f"repository index request: invalid JSON: {exc}"), 400)
            if not isinstance(doc, dict):
                return json(error_body("repository index request: expected a JSON object"), 400)
            only_ready = doc.get("ready", False)
            if not isinstance(only_ready, bool):
                return json(
                    error_body("repository index request: 'ready' must be true or false"), 400
                )
        rt = gateway.runtime
        entries = []
        for name, sig in sorted(gateway.signatures.items()):
            if not gateway.ready:
                state, reason = "UNAVAILABLE", "the server is shutting down"
            elif explicit:
                state, reason = rt.model_state(name)
            elif rt.model_ready(name):
                state, reason = "READY", ""
            else:
                state, reason = "UNAVAILABLE", "no replica ready"
            if only_ready and state != "READY":
                continue
            entries.extend(
                {"name": name, "version": v, "state": state, "reason": reason}
                for v in sig.versions
            )
        return json(orjson.dumps(entries))

    @app.post("/v2/repository/models/<name>/load")
    @app.post("/v2/repository/models/<name>/unload")
    async def repository_control(name: str) -> Any:
        action = request.path.rpartition("/")[2]
        if not explicit:
            return json(
                error_body(
                    f"cannot {action} model {name!r}: model control is off; the models "
                    "served are the configuration's, loaded at start"
                ),
                400,
            )
        body = await control_body(gateway.server_config.max_body_bytes)
        refusal, load_config = repository_request(action, body)
        if refusal is not None:
            return json(error_body(refusal), 400)
        rt = gateway.runtime
        failure = None
        # A load is cut short when the server begins to shut down: the copy would
        # serve nothing (no new request is taken), and the drain would wait for this
        # answer for its whole grace. The load itself ends when the runtime closes.
        with trio.CancelScope() as call:
            async with trio.open_nursery() as watch:
                if action == "load":
                    watch.start_soon(_cancel_on_drain, gateway, call)
                try:
                    await (
                        rt.load_model(name, load_config) if action == "load"
                        else rt.unload_model(name)
                    )
                except (UnknownModel, ModelLoadError, ConfigError) as exc:
                    # as Triton answers a model it cannot find or load: 400 (the
                    # error's own naming of the model is not said twice)
                    why = without_model(name, str(exc))
                    failure = json(error_body(f"failed to {action} {name!r}: {why}"), 400)
                except TrioserveError as exc:  # shut down meanwhile: 503
                    failure = answer(error_answer(exc))
                watch.cancel_scope.cancel("the load or unload is over")
        if call.cancelled_caught:
            return answer(error_answer(ActorClosed(
                f"the server is shutting down: model {name!r} was not loaded"
            )))
        return failure if failure is not None else json(b"{}")

    rollout_routes(app, gateway, json)

    @app.post("/v2/models/<name>/infer")
    @app.post("/v2/models/<name>/versions/<version>/infer")
    async def infer(name: str, version: str | None = None) -> Any:
        body = await request.get_data(cache=False)
        return answer(
            await gateway.infer(
                name,
                version,
                body,
                authorization=_field_lines(request.headers.getlist("Authorization")),
                header_length=", ".join(
                    request.headers.getlist("Inference-Header-Content-Length")
                ) or None,
                idempotency_key=_field_lines(request.headers.getlist("Idempotency-Key")),
                content_encoding=request.headers.get("Content-Encoding"),
            )
        )

    @app.get("/v2/stream")
    async def stream_without_upgrade() -> Any:
        # Why the upgrade did not happen: none asked for, HTTP/1.0, or a connection
        # that is to close. Only a connection that stays open can be upgraded.
        upgrading = "websocket" in request.headers.get("Upgrade", "").lower()
        tokens = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
        # a sender of Upgrade lists it in Connection (RFC 9110 7.8): with the close
        # a connection that cannot be upgraded gets, one field line (transport/_http.py)
        headers = {"Upgrade": "websocket", "Connection": "upgrade"}
        if request.http_version != "1.1":
            why = "a WebSocket upgrade needs HTTP/1.1"
        elif upgrading and "close" in tokens:
            why = "'Connection: close' ends the connection it would upgrade"
        else:
            why = "send 'Upgrade: websocket'"
        return json(error_body(f"/v2/stream is a WebSocket endpoint: {why}"), 426, headers)

    @app.get("/metrics")
    async def metrics() -> Any:
        body, content_type = exposition(gateway.registry, request.headers.get("Accept"))
        # the format follows Accept: a cache keeps each apart
        return Response(body, content_type=content_type, headers={"Vary": "Accept"})

    return app


async def _cancel_on_drain(gateway: Gateway, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once ``gateway`` begins to drain."""
    await gateway.drain_begun.wait()
    scope.cancel("the server is shutting down")


def repository_request(action: str, body: bytes) -> tuple[str | None, dict | None]:
    """Why a load or unload request's body is refused (None: it is not), and a load's
    configuration (None: the model's table as configured). The body is empty or
    Triton's: a JSON object with an optional ``parameters`` object. An unload's
    ``unload_dependents`` must be true or false, as Triton's (and is then ignored: no
    model depends on another here); its other parameters are ignored, as Triton
    ignores them. A load's ``config`` is a JSON object of the model's keys, or (as
    Triton's) a string holding one; its keys are checked by the load. Triton's
    ``file:`` parameters are refused: there are no model files to replace here."""
    if not body.strip():
        return None, None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return f"repository {action} request: invalid JSON: {exc}", None
    if not isinstance(doc, dict) or not isinstance(doc.get("parameters", {}), dict):
        return (f"repository {action} request: expected a JSON object with an optional "
                "'parameters' object"), None
    parameters = doc.get("parameters", {})
    if action == "unload":
        dependents = parameters.get("unload_dependents", False)
        if not isinstance(dependents, bool):
            return ("repository unload request: parameter 'unload_dependents' must be true "
                    f"or false, got {shown(dependents, body)}"), None
        return None, None
    files = [k for k in parameters if k.startswith("file:")]
    if files:
        return (f"repository load request: parameter {files[0]!r} is not supported: a "
                "model here has no files to replace (its backend loads what it runs; "
                "give the backend's options in parameter 'config' instead)"), None
    if "config" not in parameters:
        return None, None
    config = parameters["config"]
    if isinstance(config, str):
        try:
            config = orjson.loads(config)
        except orjson.JSONDecodeError as exc:
            return ("repository load request: parameter 'config' is not valid JSON (a "
                    f"string holding a JSON object of the model's keys): {exc}"), None
    if not isinstance(config, dict):
        return ("repository load request: parameter 'config' must be a JSON object of the "
                "model's keys (as its [models.NAME] table), or a string holding one, got "
                f"{shown(parameters['config'], body)}"), None
    return None, config


def _why(readiness: dict[str, Any]) -> dict[str, Any]:
    """Why a model is not ready, as a readiness probe's 503 says it: its ``state``,
    ``reason`` and ``replicas`` by health, and a model whose versions have replicas
    of their own the versions those replicas serve (``replicas_of``) and its
    ``other_versions``' (``Runtime.readiness``)."""
    keys = ("state", "reason", "replicas", "replicas_of", "other_versions")
    return {k: readiness[k] for k in keys if k in readiness}


def _said(why: dict[str, Any]) -> str:
    """``why`` in words: ``no replica ready (replicas: open 1, lost 1)``; with other
    versions' replicas, every count labelled by version: ``no replica ready
    (replicas of version '1': open 1; version '2': ready 1)``."""

    def counted(replicas: dict[str, int]) -> str:
        return ", ".join(f"{h} {n}" for h, n in replicas.items())

    others = why.get("other_versions", {})
    if not others:
        if not why["replicas"]:
            return why["reason"]
        return f"{why['reason']} (replicas: {counted(why['replicas'])})"
    versions = why["replicas_of"]
    label = "version" if len(versions) == 1 else "versions"
    parts = [f"replicas of {label} {', '.join(map(repr, versions))}: "
             f"{counted(why['replicas']) or 'none'}"]
    parts.extend(f"version {v!r}: {counted(r) or 'none'}" for v, r in others.items())
    return f"{why['reason']} ({'; '.join(parts)})"


def _field_lines(values: list[str]) -> Any:
    """A singleton field's values (Authorization, Idempotency-Key) as
    ``Gateway.infer`` takes them: None, the one value, or a tuple of several
    (refused)."""
    field: Any = None
    for value in values:
        field = another_field_line(field, value)
    return field


def _quote(name: str) -> bytes:
    return orjson.dumps(name)
