"""A replica's health: the part of :class:`~trioserve.actors.BatcherActor` that says
whether it takes work (its state, a device lost, retiring, a straggling thread, a
worker being replaced, its circuit breaker), and waits out an open breaker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from trioserve import ActorState

if TYPE_CHECKING:
    from ._straggler import Breaker

#: Every health a replica may have (:attr:`BatcherActor.health`): the running
#: replica's, then the actor's states when it is not running.
REPLICA_HEALTH = (
    "ready", "half_open", "open", "degraded", "replacing", "retiring", "lost",
    "starting", "restarting", "stopped", "broken",
)
#: The healths of a replica that takes work (``BatcherActor.ready``).
_SERVING = frozenset({"ready", "half_open"})


class ReplicaHealth:
    """The health of a batcher; not used on its own."""

    if TYPE_CHECKING:
        state: ActorState
        lost: str | None
        _degraded: bool
        _replacing: bool
        _replace_due: bool
        _replace_wake: trio.Event
        _retire_asked: trio.Event
        _breaker: Breaker

    @property
    def health(self) -> str:
        """``ready`` (pulling work), ``half_open`` (pulling work on probation: its
        circuit breaker's cooldown passed, and its next good batch closes it, a
        failure opens it again), ``lost`` (a thread or inline replica whose model
        left its device unusable: it serves no more), ``degraded`` (a straggling
        thread still runs),
        ``replacing`` (a new worker process is starting), ``open`` (its circuit breaker
        is open after repeated failures: it pulls nothing), ``retiring`` (the
        autoscaler retires it: it finishes what it holds and pulls no more), or the
        actor's state when it is not running (starting, restarting, stopped, broken).
        One of :data:`REPLICA_HEALTH`."""
        if self.state is not ActorState.RUNNING:
            return self.state.value
        if self.lost is not None:
            return "lost"
        if self._retire_asked.is_set():
            return "retiring"
        if self._degraded:
            return "degraded"
        if self._replacing:
            return "replacing"
        now = trio.current_time()
        if self._breaker.is_open(now):
            return "open"
        if self._breaker.half_open(now):
            return "half_open"
        return "ready"

    @property
    def ready(self) -> bool:
        """Whether it takes work: ``ready``, or ``half_open`` (its trial needs work
        to run, and a readiness probe that turned a lone replica's traffic away
        would hold its breaker half-open)."""
        return self.health in _SERVING

    async def _wait_breaker(self) -> None:
        """Wait while the breaker is open; a worker replacement falling due (another
        replica's evidence opened it) ends the wait early."""
        until = self._breaker.open_until
        if trio.current_time() < until and not self._replace_due:
            with trio.move_on_at(until):
                await self._replace_wake.wait()
