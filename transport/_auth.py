"""Tenancy at the edge: an ``Authorization: Bearer <api key>`` header names a tenant."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trioserve import Forbidden, TenantConfig, Unauthorized

#: The tenant label of requests refused before a tenant was known.
ANONYMOUS = "-"


class Authenticator:
    """Maps API keys to tenant names; the ``default`` tenant takes keyless requests."""

    __slots__ = ("_default", "_keys", "_operators")

    def __init__(
        self, tenants: Iterable[TenantConfig], operator_keys: Iterable[str] = ()
    ) -> None:
        self._keys: dict[bytes, str] = {}
        self._default: str | None = None
        # known only to say why one does not infer (it was "unknown API key")
        self._operators = frozenset(k.encode() for k in operator_keys)
        for t in tenants:
            for key in t.api_keys:
                self._keys[key.encode()] = t.name
            if t.default:
                self._default = t.name

    def tenant(self, authorization: bytes | str | tuple[bytes | str, ...] | None) -> str:
        """The tenant of an ``Authorization`` header value (None: no header; a tuple:
        the values of several Authorization field lines).

        Raises Unauthorized (401) for a missing key without a default tenant, a
        malformed header, an unknown key or an operator's (``operator_keys``, which
        says so), or more than one Authorization field line (a singleton field: a
        proxy that reads one and the server that reads another would disagree on who
        is asking).
        """
        if authorization is None and self._default is not None:
            return self._default
        key = bearer_key(authorization)
        tenant = self._keys.get(key)
        if tenant is None:
            if key in self._operators:
                raise Unauthorized(
                    "an operator's API key (server.control_plane_keys) does not infer: "
                    "send one of a tenant's api_keys"
                )
            raise Unauthorized("unknown API key")
        return tenant

    def is_tenant_key(self, key: bytes) -> bool:
        """Whether ``key`` belongs to a tenant."""
        return key in self._keys


class ControlPlaneGuard:
    """Who may read the control plane (``server.control_plane_keys``): anyone when
    no key is configured, else a request whose bearer key is one of them."""

    __slots__ = ("_auth", "_keys")

    def __init__(self, keys: Iterable[str], auth: Authenticator) -> None:
        self._keys = frozenset(k.encode() for k in keys)
        self._auth = auth

    @property
    def open(self) -> bool:
        """Whether the control plane answers anyone (no key configured)."""
        return not self._keys

    def check(
        self, authorization: bytes | str | tuple[bytes | str, ...] | None,
        doing: str = "read the control plane",
    ) -> None:
        """Refuse a request to the control plane that lacks an operator's key;
        ``doing``: what the request does, as the 403 says it (``load or unload a
        model``, ``act on a model's rollout``; else a read).

        Raises Unauthorized (401) for a missing, malformed or unknown key, or more
        than one Authorization field line (as :meth:`Authenticator.tenant`), and
        Forbidden (403) for a tenant's key that is not also allowed here (none is:
        the configuration keeps the two apart). The default tenant's keyless access
        does not extend to the control plane.
        """
        if not self._keys:
            return
        key = bearer_key(authorization)
        if key in self._keys:
            return
        if self._auth.is_tenant_key(key):
            raise Forbidden(
                f"a tenant's API key may not {doing}: that takes an operator's key "
                "(server.control_plane_keys)"
            )
        raise Unauthorized("unknown API key")


def bearer_key(authorization: bytes | str | tuple[bytes | str, ...] | None) -> bytes:
    """The API key of an ``Authorization: Bearer <api key>`` value.

    Raises Unauthorized (401) for no header (None), a malformed one, or more than one
    Authorization field line (a tuple: a singleton field, so a proxy that reads one and
    the server that reads another would disagree on who is asking).
    """
    if type(authorization) is tuple:
        raise Unauthorized("more than one Authorization header: send one 'Bearer <api key>'")
    if authorization is None:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <api key>'")
    if isinstance(authorization, str):
        authorization = authorization.encode("latin-1")
    assert isinstance(authorization, bytes)
    scheme, _, key = authorization.strip().partition(b" ")
    key = key.strip()
    if scheme.lower() != b"bearer" or not key:
        raise Unauthorized("malformed Authorization header: expected 'Bearer <api key>'")
    return key


def another_field_line(field: Any, value: bytes | str) -> Any:
    """What the header loops keep for a singleton field (Authorization,
    Idempotency-Key) after a field line of ``value``: the value, or after an earlier
    one, a tuple of them (refused: by ``tenant`` for Authorization, by
    ``Gateway.infer`` for Idempotency-Key)."""
    if field is None:
        return value
    if type(field) is tuple:
        return (*field, value)
    return (field, value)
