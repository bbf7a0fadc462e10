"""Planted bugs of the result cache and its actor, which the cache suite sees
(those of a flight's reruns are in ``fuzz/_mutants_flights.py``). Listed in
``fuzz._mutants.MUTANTS``."""

from __future__ import annotations

import math
from typing import Any

import trioserve.actors
from trioserve.actors import SHARED_NAMESPACE, cache_key

Cache = trioserve.actors.Cache
CacheActor = trioserve.actors.CacheActor


class _FlightsWithoutGeneration:
    """A SingleFlight table whose keys lose their last part, the generation."""

    def __init__(self, flights: Any) -> None:
        self._flights = flights

    async def call(self, key: Any, fn: Any, *args: Any, **kw: Any) -> Any:
        return await self._flights.call(key[:-1], fn, *args, **kw)

    def __contains__(self, key: Any) -> bool:
        return key[:-1] in self._flights

    def statistics(self) -> Any:
        return self._flights.statistics()


class JoinsOlderFlights(CacheActor):
    """The flight key leaves out the generation (the cache actor before its fix): a
    request after an invalidation joins an identical one in flight from before it and
    gets the old weights' answer."""

    @property
    def _flights(self) -> Any:
        return self.__dict__.get("_flights_")

    @_flights.setter
    def _flights(self, flights: Any) -> None:
        self.__dict__["_flights_"] = None if flights is None else _FlightsWithoutGeneration(
            flights
        )


class OneNamespace(Cache):
    """Every tenant's key is in the shared namespace, whatever the model's rule: one
    tenant's answer from a model that is not shareable is served to another."""

    def key(self, model: str, version: str, tenant: str, inputs: Any, params: Any = None) -> Any:
        if not self.rule(model).enabled:
            return None
        return cache_key(model, version, SHARED_NAMESPACE, inputs, params)


class TtlIgnoredOnGet(Cache):
    """A lookup never finds an entry expired: one past its TTL is served until the
    cache actor's sweep drops it."""

    def __init__(self, capacity: int, **kw: Any) -> None:
        super().__init__(capacity, **kw)
        get = self.policy.get
        self.get = lambda key, now, default=None: get(key, -math.inf, default)
