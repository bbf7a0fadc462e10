"""Planted bugs of a flight and its callers' deadlines (docs/cache.md), for the
cache suite: ``SingleFlight`` variants whose choice of a rerun is wrong, or that
ignore a late answer, each put in the cache actor by a variant of it. Listed in
``fuzz._mutants.MUTANTS``."""

from __future__ import annotations

from typing import Any

import outcome
import trioserve.actors
from trioserve.actors._singleflight import LateOutcome, SingleFlight, _Flight, _Round

CacheActor = trioserve.actors.CacheActor


class _NoRerun(SingleFlight):
    """An error of the driver's deadline answers every waiter (the flight before
    reruns): a caller that joined with a later deadline inherits the driver's."""

    def _run_again(self, flight: _Flight, exc: Exception) -> bool:
        return False


class _RerunForTheLatest(SingleFlight):
    """The rerun is driven by the waiter with the latest deadline, not the earliest:
    the others wait for it past their own deadline."""

    def _run_again(self, flight: _Flight, exc: Exception) -> bool:
        round_ = flight.round
        bound = self._deadline_bound(exc, round_.driver.deadline)
        if bound is None:
            return False
        later = [w for w in flight.waiters if w is not round_.driver and w.deadline > bound]
        if not later:
            return False
        flight.round = round_.next = _Round(max(later, key=lambda w: w.deadline))
        round_.bound = bound
        round_.result = outcome.Error(exc)
        round_.done.set()
        self._reruns += 1
        return True


class _RerunForThePassed(SingleFlight):
    """A rerun is driven for waiters whose own deadline has passed too (one not
    after the deadline the error belongs to, or before the round's end): they run,
    and pay, for nothing."""

    def _run_again(self, flight: _Flight, exc: Exception) -> bool:
        round_ = flight.round
        bound = self._deadline_bound(exc, round_.driver.deadline)
        if bound is None:
            return False
        later = [
            w for w in flight.waiters if w is not round_.driver and w.deadline >= bound
        ]
        if not later:
            return False
        flight.round = round_.next = _Round(min(later, key=lambda w: w.deadline))
        round_.bound = bound
        round_.result = outcome.Error(exc)
        round_.done.set()
        self._reruns += 1
        return True


class _IgnoresLateOutcomes(SingleFlight):
    """A driver answered DeadlineExceeded while its batch ran: the waiters with a
    later deadline do not wait for that batch's answer, the flight runs again at once
    (a second model call for the key, and ``late_answers`` never counted)."""

    async def _wait_late(self, flight: _Flight, exc: Exception, late: LateOutcome) -> bool:
        return False


def _with_flights(flights_class: type) -> type:
    """The cache actor with its SingleFlight table of class ``flights_class``."""

    class WithFlights(CacheActor):
        @property
        def _flights(self) -> Any:
            return self.__dict__.get("_flights_")

        @_flights.setter
        def _flights(self, flights: Any) -> None:
            if flights is not None and type(flights) is SingleFlight:
                flights = flights_class(
                    flights._nursery, deadline_bound=flights._deadline_bound,
                    late_outcomes=flights._late_outcomes,
                )
            self.__dict__["_flights_"] = flights

    WithFlights.__name__ = WithFlights.__qualname__ = f"CacheActorWith{flights_class.__name__}"
    return WithFlights


#: The cache actor with each broken SingleFlight (the planted bugs of a flight).
CacheActorWithNoRerun = _with_flights(_NoRerun)
CacheActorWithRerunForTheLatest = _with_flights(_RerunForTheLatest)
CacheActorWithRerunForThePassed = _with_flights(_RerunForThePassed)
CacheActorIgnoringLateOutcomes = _with_flights(_IgnoresLateOutcomes)
