"""Suite ``runtime``: whole scenarios through ``open_runtime`` under MockClock.

A :class:`Scenario` is a script: a config (model limits, replicas, classes with aging,
timeouts and over-quota policies, tenants with weights, credits and queue shares, the
queue bound, the shutdown grace) and a list of calls (arrival time, tenant, class, items
with costs, model latencies, stragglers, model errors and replica crashes, caller
cancellations by deadline or by ``cancel()``), optionally cut short by an early
shutdown. :func:`run_scenario` plays it in ``trio.run`` with
``MockClock(autojump_threshold=0)``, so a scenario replays exactly, and checks:

- the queue's invariants (QueueObserver on the runtime's own FairQueue): FIFO per flow,
  batch budgets, deadlines, aging, the fair-share lag, bounded queue, nothing dispatched
  twice or lost between the queue and a batcher;
- every batch a replica starts, fresh or handed back for a retry: within the budgets,
  nothing in it past its deadline; an item runs again only after a batch whose model
  raised (the batch is split and retried);
- every caller gets exactly one outcome, one its situation allows (a result only if
  the last batch of each of its items succeeded; ModelError only for an input that
  raises — model errors reach only their own input; ActorBroken only if its batch
  crashed the replica; DeadlineExceeded only after its timeout; ActorClosed only after
  shutdown began; a cancelled caller returns exactly at its cancel time ...);
- each result is the caller's own output, in the order it submitted its items;
- credits: a tenant's admitted cost stays within burst + rate × elapsed;
- no task outlives the runtime.

The suite is four modules: the scenario and its strategies (``fuzz/_scenario.py``),
the model and the simulated device (``fuzz/_device.py``: a batch's latency in trio
time, crashes, a worker's pipeline), playing a scenario through ``open_runtime``
(this module: :func:`play`, :func:`run_scenario`) and the checks of what happened
(``fuzz/_runtime_checks.py``).
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Iterator
from typing import Any

import attrs
import trio
import trio.testing
import trioserve
import trioserve._front as _front
import trioserve._many as _many
import trioserve._runtime as _assembly
import trioserve.actors
from hypothesis.internal.entropy import deterministic_PRNG

from ._checker import InvariantViolation, QueueObserver, batch_cost
from ._crashes import watch_crashes
from ._device import EchoModel, Execution, batcher_class, item_input, item_key, part_id
from ._driven import NoZygote, watchdog_class
from ._product import PRODUCT, Product, observed_queue_class
from ._replicas import Replicas, scheduler_class
from ._runtime_checks import check
from ._scenario import HORIZON_S, MS, Call, Item, Scenario
from ._scenario import scenarios as scenarios
from ._stats import count_example, expect

expect(
    "runtime",
    "oversize: items run in parts",
    "pipeline: batches pulled while another was in flight",
    "running: scenarios",
    "running: DeadlineExceeded while the batch ran",
    "running: late answers skipped",
    "running: batches staged behind another",
    "running: batches handed back with requests answered",
    "replica batches: killed",
    "replica batches: died",
    "replica batches: returned",
    "running: workers dead after writing results",
    "running: results read from a dead worker's pipe",
    "running: workers dead while a batch was sent",
    "running: stragglers cut off as they wrote their result",
    "running: results read from a cut-off worker's pipe",
    "running: batches after a written result begun",
    "running: batches after a written result never read",
    "running: batches after a written result not known if read",
)


# ---------------------------------------------------------------- one run
@attrs.define(eq=False)
class Outcome:
    kind: str  # "result", "error", "cancelled"
    value: Any
    at: float


@attrs.define(eq=False)
class Run:
    scenario: Scenario
    product: Product
    items: dict[int, tuple[int, Item]] = attrs.Factory(dict)  # key -> (call index, item)
    outcomes: dict[int, Outcome] = attrs.Factory(dict)
    executions: list[Execution] = attrs.Factory(list)
    current: Execution | None = None
    violations: list[tuple[str, str]] = attrs.Factory(list)
    queues: list[Any] = attrs.Factory(list)
    #: the queue of each lane: "fast" (the model's own) and, with a slow lane, "slow"
    lanes: dict[str, Any] = attrs.Factory(dict)
    t0: float = 0.0
    credits_used: dict[str, float] = attrs.Factory(dict)
    shutdown_at: float = math.inf
    end: float = 0.0
    replicas: Replicas = attrs.field(init=False)
    #: model calls per replica (a flaky replica succeeds on every n-th)
    model_calls: collections.Counter[int] = attrs.Factory(collections.Counter)
    #: the scheduler class open_runtime is to build (the product's, observed)
    scheduler_class: type | None = None
    #: with ``Scenario.running``: the runtime's watchdog, on trio's clock
    watchdog: Any = None
    #: with ``Scenario.running``: the "crash" items whose one worker death
    #: (after writing, or while sent: ``fuzz._device.death_of``) was planted
    deaths: set[int] = attrs.Factory(set)
    #: with ``Scenario.running``: per reply (by id), how often its caller's credits
    #: were refunded for it as never run (``_refund_if_unrun``), and the reply
    refunds: dict[int, list[Any]] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        self.replicas = Replicas(
            lane_of=self.lane_of_replica, breakers=not self.scenario.running
        )

    def replica_delay(self, index: int) -> int:
        delays = self.scenario.replica_delay_ms
        return delays[index] if index < len(delays) else 0

    def broken_at(self, index: int, now: float) -> bool:
        """Whether replica ``index``'s model raises on its call now (each call
        counts, for a flaky spell)."""
        self.model_calls[index] += 1
        n = self.model_calls[index]
        for b in self.scenario.broken:
            if b.replica != index or now < self.t0 + b.from_ms * MS:
                continue
            if (b.until_ms is None or now < self.t0 + b.until_ms * MS) and (
                b.every == 1 or n % b.every
            ):
                return True
        return False

    def check_started(self, ex: Execution, batch: list[Any]) -> None:
        """A replica starts ``batch``: within the budgets, nothing past its deadline."""
        sc = self.scenario
        if len(batch) > sc.max_batch_size:
            self.violations.append(
                (
                    "batch-budget",
                    f"replica {ex.replica} started a batch of {len(batch)} at t={ex.at:.6g}, "
                    f"over max_batch_size {sc.max_batch_size}",
                )
            )
        costs = [req.cost for req in batch]
        cost = batch_cost(costs, sc.padded)
        if sc.max_batch_tokens is not None and cost > sc.max_batch_tokens and len(batch) > 1:
            self.violations.append(
                (
                    "batch-budget",
                    f"replica {ex.replica} started a batch costing {cost} (costs {costs}) at "
                    f"t={ex.at:.6g}, over max_batch_tokens {sc.max_batch_tokens}",
                )
            )
        lane = self.lane_of_replica(ex.replica)
        for req, p in zip(batch, ex.parts, strict=True):
            if self.lane_of_cost(req.cost) != lane:
                self.violations.append(
                    (
                        "lane",
                        f"replica {ex.replica} of the {lane} lane started item {p[0]} (part "
                        f"at {p[1]}, cost {req.cost}) at t={ex.at:.6g}: slow_lane_cost is "
                        f"{self.scenario.slow_lane_cost}",
                    )
                )
            if req.deadline <= ex.at:
                self.violations.append(
                    (
                        "deadline",
                        f"replica {ex.replica} started item {p[0]} (part at {p[1]}) at "
                        f"t={ex.at:.6g}, {ex.at - req.deadline:.6g}s after its deadline",
                    )
                )

    def check_attempts(self, ex: Execution, batch: list[Any]) -> None:
        """On a worker (``Scenario.running``), as ``batch`` starts: each request has
        counted (``Reply.attempts``) exactly the poison attempts it made, the batches
        it failed alone in: cut off, or its worker dead running them. A batch handed
        back unsent, or staged behind, never ran: no attempt, whatever took its
        worker (one being sent as its worker died included)."""
        for k, req in zip(ex.keys, batch, strict=True):
            made = [
                e for e in self.executions
                if e.status in ("killed", "died") and k in e.keys
                and sum(e.answerable) == 1 and e.answerable[e.keys.index(k)]
            ]
            if req.reply.attempts != len(made):
                self.violations.append((
                    "outcome",
                    f"item {k[0]} (part at {k[1]}) started on replica {ex.replica} at "
                    f"t={ex.at:.6g} having counted {req.reply.attempts} poison "
                    f"attempt(s); it failed alone in {len(made)} batch(es) (cut off, or "
                    f"its worker dead running them): "
                    f"{[(f'{e.at:.6g}', e.status) for e in made]}; its batches: "
                    f"{[(f'{e.at:.6g}', e.status) for e in self.executions if k in e.keys]}",
                ))

    def check_never_reached(self, held: list[Execution]) -> None:
        """On a worker (``Scenario.running``), once its replica handed back the
        batches it was killed holding (lost, or replaced): one that never reached
        its device (staged behind, being sent, or not read whole: its pipe said
        so, ``never_read``) is not charged: a request of it is marked as having run
        (``Reply.ran``: its caller, leaving, not refunded) only when a batch
        holding it reached a device before."""
        for ex in held:
            if ex.reached:
                continue
            for k, req in zip(ex.keys, ex.reqs, strict=True):
                ran = [
                    e for e in self.executions
                    if e.reached and any(r.reply is req.reply for r in e.reqs)
                ]
                if req.reply.ran and not ran:
                    self.violations.append((
                        "outcome",
                        f"item {k[0]} (part at {k[1]}) was charged as having run "
                        f"(Reply.ran) when its worker on replica {ex.replica} was lost "
                        f"or replaced at t={ex.end:.6g}, though its batch (started at "
                        f"t={ex.at:.6g}, {ex.status}) never reached the device, nor "
                        "did any batch holding it before",
                    ))

    def fault(self, key: int) -> str | None:
        return self.items[key][1].fault

    def latency(self, key: int) -> int:
        return self.items[key][1].latency_ms

    def lane_of_cost(self, cost: int) -> str:
        slow = self.scenario.slow_lane_cost
        return "slow" if slow is not None and cost >= slow else "fast"

    def lane_of_replica(self, index: int) -> str:
        sc = self.scenario
        if sc.slow_lane_cost is not None and index >= sc.replicas - sc.slow_lane_replicas:
            return "slow"
        return "fast"

    @property
    def observers(self) -> list[QueueObserver]:
        """The observers of the lanes' queues, the fast lane's first."""
        return [q.observer for q in self.lanes.values()]


def config_of(sc: Scenario, run: Run) -> trioserve.Config:
    classes = tuple(
        trioserve.ClassConfig(
            name=f"c{i}",
            max_queue_wait_ms=c.aging_ms,
            timeout_ms=c.timeout_ms,
            over_quota=c.over_quota,
        )
        for i, c in enumerate(sc.classes)
    )
    tenants = tuple(
        trioserve.TenantConfig(
            name=f"t{i}",
            default=i == 0,
            weight=t.weight,
            classes=tuple(f"c{c}" for c in t.classes),
            credit_rate=t.credit_rate,
            credit_burst=t.credit_burst,
            queue_share=t.queue_share,
        )
        for i, t in enumerate(sc.tenants)
    )
    model = trioserve.ModelConfig(
        name="m",
        backend=EchoModel(run, padded=sc.padded),
        replicas=sc.replicas,
        slow_lane_cost=sc.slow_lane_cost,
        slow_lane_replicas=sc.slow_lane_replicas,
        max_batch_size=sc.max_batch_size,
        max_batch_tokens=sc.max_batch_tokens,
        max_wait_ms=sc.max_wait_ms,
        oversize=sc.oversize,
        timeout_ms=sc.timeout_ms,
        execution="process" if sc.running else "inline",
        # (running: a batch is cut off at cut_off_ms, whatever the batches before took)
        batch_timeout_floor_ms=sc.cut_off_ms,
        batch_timeout_cap_ms=sc.cut_off_ms,
        adaptive_limit=sc.adaptive,
        hedge=sc.hedge_after_ms is not None,
        hedge_after_ms=sc.hedge_after_ms,
    )
    return trioserve.Config(
        models=(model,),
        tenants=tenants,
        classes=classes,
        runtime=trioserve.RuntimeLimits(
            queue_bound=sc.queue_bound,
            restart_intensity=10_000,
            restart_period_s=1.0,
            graceful_timeout_s=sc.graceful_ms * MS,
        ),
    )


@contextlib.contextmanager
def product_installed(run: Run) -> Iterator[None]:
    """open_runtime builds its queues and batchers from ``trioserve.actors``, and its
    Runtime from ``trioserve._runtime.Runtime``: point those names at the observed
    product (or planted-bug) classes while it starts."""
    actors = trioserve.actors
    saved = (
        actors.FairQueue, actors.BatcherActor, actors.SchedulerActor, actors.Breaker,
        _assembly.Runtime, actors.Watchdog, _assembly.Zygote,
    )
    actors.FairQueue = observed_queue_class(run.product.queue_class, run.queues.append)
    actors.BatcherActor = batcher_class(run.product.batcher_class, run)
    run.scheduler_class = scheduler_class(
        run.product.scheduler_class, run.replicas, lambda req: part_id(req.item["x"])
    )
    actors.SchedulerActor = run.scheduler_class
    actors.Breaker = run.product.breaker_class
    _assembly.Runtime = run.product.runtime_class
    refund_if_unrun = _front._refund_if_unrun
    if run.scenario.running:
        # worker processes in trio time, and a watchdog on trio's clock
        actors.Watchdog = watchdog_class(run)
        _assembly.Zygote = NoZygote
        _front._refund_if_unrun = _many._refund_if_unrun = _refunds_noted(
            run, refund_if_unrun
        )
    try:
        yield
    finally:
        (
            actors.FairQueue, actors.BatcherActor, actors.SchedulerActor, actors.Breaker,
            _assembly.Runtime, actors.Watchdog, _assembly.Zygote,
        ) = saved
        _front._refund_if_unrun = _many._refund_if_unrun = refund_if_unrun


def _refunds_noted(run: Run, refund_if_unrun: Any) -> Any:
    """The runtime's ``_refund_if_unrun`` (a caller that left is refunded when its
    request never ran), noting each refund it makes against the replies it was
    for (``Run.refunds``)."""

    def noted(replies: Any, refund: Any, taken: Any = ()) -> None:
        def told() -> None:
            for reply in replies:
                run.refunds.setdefault(id(reply), [reply, 0])[1] += 1
            refund()

        refund_if_unrun(replies, told, taken)

    return noted


def _lanes(run: Run, rt: trioserve.Runtime) -> dict[str, Any]:
    """The observed queue of each lane of the runtime's model "m"."""
    served = rt.models["m"]
    lanes = {"fast": served.scheduler.policy}
    if served.slow_scheduler is not None:
        lanes["slow"] = served.slow_scheduler.policy
    schedulers = [served.scheduler, served.slow_scheduler]
    if type(rt) is not run.product.runtime_class or not all(
        any(q is mine for mine in run.queues) for q in lanes.values()
    ) or any(s is not None and type(s) is not run.scheduler_class for s in schedulers) or any(
        type(b._breaker) is not run.product.breaker_class for b in served.batchers
    ):
        raise RuntimeError(
            "fuzz: open_runtime did not build its Runtime, its lanes' queues and schedulers "
            "or its breakers from the names fuzz/_runtime.py:product_installed replaces; "
            "update it"
        )
    return lanes


def _tasks() -> list[trio.lowlevel.Task]:
    out: list[trio.lowlevel.Task] = []
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        out.append(task)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return out


def leaked_since(before: set[int]) -> str | None:
    """The tasks running now that were not in ``before`` (their ids), in words: what
    outlived the runtime; None when nothing did."""
    leaked = [t for t in _tasks() if id(t) not in before]
    if not leaked:
        return None
    return f"{len(leaked)} task(s) outlived the runtime: " + ", ".join(
        sorted(t.name for t in leaked)
    )


async def _play(run: Run) -> None:
    sc = run.scenario
    cfg = config_of(sc, run)
    before = {id(t) for t in _tasks()}
    done = trio.Event()
    left = len(sc.calls)

    async def caller(i: int, call: Call, rt: trioserve.Runtime, nursery: trio.Nursery) -> None:
        nonlocal left
        await trio.sleep_until(run.t0 + call.at_ms * MS)
        tenant = f"t{call.tenant}"
        cls = None if call.cls is None else f"c{call.cls}"
        inputs = [item_input(item_key(i, j), it.cost) for j, it in enumerate(call.items)]
        result: Outcome | None = None
        with trio.CancelScope() as scope:
            if call.cancel_ms is not None:
                when = trio.current_time() + call.cancel_ms * MS
                if call.cancel_how == "deadline":
                    scope.deadline = when
                else:
                    nursery.start_soon(_cancel_at, scope, when)
            try:
                if len(inputs) == 1:
                    value: Any = await rt.infer("m", inputs[0], tenant=tenant, priority=cls)
                else:
                    value = await rt.infer_batch("m", inputs, tenant=tenant, priority=cls)
                result = Outcome("result", value, trio.current_time())
            except Exception as exc:
                result = Outcome("error", exc, trio.current_time())
        if scope.cancelled_caught:
            result = Outcome("cancelled", None, trio.current_time())
        assert result is not None
        run.outcomes[i] = result
        left -= 1
        if not left:
            done.set()

    async with trio.open_nursery() as callers:
        with product_installed(run):
            async with trioserve.open_runtime(cfg) as rt:
                run.lanes = _lanes(run, rt)
                run.replicas.batchers = list(rt.models["m"].batchers)
                if sc.running:
                    callers.start_soon(run.watchdog.drive)
                run.t0 = trio.current_time()
                for i, call in enumerate(sc.calls):
                    for j, it in enumerate(call.items):
                        run.items[item_key(i, j)] = (i, it)
                    callers.start_soon(caller, i, call, rt, callers)
                last = run.t0 + (sc.calls[-1].at_ms * MS if sc.calls else 0.0)
                if sc.shutdown_at_ms is None:
                    with trio.move_on_at(last + HORIZON_S):
                        await done.wait()
                else:
                    await trio.sleep_until(run.t0 + sc.shutdown_at_ms * MS)
                run.shutdown_at = trio.current_time()
            with trio.move_on_at(max(trio.current_time(), last) + HORIZON_S):
                await done.wait()
            run.end = trio.current_time()
            run.credits_used = dict(rt.credits_used)
            callers.cancel_scope.cancel("fuzz: the run is over")
    if (leak := leaked_since(before)) is not None:
        raise InvariantViolation("leak", leak)
    if run.watchdog is not None and run.watchdog.live():
        raise InvariantViolation(
            "leak",
            f"{run.watchdog.live()} deadline(s) stayed armed with the watchdog after the "
            "runtime closed: a batch's deadlines are disarmed as it leaves its replica",
        )


async def _cancel_at(scope: trio.CancelScope, when: float) -> None:
    await trio.sleep_until(when)
    scope.cancel("fuzz: the caller gives up")


def run_scenario(scenario: Scenario, product: Product = PRODUCT) -> None:
    """Play ``scenario`` against ``product`` and raise InvariantViolation on the first
    broken invariant (the queue's first, then the callers')."""
    count_example("runtime")
    run = play(scenario, product)
    check(run)


def play(scenario: Scenario, product: Product = PRODUCT) -> Run:
    """Play ``scenario`` and return what happened, unchecked. Deterministic: trio's
    scheduler is seeded as in a hypothesis example (importing hypothesis makes its
    task order depend on that seed only), so a pasted reproduction replays exactly."""
    return replay(_play, Run(scenario=scenario, product=product))


def replay(play_fn: Any, run: Any) -> Any:
    """Run ``play_fn(run)`` under trio on an autojumping MockClock, trio's scheduler
    seeded as in a hypothesis example, so a pasted reproduction replays exactly;
    return ``run``. Every suite that drives a runtime plays through this.

    An actor of the runtime that crashed (or a traceback the runtime logged) where
    no fault the scenario planted explains it fails the run (``crash``,
    ``fuzz/_crashes.py``), before the suite checks what the callers got; when the run
    failed otherwise first, the crash is added to that failure as a note."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    with watch_crashes() as crashes, deterministic_PRNG(0):
        try:
            trio.run(play_fn, run, clock=clock)
        except Exception as exc:
            if (crash := crashes.violation()) is not None:
                exc.add_note(f"Before it, {crash}")
            raise
    if (crash := crashes.violation()) is not None:
        raise crash
    return run


def raise_first(violations: list[tuple[str, str]]) -> None:
    """Raise the first of a run's recorded violations (invariant, text), if any."""
    if violations:
        invariant, text = violations[0]
        raise InvariantViolation(invariant, text)

