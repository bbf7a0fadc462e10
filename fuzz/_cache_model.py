"""The cache suite's model and simulated devices: :class:`KeyModel`, which answers
``[model, key, generation, tenant, run]``, the batcher on a simulated device
(:func:`device_class`: a batch takes its slowest key's latency in trio time) and, for
a model that runs off the event loop, :class:`CacheWorker`, a worker process in trio
time; and the record of what they ran (:class:`ModelRun`, :class:`Dispatched`).

``fuzz/_cache.py`` installs them in the product and plays a scenario with them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import trio
from trioserve import ModelBackend, TensorSpec

from ._cache_flights import SeenLate, carrying
from ._cache_scenario import STRAGGLE, TICK
from ._device import TrioWorker
from ._stats import note

if TYPE_CHECKING:
    from ._cache import CacheRun

X = TensorSpec(name="x", datatype="FP64", shape=(-1,))
Y = TensorSpec(name="y", datatype="FP64", shape=(-1,))


@attrs.define(eq=False)
class ModelRun:
    """One batch a model ran: when it started (and read its weights) and ended, which
    items ((key, tenant, class) each), the generation of its weights, and how it ended
    ("ok" or "error")."""

    number: int
    model: int
    at: float
    end: float
    gen: int
    items: list[tuple[int, int, str]]
    status: str = "ok"


@attrs.define(eq=False)
class Dispatched:
    """A batch a replica of model ``model`` took at ``at``: its items' (key, tenant,
    class, deadline); ``end``: when it left the replica (answered, failed, or cut off
    by the shutdown; None while it runs). ``replies``: its requests' replies (which
    request is which, across the batches it runs in); ``how`` it left: "ok" (the
    model answered), "error" (the model raised), and on a worker "killed" (its
    worker killed while it ran: cut off), "died" (its worker died running it; both
    hand it back split, a suspect), "returned" (handed back as it was: staged behind
    those, or its worker replaced because its breaker opened) or "closed" (the
    runtime closed); ``alive``: per request, whether it still waited for its answer
    as the batch left (one answered DeadlineExceeded while it ran no longer does)."""

    model: int
    at: float
    items: list[tuple[int, int, str, float]]
    end: float | None = None
    replies: list[Any] = attrs.Factory(list)
    how: str = "running"
    alive: list[bool] = attrs.Factory(list)


class KeyModel(ModelBackend):
    """Answers ``[model, key, generation, tenant, run]`` per item; raises on a batch
    holding a key within its first ``flaky[key]`` runs. Runs inline, or in a
    :class:`CacheWorker` (``ModelRule.running``)."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "inline"

    def __init__(self, run: CacheRun, index: int) -> None:
        self._run = run
        self._index = index

    def load(self, device: str, *, torch_threads: int = 1) -> Any:
        run, m = self._run, self._index

        def forward(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
            started = run.current
            run.current = None
            keys = [int(it["x"][0]) for it in items]
            if started is None or len(started[2]) != len(keys):
                run.violations.append(
                    ("duplicated", f"model m{m} ran keys {keys} outside a batch a replica started")
                )
                started = (trio.current_time(), run.gen[m], [(0, "?")] * len(keys), None)
            at, gen, who, taken = started
            ex = ModelRun(
                number=len(run.runs),
                model=m,
                at=at,
                end=trio.current_time(),
                gen=gen,
                items=[(k, t, c) for k, (t, c) in zip(keys, who, strict=True)],
            )
            run.runs.append(ex)
            bad = []
            for k in keys:
                n = run.tries[m, k] = run.tries.get((m, k), 0) + 1
                if n <= run.scenario.flaky[k]:
                    bad.append(k)
            if taken is not None:
                taken.how = "error" if bad else "ok"
            if bad:
                ex.status = "error"
                raise ValueError(f"planted model error on key {bad[0]} (run {ex.number})")
            return [
                {"y": np.array([m, k, ex.gen, t, ex.number], dtype=np.float64)}
                for k, (t, _) in zip(keys, who, strict=True)
            ]

        return forward


def _taken(
    run: CacheRun, m: int, batch: list[Any], *, worker: bool = False
) -> tuple[Dispatched, float, Any]:
    """A replica of model ``m`` takes ``batch`` (for its ``worker``, or inline):
    noted; its latency (seconds: its slowest key's, and on a worker ``STRAGGLE``
    more while one of its keys straggles), and what the model learns when it runs
    it (``CacheRun.current``). A flight's request in it (its reply carries the
    round's late hook) names it to that round: the batch the round's late outcome
    comes from if its driver is answered while it runs."""
    sc = run.scenario
    keys = [int(req.item["x"][0]) for req in batch]
    at, gen = trio.current_time(), run.gen[m]
    who = [(int(req.tenant[1:]), req.priority) for req in batch]
    taken = Dispatched(
        model=m, at=at,
        items=[(k, t, c, req.deadline) for k, (t, c), req in zip(keys, who, batch, strict=True)],
        replies=[req.reply for req in batch],
    )
    run.dispatched.append(taken)
    for req in batch:
        hook = req.reply.late
        if isinstance(hook, SeenLate):
            hook.round.batches.append(taken)
        elif (hook := carrying(req.reply)) is not None:
            # the request carrying the item of one answered while its batch ran
            hook.round.batches.append(taken)
            hook.round.late_batch = taken
    latency = max(sc.latency[k] for k in keys)
    if worker:
        straggles = False
        for k in sorted(set(keys)):
            n = run.staged[m, k] = run.staged.get((m, k), 0) + 1
            straggles = straggles or n <= sc.straggle[k]
        if straggles:
            latency += STRAGGLE
            note("cache", "straggling batches")
    return taken, latency * TICK, (at, gen, who, taken)


class CacheWorker(TrioWorker):
    """A worker process in trio time for a model of the suite whose replicas run off
    the event loop (``ModelRule.running``): a batch takes its slowest key's latency
    from when the one before is done, then the model runs it. Meanwhile the
    runtime's watchdog answers the deadlines of its requests."""

    def __init__(self, batcher: Any, run: CacheRun) -> None:
        super().__init__(batcher._backend.load(batcher.device), run.scenario.slots)
        self._batcher = batcher
        self._run = run
        #: killed to be replaced (its breaker opened): its batches go back as they were
        self.replaced = False

    def _stage(self, items: list[Any]) -> tuple[Any, float]:
        batch = self._batcher._in_flight[-1]  # appended just before it is sent
        if len(batch) != len(items) or any(
            r.item is not it for r, it in zip(batch, items, strict=True)
        ):
            raise RuntimeError("fuzz: the batch submitted is not the last one in flight")
        if len(self._held) > 0:
            note("cache", "batches staged behind another")
        taken, latency, current = _taken(self._run, self._batcher._m, batch, worker=True)
        return (taken, current), latency

    def _dies(self, record: Any) -> str | None:
        taken, _ = record
        run, m = self._run, taken.model
        dies = None
        for k in sorted({k for k, _, _, _ in taken.items}):
            n = run.deaths[m, k] = run.deaths.get((m, k), 0) + 1
            if dies is None and n <= run.scenario.dies[k]:
                dies = k
        if dies is None:
            return None
        taken.how = "died"
        note("cache", "workers died running a batch")
        return f"planted worker death on key {dies}"

    def _runs(self, record: Any) -> None:
        taken, current = record
        taken.end = trio.current_time()
        taken.alive = [r.answerable for r in taken.replies]
        self._run.current = current

    def _killed_holding(self, records: list[Any]) -> None:
        now = trio.current_time()
        run = self._run
        for j, (taken, _) in enumerate(records):
            taken.end = now
            taken.alive = [r.answerable for r in taken.replies]
            if run.closing:
                taken.how = "closed"
            elif j == 0 and not self.replaced:
                if taken.how != "died":
                    taken.how = "killed"
                    note("cache", "batches cut off")
            else:
                taken.how = "returned"
                note("cache", "batches handed back as they were")


def device_class(base: type, run: CacheRun) -> type:
    """The product's batcher on a simulated device: a batch first takes its slowest
    key's latency in trio time; the model then learns whose requests it runs. A
    replica of a ``running`` model feeds a :class:`CacheWorker`."""

    class SimulatedDevice(base):  # type: ignore[misc, valid-type]
        async def _start_worker(self) -> None:
            worker = CacheWorker(self, run)
            await self._load(worker.start)
            self._worker = worker

        async def _execute(self, batch: list[Any]) -> None:
            taken, latency, current = _taken(run, self._m, batch)
            try:
                if latency:
                    await trio.sleep(latency)
                run.current = current
                taken.alive = [r.reply.answerable for r in batch]
                await super()._execute(batch)
            finally:
                taken.end = trio.current_time()
                if taken.how == "running":
                    taken.how = "closed"

        def _replace_broken(self, worker: Any) -> None:
            worker.replaced = True  # its batches go back as they were
            note("cache", "workers replaced (their breaker opened)")
            super()._replace_broken(worker)

        @property
        def _m(self) -> int:
            return int(self.model[1:])

    return SimulatedDevice
