"""The operator's rollout endpoints of the control plane (docs/rollout.md):
``GET /v2/models/{name}/rollout`` (the state) and ``POST .../rollout/promote``,
``/rollback`` (body optional: ``{"reason": "..."}``), ``/pause``, ``/resume`` and
``/start`` (body: ``{"canary": "V"}`` and optional rule keys), each answering 200
with the new state; 404 for an unknown model or one without a rollout, 409 for an
action the rollout's state does not allow, 400 for a bad body (or a start's canary
or rule that is wrong).
Guarded as the rest of the control plane (``server.control_plane_keys``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from trioserve import ConfigError, InvalidInput, UnknownModel
from trioserve._rollout_ops import START_RULES

from ._control_body import control_body
from ._v2 import error_body

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from ._gateway import Gateway

#: path segment -> the Runtime's method
ACTIONS = {
    "promote": "promote",
    "rollback": "rollback",
    "pause": "pause_rollout",
    "resume": "resume_rollout",
    "start": "start_rollout",
}


def rollout_routes(app: QuartTrio, gateway: Gateway, json: Callable[..., Any]) -> None:
    """Add the rollout's endpoints to ``app``; ``json(body, status)`` answers."""
    rt = gateway.runtime

    @app.get("/v2/models/<name>/rollout")
    async def rollout_state(name: str) -> Any:
        try:
            return json(orjson.dumps(rt.rollout_state(name)))
        except (UnknownModel, ConfigError) as exc:
            return json(error_body(str(exc)), 404)

    def action_view(action: str) -> Callable[..., Any]:
        async def view(name: str) -> Any:
            body = await control_body(gateway.server_config.max_body_bytes)
            try:
                args, kwargs = _arguments(action, body)
            except ValueError as exc:
                return json(error_body(f"rollout {action} request: {exc}"), 400)
            try:
                rt.rollout_state(name)  # a model served, with a rollout
            except (UnknownModel, ConfigError) as exc:
                return json(error_body(str(exc)), 404)
            try:
                doc = getattr(rt, ACTIONS[action])(name, *args, **kwargs)
            except ConfigError as exc:  # its state does not allow it
                return json(error_body(str(exc)), 409)
            except InvalidInput as exc:
                return json(error_body(str(exc)), 400)
            return json(orjson.dumps(doc))

        view.__name__ = f"rollout_{action}"
        return view

    for action in ACTIONS:
        app.add_url_rule(
            f"/v2/models/<name>/rollout/{action}", endpoint=f"rollout_{action}",
            view_func=action_view(action), methods=["POST"],
        )


def _arguments(action: str, body: bytes) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The Runtime method's arguments after the model's name, from the request's
    body: empty, or a JSON object; a rollback's may give a ``reason`` (a string), a
    start's must give ``canary`` and may give the rollout's rule keys. ValueError
    says why a body is refused."""
    if not body.strip():
        if action == "start":
            raise ValueError("a start's body must be a JSON object giving 'canary'")
        return (), {}
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("expected a JSON object")
    if action == "start":
        unknown = sorted(set(doc) - {"canary", *START_RULES})
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; a start's body may give "
                             f"canary, {', '.join(START_RULES)}")
        if not isinstance(doc.get("canary"), str) or not doc["canary"]:
            raise ValueError("'canary' must be given, a version's name (a non-empty string)")
        return (), doc
    allowed = {"reason"} if action == "rollback" else set()
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise ValueError(
            f"unknown key {unknown[0]!r}"
            + ("; a rollback's body may give 'reason'" if action == "rollback" else
               f"; a {action} takes no parameters")
        )
    if "reason" in doc:
        if not isinstance(doc["reason"], str) or not doc["reason"]:
            raise ValueError("'reason' must be a non-empty string")
        return (doc["reason"],), {}
    return (), {}
