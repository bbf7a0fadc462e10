"""The rollout suite's reference: :class:`RolloutRun` keeps docs/rollout.md's rules
beside the product's ``Rollout``, fed what the runtime feeds it (each routing,
outcome recorded, event and operator's action), and records every rule the product
breaks. ``fuzz/_rollout.py`` plays a scenario and reports to it; its docstring lists
the checks.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import attrs
import trio
from trioserve import ConfigError, InvalidInput

from ._product import PRODUCT, Product
from ._rollout_scenario import TICK, RolloutScenario, ROp
from ._stats import note

#: The versions of model ``m``: the stable (the model's backend), the canary and the
#: shadow.
STABLE, CANARY, SHADOW = "1", "2", "3"
#: The event each operator's action makes, and the state it moves to.
OP_EVENT = {"promote": "promoted", "rollback": "rolled_back", "pause": "paused",
            "resume": "resumed", "start": "started"}
OP_STATE = {"promote": "promoted", "rollback": "rolled_back", "pause": "paused",
            "resume": "canary", "start": "canary"}


@attrs.define(eq=False)
class RolloutRun:
    """What happened, and the reference of the rules kept beside the product."""

    scenario: RolloutScenario
    product: Product = PRODUCT
    t0: float = 0.0
    violations: list[tuple[str, str]] = attrs.Factory(list)
    #: caller's task -> its call's number
    task_call: dict[Any, int] = attrs.Factory(dict)
    #: call number -> the versions its items were routed to, in order
    routed: dict[int, list[str]] = attrs.Factory(dict)
    #: call number -> its outcome: ("result", values) or ("error", exc)
    outcomes: dict[int, tuple[str, Any]] = attrs.Factory(dict)
    #: (version, ok) -> how many outcomes the runtime recorded (ok "late": a request
    #: whose deadline passed in the queue)
    recorded: dict[tuple[str, bool | str], int] = attrs.Factory(dict)
    # the reference
    ref_state: str = "stable"
    #: the trial's versions and steps (the configuration's, until the operator
    #: starts a new trial)
    ref_stable: str = STABLE
    ref_canary: str = CANARY
    ref_steps: tuple[float, ...] = ()
    ref_trial_started: bool = False
    #: the operator started the trial after a promotion (against the promoted canary)
    ref_after_promotion: bool = False
    ref_step: int = 0
    ref_started: float = 0.0
    ref_routed: int = 0
    #: version -> [ok, errors, late] in the step
    ref_counts: dict[str, list[int]] = attrs.Factory(dict)
    #: when the operator paused it (None: not paused)
    ref_paused_at: float | None = None
    #: in the step: when the canary's answers reached min_requests, when the
    #: operator last resumed it (None: not yet)
    ref_reached_at: float | None = None
    ref_resumed_at: float | None = None
    #: the events the reference expects counted, by kind
    ref_events: dict[str, int] = attrs.Factory(dict)
    #: the operator's action under way, and the events it made
    op: ROp | None = None
    op_events: list[Any] = attrs.Factory(list)
    shadow_seen: int = 0
    #: the input of each copy sent, and the stable whose answer it copies
    shadow_sent: list[tuple[int, str]] = attrs.Factory(list)

    def at(self, t: float) -> str:
        return f"tick {(t - self.t0) / TICK:g}"

    def fail(self, invariant: str, text: str) -> None:
        self.violations.append((invariant, text))

    # ------------------------------------------------------------ the reference
    def begin(self, now: float) -> None:
        sc = self.scenario
        self.ref_state = "canary" if sc.canary else "stable"
        self.ref_steps = sc.steps
        self.ref_started = now
        self.ref_counts = {self.ref_stable: [0, 0, 0], self.ref_canary: [0, 0, 0]}

    @property
    def on_trial(self) -> bool:
        """A canary on trial, paused or not: routed by the split, counted, checked."""
        return self.ref_state in ("canary", "paused")

    def share(self) -> Fraction:
        if self.on_trial:  # a pause holds the step's share
            return Fraction(repr(self.ref_steps[self.ref_step]))
        return Fraction(1) if self.ref_state == "promoted" else Fraction(0)

    def expected_route(self) -> str:
        if self.ref_state == "promoted":
            return self.ref_canary
        if not self.on_trial:
            return self.ref_stable
        if self.ref_state == "paused":
            note("rollout", "routed while paused")
        if self.ref_trial_started:
            note("rollout", "routed in a started trial")
        if self.ref_after_promotion:
            note("rollout", "routed in a trial started after a promotion")
        self.ref_routed += 1
        n, s = self.ref_routed, self.share()
        due = math.floor(n * s) > math.floor((n - 1) * s)
        return self.ref_canary if due else self.ref_stable

    def _answers(self, version: str) -> int:
        ok, errors, _ = self.ref_counts[version]
        return ok + errors

    def _error_breach(self) -> bool:
        sc = self.scenario
        _, errors, _ = self.ref_counts[self.ref_canary]
        answers = self._answers(self.ref_canary)
        return errors > sc.max_error_rate * max(answers, sc.min_requests)

    def _late_breach(self) -> bool:
        """The stable has min_requests outcomes (answers and late) and the canary's
        late share, over at least min_requests outcomes (the least it can have
        then), exceeds the stable's by more than max_error_rate (the rate as
        written, compared exactly)."""
        sc = self.scenario
        c, s = self.ref_counts[self.ref_canary], self.ref_counts[self.ref_stable]
        if sum(s) < sc.min_requests or c[2] == 0:
            return False
        return (Fraction(c[2], max(sum(c), sc.min_requests)) - Fraction(s[2], sum(s))
                > Fraction(repr(sc.max_error_rate)))

    def _breach(self) -> bool:
        return self._error_breach() or self._late_breach()

    def _ending(self, now: float) -> bool:
        """The step is due to end: it lasted ``step_s`` (the pauses left out) and
        the canary answered ``min_requests`` in it; never while paused."""
        sc = self.scenario
        return (self.ref_state == "canary"
                and now - self.ref_started >= sc.step_s * TICK
                and self._answers(self.ref_canary) >= sc.min_requests)

    def on_record(self, version: str, ok: bool | str) -> None:
        """An outcome recorded for ``version``: ok, an error (False) or "late"."""
        key = (version, ok)
        self.recorded[key] = self.recorded.get(key, 0) + 1
        if self.on_trial and version in self.ref_counts:
            if self.ref_state == "paused":
                note("rollout", "recorded while paused")
            self.ref_counts[version][2 if ok == "late" else 0 if ok else 1] += 1
            if (version == self.ref_canary and self.ref_reached_at is None
                    and self._answers(self.ref_canary) >= self.scenario.min_requests):
                self.ref_reached_at = trio.current_time()

    def on_events(self, events: list[Any]) -> None:
        sc = self.scenario
        for e in events:
            now = e.at
            note("rollout", e.kind)
            what = (f"at {self.at(now)} the rollout's event {e.kind} (step {e.step}, share "
                    f"{e.share:g}, reason {e.reason!r}, operator {e.operator})")
            self.ref_events[e.kind] = self.ref_events.get(e.kind, 0) + 1
            if e.operator:
                self._on_operator_event(e, what)
                continue
            if not self.on_trial:
                self.fail("rollout", f"{what}, but it was {self.ref_state}: final")
                continue
            if self.ref_state == "paused" and e.kind != "rolled_back":
                self.fail("rollout", f"{what}, but the operator paused it at "
                          f"{self.at(self.ref_paused_at or 0.0)}: no step ends while paused")
                continue
            c_ok, c_err, c_late = self.ref_counts[self.ref_canary]
            figures = (f"step {self.ref_step} began at {self.at(self.ref_started)}, the "
                       f"canary answered {c_ok} ok and {c_err} errors in it and {c_late} "
                       f"were late, stable [ok, errors, late] "
                       f"{self.ref_counts[self.ref_stable]}; step_s {sc.step_s} ticks, "
                       "min_requests "
                       f"{sc.min_requests}, max_error_rate {sc.max_error_rate:g}")
            if e.kind in ("step", "promoted"):
                if not self._ending(now) or self._breach():
                    self.fail("rollout", f"{what}: {figures}")
                else:
                    # then at once: when it lasted step_s (the pauses left out), the
                    # canary had its answers and the operator's last resume, if later
                    due = max(self.ref_started + sc.step_s * TICK, self.ref_reached_at or 0.0,
                              self.ref_resumed_at or 0.0)
                    if now != due:
                        self.fail("rollout", f"{what}: it was due at {self.at(due)} "
                                  f"({figures})")
                last = self.ref_step + 1 >= len(self.ref_steps)
                if (e.kind == "promoted") != last:
                    self.fail("rollout", f"{what} at step {self.ref_step} of "
                              f"{len(self.ref_steps)}")
                if e.kind == "promoted":
                    self.ref_state = "promoted"
                    if e.share != 1.0:
                        self.fail("rollout", f"{what}: a promoted canary's share is 1")
                    continue
                self.ref_step += 1
                self.ref_started = now
                self.ref_routed = 0
                self.ref_reached_at = self.ref_resumed_at = None
                self.ref_counts = {self.ref_stable: [0, 0, 0], self.ref_canary: [0, 0, 0]}
                if e.step != self.ref_step or e.share != float(self.share()):
                    self.fail("rollout", f"{what}: expected step {self.ref_step} at share "
                              f"{self.ref_steps[self.ref_step]:g} (steps {self.ref_steps})")
            elif e.kind == "rolled_back":
                reason = e.reason or ""
                note("rollout", f"rolled_back for {reason.split(':')[0]}")
                if reason.startswith("error rate"):
                    if not self._error_breach():
                        self.fail("rollout", f"{what}: the error rule holds ({figures})")
                elif reason.startswith("late:"):
                    if not self._late_breach():
                        self.fail("rollout", f"{what}: the late rule holds ({figures})")
                elif reason.startswith("latency"):
                    both = (self.ref_stable, self.ref_canary)
                    if min(self._answers(v) for v in both) < sc.min_requests:
                        self.fail("rollout", f"{what}: a version has fewer than "
                                  f"min_requests answers ({figures})")
                else:
                    self.fail("rollout", f"{what}: no known reason")
                if self.ref_state == "paused":
                    note("rollout", "rolled_back while paused")
                self.ref_state = "rolled_back"
                self.ref_paused_at = None
                if e.share != 0.0:
                    self.fail("rollout", f"{what}: a rolled-back canary's share is 0")
            else:
                self.fail("rollout", f"{what}: unknown event")

    def _on_operator_event(self, e: Any, what: str) -> None:
        """An event marked the operator's: only the one the action under way makes,
        and only when the reference's state allows that action."""
        op = self.op
        if op is None:
            self.fail("rollout", f"{what}: marked the operator's, but no action was asked")
            return
        self.op_events.append(e)
        if len(self.op_events) > 1:
            self.fail("rollout", f"{what}: the operator's {op.action} at tick {op.at} "
                      f"made {len(self.op_events)} events, one expected")
            return
        why = self.refusal(op.action)
        if op.action == "start" and why is None:
            why = self.invalid_start(op)
        if why is not None:
            return  # reported once the action returns
        if e.kind != OP_EVENT[op.action]:
            self.fail("rollout", f"{what}: the operator asked {op.action}")
        if op.action == "start":
            self._on_started(e, op, what)
            return
        want_reason = (op.reason or "operator") if op.action == "rollback" else None
        if e.reason != want_reason:
            self.fail("rollout", f"{what}: the operator's {op.action} gave reason "
                      f"{want_reason!r}")
        if e.step != self.ref_step:
            self.fail("rollout", f"{what}: it was at step {self.ref_step}")
        now = e.at
        if op.action == "pause":
            self.ref_paused_at = now
        elif op.action == "resume":
            assert self.ref_paused_at is not None
            # the step goes on, the pause not counted in its step_s
            self.ref_started += now - self.ref_paused_at
            self.ref_resumed_at = now
            self.ref_paused_at = None
        else:
            self.ref_paused_at = None
        self.ref_state = OP_STATE[op.action]
        if e.share != float(self.share()):
            self.fail("rollout", f"{what}: the share after it is {float(self.share()):g}")

    def _on_started(self, e: Any, op: ROp, what: str) -> None:
        """A new trial of ``op.canary`` against the version taking every unversioned
        request (the promoted canary, else the stable), at its first step."""
        self.ref_after_promotion = self.ref_state == "promoted"
        if self.ref_after_promotion:
            note("rollout", "started after a promotion")
        target = self.ref_canary if self.ref_after_promotion else self.ref_stable
        assert op.canary is not None
        self.ref_stable, self.ref_canary = target, op.canary
        self.ref_steps = op.steps if op.steps is not None else self.scenario.steps
        self.ref_state = "canary"
        self.ref_trial_started = True
        self.ref_step = 0
        self.ref_started = e.at
        self.ref_routed = 0
        self.ref_paused_at = self.ref_reached_at = self.ref_resumed_at = None
        self.ref_counts = {self.ref_stable: [0, 0, 0], self.ref_canary: [0, 0, 0]}
        if e.step != 0 or e.share != float(self.share()) or e.reason is not None:
            self.fail("rollout", f"{what}: a trial started is at its first step, share "
                      f"{float(self.share()):g}, no reason")

    def invalid_start(self, op: ROp) -> str | None:
        """Why a start's canary is refused as invalid input (the state allowing
        it), or None: the stable it would run against, or the shadow."""
        target = self.ref_canary if self.ref_state == "promoted" else self.ref_stable
        if op.canary == target:
            return "the canary is the stable"
        if self.scenario.shadow and op.canary == SHADOW:
            return "the canary is the shadow"
        return None

    def refusal(self, action: str) -> str | None:
        """Why the rollout's state (the reference's) does not allow the operator's
        ``action`` (docs/rollout.md), or None."""
        if action == "start":
            if self.on_trial:
                return f"a canary is on trial ({self.ref_state})"
            return None
        if self.ref_state == "stable":
            return "it has no canary"
        if self.ref_state in ("promoted", "rolled_back"):
            return f"it is already {self.ref_state} (final)"
        if action == "pause" and self.ref_state == "paused":
            return "it is already paused"
        if action == "resume" and self.ref_state != "paused":
            return "it is not paused"
        return None

    def operate(self, rt: Any, op: ROp) -> None:
        """The operator's ``op``, through the runtime's public method: refused with
        ConfigError exactly when the reference says the state does not allow it (a
        rollback's empty reason with InvalidInput, whatever the state), changing
        nothing then; else exactly its one event, and the state it returns is the
        reference's."""
        now = trio.current_time()
        what = f"at {self.at(now)} the operator's {op.action}" + (
            f" (reason {op.reason!r})" if op.action == "rollback" else "")
        why = self.refusal(op.action)
        invalid = False
        if op.action == "rollback" and not op.reason:
            invalid, why = True, "an empty reason"
        elif op.action == "start" and why is None:
            # (the state first: a start while on trial is refused, whatever its canary)
            bad = self.invalid_start(op)
            if bad is not None:
                invalid, why = True, bad
        before = (self.ref_state, self.ref_step, float(self.share()))
        self.op, self.op_events = op, []
        try:
            if op.action == "rollback":
                state = rt.rollback("m", op.reason)
            elif op.action == "start":
                rule = {"steps": list(op.steps)} if op.steps is not None else {}
                state = rt.start_rollout("m", canary=op.canary, **rule)
            else:
                state = {"promote": rt.promote, "pause": rt.pause_rollout,
                         "resume": rt.resume_rollout}[op.action]("m")
        except (ConfigError, InvalidInput) as exc:
            want = InvalidInput if invalid else ConfigError
            if why is None or not isinstance(exc, want):
                self.fail("rollout", f"{what} raised {exc!r}; the reference "
                          f"({self.ref_state}, step {self.ref_step}) "
                          + ("allows it" if why is None else f"refuses it: {why}"))
            elif self.op_events:
                self.fail("rollout", f"{what} was refused ({exc}) but made events "
                          f"{[e.kind for e in self.op_events]}")
            else:
                note("rollout", "operator refused")
            state = None
        finally:
            self.op = None
        if state is not None:
            if why is not None:
                self.fail("rollout", f"{what} was allowed (the rollout now {state['state']}"
                          f"); the reference ({before[0]}, step {before[1]}) refuses "
                          f"it: {why}")
                return
            note("rollout", f"operator {op.action}")
            if len(self.op_events) != 1:
                self.fail("rollout", f"{what} made events "
                          f"{[e.kind for e in self.op_events]}, one expected")
            want = (self.ref_state, self.ref_state == "paused", float(self.share()))
            got = (state["state"], state["paused"], state["share"])
            if got != want:
                self.fail("rollout", f"{what} returned (state, paused, share) {got}; the "
                          f"reference {want}")

    def check_events(self, counted: dict[str, int], now: float) -> None:
        """The events the controller counted are those it made (each kind)."""
        want = {k: self.ref_events.get(k, 0) for k in counted}
        if dict(counted) != want or set(self.ref_events) - set(counted):
            self.fail("rollout", f"at {self.at(now)} the events counted {dict(counted)}; "
                      f"those made {self.ref_events}")

    def after_change(self, rollout: Any, now: float) -> None:
        """After the runtime fed the rollout: nothing due is left undone, and the
        product's state is the reference's."""
        if self.on_trial:
            if self._breach():
                self.fail("rollout", f"at {self.at(now)} the canary's outcomes "
                          f"{self.ref_counts[self.ref_canary]} (ok, errors, late) in step "
                          f"{self.ref_step}, stable's {self.ref_counts[self.ref_stable]}, are "
                          "past "
                          f"max_error_rate {self.scenario.max_error_rate:g} (min_requests "
                          f"{self.scenario.min_requests}), still on trial "
                          f"({self.ref_state})")
            elif self._ending(now):
                self.fail("rollout", f"at {self.at(now)} step {self.ref_step} (began at "
                          f"{self.at(self.ref_started)}) lasted step_s and the canary "
                          f"answered {self._answers(self.ref_canary)} in it, still on trial")
        self.compare(rollout, now)

    def compare(self, rollout: Any, now: float) -> None:
        state = rollout.state.value
        if state != self.ref_state or (self.on_trial and rollout.step != self.ref_step) \
                or rollout.share != float(self.share()):
            self.fail("rollout", f"at {self.at(now)} the rollout is {state} at step "
                      f"{rollout.step}, share {rollout.share:g}; the reference "
                      f"{self.ref_state} at step {self.ref_step}, share "
                      f"{float(self.share()):g}")

