"""Tenancy at the edge: an ``Authorization: Bearer <api key>`` header names a tenant."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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

    def tenant(self, authorization: bytes | str | tuple[bytes | str, ...] | None) -> str:
        """The tenant of an ``Authorization`` header value (None: no header; a tuple:
        the values of several Authorization field lines).

        Raises Unauthorized (401) for a missing key without a default tenant, a
        malformed header, an unknown key, or more than one Authorization field line
        (a singleton field: a proxy that reads one and the server that reads another
        would disagree on who is asking).
        """
        if type(authorization) is tuple:
            raise Unauthorized("more than one Authorization header: send one 'Bearer <api key>'")
        if authorization is None:
            if self._default is not None:
                return self._default
            raise Unauthorized("missing API key: send 'Authorization: Bearer <api key>'")
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1")
        assert isinstance(authorization, bytes)
        scheme, _, key = authorization.strip().partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key:
            raise Unauthorized("malformed Authorization header: expected 'Bearer <api key>'")
        tenant = self._keys.get(key)
        if tenant is None:
            raise Unauthorized("unknown API key")
        return tenant


def another_field_line(authorization: Any, value: bytes | str) -> Any:
    """What the header loops keep for Authorization after a field line of ``value``:
    the value, or after an earlier one, a tuple of them (refused by ``tenant``)."""
    if authorization is None:
        return value
    if type(authorization) is tuple:
        return (*authorization, value)
    return (authorization, value)
