"""The edge's use of the result cache: whole encoded answers of wire requests, keyed
by the raw request, and invalidating a model's cached results."""

from __future__ import annotations

import math
from typing import Any

import trio


class _EdgeCache:
    """The Runtime's edge cache hooks, over its cache actor (``Runtime.cache``)."""

    def response_key(
        self, model: str, version: str | None, tenant: str, raw: bytes, variant: bytes = b""
    ) -> Any:
        """The cache key of a wire request's encoded answer, an opaque value for
        ``cached_response`` and ``keep_response`` (None: ``model`` is not cached).
        Identical bytes from the same tenant get the same answer without being parsed,
        run or encoded again; ``variant`` (a content coding) keeps each form apart."""
        if model not in self._cached or self.cache.cache is None:
            return None
        family = self._families.get(model)
        if version is None and family is not None and family.controller is not None:
            return None  # routed by its rollout: the version is known once it is routed
        cache = self.cache.cache
        version = version or self.models[model].config.versions[-1]  # the default: the last
        key = cache.raw_key(model, version, tenant, raw, variant)
        if key is None:
            return None
        # The answer is kept no longer than the cached results it is made of (a
        # model without a TTL: for as long as they are).
        until = self.cache.track_expiry() if cache.rule(model).ttl < math.inf else None
        return key, cache.generation(model), until

    def cached_response(self, key: Any) -> Any:
        """The kept answer of ``key``, or None. A miss here is not counted: the
        request goes on to the item cache, whose lookups count its outcome (else a new
        request counted as two misses). A hit is a request answered at once: good
        against its model's objective, as a hit of ``infer`` is."""
        cache = self.cache.cache
        now = trio.current_time()
        hit = cache.get(key[0], now)
        if hit is None:
            cache.policy.misses -= 1
            return None
        slo = self.models[key[0].model].slo
        if slo is not None:
            slo.answered(now, 0.0)
        return hit

    def keep_response(self, key: Any, answer: Any, size: int, tenant: str) -> None:
        """Keep an encoded answer of ``size`` bytes (charged with its key's bytes and
        the cache's per-entry overhead, ``_cache_actor.OVERHEAD``), unless its model
        was invalidated since ``key`` was made (the answer may come from the weights
        invalidated), until the first of the results it was made of expires (a cached
        one may be older than it)."""
        key, generation, until = key
        cache = self.cache.cache
        if cache.generation(key.model) == generation:
            size += cache.key_bytes(key)
            # through the actor: its timer drops the answer when it expires
            self.cache.keep(key, answer, size=size, tenant=tenant,
                            expires=math.inf if until is None else until[0])

    def invalidate_cache(self, model: str, version: str | None = None) -> int:
        """Drop the cached results of a model (or of one of its versions); return how
        many. Call it when the model's weights change under the same version: from then
        on no request of the model joins a computation started before, whether the
        model is cached or only coalesced.

        Raises UnknownModel for a model or version not served (a name mistyped would
        otherwise drop nothing and say 0), and InvalidInput for a version that is not
        a string, as :meth:`infer` does."""
        self._known(model, version)
        if self.cache is None:
            return 0
        return self.cache.invalidate(model, version)
