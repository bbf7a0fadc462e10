"""Suite ``rollout``: versions with weights of their own, a canary's split, steps,
promotion and rollback, and a shadow, through ``open_runtime`` under MockClock.

A scenario (fuzz/_rollout_scenario.py) serves model ``m``: version 1 on the model's
backend (stable), 2 and 3 on their own (the canary and the shadow); each answers
``[x, its version]`` (the shadow answers stable's ``[x, 1]`` for an even ``x``, so
some copies match and some do not), raises on its ``bad`` inputs, and takes its
latency per batch in trio time. Callers arrive at random times with unversioned or
versioned ``infer`` / ``infer_batch`` calls; the operator promotes, rolls back,
pauses and resumes at chosen ticks through the runtime's public methods
(``rt.promote``, ``rt.rollback``, ``rt.pause_rollout``, ``rt.resume_rollout``),
whether the state allows it or not.

The checks, against a reference of the documented rules (docs/rollout.md) kept
beside the product's :class:`Rollout`, fed what the runtime feeds it:

- ``split``: each unversioned request is routed by the counter rule exactly (the
  n-th of a step goes to the canary iff floor(n × share) > floor((n − 1) × share),
  the share the step's), to the target once the rollout is final, and its answer
  comes from that version; a versioned request's from the version it named.
- ``rollout``: the events follow the steps (a step ends, or the canary is promoted,
  only once it lasted ``step_s`` and the canary answered ``min_requests`` in it, and
  then at once), a rollback for errors only past the error rule and then at once, one
  for latency only with both versions' ``min_requests`` answers; a rollback for late
  requests (their deadline passed in the queue) only once the stable has
  ``min_requests`` outcomes (answers and late) and the canary's late share, over at
  least ``min_requests`` outcomes, exceeds the stable's by more than
  ``max_error_rate``, and then at once (late requests are
  no answers: they neither end a step nor count as errors); the shares are the steps';
  promoted and rolled back stay final; each routed request's outcome is recorded
  once, for its version (an error for each item of a failed part), and nothing else.
  The operator's actions: an action is refused (``ConfigError``) exactly when the
  reference's state does not allow it (no canary, final, a pause when paused, a
  resume when not), a rollback's empty reason always (``InvalidInput``), and a
  refused one changes nothing; an allowed one makes exactly its one event (marked
  the operator's, a rollback with the operator's reason) and the state the
  reference says. Paused, the share and the split's count hold, no step ends nor is
  the canary promoted by a check, but outcomes are counted and the rules still roll
  it back; resumed, the step's ``step_s`` leaves the pause out (a step due at the
  resume ends at once). The events counted are the reference's.
- ``shadow``: a copy of a share (the counter rule) of stable's answers goes to the
  shadow, never more waiting than ``shadow_queue``; every copy sent is counted once
  (match, mismatch, error or dropped), exactly as the shadow's answers say when none
  was dropped; a copy never reaches a caller nor counts as one.
- ``lost`` / ``outcome``: every caller returns once, with a result exactly when no
  item of it is bad on its version, else ``ModelError`` (or, with a ``timeout``,
  ``DeadlineExceeded``: in the queue, recorded late; while its batch ran, an
  error); ``leak``: no task outlives the runtime.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing
import trioserve
import trioserve.actors
from trioserve import (
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ModelBackend,
    ModelError,
    TensorSpec,
)

from ._product import PRODUCT, Product
from ._rollout_scenario import HORIZON_S, TICK, RCall, RolloutScenario, ROp
from ._rollout_scenario import rollout_scenarios as rollout_scenarios
from ._runtime import _tasks, leaked_since, raise_first, replay
from ._stats import count_example, expect, note

X = TensorSpec(name="x", datatype="FP64", shape=(-1,))
Y = TensorSpec(name="y", datatype="FP64", shape=(-1,))
STABLE, CANARY, SHADOW = "1", "2", "3"

expect("rollout", "step", "promoted", "rolled_back", "routed to canary",
       "shadow match", "shadow dropped", "operator promote", "operator rollback",
       "operator pause", "operator resume", "operator refused", "routed while paused",
       "recorded while paused", "rolled_back while paused", "step due at a resume",
       "operator start", "routed in a started trial")
#: The event each operator's action makes, and the state it moves to.
OP_EVENT = {"promote": "promoted", "rollback": "rolled_back", "pause": "paused",
            "resume": "resumed", "start": "started"}
OP_STATE = {"promote": "promoted", "rollback": "rolled_back", "pause": "paused",
            "resume": "canary", "start": "canary"}


class VersionModel(ModelBackend):
    """One version's weights: ``[x, version]`` per item (the shadow: ``[x, 1]`` for an
    even ``x``); a batch holding a ``bad`` input raises. Runs inline; ``latency``
    (ticks per batch) is taken by the simulated device."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "inline"

    def __init__(self, version: int, bad: tuple[int, ...], latency: int) -> None:
        self.version = version
        self.bad = frozenset(bad)
        self.latency = latency

    def load(self, device: str, *, torch_threads: int = 1) -> Any:
        def forward(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
            xs = [int(it["x"][0]) for it in items]
            hit = [x for x in xs if x in self.bad]
            if hit:
                raise ValueError(f"planted error of version {self.version} on input {hit[0]}")
            return [{"y": np.array([x, self._tag(x)], dtype=np.float64)} for x in xs]

        return forward

    def _tag(self, x: int) -> int:
        if self.version == 3 and x % 2 == 0:
            return 1
        return self.version


def device_class(base: type) -> type:
    """The product's batcher on a simulated device: a batch first takes its version's
    latency in trio time."""

    class SimulatedDevice(base):  # type: ignore[misc, valid-type]
        async def _execute(self, batch: list[Any]) -> None:
            latency = getattr(self._backend, "latency", 0)
            if latency:
                await trio.sleep(latency * TICK)
            await super()._execute(batch)

    return SimulatedDevice


# ---------------------------------------------------------------- observing the rollout
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
        target = self.ref_canary if self.ref_state == "promoted" else self.ref_stable
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


def controller_class(base: type, run: RolloutRun) -> type:
    """The product's RolloutController, reporting to ``run``."""

    class Observed(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            run.begin(trio.current_time())

        def route(self) -> str:
            now = trio.current_time()
            call = run.task_call.get(trio.lowlevel.current_task())
            version = super().route()
            expected = run.expected_route()
            if call is None:
                run.fail("split", f"at {run.at(now)} a request outside a caller was routed")
            else:
                run.routed.setdefault(call, []).append(version)
                note("rollout", f"routed to "
                     f"{'canary' if version == run.ref_canary else 'stable'}")
            if version != expected:
                run.fail("split", f"at {run.at(now)} call #{call}'s item was routed to "
                         f"version {version}, the counter rule says {expected} ({run.ref_state}"
                         f", step {run.ref_step} at share {float(run.share()):g}, request "
                         f"{run.ref_routed} of the step)")
            return version

        def record(self, version: str, ok: bool, latency: float) -> None:
            run.on_record(version, ok)
            super().record(version, ok, latency)
            run.after_change(self.rollout, trio.current_time())

        def record_late(self, version: str) -> None:
            run.on_record(version, "late")
            super().record_late(version)
            run.after_change(self.rollout, trio.current_time())

        def _apply(self, events: list[Any]) -> None:
            run.on_events(events)
            super()._apply(events)

        def shadow_copy(self, version: str, inputs: Any, result: Any, tenant: str) -> None:
            if self.shadow is not None and version == self.rollout.stable:
                run.shadow_seen += 1
                share = Fraction(repr(run.scenario.shadow_share))
                if math.floor(run.shadow_seen * share) > len(run.shadow_sent):
                    run.shadow_sent.append((int(np.asarray(inputs["x"])[0]), version))
            super().shadow_copy(version, inputs, result, tenant)
            used = self._send.statistics().current_buffer_used
            if used > run.scenario.shadow_queue:
                run.fail("shadow", f"at {run.at(trio.current_time())} {used} copies wait "
                         f"for the shadow, over shadow_queue {run.scenario.shadow_queue}")

    return Observed


# ---------------------------------------------------------------- playing
def config_of(sc: RolloutScenario) -> trioserve.Config:
    rollout: dict[str, Any] = {
        "stable": STABLE,
        "steps": list(sc.steps),
        "step_s": sc.step_s * TICK,
        "min_requests": sc.min_requests,
        "max_error_rate": sc.max_error_rate,
        "max_latency_ratio": sc.max_latency_ratio,
    }
    if sc.canary:
        rollout["canary"] = CANARY
    if sc.shadow:
        rollout.update(shadow=SHADOW, shadow_share=sc.shadow_share,
                       shadow_queue=sc.shadow_queue)
    model = trioserve.ModelConfig(
        name="m",
        backend=VersionModel(1, (), sc.latency[0]),
        versions={
            STABLE: {},
            CANARY: {"backend": VersionModel(2, sc.bad, sc.latency[1])},
            SHADOW: {"backend": VersionModel(3, sc.shadow_bad, sc.latency[2])},
        },
        rollout=rollout,
        max_batch_size=sc.max_batch_size,
        max_wait_ms=0,
        timeout_ms=None,
        execution="inline",
        adaptive_limit=False,
    )
    # the callers' class (realtime) has the scenario's deadline; the shadow's copies
    # (the lowest class, batch) the model's: none
    realtime, batch = attrs.fields(trioserve.Config).classes.default.factory()
    if sc.timeout is not None:
        realtime = attrs.evolve(realtime, timeout_ms=sc.timeout * TICK * 1000)
    return trioserve.Config(
        models=(model,),
        classes=(realtime, batch),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        runtime=trioserve.RuntimeLimits(queue_bound=256, graceful_timeout_s=1.0),
    )


@contextlib.contextmanager
def product_installed(run: RolloutRun) -> Iterator[None]:
    """open_runtime builds its batchers and the rollout's classes from
    ``trioserve.actors``: point those names at the simulated and observed ones."""
    actors = trioserve.actors
    saved = actors.BatcherActor, actors.Rollout, actors.RolloutController
    actors.BatcherActor = device_class(run.product.batcher_class)
    actors.Rollout = run.product.rollout_class
    actors.RolloutController = controller_class(run.product.rollout_controller_class, run)
    try:
        yield
    finally:
        actors.BatcherActor, actors.Rollout, actors.RolloutController = saved


def _x(x: int) -> dict[str, np.ndarray]:
    return {"x": np.array([float(x)])}


async def _play(run: RolloutRun) -> None:
    sc = run.scenario
    before = {id(t) for t in _tasks()}

    async def caller(i: int, call: RCall, rt: trioserve.Runtime) -> None:
        await trio.sleep_until(run.t0 + call.at * TICK)
        run.task_call[trio.lowlevel.current_task()] = i
        try:
            if call.batch or len(call.xs) > 1:
                values = await rt.infer_batch("m", [_x(x) for x in call.xs],
                                              version=call.version)
            else:
                values = [await rt.infer("m", _x(call.xs[0]), version=call.version)]
            outcome: tuple[str, Any] = ("result", values)
        except Exception as exc:
            outcome = ("error", exc)
        if i in run.outcomes:
            run.fail("duplicated", f"call #{i} returned twice")
        run.outcomes[i] = outcome

    async def operator(rt: trioserve.Runtime) -> None:
        controller = rt._families["m"].controller
        for op in sc.ops:
            await trio.sleep_until(run.t0 + op.at * TICK)
            run.operate(rt, op)
            resumed = run.ref_state == "canary" and op.action == "resume"
            step = run.ref_step
            # What the action made due (a step that lasted long enough, at a
            # resume) is done at once: by the time every task waits, at this time.
            await trio.testing.wait_all_tasks_blocked()
            now = trio.current_time()
            if resumed and (run.ref_step != step or run.ref_state != "canary"):
                note("rollout", "step due at a resume")
            run.after_change(controller.rollout, now)
            run.check_events(controller.events, now)

    async with trio.open_nursery() as callers:
        with product_installed(run):
            async with trioserve.open_runtime(config_of(sc)) as rt:
                run.t0 = trio.current_time()
                for i, call in enumerate(sc.calls):
                    callers.start_soon(caller, i, call, rt)
                if sc.ops:
                    callers.start_soon(operator, rt)
                last = max([c.at for c in sc.calls] + [op.at for op in sc.ops] + [0])
                # long enough for every caller, the shadow's copies and the steps' ends
                await trio.sleep_until(run.t0 + last * TICK + HORIZON_S)
                _check_end(run, rt)
            callers.cancel_scope.cancel("fuzz: the run is over")
    if (leak := leaked_since(before)) is not None:
        run.fail("leak", leak)


def _check_end(run: RolloutRun, rt: trioserve.Runtime) -> None:
    sc = run.scenario
    now = trio.current_time()
    controller = rt._families["m"].controller
    run.after_change(controller.rollout, now)
    stats = rt.statistics()["m"]["rollout"]
    if stats["state"] != run.ref_state or stats["share"] != float(run.share()) \
            or stats["paused"] != (run.ref_state == "paused"):
        run.fail("rollout", f"at the end statistics say {stats['state']} (paused "
                 f"{stats['paused']}) at share {stats['share']:g}; the reference "
                 f"{run.ref_state} at {float(run.share()):g}")
    run.check_events(stats["events"], now)
    expected: dict[tuple[str, bool | str], int] = {}
    loose: dict[str, int] = {}
    for i, call in enumerate(sc.calls):
        _check_call(run, i, call, expected, loose)
    recorded = {k: v for k, v in run.recorded.items() if v}
    if not loose and recorded != expected:
        run.fail("rollout", f"the outcomes recorded for the rollout, (version, ok) -> n: "
                 f"{dict(sorted(recorded.items(), key=str))}; the callers' routed items "
                 f"say {dict(sorted(expected.items(), key=str))}")
    # The items of calls whose parts failed apart (only the first part's error
    # reached the caller) are each recorded once, as one of the three.
    kinds = (True, False, "late")
    for v in sorted({k[0] for k in (*recorded, *expected)} | set(loose)) if loose else ():
        got = {k: recorded.get((v, k), 0) for k in kinds}
        want = {k: expected.get((v, k), 0) for k in kinds}
        more = loose.get(v, 0)
        if sum(got.values()) != sum(want.values()) + more or any(
            not want[k] <= got[k] <= want[k] + more for k in kinds
        ):
            run.fail("rollout", f"version {v}'s outcomes recorded for the rollout "
                     f"(ok, error, late): {got}; the callers say {want} and {more} "
                     "more items, each one of the three")
    if sc.shadow:
        got = controller.shadow_results
        ran = {k: got[k] for k in ("match", "mismatch", "error", "dropped")}
        note("rollout", "shadow match", ran["match"])
        note("rollout", "shadow dropped", ran["dropped"])
        sent = run.shadow_sent
        if sum(ran.values()) != len(sent):
            run.fail("shadow", f"{len(sent)} copies sent to the shadow (share "
                     f"{sc.shadow_share:g} of {run.shadow_seen} stable answers), counted "
                     f"{ran}")
        elif not ran["dropped"]:
            # the shadow answers as stable 1 does on even inputs: a copy of another
            # stable's answer (a trial started after a promotion) never matches
            same = [x not in sc.shadow_bad and _tag(SHADOW, x) == v for x, v in sent]
            errors = sum(1 for x, _ in sent if x in sc.shadow_bad)
            want = {
                "match": sum(same),
                "mismatch": len(sent) - sum(same) - errors,
                "error": errors,
                "dropped": 0,
            }
            if ran != want:
                run.fail("shadow", f"the shadow's copies of inputs {sent} counted {ran}, "
                         f"its answers say {want}")


def _check_call(run: RolloutRun, i: int, call: RCall,
                expected: dict[tuple[str, bool | str], int], loose: dict[str, int]) -> None:
    sc = run.scenario
    what = f"call #{i} (at tick {call.at}, inputs {list(call.xs)}, version {call.version})"
    outcome = run.outcomes.get(i)
    if outcome is None:
        run.fail("lost", f"{what} never got an answer ({HORIZON_S:g} s of trio time after "
                 "the last arrival)")
        return
    routed = run.routed.get(i, [])
    if call.version is not None:
        if routed:
            run.fail("split", f"{what} named its version, but was routed to {routed}")
        versions = [call.version] * len(call.xs)
    else:
        if len(routed) != len(call.xs):
            run.fail("split", f"{what}: its {len(call.xs)} item(s) routed {len(routed)} "
                     f"time(s): {routed}")
            return
        versions = routed
        parts: dict[str, list[int]] = {}
        for x, v in zip(call.xs, versions, strict=True):
            parts.setdefault(v, []).append(x)
        kind, value = outcome
        late = isinstance(value, DeadlineExceeded)
        for v, xs in parts.items():
            ok: bool | str = not any(_bad(sc, v, x) for x in xs)
            if kind == "error" and sc.timeout is not None and len(parts) > 1:
                # one part's error reached the caller: with deadlines each part may
                # have been late, run past its deadline, failed or answered
                loose[v] = loose.get(v, 0) + len(xs)
                continue
            if late:
                ok = "late" if value.in_queue else False
                note("rollout", "late" if value.in_queue else "deadline while running")
            expected[v, ok] = expected.get((v, ok), 0) + len(xs)
    should_fail = any(_bad(sc, v, x) for x, v in zip(call.xs, versions, strict=True))
    kind, value = outcome
    if kind == "error":
        deadline = sc.timeout is not None and isinstance(value, DeadlineExceeded)
        if not deadline and (not should_fail or not isinstance(value, ModelError)):
            run.fail("outcome", f"{what}, routed to {versions}, raised {value!r}")
        return
    if should_fail:
        run.fail("outcome", f"{what}, routed to {versions}, was answered {value}: an item "
                 "of it is bad on its version")
        return
    got = [(int(v["y"][0]), str(int(v["y"][1]))) for v in value]
    want = [(x, _tag(v, x)) for x, v in zip(call.xs, versions, strict=True)]
    if got != want:
        run.fail("split", f"{what} was answered (input, version) {got}; it was routed to "
                 f"{want}")


def _tag(version: str, x: int) -> str:
    """The version an answer of ``version`` to input ``x`` names (the shadow names
    stable's for an even input, so that its copy matches)."""
    return STABLE if version == SHADOW and x % 2 == 0 else version


def _bad(sc: RolloutScenario, version: str, x: int) -> bool:
    if version == CANARY:
        return x in sc.bad
    if version == SHADOW:
        return x in sc.shadow_bad
    return False


def run_rollout_scenario(scenario: RolloutScenario, product: Product = PRODUCT) -> None:
    """Play ``scenario`` against ``product``; raise InvariantViolation on the first
    broken invariant."""
    count_example("rollout")
    raise_first(replay(_play, RolloutRun(scenario=scenario, product=product)).violations)
