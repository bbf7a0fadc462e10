"""The rollout's decisions, sans-IO: which version an unversioned request goes to,
and when the canary advances a step, is promoted or rolled back.

``Rollout`` is fed each routed request's outcome (``record(version, ok, latency,
now)``, or ``record_late(version, now)`` for one whose deadline passed in the queue)
and the time (``tick(now)``), and answers the canary's share, its state and the
events of each change. Nothing in it awaits or reads a clock.

The rules (docs/rollout.md):

- The canary's share follows ``steps`` in order. Within a step the split is a
  counter, not a draw: of the first n requests of a step, exactly floor(n * share)
  go to the canary (a smooth weighted round-robin), so a test can count them.
- A step ends once it has lasted ``step_s`` and the canary has answered at least
  ``min_requests`` in it: the next step begins (its counts start at zero), or, after
  the last, the canary is promoted.
- The canary is rolled back at once when, in the step, its errors exceed
  ``max_error_rate`` of its answers with at least ``min_requests`` of them, or are
  already so many that they will at ``min_requests`` (more than ``max_error_rate *
  min_requests``); or when its p99 latency exceeds ``max_latency_ratio`` times the
  stable's, both with at least ``min_requests`` answers in the step (compared when
  they first have, then every ``LATENCY_EVERY`` answers, and before a step ends);
  or when its late share (requests whose deadline passed in its queue, of its
  answers and late ones) exceeds the stable's by more than ``max_error_rate``, both
  with at least ``min_requests`` outcomes (answers and late) in the step. A late
  request alone is no error (a client's own too-short timeout says nothing of the
  version), but the same clients' timeouts hit both versions alike, so a difference
  is the canary's own slowness (a hung canary answers nothing: all its outcomes are
  late); or sooner, once the stable has ``min_requests`` outcomes and the canary's
  late ones are so many that its share at ``min_requests`` outcomes, whatever they
  are, would be past the stable's share of now by more than ``max_error_rate``.
  Late requests do not count toward the ``min_requests`` a step needs.
- Promoted and rolled back end the trial: only the operator's ``start`` begins a
  new one (of another canary against the version taking every unversioned request
  then: the promoted canary, else the stable).
- A rollout just made may start from what an earlier run of the server recorded
  (``restore``): promoted, rolled back, or on trial (paused or not) at a step, with
  the time already served in it.
- The operator may promote, roll back, pause and resume (``promote``, ``rollback``,
  ``pause``, ``resume``). Paused, the share holds and no step ends, but the
  outcomes are still counted and checked: a breach still rolls back. Resumed, the
  step goes on, the pause not counted in its ``step_s``.
"""

from __future__ import annotations

import enum
import math
from fractions import Fraction

import attrs

from ._metrics import Latency


class RolloutState(enum.Enum):
    STABLE = "stable"  # no canary: every unversioned request goes to stable
    CANARY = "canary"  # a canary on trial
    PAUSED = "paused"  # on trial, held by the operator at its share and step
    PROMOTED = "promoted"  # the canary takes every unversioned request
    ROLLED_BACK = "rolled_back"  # the canary takes none


#: The operator's actions: the states each is allowed from.
_ALLOWED = {
    "promote": {RolloutState.CANARY, RolloutState.PAUSED},
    "rollback": {RolloutState.CANARY, RolloutState.PAUSED},
    "pause": {RolloutState.CANARY},
    "resume": {RolloutState.PAUSED},
    # a new trial: once the last one ended, or when there was none
    "start": {RolloutState.STABLE, RolloutState.PROMOTED, RolloutState.ROLLED_BACK},
}

_MOVES = {
    RolloutState.STABLE: {RolloutState.CANARY},  # started
    RolloutState.CANARY: {RolloutState.PROMOTED, RolloutState.ROLLED_BACK, RolloutState.PAUSED},
    RolloutState.PAUSED: {RolloutState.CANARY, RolloutState.PROMOTED, RolloutState.ROLLED_BACK},
    RolloutState.PROMOTED: {RolloutState.CANARY},  # a new trial started
    RolloutState.ROLLED_BACK: {RolloutState.CANARY},  # a new trial started
}


@attrs.frozen(kw_only=True)
class RolloutRules:
    """The canary's steps and checks (``[models.NAME.rollout]``)."""

    steps: tuple[float, ...] = (0.05, 0.25, 0.5)
    step_s: float = 60.0
    min_requests: int = 100
    max_error_rate: float = 0.01
    max_latency_ratio: float = 1.5


@attrs.frozen(kw_only=True)
class RolloutEvent:
    """A change: ``kind`` step (a new step began), promoted, rolled_back, paused,
    resumed or started (a new trial); the step's index and share after it;
    ``reason`` of a rollback (which check, the figures, or the operator's words);
    ``operator``: the operator's action, not a check's."""

    kind: str
    at: float
    step: int
    share: float
    reason: str | None = None
    operator: bool = False
    #: the canary's share before it (a promotion or rollback moves it to 1 or 0)
    share_before: float | None = None


class _StepCounts:
    """One version's outcomes in the current step: answers (``ok``, ``errors``),
    ``late`` (its deadline passed in the queue: never answered) and ``shared``
    (answered without the model running for it: in no check)."""

    __slots__ = ("errors", "late", "latency", "ok", "shared")

    def __init__(self) -> None:
        self.ok = 0
        self.errors = 0
        self.late = 0
        self.shared = 0
        self.latency = Latency()

    @property
    def answers(self) -> int:
        return self.ok + self.errors

    @property
    def outcomes(self) -> int:
        return self.ok + self.errors + self.late

    def p99(self) -> float:
        return self.latency.percentile_s(99)


class Rollout:
    """The state of one model's rollout (see the module's docstring)."""

    #: answers (both versions') between two comparisons of their latencies
    LATENCY_EVERY = 64

    def __init__(
        self, rules: RolloutRules, *, stable: str, canary: str | None, now: float
    ) -> None:
        self.rules = rules
        self.stable = stable
        self.canary = canary
        self.state = RolloutState.CANARY if canary is not None else RolloutState.STABLE
        self.step = 0
        self.step_started = now
        #: when the operator paused it (None: not paused)
        self.paused_at: float | None = None
        self.reason: str | None = None
        #: the recorded state this rollout started from (None: it began afresh)
        self.restored: RolloutState | None = None
        #: where the trial's versions and rules come from: "configuration", or
        #: "operator" (a trial started while serving, ``start``)
        self.origin = "configuration"
        #: how its stable was determined: "configuration", or, for a trial the
        #: operator started, "promoted" (the last trial's canary, promoted) or
        #: "previous" (the last trial's stable: its canary rolled back, or none)
        self.stable_from = "configuration"
        self.events: list[RolloutEvent] = []
        self._routed = 0  # unversioned requests routed in this step
        self._to_canary = 0
        self._share = Fraction(repr(rules.steps[0])) if canary is not None else Fraction(0)
        self.counts = {v: _StepCounts() for v in (stable, canary) if v is not None}
        #: answers in the step when the latencies were last compared (None: not yet)
        self._latency_checked: int | None = None
        self._set_rules(rules)

    def _set_rules(self, rules: RolloutRules) -> None:
        self.rules = rules
        #: max_error_rate as written, p / q, for the exact comparison of late shares
        rate = Fraction(repr(rules.max_error_rate))
        self._rate_p, self._rate_q = rate.numerator, rate.denominator

    # ------------------------------------------------------------ reads
    @property
    def share(self) -> float:
        """The canary's current share of unversioned requests."""
        return float(self._share)

    @property
    def on_trial(self) -> bool:
        """Whether a canary is on trial (paused or not): routed, counted, checked."""
        return self.state in (RolloutState.CANARY, RolloutState.PAUSED)

    @property
    def terminal(self) -> bool:
        return self.state in (RolloutState.PROMOTED, RolloutState.ROLLED_BACK)

    def target(self) -> str:
        """The version unversioned requests go to when no split applies."""
        if self.state is RolloutState.PROMOTED:
            assert self.canary is not None
            return self.canary
        return self.stable

    def next_deadline(self) -> float:
        """When ``tick`` may next change something by the time alone: the end of
        the step's ``step_s`` (inf when final or paused, or when it waits for
        requests)."""
        if self.state is not RolloutState.CANARY:
            return math.inf
        end = self.step_started + self.rules.step_s
        return end

    # ------------------------------------------------------------ decisions
    def route(self) -> str:
        """The version of the next unversioned request: of the first n of a step,
        floor(n * share) go to the canary, the others to stable."""
        if not self.on_trial:
            return self.target()
        self._routed += 1
        due = math.floor(self._routed * self._share)
        if due > self._to_canary:
            self._to_canary += 1
            assert self.canary is not None
            return self.canary
        return self.stable

    def record(self, version: str, ok: bool, latency: float, now: float) -> list[RolloutEvent]:
        """An unversioned request routed to ``version`` was answered (``ok``) or
        failed by the model, ``latency`` seconds after it came; returns the events
        it caused (a rollback, or the step's end)."""
        if not self.on_trial:
            return []
        counts = self.counts.get(version)
        if counts is None:
            return []
        if ok:
            counts.ok += 1
        else:
            counts.errors += 1
        counts.latency.record(latency)
        return self._check(now)

    def record_shared(self, version: str) -> None:
        """An unversioned request routed to ``version`` was answered without the
        model running for it (a cache hit, or joined onto an identical request in
        flight): counted apart, in no check. Its near-zero latency says nothing of
        the version (and would flatter the one hit more), nor is it an answer for
        the error rate (hits would dilute the canary's errors by its hit rate, and
        a joined request's error is the one it joined, counted once already)."""
        if not self.on_trial:
            return
        counts = self.counts.get(version)
        if counts is not None:
            counts.shared += 1

    def record_late(self, version: str, now: float) -> list[RolloutEvent]:
        """An unversioned request routed to ``version`` was not answered: its
        deadline passed while it waited in the queue. Returns the events it caused
        (a rollback on the late shares)."""
        if not self.on_trial:
            return []
        counts = self.counts.get(version)
        if counts is None:
            return []
        counts.late += 1
        return self._check(now)

    def tick(self, now: float) -> list[RolloutEvent]:
        """The time is ``now``: the events it brings (the step's end)."""
        if not self.on_trial:
            return []
        return self._check(now)

    def restore(
        self, state: RolloutState, *, step: int, reason: str | None, now: float,
        elapsed: float = 0.0,
    ) -> None:
        """Start from what an earlier run recorded: ``state`` promoted, rolled back
        (for ``reason``), or on trial (canary, or paused) at ``step`` with
        ``elapsed`` seconds of it already served (its share, the step's counts
        empty: they were in the earlier run's memory). Only on a rollout just made
        (a canary at its first step, nothing happened); no event (nothing changed in
        this run). ValueError for anything else."""
        if self.state is not RolloutState.CANARY or self.events or self.restored:
            raise ValueError("only a canary's rollout just begun can be restored")
        if state is RolloutState.STABLE:
            raise ValueError(f"cannot restore a rollout to {state.value}")
        if not 0 <= step < len(self.rules.steps):
            raise ValueError(f"step {step} is not one of the {len(self.rules.steps)} steps")
        if not (math.isfinite(elapsed) and elapsed >= 0):
            raise ValueError(f"a step's time served must be a finite number >= 0, got {elapsed!r}")
        self.step = step
        self._begin_step(now - elapsed, Fraction(repr(self.rules.steps[step])))
        self.state = self.restored = state
        if state is RolloutState.PAUSED:
            self.paused_at = now
        elif state is RolloutState.CANARY:
            pass
        else:
            self.reason = reason
            self._share = Fraction(1) if state is RolloutState.PROMOTED else Fraction(0)

    # ------------------------------------------------------------ the operator's
    def refusal(self, action: str) -> str | None:
        """Why the operator's ``action`` (promote, rollback, pause, resume, start) is
        not allowed now, or None."""
        if self.state in _ALLOWED[action]:
            return None
        if action == "start":
            held = " (paused)" if self.state is RolloutState.PAUSED else ""
            return (f"canary {self.canary!r} is on trial{held}; roll it back or promote "
                    "it first")
        if self.state is RolloutState.STABLE:
            return "it has no canary"
        if self.terminal:
            return f"the canary is already {self.state.value} (final)"
        if action == "resume":
            return "it is not paused"
        return "it is already paused"

    def promote(self, now: float) -> list[RolloutEvent]:
        """The operator promotes the canary: it takes every unversioned request."""
        self._allowed("promote")
        return [self._move(RolloutState.PROMOTED, now, None, operator=True)]

    def rollback(self, now: float, reason: str) -> list[RolloutEvent]:
        """The operator rolls the canary back (share 0), for ``reason``."""
        self._allowed("rollback")
        return [self._move(RolloutState.ROLLED_BACK, now, reason, operator=True)]

    def pause(self, now: float) -> list[RolloutEvent]:
        """The operator holds the canary at its share and step: no step ends until
        :meth:`resume`; its outcomes are still checked (a breach still rolls back)."""
        self._allowed("pause")
        self.paused_at = now
        return [self._move(RolloutState.PAUSED, now, None, operator=True)]

    def resume(self, now: float) -> list[RolloutEvent]:
        """The operator resumes a paused canary: its step goes on, the pause not
        counted in its ``step_s`` (it may end at once, if it lasted long enough)."""
        self._allowed("resume")
        assert self.paused_at is not None
        self.step_started += now - self.paused_at
        return [self._move(RolloutState.CANARY, now, None, operator=True)]

    def start(
        self, canary: str, rules: RolloutRules, now: float, *, operator: bool = True
    ) -> list[RolloutEvent]:
        """Begin a new trial of ``canary`` under ``rules``, at its first step, against
        the version that takes every unversioned request now (the promoted canary,
        else the stable), which becomes its stable. Only once the last trial ended
        (promoted, rolled back) or when there was none; ``canary`` must differ from
        that stable (ValueError otherwise)."""
        self._allowed("start")
        stable = self.target()
        if canary == stable:
            raise ValueError(f"the canary {canary!r} is the stable version")
        if self.state is RolloutState.PROMOTED:
            self.stable_from = "promoted"
        elif self.state is RolloutState.ROLLED_BACK or self.origin == "operator":
            self.stable_from = "previous"
        # (no canary yet: the configuration's stable stays, as its stable_from says)
        self.origin = "operator"
        self.stable, self.canary = stable, canary
        self._set_rules(rules)
        self.step = 0
        self.reason = None
        self.paused_at = None
        self.restored = None
        self.counts = {v: _StepCounts() for v in (stable, canary)}
        self._begin_step(now, Fraction(repr(rules.steps[0])))
        if RolloutState.CANARY not in _MOVES[self.state]:
            raise RuntimeError(f"rollout: no move from {self.state.value} to canary")
        self.state = RolloutState.CANARY
        event = RolloutEvent(kind="started", at=now, step=0, share=self.share,
                             operator=operator)
        self.events.append(event)
        return [event]

    def step_elapsed(self, now: float) -> float | None:
        """Seconds the current step has run at ``now``, its pauses not counted (what
        its ``step_s`` is measured against); None once the rollout has ended."""
        if self.state not in (RolloutState.CANARY, RolloutState.PAUSED):
            return None
        end = self.paused_at if self.paused_at is not None else now
        return max(0.0, end - self.step_started)

    def _allowed(self, action: str) -> None:
        why = self.refusal(action)
        if why is not None:
            raise ValueError(f"cannot {action} the rollout: {why}")

    # ------------------------------------------------------------ internals
    def _check(self, now: float) -> list[RolloutEvent]:
        r = self.rules
        canary = self.counts[self.canary]  # type: ignore[index]
        ending = (
            self.state is RolloutState.CANARY  # paused: no step ends
            and now - self.step_started >= r.step_s
            and canary.answers >= r.min_requests
        )
        breach = self._breach(latency_due=ending)
        if breach is not None:
            return [self._move(RolloutState.ROLLED_BACK, now, breach)]
        if not ending:
            return []
        if self.step + 1 >= len(r.steps):
            return [self._move(RolloutState.PROMOTED, now, None)]
        self.step += 1
        self._begin_step(now, Fraction(repr(r.steps[self.step])))
        event = RolloutEvent(kind="step", at=now, step=self.step, share=self.share)
        self.events.append(event)
        return [event]

    def _breach(self, *, latency_due: bool) -> str | None:
        """Why the canary is to be rolled back now, or None. The latencies are
        compared when both versions first have ``min_requests`` answers in the step,
        then after each ``LATENCY_EVERY`` answers more, and always before a step
        ends (``latency_due``): a p99 costs ~10 µs, too much for every answer."""
        r = self.rules
        canary = self.counts[self.canary]  # type: ignore[index]
        stable = self.counts[self.stable]
        n = canary.answers
        if canary.errors > r.max_error_rate * max(n, r.min_requests):
            if n >= r.min_requests:
                over = f"over max_error_rate {r.max_error_rate:g}"
            else:  # caught early: these errors breach the rate at min_requests already
                over = (
                    f"more than max_error_rate {r.max_error_rate:g} × min_requests "
                    f"{r.min_requests} = {r.max_error_rate * r.min_requests:g} already"
                )
            return (
                f"error rate: {canary.errors} errors in {n} answers of the canary "
                f"({canary.errors / n:.2%}), {over}"
            )
        late = self._late_breach()
        if late is not None:
            return late
        if n >= r.min_requests and stable.answers >= r.min_requests:
            answers = n + stable.answers
            last = self._latency_checked
            if not latency_due and last is not None and answers - last < self.LATENCY_EVERY:
                return None
            self._latency_checked = answers
            c99, s99 = canary.p99(), stable.p99()
            if c99 > r.max_latency_ratio * s99:
                return (
                    f"latency: the canary's p99 {c99 * 1e3:.3g} ms over the stable's "
                    f"{s99 * 1e3:.3g} ms ({c99 / s99 if s99 else math.inf:.3g}x), over "
                    f"max_latency_ratio {r.max_latency_ratio:g}"
                )
        return None

    def _late_breach(self) -> str | None:
        """Why the canary's late share is past the stable's by more than
        ``max_error_rate``, or None. Exact: the shares and the rate as written are
        compared as fractions.

        With ``min_requests`` outcomes of each, the shares as they are. Sooner, once
        the stable has ``min_requests`` outcomes: the canary's share taken over
        ``min_requests`` outcomes (its late ones of ``max(outcomes, min_requests)``),
        the least it can have at ``min_requests`` whatever its next outcomes are, so
        that it is rolled back now only if it would be then against the stable's
        share as it is now (the stable's own share may still move)."""
        r = self.rules
        canary = self.counts[self.canary]  # type: ignore[index]
        stable = self.counts[self.stable]
        if canary.late == 0:
            return None  # its late share is 0: never past the stable's
        cn, sn = canary.outcomes, stable.outcomes
        if sn < r.min_requests:
            return None  # the stable's share is not known well enough yet
        at = max(cn, r.min_requests)
        # canary.late / at - stable.late / sn > p / q, in integers
        if self._rate_q * (canary.late * sn - stable.late * at) <= self._rate_p * at * sn:
            return None
        early = (
            f", sure to be over at {r.min_requests} whatever its next ones"
            if cn < r.min_requests else ""
        )
        return (
            f"late: {canary.late} of the canary's {cn} requests ({canary.late / cn:.2%}) "
            f"passed their deadline in its queue, {stable.late} of the stable's {sn} "
            f"({stable.late / sn:.2%}): more by over max_error_rate "
            f"{r.max_error_rate:g} (at least {r.min_requests} of each{early})"
        )

    def _begin_step(self, now: float, share: Fraction) -> None:
        self.step_started = now
        self._share = share
        self._routed = 0
        self._to_canary = 0
        self.counts = {v: _StepCounts() for v in self.counts}
        self._latency_checked = None

    def _move(
        self, to: RolloutState, now: float, reason: str | None, *, operator: bool = False
    ) -> RolloutEvent:
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"rollout: no move from {self.state.value} to {to.value}")
        was = self.state
        share_before = self.share
        self.state = to
        if to is RolloutState.PAUSED:
            kind = "paused"
        elif to is RolloutState.CANARY:
            kind = "resumed"
            self.paused_at = None
        else:
            self.reason = reason
            self.paused_at = None
            self._share = Fraction(1) if to is RolloutState.PROMOTED else Fraction(0)
            kind = "promoted" if to is RolloutState.PROMOTED else "rolled_back"
        assert was is not to
        event = RolloutEvent(kind=kind, at=now, step=self.step, share=self.share,
                             reason=reason, operator=operator, share_before=share_before)
        self.events.append(event)
        return event
