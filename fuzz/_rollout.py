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
beside the product's :class:`Rollout` (fuzz/_rollout_reference.py), fed what the
runtime feeds it:

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
from trioserve import DeadlineExceeded, ModelBackend, ModelError, TensorSpec

from ._product import PRODUCT, Product
from ._rollout_reference import CANARY, SHADOW, STABLE, RolloutRun
from ._rollout_scenario import HORIZON_S, TICK, RCall, RolloutScenario
from ._rollout_scenario import rollout_scenarios as rollout_scenarios
from ._runtime import _tasks, leaked_since, raise_first, replay
from ._stats import count_example, expect, note

X = TensorSpec(name="x", datatype="FP64", shape=(-1,))
Y = TensorSpec(name="y", datatype="FP64", shape=(-1,))

expect("rollout", "step", "promoted", "rolled_back", "routed to canary",
       "shadow match", "shadow dropped", "operator promote", "operator rollback",
       "operator pause", "operator resume", "operator refused", "routed while paused",
       "recorded while paused", "rolled_back while paused", "step due at a resume",
       "operator start", "routed in a started trial", "started after a promotion",
       "routed in a trial started after a promotion")


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
