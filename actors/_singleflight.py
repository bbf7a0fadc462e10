"""In-flight coalescing ("singleflight"): concurrent identical requests share one
computation.

The first caller of a key starts the computation as a task in the owner's nursery
(not in its own task), so that it outlives any one caller: cancelling a waiter,
the first one included, only withdraws that waiter. When the last waiter leaves,
nobody wants the result any more and the computation is cancelled. Every waiter gets
the same value, or its own copy of the same exception; a failed computation leaves
nothing behind, so the next call computes afresh (errors are never cached).
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import attrs
import outcome
import trio
from trioserve import ActorClosed


def own_error(exc: BaseException) -> BaseException:
    """A copy of ``exc`` for one of the several callers it answers, with its cause,
    context and traceback so far. Raised as it is in every caller, one exception
    object gathered every caller's frames into one traceback (2,000 entries after
    1,000 callers of two frames each), and with them those frames' locals, until the
    last caller dropped it. ``exc`` itself when it cannot be copied."""
    try:
        own = copy.copy(exc)
    except Exception:
        return exc
    if type(own) is not type(exc):
        return exc
    own.__cause__ = exc.__cause__
    own.__context__ = exc.__context__
    own.__suppress_context__ = exc.__suppress_context__
    return own.with_traceback(exc.__traceback__)


@attrs.frozen(kw_only=True)
class SingleFlightStatistics:
    """``started``: computations started; ``coalesced``: calls that joined one already
    in flight; ``abandoned``: computations cancelled because every waiter left."""

    in_flight: int
    started: int
    coalesced: int
    abandoned: int


@attrs.define(eq=False)
class _Flight:
    done: trio.Event = attrs.Factory(trio.Event)
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    waiters: int = 0
    result: outcome.Outcome | None = None


class SingleFlight:
    """A table of computations in flight, by key; they run in ``nursery``.

    The nursery must outlive the callers' interest in results (the cache actor's own
    nursery). When it is cancelled, computations still running end and their waiters
    get :class:`~trioserve.ActorClosed`.
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._flights: dict[Hashable, _Flight] = {}
        self._started = 0
        self._coalesced = 0
        self._abandoned = 0

    def __len__(self) -> int:
        return len(self._flights)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._flights

    async def call(self, key: Hashable, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Return ``await fn(*args)``, computed once for every concurrent call of ``key``.

        The first call starts the computation; later calls made before it finishes
        join it (``fn`` is then not called). A checkpoint. Cancelling this call
        withdraws only this caller; the computation goes on for the others, and is
        cancelled when no caller is left. Raises whatever the computation raised (the
        waiter's own copy of it), or ActorClosed if the owner's nursery was cancelled
        first.
        """
        flight = self._flights.get(key)
        if flight is None:
            flight = _Flight()
            try:
                self._nursery.start_soon(self._compute, key, flight, fn, args)
            except RuntimeError:  # "Nursery is closed to new arrivals"
                raise ActorClosed("singleflight: its owner's nursery is closed") from None
            self._flights[key] = flight
            self._started += 1
        else:
            self._coalesced += 1
        flight.waiters += 1
        try:
            await flight.done.wait()
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.done.is_set():
                # The last one out: nobody wants the result. Forget it now, so that a
                # new call starts afresh instead of joining a cancelled computation.
                if self._flights.get(key) is flight:
                    del self._flights[key]
                self._abandoned += 1
                flight.scope.cancel(reason="singleflight: every waiter left")
        result = flight.result
        assert result is not None
        if isinstance(result, outcome.Error):
            raise own_error(result.error)
        return result.value

    async def _compute(
        self, key: Hashable, flight: _Flight, fn: Callable[..., Awaitable[Any]], args: tuple
    ) -> None:
        try:
            with flight.scope:
                try:
                    value = await fn(*args)
                except trio.Cancelled:
                    raise
                except Exception as exc:
                    flight.result = outcome.Error(exc)
                else:
                    flight.result = outcome.Value(value)
        finally:
            if self._flights.get(key) is flight:
                del self._flights[key]
            if flight.result is None:  # cancelled: the nursery is closing, or nobody waits
                flight.result = outcome.Error(
                    ActorClosed(f"the computation of {key!r} was cancelled before it finished")
                )
            flight.done.set()

    def statistics(self) -> SingleFlightStatistics:
        return SingleFlightStatistics(
            in_flight=len(self._flights),
            started=self._started,
            coalesced=self._coalesced,
            abandoned=self._abandoned,
        )
