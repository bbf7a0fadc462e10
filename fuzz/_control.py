"""Suite ``control``: explicit model control (docs/model-control.md), random load /
unload / reload storms interleaved with traffic, through ``open_runtime`` under
MockClock.

A scenario serves model ``m`` (``server.model_control = "explicit"``, loaded at start
or not, one or two replicas, a latency per batch, a load of 0 to 3 ticks per replica)
to callers arriving at random times (``infer`` / ``infer_batch``, each item a
distinct input the model echoes), while
``load_model`` and ``unload_model`` are asked at random times (a load of a loaded
model is a reload). In some scenarios the tenant has credits and its class waits for
them: a caller looks the model up, waits for its credits, and only then submits, so
a reload or an unload in between hands its request over (the old queue forwards it
to the new copy's, or to the stand-in's refusal). The checks:

- ``lost`` / ``outcome`` / ``misrouted``: every call returns once, with its own inputs
  echoed, or refused exactly when the model was not loaded when it arrived, as its
  state was then (``UnknownModel`` not loaded, or unloading; ``Overloaded`` for its
  first load under way), or an unload swapped the copy out while it waited for its
  credits (then at once, as one of those); nothing else (no ``ActorClosed`` from a
  copy gone).
- ``control``: each request runs on a replica of the copy (the queue) that admitted
  it, which the request looked up or was handed to; the model's state moves are a
  legal lifecycle path, and exactly the moves of the loads and unloads in the order
  asked (two loads asked while one is under way share it, and two unloads; an
  unload asked right after a load still to end abandons it: the model's first load
  under way moves to UNLOADING then UNAVAILABLE, a reload under way back to READY
  (the loaded copy, which the unload then unloads), one still waiting for its turn
  never moves, and only such loads raise, ModelLoadError, each of them); when an
  unload ends (``unloaded``), no replica of the model is left running, of the copy
  unloaded nor of one an earlier reload replaced.
- ``leak``: no task outlives the runtime.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing
import trioserve
import trioserve._control as _control_module
import trioserve.actors
from hypothesis import strategies as st
from trioserve import ModelBackend, Overloaded, TensorSpec, UnknownModel

from ._product import PRODUCT, Product
from ._runtime import _tasks, leaked_since, raise_first, replay
from ._stats import count_example, expect, note

TICK = 2.0**-10
HORIZON_S = 3600.0
X = TensorSpec(name="x", datatype="FP64", shape=(-1,))

expect("control", "reload", "load", "unload", "not loaded", "handed over", "versions",
       "abandoned", "reload abandoned")


# ---------------------------------------------------------------- the script
@attrs.frozen(kw_only=True)
class CCall:
    """A caller at ``at`` (ticks) with ``n`` items (``infer`` for one), naming
    ``version`` (None: unversioned)."""

    at: int = 0
    n: int = 1
    version: str | None = None


@attrs.frozen(kw_only=True)
class Op:
    """``load_model`` (``load`` True) or ``unload_model`` asked at ``at`` (ticks)."""

    at: int = 0
    load: bool = True


@attrs.frozen(kw_only=True)
class ControlScenario:
    load_at_start: bool = True
    replicas: int = 1
    max_batch_size: int = 2
    latency: int = 1  # ticks per batch
    #: ticks a replica's model takes to load (0: one checkpoint), so that an op may
    #: be asked while a load, or a reload, is under way
    load_ticks: int = 0
    calls: tuple[CCall, ...] = ()
    ops: tuple[Op, ...] = ()
    #: the tenant's credits per tick (None: unlimited); its class waits for them
    credit_per_tick: float | None = None
    #: versions "1" and "2", version 2 with weights of its own: the model's copy is
    #: both versions' queues and replicas, loaded, reloaded and unloaded together
    versions: bool = False


_GAP = st.sampled_from([0, 0, 1, 1, 2, 3, 4, 8])
_EVENTS = st.lists(
    st.builds(CCall, at=_GAP, n=st.sampled_from([1, 1, 1, 2, 3]),
              version=st.sampled_from([None, None, "1", "2"]))
    | st.builds(CCall, at=_GAP, n=st.sampled_from([1, 1, 2]))
    | st.builds(Op, at=_GAP, load=st.booleans()),
    min_size=4, max_size=30,
)


@st.composite
def control_scenarios(draw: st.DrawFn) -> ControlScenario:
    at, calls, ops = 0, [], []
    for e in draw(_EVENTS):
        at += e.at
        (calls if isinstance(e, CCall) else ops).append(attrs.evolve(e, at=at))
    return ControlScenario(
        load_at_start=draw(st.booleans()),
        replicas=draw(st.integers(1, 2)),
        max_batch_size=draw(st.integers(1, 3)),
        latency=draw(st.sampled_from([0, 1, 2, 4])),
        load_ticks=draw(st.sampled_from([0, 0, 1, 3])),
        calls=tuple(calls),
        ops=tuple(ops),
        credit_per_tick=draw(st.sampled_from([None, None, 0.25, 0.5, 1.0])),
        versions=draw(st.booleans()),
    )


# ---------------------------------------------------------------- the model and observers
class Echo(ModelBackend):
    inputs = (X,)
    outputs = (X,)
    default_execution = "inline"

    def load(self, device: str, *, torch_threads: int = 1) -> Any:
        return lambda items: [{"x": it["x"]} for it in items]


#: the lifecycle of docs/model-control.md: state -> the states it may move to
LIFECYCLE = {
    "UNAVAILABLE": {"LOADING"},
    # LOADING to UNLOADING: an unload abandons the model's first load under way
    "LOADING": {"READY", "UNAVAILABLE", "UNLOADING"},
    # a reload: READY (reloading, the loaded copy serves meanwhile), then READY
    "READY": {"READY", "UNLOADING"},
    "UNLOADING": {"UNAVAILABLE"},
}


@attrs.define(eq=False)
class ControlRun:
    scenario: ControlScenario
    product: Product = PRODUCT
    t0: float = 0.0
    violations: list[tuple[str, str]] = attrs.Factory(list)
    #: input -> the scheduler that admitted it
    admitted: dict[int, Any] = attrs.Factory(dict)
    #: call number -> (loaded when it arrived, unloaded while it waited, outcome, the
    #: model's state when it arrived)
    outcomes: dict[int, tuple[bool, bool, Any, str]] = attrs.Factory(dict)
    batchers_running: int = 0
    #: the swaps of a copy for the stand-in so far (an unload's first move)
    unloads: int = 0
    moves: list[tuple[str, str]] = attrs.Factory(list)  # (state, reason), as moved
    # the reference of the ops: each op asked (not shared) and its expected moves
    state: str = "UNAVAILABLE"
    loaded: bool = False
    pending: list[list[str]] = attrs.Factory(list)  # per op: the moves still due
    last_kind: str | None = None  # of the last op asked, while it is pending
    #: the loads an unload abandoned, as the reference says (the ops' lists)
    abandoned: list[list[str]] = attrs.Factory(list)

    def at(self, t: float | None = None) -> str:
        now = trio.current_time() if t is None else t
        return f"tick {(now - self.t0) / TICK:g}"

    def fail(self, invariant: str, text: str) -> None:
        self.violations.append((invariant, text))

    def asked(self, load: bool) -> list[str]:
        """The op asked (or the one under way it shares): its moves still due."""
        kind = "load" if load else "unload"
        if self.pending and self.last_kind == kind:
            return self.pending[-1]  # shares the one under way
        if not load and self.pending and self.last_kind == "load":
            self._overtaken()
        self.last_kind = kind
        self.pending.append([kind])  # its moves are found when its turn comes
        return self.pending[-1]

    def _overtaken(self) -> None:
        """An unload asked right after a load still to end abandons it, the model's
        first load or a reload. One waiting for its turn never moves; a first load
        under way moves to UNLOADING at once, then UNAVAILABLE; a reload under way
        moves back to READY at once (the loaded copy serves until the unload's
        turn, which unloads it)."""
        load = self.pending[-1]
        if load == ["load"]:  # its turn has not come
            self.pending.pop()
        elif self.state == "LOADING":  # under way: the model's first load
            load[:] = ["", "UNLOADING", "UNAVAILABLE"]
        else:  # a reload under way: its move still due is READY, as if it had ended
            note("control", "reload abandoned")
        self.abandoned.append(load)
        note("control", "abandoned")

    def moved(self, state: str, reason: str) -> None:
        self.moves.append((state, reason))
        if state not in LIFECYCLE[self.state]:
            self.fail("control", f"at {self.at()} the model moved from {self.state} to "
                      f"{state} ({reason!r}): not a move of the lifecycle")
        # the op whose turn it is: skip unloads of a model not loaded (no moves)
        while self.pending and self.pending[0] == ["unload"] and not self.loaded:
            self._done()
        if not self.pending:
            self.fail("control", f"at {self.at()} the model moved to {state} ({reason!r}) "
                      "with no load or unload asked")
        else:
            head = self.pending[0]
            if len(head) == 1:  # its first move
                kind = head[0]
                head[:] = (["", "READY" if self.loaded else "LOADING", "READY"]
                           if kind == "load" else ["", "UNLOADING", "UNAVAILABLE"])
                if kind == "load":
                    note("control", "reload" if self.loaded else "load")
                    if self.scenario.versions:
                        note("control", "versions")
                else:
                    note("control", "unload")
            if head[1] != state:
                self.fail("control", f"at {self.at()} the model moved to {state} "
                          f"({reason!r}); the ops asked, in order, say {head[1]} next "
                          f"(moves so far {self.moves})")
            del head[1]
            if len(head) == 1:
                self.loaded = state == "READY"
                self._done()
        self.state = state
        if state == "UNLOADING":
            self.unloads += 1
        if state == "UNAVAILABLE" and reason == "unloaded" and self.batchers_running:
            self.fail("control", f"at {self.at()} the unload ended with "
                      f"{self.batchers_running} replica(s) of the model still running")

    def _done(self) -> None:
        self.pending.pop(0)
        if not self.pending:
            self.last_kind = None


def scheduler_class(base: type, run: ControlRun) -> type:
    class Observed(base):  # type: ignore[misc, valid-type]
        def _took(self, request: Any) -> None:
            run.admitted[int(request.item["x"][0])] = self

        def submit_nowait(self, request: Any) -> None:
            if self._closed and self.successor is not None:
                note("control", "handed over")
            super().submit_nowait(request)
            if not self._closed:
                self._took(request)

        def submit_all_nowait(self, requests: list[Any]) -> None:
            if self._closed and self.successor is not None:
                note("control", "handed over")
            super().submit_all_nowait(requests)
            if not self._closed:
                for r in requests:
                    self._took(r)

    return Observed


def batcher_class(base: type, run: ControlRun) -> type:
    class SimulatedDevice(base):  # type: ignore[misc, valid-type]
        async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            run.batchers_running += 1
            try:
                await super().run(task_status=task_status)
            finally:
                run.batchers_running -= 1

        async def _load(self, load: Any) -> Any:
            # the model loads inline: a thread hop under the autojumping clock would
            # let trio time run to the end of the scenario while it loads
            async def inline() -> Any:
                await trio.sleep(run.scenario.load_ticks * TICK)
                return self._load_in_thread()

            return await super()._load(inline)

        async def _execute(self, batch: list[Any]) -> None:
            for req in batch:
                x = int(req.item["x"][0])
                if run.admitted.get(x) is not self._scheduler:
                    run.fail("control", f"at {run.at()} input {x} ran on a replica of a "
                             "copy other than the one that admitted it")
            if run.scenario.latency:
                await trio.sleep(run.scenario.latency * TICK)
            await super()._execute(batch)

    return SimulatedDevice


def control_class(base: type, run: ControlRun) -> type:
    class Observed(base):  # type: ignore[misc, valid-type]
        async def load(self, model: str, config: Any = None) -> None:
            op = run.asked(True)
            try:
                await super().load(model, config)
            except trioserve.ModelLoadError as exc:
                if not any(op is o for o in run.abandoned) or not str(exc).startswith(
                    "model 'm': its load was abandoned: an unload of the model was asked"
                ):
                    run.fail("control", f"at {run.at()} a load raised {exc!r}; the ops "
                             "asked do not abandon it")
                raise
            if any(op is o for o in run.abandoned):
                run.fail("control", f"at {run.at()} a load returned (loaded); an unload "
                         "asked before it ended abandons it")

        async def unload(self, model: str) -> None:
            run.asked(False)
            await super().unload(model)

    return Observed


def entry_class(base: type, run: ControlRun) -> type:
    class ObservedEntry(base):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def move(self, to: Any, reason: str = "") -> None:
            super().move(to, reason)
            run.moved(to.value, reason)

    return ObservedEntry


@contextlib.contextmanager
def product_installed(run: ControlRun) -> Iterator[None]:
    # patched where they are looked up: ModelControl by the assembly, _Entry (defined in
    # trioserve._model_state) by ModelControl, both as trioserve._control's names
    actors, ctl = trioserve.actors, _control_module
    saved = actors.BatcherActor, actors.SchedulerActor, ctl.ModelControl, ctl._Entry
    actors.BatcherActor = batcher_class(run.product.batcher_class, run)
    actors.SchedulerActor = scheduler_class(run.product.scheduler_class, run)
    ctl.ModelControl = control_class(run.product.control_class, run)
    ctl._Entry = entry_class(saved[3], run)
    try:
        yield
    finally:
        actors.BatcherActor, actors.SchedulerActor, ctl.ModelControl, ctl._Entry = saved


def config_of(sc: ControlScenario) -> trioserve.Config:
    model = trioserve.ModelConfig(
        name="m", backend=Echo(), load_at_start=sc.load_at_start, replicas=sc.replicas,
        max_batch_size=sc.max_batch_size, max_wait_ms=0, timeout_ms=None,
        execution="inline", adaptive_limit=False,
        versions={"1": {}, "2": {"backend": Echo()}} if sc.versions else ("1",),
    )
    tenant = trioserve.TenantConfig(name="t", default=True)
    if sc.credit_per_tick is not None:
        # the batch class waits for credits (default_classes), without a deadline
        tenant = attrs.evolve(
            tenant, classes=("batch",), credit_rate=sc.credit_per_tick / TICK,
            credit_burst=1.0,
        )
    return trioserve.Config(
        models=(model,),
        tenants=(tenant,),
        runtime=trioserve.RuntimeLimits(queue_bound=256, graceful_timeout_s=1.0),
        server=trioserve.ServerConfig(model_control="explicit"),
    )


async def _play(run: ControlRun) -> None:
    sc = run.scenario
    before = {id(t) for t in _tasks()}

    async def caller(i: int, call: CCall, rt: trioserve.Runtime) -> None:
        await trio.sleep_until(run.t0 + call.at * TICK)
        xs = [i * 10 + j for j in range(call.n)]
        loaded = rt.models["m"].loaded
        state = rt.model_state("m")[0]
        unloads = run.unloads
        version = call.version if sc.versions else None
        try:
            if call.n > 1:
                got = await rt.infer_batch(
                    "m", [np.array([float(x)]) for x in xs], version=version
                )
            else:
                got = [await rt.infer("m", np.array([float(xs[0])]), version=version)]
            outcome: Any = [int(v["x"][0]) for v in got]
        except Exception as exc:
            outcome = exc
        if i in run.outcomes:
            run.fail("duplicated", f"call #{i} returned twice")
        run.outcomes[i] = (loaded, run.unloads != unloads, outcome, state)

    async def operator(op: Op, rt: trioserve.Runtime) -> None:
        await trio.sleep_until(run.t0 + op.at * TICK)
        if not op.load:
            await rt.unload_model("m")
            return
        with contextlib.suppress(trioserve.ModelLoadError):  # abandoned (checked)
            await rt.load_model("m")

    async with trio.open_nursery() as callers:
        with product_installed(run):
            async with trioserve.open_runtime(config_of(sc)) as rt:
                run.t0 = trio.current_time()
                for i, call in enumerate(sc.calls):
                    callers.start_soon(caller, i, call, rt)
                for op in sc.ops:
                    callers.start_soon(operator, op, rt)
                last = max([c.at for c in sc.calls] + [o.at for o in sc.ops] + [0])
                await trio.sleep_until(run.t0 + last * TICK + HORIZON_S)
                while run.pending and run.pending[0] == ["unload"] and not run.loaded:
                    run._done()  # an unload of a model not loaded: no moves
                if run.pending:
                    run.fail("control", f"at the end ops asked are still due: {run.pending}")
                if not run.loaded and run.batchers_running:
                    run.fail("control", f"at the end the model is unloaded and "
                             f"{run.batchers_running} replica(s) still run")
            callers.cancel_scope.cancel("fuzz: the run is over")
    for i, call in enumerate(sc.calls):
        _check_call(run, i, call)
    if (leak := leaked_since(before)) is not None:
        run.fail("leak", leak)


def _check_call(run: ControlRun, i: int, call: CCall) -> None:
    what = f"call #{i} (at tick {call.at}, {call.n} item(s))"
    if i not in run.outcomes:
        run.fail("lost", f"{what} never got an answer")
        return
    loaded, unloaded, outcome, state = run.outcomes[i]
    xs = [i * 10 + j for j in range(call.n)]
    if isinstance(outcome, BaseException):
        # refused as not loaded: the model was not loaded when the call looked it up
        # (told as its state was), or an unload swapped its copy out while the call
        # waited for its credits (told as the state is then: unloading, mostly)
        said = _refused_as(outcome)
        if not loaded:
            refused = said == state
        else:
            refused = (
                unloaded and run.scenario.credit_per_tick is not None and said is not None
            )
        if not refused:
            run.fail("outcome", f"{what}, the model {'' if loaded else 'not '}loaded when "
                     f"it arrived, raised {outcome!r}")
        else:
            note("control", "not loaded")
    elif not loaded:
        run.fail("outcome", f"{what} arrived while the model was not loaded, and was "
                 f"answered {outcome}")
    elif outcome != xs:
        run.fail("misrouted", f"{what} sent {xs} and was answered {outcome}")


def _refused_as(outcome: BaseException) -> str | None:
    """The model's state a refusal of a model not loaded says (None: not one)."""
    text = str(outcome)
    if isinstance(outcome, UnknownModel) and "' is not loaded (" in text:
        return "UNAVAILABLE"
    if isinstance(outcome, UnknownModel) and "' is unloading: " in text:
        return "UNLOADING"
    if isinstance(outcome, Overloaded) and "' is loading: " in text:
        return "LOADING"
    return None


def run_control_scenario(scenario: ControlScenario, product: Product = PRODUCT) -> None:
    """Play ``scenario`` against ``product``; raise InvariantViolation on the first
    broken invariant."""
    count_example("control")
    raise_first(replay(_play, ControlRun(scenario=scenario, product=product)).violations)
