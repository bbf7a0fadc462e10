"""Tenancy at the edge: an ``Authorization: Bearer <api key>`` header names a tenant."""

from __future__ import annotations

from collections.abc import Iterable

from trioserve import TenantConfig, Unauthorized

#: The tenant label of requests refused before a tenant was known.
ANONYMOUS = "-"


class Authenticator:
    """Maps API keys to tenant names; the ``default`` tenant takes keyless requests."""

    __slots__ = ("_default", "_keys")

    def __init__(self, tenants: Iterable[TenantConfig]) -> None:
        self._keys: dict[bytes, str] = {}
        self._default: str | None = None
        for t in tenants:
            for key in t.api_keys:
                self._keys[key.encode()] = t.name
            if t.default:
                self._default = t.name

    def tenant(self, authorization: bytes | str | None) -> str:
        """The tenant of an ``Authorization`` header value (None: no header).

        Raises Unauthorized (401) for a missing key without a default tenant, a
        malformed header, or an unknown key.
        """
        if authorization is None:
            if self._default is not None:
                return self._default
            raise Unauthorized("missing API key: send 'Authorization: Bearer <api key>'")
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1")
        scheme, _, key = authorization.strip().partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key:
            raise Unauthorized("malformed Authorization header: expected 'Bearer <api key>'")
        tenant = self._keys.get(key)
        if tenant is None:
            raise Unauthorized("unknown API key")
        return tenant
