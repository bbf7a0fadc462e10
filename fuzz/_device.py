"""The runtime suite's model and simulated device.

The model (:class:`EchoModel`) runs inline and echoes its input, each item's input
naming its call and item (:func:`item_input`, :func:`part_id`), so an answer says whose
it is. The batchers are the product's (:func:`batcher_class`), with ``_execute``
preceded by a trio sleep for the batch's latency (the slowest item's, a straggler holds
the whole batch back) and, for a "crash" item, a raise that crashes the replica so its
supervisor restarts it; a replica with ``Scenario.pipeline`` above 1 holds that many
batches in flight, as a worker process's pipeline does. Every batch a replica starts
is noted as an :class:`Execution` and checked as it starts (``Run.check_started``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import trio
import trioserve
import trioserve.actors
from trioserve import ModelBackend, TensorSpec

from ._scenario import MS
from ._stats import note

if TYPE_CHECKING:
    from ._runtime import Run

#: An item's x is KEY_SPAN * key + [0, 1, ..., cost - 1]: each part of a split item
#: still names its call and item, and the exact output proves whose answer it is.
KEY_SPAN = 1000


# ---------------------------------------------------------------- the model
X = TensorSpec(name="x", datatype="FP64", shape=(-1,))
Y = TensorSpec(name="y", datatype="FP64", shape=(-1,))


def item_input(key: int, cost: int) -> np.ndarray:
    return KEY_SPAN * key + np.arange(cost, dtype=np.float64)


def item_key(call: int, item: int) -> int:
    """The key of item ``item`` of call ``call`` (a call has at most four items)."""
    return call * 4 + item


def part_id(x: np.ndarray) -> tuple[int, int]:
    """(item key, offset of the part's first element)."""
    first = int(x[0])
    return first // KEY_SPAN, first % KEY_SPAN


class EchoModel(ModelBackend):
    """Items cost their length; returns each input as its output; raises on a batch
    holding an item whose fault is "error". Runs inline."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "inline"
    supports_split = True

    def __init__(self, run: Run, *, padded: bool) -> None:
        self._run = run
        self.padded = padded

    def prepare(self, name: str, inputs: Any) -> tuple[Any, int]:
        it, _ = super().prepare(name, inputs)
        return it, int(it["x"].shape[0])

    def load(self, device: str, *, torch_threads: int = 1) -> Any:
        run = self._run

        def forward(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
            ex = run.current
            run.current = None
            parts = [part_id(it["x"]) for it in items]
            if ex is None or ex.parts != parts:
                run.violations.append(
                    ("duplicated", f"the model ran {parts} outside a batch a replica started")
                )
            bad = [k for k, _ in parts if run.fault(k) == "error"]
            broken = ex is not None and run.broken_at(ex.replica, trio.current_time())
            if ex is not None:
                run.replicas.at_model(ex, ex.reqs, broken)
                ex.status = "error" if bad or broken else "ok"
            if broken:
                raise RuntimeError(f"planted broken replica {ex.replica}")  # type: ignore[union-attr]
            if bad:
                raise ValueError(f"planted model error on item {bad[0]}")
            return [{"y": it["x"].copy()} for it in items]

        return forward

    def split(self, item: Any, budget: int) -> list[tuple[Any, int]]:
        x = item["x"]
        chunks = [x[i : i + budget] for i in range(0, len(x), budget)]
        return [({"x": c}, len(c)) for c in chunks]

    def merge(self, parts: list[Any]) -> dict[str, np.ndarray]:
        return {"y": np.concatenate([p["y"] for p in parts])}


@attrs.define(eq=False)
class Execution:
    """One batch a replica started: when, which parts, and how it ended: "ok" (the
    model answered), "error" (the model raised), "crash" (the replica crashed), or
    "cut" (cancelled at shutdown before the model ran)."""

    at: float
    replica: int
    parts: list[tuple[int, int]]
    #: its requests (for the reference of the replicas, fuzz/_replicas.py)
    reqs: list[Any] = attrs.Factory(list)
    status: str = "cut"
    end: float | None = None
    #: per request: (part, hedge copy?), and whether it ran before (a retry)
    keys: list[tuple[int, int, bool]] = attrs.Factory(list)
    retried: list[bool] = attrs.Factory(list)
    #: when the model was called: its replica broken, each reply still answerable,
    #: another replica of its lane ready, each hedge twin still answerable
    broken: bool = False
    answerable: list[bool] = attrs.Factory(list)
    others_ready: bool = False
    twins_answerable: list[bool] = attrs.Factory(list)
    #: it raised on a part alone that is to run once on another replica
    marked: bool = False


def batcher_class(base: type, run: Run) -> type:
    """The product's batcher (``base``) on a simulated device: each batch first takes
    its latency in trio time, and a batch holding a "crash" item crashes the replica.
    Every batch a replica starts (fresh from the queue or handed back for a retry) is
    checked against the deadlines and budgets here."""

    class SimulatedDevice(base):  # type: ignore[misc, valid-type]
        def _stage(self, batch: list[Any]) -> Execution:
            """``batch`` is handed to this replica's device: checked, and noted."""
            parts = [part_id(req.item["x"]) for req in batch]
            ex = Execution(
                at=trio.current_time(), replica=self.index, parts=parts, reqs=list(batch)
            )
            run.executions.append(ex)
            run.check_started(ex, batch)
            run.replicas.started(ex, batch)
            return ex

        async def _execute(self, batch: list[Any], ex: Execution | None = None) -> None:
            if ex is None:
                ex = self._stage(batch)
            try:
                latency = (
                    run.scenario.batch_latency_ms + run.replica_delay(self.index)
                    + max(run.latency(k) for k, _ in ex.parts)
                )
                if latency:
                    await trio.sleep(latency * MS)
                crash = [k for k, _ in ex.parts if run.fault(k) == "crash"]
                if crash:
                    ex.status = "crash"
                    raise RuntimeError(f"planted replica crash on item {crash[0]}")
                run.current = ex  # the inline model runs synchronously inside the next call
                await super()._execute(batch)
            finally:
                # (inline: the model ran and its answers were delivered with no
                # checkpoint since)
                ex.end = trio.current_time()
                run.replicas.ended(ex, batch, ex.end)

        async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            pipeline = run.scenario.pipeline
            slots = pipeline[self.index] if self.index < len(pipeline) else 1
            if slots <= 1:
                await super().run(task_status=task_status)
                return
            # The pipeline of a worker-process replica (BatcherActor._serve_worker):
            # it pulls while it has room, so it holds batches in flight when it
            # pulls (``holds``, ``_keep_apart``), and the device runs them in order.
            # Its worker's loss and replacement are not simulated.
            if self._runner is None:
                self._runner = self._backend.load(self.device)
            task_status.started(self)
            room = trio.Semaphore(slots)
            staged_send, staged_recv = trio.open_memory_channel[tuple[list[Any], Execution]](
                slots
            )
            pull = self._scheduler.pull
            twins = self._scheduler.twins
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._device, staged_recv, room)
                while True:
                    await self._wait_breaker()
                    await room.acquire()
                    batch = await pull(self)
                    if self._in_flight:
                        note("runtime", "pipeline: batches pulled while another was in flight")
                    if twins:
                        batch = self._keep_apart(batch)
                        if not batch:
                            room.release()
                            continue
                    self._in_flight.append(batch)
                    await staged_send.send((batch, self._stage(batch)))
                    if trioserve.actors.retried(batch) and self._scheduler.replicas > 1:
                        # as _serve_worker: nothing staged behind a retry
                        for _ in range(slots):
                            await room.acquire()
                        for _ in range(slots):
                            room.release()

        async def _device(self, staged: Any, room: trio.Semaphore) -> None:
            async for batch, ex in staged:
                await self._execute(batch, ex)
                if self._in_flight and self._in_flight[0] is batch:
                    self._in_flight.popleft()
                room.release()

    return SimulatedDevice

