"""Planted bugs of the rollout (``Rollout``'s decisions and the
``RolloutController`` that feeds it), which the rollout suite sees. Listed in
``fuzz._mutants.MUTANTS``."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import trioserve.actors

Rollout = trioserve.actors.Rollout
RolloutController = trioserve.actors.RolloutController


class RoutesByThePreviousShare(Rollout):
    """The split counts a new step's requests by the share of the step before it."""

    def route(self) -> str:
        if self.state is not trioserve.actors.RolloutState.CANARY or self.step == 0:
            return super().route()
        previous = Fraction(repr(self.rules.steps[self.step - 1]))
        self._routed += 1
        if math.floor(self._routed * previous) > self._to_canary:
            self._to_canary += 1
            assert self.canary is not None
            return self.canary
        return self.stable


class ResumesAfterARollback(Rollout):
    """A rolled-back canary goes back on trial, at its step's share, at the next tick."""

    def tick(self, now: float) -> list[Any]:
        if self.state is trioserve.actors.RolloutState.ROLLED_BACK:
            self.state = trioserve.actors.RolloutState.CANARY
            self._begin_step(now, Fraction(repr(self.rules.steps[self.step])))
        return super().tick(now)


class PauseStillAdvancesSteps(Rollout):
    """A pause holds the share, but the step still ends on time (and the last one
    promotes the canary), as if not paused."""

    def next_deadline(self) -> float:
        if self.state is trioserve.actors.RolloutState.PAUSED:
            return self.step_started + self.rules.step_s
        return super().next_deadline()

    def _check(self, now: float) -> list[Any]:
        paused = trioserve.actors.RolloutState.PAUSED
        if self.state is not paused:
            return super()._check(now)
        self.state = trioserve.actors.RolloutState.CANARY
        try:
            return super()._check(now)
        finally:
            if self.state is trioserve.actors.RolloutState.CANARY:
                self.state = paused


class ResumeCountsThePause(Rollout):
    """A resume leaves the step's start where it was: the pause counts in its
    ``step_s``."""

    def resume(self, now: float) -> list[Any]:
        self.paused_at = now
        return super().resume(now)


class PromotesARolledBackCanary(Rollout):
    """The operator may promote a canary already rolled back."""

    def refusal(self, action: str) -> str | None:
        if action == "promote" and self.state is trioserve.actors.RolloutState.ROLLED_BACK:
            return None
        return super().refusal(action)

    def promote(self, now: float) -> list[Any]:
        if self.state is trioserve.actors.RolloutState.ROLLED_BACK:
            self.state = trioserve.actors.RolloutState.CANARY
        return super().promote(now)


class StartKeepsTheOldStable(Rollout):
    """A trial the operator starts after a promotion runs against the last trial's
    stable, not its promoted canary (which took every unversioned request)."""

    def start(self, canary: str, rules: Any, now: float, *, operator: bool = True) -> list[Any]:
        if self.state is trioserve.actors.RolloutState.PROMOTED and canary != self.stable:
            self.state = trioserve.actors.RolloutState.ROLLED_BACK
        return super().start(canary, rules, now, operator=operator)


class PauseHoldsTheChecks(Rollout):
    """Paused, the outcomes are counted but no rule is checked: a breach waits for
    the resume."""

    def _check(self, now: float) -> list[Any]:
        if self.state is trioserve.actors.RolloutState.PAUSED:
            return []
        return super()._check(now)


class ResumeWaitsForAnAnswer(RolloutController):
    """A resume does not wake the controller: a step that lasted long enough ends
    only at the canary's next answer, not at once."""

    def _apply(self, events: list[Any]) -> None:
        if [e.kind for e in events] == ["resumed"]:
            self.events["resumed"] += 1
            return
        super()._apply(events)


class ShadowQueuePastItsBound(RolloutController):
    """The shadow's channel holds two copies more than ``shadow_queue``."""

    def __init__(self, *, shadow_queue: int = 64, **kw: Any) -> None:
        super().__init__(shadow_queue=shadow_queue + 2, **kw)
