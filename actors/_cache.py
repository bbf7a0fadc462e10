"""The result cache's decision core (:class:`Cache`): a byte-sized policy from
:mod:`._policy` (W-TinyLFU or LRU), per-model rules (opt-out, TTL, sharing), per-tenant
byte quotas, cache keys (of items, and of whole encoded requests for the edge), and
invalidation by model and version. Sans-IO, as the policies: ``now`` is an argument.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Mapping
from typing import Any

import attrs

from ._cachekey import SHARED_NAMESPACE, CacheKey, cache_key, namespace_for
from ._policy import CACHE_POLICIES

#: Raw keys (``Cache.raw_key``) hold a body up to this size itself, a larger one by its
#: blake2b digest, each behind its own tag. A :meth:`Cache.key` digest is bytes, never
#: such a tuple.
RAW_INLINE = 4096
_RAW = "raw"
_RAW_DIGEST = "raw-blake2b"


@attrs.frozen(kw_only=True)
class CacheRule:
    """How one model's results are cached: not at all (``enabled=False``, for a
    non-deterministic model), for ``ttl`` seconds, and in the tenant's own namespace or
    (``shareable``) in the one namespace every tenant reads."""

    enabled: bool = True
    ttl: float = attrs.field(default=math.inf, validator=attrs.validators.gt(0))
    shareable: bool = False


class Cache:
    """The result cache's decision core: a policy ("tinylfu" or "lru") sized in bytes,
    with per-model rules (opt-out, TTL, sharing) and optional per-tenant byte quotas.

    The cache actor calls ``key`` (None: the model is not cached), ``get``, and after
    computing a miss ``put``; ``invalidate(model, version)`` when a version changes.
    An answer computed across an invalidation must not be kept: ``generation(model)``
    changes with every invalidation of the model, so a caller reads it before computing
    and puts only if it is unchanged.
    ``get`` and the other lookups are the policy's own bound methods, so a lookup
    costs no wrapper call. ``options`` go to the policy's constructor.
    """

    def __init__(
        self,
        capacity: int,
        *,
        policy: str = "tinylfu",
        rules: Mapping[str, CacheRule] | None = None,
        default_rule: CacheRule = CacheRule(),
        quotas: Mapping[str, int] | None = None,
        default_quota: int | None = None,
        **options: Any,
    ) -> None:
        try:
            cls = CACHE_POLICIES[policy]
        except KeyError:
            raise ValueError(
                f"cache policy must be one of {', '.join(map(repr, CACHE_POLICIES))}, "
                f"got {policy!r}"
            ) from None
        p = cls(capacity, quotas=quotas, default_quota=default_quota, **options)
        self.policy = p
        self.rules = dict(rules or {})
        self.default_rule = default_rule
        self.get = p.get
        self.peek = p.peek
        self.remove = p.remove
        self._generations: dict[str, int] = {}
        self.expire = p.expire
        self.next_expiry = p.next_expiry
        self.tenant_bytes = p.tenant_bytes
        self.expiry = p.expiry
        self.statistics = p.statistics

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.policy

    def invalidate(self, model: str, version: str | None = None) -> int:
        """Drop the entries of ``model`` (of one ``version`` if given); returns how many.
        Answers computed before it and kept after it are refused (``generation``)."""
        self._generations[model] = self._generations.get(model, 0) + 1
        return self.policy.invalidate(model, version)

    def generation(self, model: str) -> int:
        """How many times ``model`` was invalidated: read it before computing an answer,
        and keep the answer only if it has not changed since."""
        return self._generations.get(model, 0)

    def rule(self, model: str) -> CacheRule:
        return self.rules.get(model, self.default_rule)

    def key(
        self,
        model: str,
        version: str,
        tenant: str,
        inputs: Any,
        params: Mapping[str, Any] | None = None,
    ) -> CacheKey | None:
        """The key of a request by ``tenant``, in its namespace or the shared one as the
        model's rule says; None when the model is not cached."""
        rule = self.rule(model)
        if not rule.enabled:
            return None
        ns = namespace_for(tenant, shareable=rule.shareable)
        return cache_key(model, version, ns, inputs, params)

    def raw_key(
        self, model: str, version: str, tenant: str, raw: bytes, variant: bytes = b""
    ) -> CacheKey | None:
        """The key of an encoded request (a wire body, as bytes) by ``tenant``: for an
        edge that keeps whole encoded answers. Never equal to a :meth:`key`. Always in
        the tenant's own namespace, even for a shareable model: the body holds a
        request class, which each tenant must be checked for (the item cache behind
        still shares the computed values). ``variant`` names a form of the answer (its
        content coding): the same body with another variant is another key."""
        rule = self.rule(model)
        if not rule.enabled:
            return None
        if len(raw) <= RAW_INLINE:
            # The body itself: hashing it for the table (~0.5 us for 2 KiB) is cheaper
            # than a blake2b digest (~3.5 us), and equality is exact.
            digest: Any = (_RAW, raw, variant)
        else:
            digest = (_RAW_DIGEST, hashlib.blake2b(raw, digest_size=16).digest(), variant)
        return CacheKey(namespace_for(tenant, shareable=False), model, version, digest)

    @staticmethod
    def key_bytes(key: CacheKey) -> int:
        """The bytes a key holds: a raw key's body or the body's digest, else the
        digest."""
        digest = key.digest
        return len(digest[1]) if type(digest) is tuple else len(digest)

    def put(
        self,
        key: CacheKey,
        value: Any,
        *,
        size: int,
        now: float,
        tenant: str | None = None,
        expires: float = math.inf,
    ) -> bool:
        """Offer a computed value; it expires after the model's TTL, or at ``expires``
        if sooner (a value made from cached ones: when the first of them expires).
        Charged to ``tenant``'s quota (default: the key's namespace, unless it is the
        shared one). Returns whether it is resident after the call (see
        ``_BytePolicy.put``)."""
        rule = self.rule(key.model)
        if not rule.enabled:
            return False
        if tenant is None and key.namespace != SHARED_NAMESPACE:
            tenant = key.namespace
        return self.policy.put(
            key, value, size=size, now=now, expires=min(now + rule.ttl, expires),
            tenant=tenant,
        )
