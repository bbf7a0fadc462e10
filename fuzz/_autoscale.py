"""Suite ``autoscale``: an autoscaled model (docs/faults.md, "Autoscaling") through
``open_runtime`` under MockClock.

A scenario serves model ``m`` with ``[models.m.autoscaling]`` (random bounds, target,
delays, ``look_back_s`` and interval) to callers whose load comes in bursts, steps and
idle spells (each item a distinct input the model echoes, each batch taking a random
number of ticks). The replicas the autoscaler adds take a random time to load, and
some fail to; the runtime is shut down at a random time, possibly while replicas
load. The checks:

- ``lost`` / ``duplicated`` / ``misrouted`` / ``outcome``: every call returns once,
  with its own inputs echoed, or ``ActorClosed`` only once shutdown began;
- ``scaling``: the replicas serving (one starting counted, one retiring not) stay in
  [``min_replicas``, ``max_replicas``] at every look and every replica start; every
  look's decision is the one of a reference of the documented rule fed the same load
  and count (the window's mean over ``look_back_s``, ceil(mean / target) within the
  bounds, up once every look asked for more for ``upscale_delay_s``, to the last
  look's count, down once every look asked for fewer for ``downscale_delay_s``, to the
  most any of them asked for; a failed start waits its delay again); no replica is
  started once shutdown began, and none runs once the runtime is closed;
- ``leak``: no task outlives the runtime.
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
from hypothesis import strategies as st
from trioserve import ActorClosed, ModelBackend, TensorSpec
from trioserve.actors._scaling import serves

from ._product import PRODUCT, Product
from ._runtime import _tasks, leaked_since, raise_first, replay
from ._stats import count_example, expect, note

TICK = 0.25  # trio seconds
X = TensorSpec(name="x", datatype="FP64", shape=(-1,))

expect("autoscale", "up", "down", "start failed", "started", "shutdown mid-start",
       "window mean", "retired busy")


# ---------------------------------------------------------------- the script
@attrs.frozen(kw_only=True)
class ACall:
    """A caller at ``at`` (ticks) with ``n`` items (``infer`` for one)."""

    at: int = 0
    n: int = 1


@attrs.frozen(kw_only=True)
class Start:
    """How an added replica's load goes: ``ticks`` long, then it fails or not."""

    ticks: int = 0
    fails: bool = False


@attrs.frozen(kw_only=True)
class AutoscaleScenario:
    min_replicas: int = 1
    max_replicas: int = 2
    initial: int = 1  # replicas at start, in [min, max]
    target: int = 2
    upscale_delay_s: float = 1.0
    downscale_delay_s: float = 2.0
    interval_s: float = 0.5
    look_back_s: float | None = None
    devices: int = 1
    max_batch_size: int = 2
    latency: int = 1  # ticks per batch
    #: the added replicas' loads, in the order they are started (then: at once, sound)
    starts: tuple[Start, ...] = ()
    calls: tuple[ACall, ...] = ()
    #: ticks after the last call at which the runtime shuts down (negative: before
    #: it, and the calls from then on never come; None: once it could have scaled
    #: back down)
    shutdown_after: int | None = None


_SEGMENT = st.tuples(
    st.sampled_from([0, 0, 1, 2, 4, 8, 16, 40]),  # idle before it (ticks)
    st.integers(1, 12),  # calls
    st.sampled_from([0, 0, 1, 1, 2, 4]),  # ticks between them (0: a burst)
    st.sampled_from([1, 1, 1, 2, 3]),  # items per call
)
_SEGMENTS = st.lists(_SEGMENT, min_size=1, max_size=5)
_STARTS = st.lists(
    st.builds(Start, ticks=st.sampled_from([0, 1, 2, 4, 8, 16, 32]),
              fails=st.sampled_from([False, False, False, True])),
    max_size=8,
)


@st.composite
def autoscale_scenarios(draw: st.DrawFn) -> AutoscaleScenario:
    lo = draw(st.integers(1, 2))
    hi = draw(st.integers(lo, 4))
    at, calls = 0, []
    for idle, count, spacing, n in draw(_SEGMENTS):
        at += idle
        for _ in range(count):
            calls.append(ACall(at=at, n=n))
            at += spacing
    return AutoscaleScenario(
        min_replicas=lo,
        max_replicas=hi,
        initial=draw(st.integers(lo, hi)),
        target=draw(st.integers(1, 4)),
        upscale_delay_s=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0])),
        downscale_delay_s=draw(st.sampled_from([0.0, 1.0, 2.0, 4.0, 8.0])),
        interval_s=draw(st.sampled_from([0.25, 0.5, 1.0])),
        look_back_s=draw(st.sampled_from([None, 0.0, 0.5, 1.0, 2.0, 4.0])),
        devices=draw(st.integers(1, 2)),
        max_batch_size=draw(st.integers(1, 4)),
        latency=draw(st.sampled_from([1, 2, 4])),
        starts=tuple(draw(_STARTS)),
        calls=tuple(calls),
        shutdown_after=draw(st.one_of(st.none(), st.integers(-24, 24))),
    )


# ---------------------------------------------------------------- the reference rule
@attrs.define(eq=False)
class ReferenceScaler:
    """The rule of docs/faults.md ("Autoscaling"), in exact arithmetic, written
    apart from ``Autoscaler``: fed the same looks, it must decide the same."""

    minimum: int
    maximum: int
    target: Fraction
    up: float
    down: float
    interval: float
    look_back: float
    next_look: float
    samples: list[tuple[float, Fraction]] = attrs.Factory(list)
    above_since: float | None = None
    below_since: float | None = None
    below_peak: int = 0

    def mean(self, now: float, load: Fraction) -> Fraction:
        self.samples = [(t, x) for t, x in self.samples if now - t < self.look_back]
        self.samples.append((now, load))
        return Fraction(sum(x for _, x in self.samples), len(self.samples))

    def decide(self, now: float, load: Fraction, current: int) -> tuple[int, Fraction | None]:
        if now < self.next_look:
            return current, None
        self.next_look = now + self.interval
        mean = self.mean(now, load)
        want = math.ceil(mean / self.target) if mean > 0 else 0
        want = min(self.maximum, max(self.minimum, want))
        if want > current:
            self.below_since = None
            if self.above_since is None:
                self.above_since = now
            if now - self.above_since >= self.up:
                self.above_since = None
                return want, mean
            return current, mean
        if want < current:
            self.above_since = None
            if self.below_since is None:
                self.below_since, self.below_peak = now, want
            self.below_peak = max(self.below_peak, want)
            if now - self.below_since >= self.down:
                self.below_since = None
                return self.below_peak, mean
            return current, mean
        self.above_since = self.below_since = None
        return current, mean

    def failed(self) -> None:
        self.above_since = self.below_since = None


# ---------------------------------------------------------------- the model and observers
class Echo(ModelBackend):
    inputs = (X,)
    outputs = (X,)
    default_execution = "inline"

    def load(self, device: str, *, torch_threads: int = 1) -> Any:
        return lambda items: [{"x": it["x"]} for it in items]


@attrs.define(eq=False)
class AutoscaleRun:
    scenario: AutoscaleScenario
    product: Product = PRODUCT
    t0: float = 0.0
    violations: list[tuple[str, str]] = attrs.Factory(list)
    outcomes: dict[int, tuple[float, Any]] = attrs.Factory(dict)  # call -> (when, outcome)
    started_calls: set[int] = attrs.Factory(set)
    closing_at: float | None = None
    running: int = 0  # replicas whose run has not returned
    added: int = 0  # replicas the autoscaler asked to start
    controller: Any = None

    def at(self) -> str:
        return f"tick {(trio.current_time() - self.t0) / TICK:g}"

    def fail(self, invariant: str, text: str) -> None:
        self.violations.append((invariant, text))

    def check_count(self, where: str) -> None:
        """The replicas serving, starting ones counted, within the bounds (until
        shutdown began: the runtime then stops them all, a look under way included)."""
        c = self.controller
        if c is None or self.closing_at is not None:
            return
        sc = self.scenario
        n = sum(1 for b in c._served.batchers if serves(b))
        if not sc.min_replicas <= n <= sc.max_replicas:
            health = [b.health for b in c._served.batchers]
            self.fail("scaling", f"at {self.at()} ({where}) {n} replicas serve, outside "
                      f"[{sc.min_replicas}, {sc.max_replicas}] (replicas: {health})")


def autoscaler_class(base: type, run: AutoscaleRun) -> type:
    class Observed(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.reference = ReferenceScaler(
                minimum=kw["minimum"], maximum=kw["maximum"], target=Fraction(kw["target"]),
                up=kw["upscale_delay"], down=kw["downscale_delay"],
                interval=kw["interval"], look_back=kw["look_back"],
                next_look=kw["now"],
            )

        def decide(self, now: float, *, load: float, current: int) -> int:
            got = super().decide(now, load=load, current=current)
            want, mean = self.reference.decide(now, Fraction(load), current)
            if got != want:
                samples = [((t - run.t0) / TICK, float(x)) for t, x in self.reference.samples]
                run.fail("scaling", f"at {run.at()} a look at load {load:g} with {current} "
                         f"replicas serving decided {got}; the rule says {want} (the "
                         f"window's mean {mean}, samples "
                         f"(tick, load) {samples})")
            if mean is not None and len({x for _, x in self.reference.samples}) > 1:
                note("autoscale", "window mean")
            return got

        def failed(self) -> None:
            super().failed()
            self.reference.failed()

    return Observed


def controller_class(base: type, run: AutoscaleRun) -> type:
    class Observed(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kw: Any) -> None:
            start = kw["start_replica"]

            async def start_replica(index: int, device: str) -> Any:
                if run.closing_at is not None:
                    run.fail("scaling", f"at {run.at()} replica {index} was started after "
                             "shutdown began")
                run.added += 1
                return await start(index, device)

            kw["start_replica"] = start_replica
            super().__init__(**kw)
            run.controller = self

        async def _look(self, nursery: trio.Nursery) -> None:
            run.check_count("before a look")
            before = self.scaler.decisions.copy()
            busy = [b for b in self._served.batchers if serves(b) and not b.idle]
            await super()._look(nursery)
            if self.scaler.decisions["up"] > before["up"]:
                note("autoscale", "up")
            if self.scaler.decisions["down"] > before["down"]:
                note("autoscale", "down")
                if any(b.retiring for b in busy):
                    note("autoscale", "retired busy")
            run.check_count("after a look")

    return Observed


def batcher_class(base: type, run: AutoscaleRun) -> type:
    class SimulatedDevice(base):  # type: ignore[misc, valid-type]
        async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            run.running += 1
            run.check_count(f"replica {self.index} starts")
            try:
                await super().run(task_status=task_status)
            finally:
                run.running -= 1

        async def _load(self, load: Any) -> Any:
            sc = run.scenario
            k = self.index - sc.initial
            start = sc.starts[k] if 0 <= k < len(sc.starts) else Start()

            async def inline() -> Any:
                # inline: a thread hop under the autojumping clock would let trio
                # time run on while it loads
                await trio.sleep(start.ticks * TICK)
                if start.fails:
                    note("autoscale", "start failed")
                    raise RuntimeError(f"planted: replica {self.index} cannot load")
                if k >= 0:
                    note("autoscale", "started")
                return self._load_in_thread()

            try:
                return await super()._load(inline)
            except trio.Cancelled:
                if run.closing_at is not None:
                    note("autoscale", "shutdown mid-start")
                raise

        async def _execute(self, batch: list[Any]) -> None:
            await trio.sleep(run.scenario.latency * TICK)
            await super()._execute(batch)

    return SimulatedDevice


@contextlib.contextmanager
def product_installed(run: AutoscaleRun) -> Iterator[None]:
    actors = trioserve.actors
    saved = actors.BatcherActor, actors.Autoscaler, actors.ScalingController
    actors.BatcherActor = batcher_class(run.product.batcher_class, run)
    actors.Autoscaler = autoscaler_class(run.product.autoscaler_class, run)
    actors.ScalingController = controller_class(run.product.scaling_controller_class, run)
    try:
        yield
    finally:
        actors.BatcherActor, actors.Autoscaler, actors.ScalingController = saved


def config_of(sc: AutoscaleScenario) -> trioserve.Config:
    model = trioserve.ModelConfig(
        name="m", backend=Echo(), replicas=sc.initial,
        devices=tuple(f"cpu:{i}" for i in range(sc.devices)),
        max_batch_size=sc.max_batch_size, max_wait_ms=0, timeout_ms=None,
        execution="inline", adaptive_limit=False,
        autoscaling=trioserve.AutoscalingConfig(
            min_replicas=sc.min_replicas, max_replicas=sc.max_replicas,
            target_queued_per_replica=sc.target, upscale_delay_s=sc.upscale_delay_s,
            downscale_delay_s=sc.downscale_delay_s, interval_s=sc.interval_s,
            look_back_s=sc.look_back_s,
        ),
    )
    return trioserve.Config(
        models=(model,),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        runtime=trioserve.RuntimeLimits(queue_bound=1024, graceful_timeout_s=1.0),
    )


def _end(sc: AutoscaleScenario) -> int:
    """The tick at which the runtime shuts down."""
    last = max([c.at for c in sc.calls] + [0])
    if sc.shutdown_after is not None:
        return max(1, last + sc.shutdown_after)
    window = sc.look_back_s if sc.look_back_s is not None else sc.upscale_delay_s
    work = sum(c.n for c in sc.calls) * sc.latency  # at most, one replica
    tail = work * TICK + window + sc.downscale_delay_s + 3 * sc.interval_s + 4.0
    return last + math.ceil(tail / TICK)


async def _play(run: AutoscaleRun) -> None:
    sc = run.scenario
    before = {id(t) for t in _tasks()}
    end = _end(sc)

    async def caller(i: int, call: ACall, rt: trioserve.Runtime) -> None:
        await trio.sleep_until(run.t0 + call.at * TICK)
        if run.closing_at is not None:
            return
        run.started_calls.add(i)
        xs = [i * 10 + j for j in range(call.n)]
        try:
            if call.n > 1:
                got = await rt.infer_batch("m", [np.array([float(x)]) for x in xs])
            else:
                got = [await rt.infer("m", np.array([float(xs[0])]))]
            outcome: Any = [int(v["x"][0]) for v in got]
        except Exception as exc:
            outcome = exc
        if i in run.outcomes:
            run.fail("duplicated", f"call #{i} returned twice")
        run.outcomes[i] = (trio.current_time(), outcome)

    async with trio.open_nursery() as callers:
        with product_installed(run):
            async with trioserve.open_runtime(config_of(sc)) as rt:
                run.t0 = trio.current_time()
                for i, call in enumerate(sc.calls):
                    if call.at < end:
                        callers.start_soon(caller, i, call, rt)
                await trio.sleep_until(run.t0 + end * TICK)
                run.closing_at = trio.current_time()
            if run.running:
                run.fail("scaling", f"at {run.at()} the runtime closed with {run.running} "
                         "replica(s) still running")
        await trio.testing.wait_all_tasks_blocked()
        callers.cancel_scope.cancel("fuzz: the run is over")
    for i, call in enumerate(sc.calls):
        if i in run.started_calls:
            _check_call(run, i, call)
    if (leak := leaked_since(before)) is not None:
        run.fail("leak", leak)


def _check_call(run: AutoscaleRun, i: int, call: ACall) -> None:
    what = f"call #{i} (at tick {call.at}, {call.n} item(s))"
    if i not in run.outcomes:
        run.fail("lost", f"{what} never got an answer")
        return
    when, outcome = run.outcomes[i]
    xs = [i * 10 + j for j in range(call.n)]
    if isinstance(outcome, BaseException):
        closing = run.closing_at
        if not isinstance(outcome, ActorClosed) or closing is None or when < closing:
            run.fail("outcome", f"{what} raised {outcome!r} at tick "
                     f"{(when - run.t0) / TICK:g} (shutdown began at "
                     f"{None if closing is None else (closing - run.t0) / TICK:g})")
    elif outcome != xs:
        run.fail("misrouted", f"{what} sent {xs} and was answered {outcome}")


def run_autoscale_scenario(scenario: AutoscaleScenario, product: Product = PRODUCT) -> None:
    """Play ``scenario`` against ``product``; raise InvariantViolation on the first
    broken invariant."""
    count_example("autoscale")
    raise_first(replay(_play, AutoscaleRun(scenario=scenario, product=product)).violations)
