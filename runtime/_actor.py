"""Actors and their supervision.

An actor is an object with a bounded inbox and an ``async run(*, task_status)`` that
calls ``task_status.started(self)`` only when it is ready. Its state lives on the
object, so a restarted actor keeps its queue. :func:`supervise` runs one actor in a
nursery and restarts it when it crashes, at most ``intensity`` times in ``period``
seconds; past that budget the failure escalates as ActorBroken.
"""

from __future__ import annotations

import collections
import enum
import logging
from typing import Any

import attrs
import trio

from ._errors import ActorBroken

log = logging.getLogger("trioserve")


class ActorState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPED = "stopped"
    BROKEN = "broken"


_ACTOR_MOVES = {
    ActorState.STARTING: {ActorState.RUNNING, ActorState.RESTARTING, ActorState.BROKEN,
                          ActorState.STOPPED},
    ActorState.RUNNING: {ActorState.RESTARTING, ActorState.STOPPED, ActorState.BROKEN},
    # A restarted actor may crash again before it reports started (its load failed).
    ActorState.RESTARTING: {ActorState.RUNNING, ActorState.RESTARTING, ActorState.BROKEN,
                            ActorState.STOPPED},
    ActorState.STOPPED: set(),
    ActorState.BROKEN: set(),
}


@attrs.frozen(kw_only=True)
class RestartPolicy:
    """At most ``intensity`` restarts within ``period`` seconds, then escalate."""

    intensity: int = 5
    period: float = 10.0


class Actor:
    """Base class: a name, a lifecycle state, a restart count."""

    name: str = "actor"

    def __init__(self) -> None:
        self.state = ActorState.STARTING
        self.restarts = 0

    def _transition(self, new: ActorState) -> None:
        if new not in _ACTOR_MOVES[self.state]:
            raise ActorBroken(f"{self.name}: cannot go from {self.state.value} to {new.value}")
        self.state = new

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        raise NotImplementedError

    def on_crash(self, exc: BaseException) -> None:
        """Called after a crash, before the restart: fail or requeue what was in flight.
        The actor reads as down then (``restarting``, or ``broken`` when it is not
        restarted), so that what it tells others of its crash counts it out."""


class _FirstStart:
    """An actor's ``task_status`` under :func:`supervise`: each run is in the
    supervisor's own task (no nursery: its errors arrive unwrapped); every start marks
    the actor running, and the first is reported to whoever started the supervisor
    (``outer``, None once told). One class for every actor (a class made per call
    was two class objects, and their cycles, for each actor started)."""

    __slots__ = ("actor", "outer")

    def __init__(self, actor: Actor, outer: Any) -> None:
        self.actor = actor
        self.outer = outer

    def started(self, value: Any = None) -> None:
        self.actor._transition(ActorState.RUNNING)
        if self.outer is not None:
            self.outer.started(self.actor)
            self.outer = None


async def supervise(
    actor: Actor,
    policy: RestartPolicy,
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``actor`` and restart it when it crashes, within ``policy``'s budget.

    Reports ``started(actor)`` once the first run is ready; a failure before that is
    raised as it is (start-up errors are not retried). Cancellation stops the actor
    (state STOPPED) and propagates. A crash past the budget raises ActorBroken chained
    to the last failure.
    """
    crashes: collections.deque[float] = collections.deque()
    status = _FirstStart(actor, task_status)
    while True:
        try:
            await actor.run(task_status=status)
            actor._transition(ActorState.STOPPED)
            return
        except trio.Cancelled:
            actor.state = ActorState.STOPPED
            raise
        except Exception as exc:
            if status.outer is not None:
                # It never started: a start-up failure (a model that cannot load) is
                # reported to whoever started it, not retried.
                actor._transition(ActorState.BROKEN)
                actor.on_crash(exc)
                raise
            now = trio.current_time()
            crashes.append(now)
            while crashes and crashes[0] <= now - policy.period:
                crashes.popleft()
            if len(crashes) > policy.intensity:
                actor._transition(ActorState.BROKEN)
                actor.on_crash(exc)
                raise ActorBroken(
                    f"{actor.name} crashed {len(crashes)} times within {policy.period:g}s "
                    f"(restart budget {policy.intensity}); last error: {exc!r}"
                ) from exc
            actor.restarts += 1
            # down from here (on_crash reads it so) until its run starts again
            actor._transition(ActorState.RESTARTING)
            actor.on_crash(exc)
            log.warning(  # with its traceback: a crash is a bug to find
                "%s crashed (%r); restart %d", actor.name, exc, actor.restarts, exc_info=True
            )
        except BaseExceptionGroup as group:
            # Not an Exception, so it holds a BaseException: a run that serves from a
            # nursery of its own (a worker process's batcher) is cancelled with a group
            # of Cancelled, and is stopped all the same.
            # One with an error of its own besides (a task's cleanup that raised) is
            # down all the same: BROKEN, not left RUNNING and read as ready.
            if group.split(trio.Cancelled)[1] is None:
                actor.state = ActorState.STOPPED
            else:
                actor.state = ActorState.BROKEN
            raise
