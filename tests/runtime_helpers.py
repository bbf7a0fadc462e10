"""Small models and configs for the runtime tests (no torch): recording callables,
a thread-run model held by a gate, and a backend whose items have costs."""

from __future__ import annotations

import heapq
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import trio
import trioserve
from trioserve import CallableBackend, ModelBackend, ModelConfig, TensorSpec, WorkerProcess
from trioserve.actors import CacheKey, Watchdog

X = TensorSpec(name="x", datatype="FP32", shape=(-1,))
Y = TensorSpec(name="y", datatype="FP32", shape=(-1,))

#: A safety net for gated threads, far above any test's run time; tests release the
#: gate themselves (and the ``gate`` fixture does at teardown).
GATE_LIMIT_S = 60.0


def pythonpath_with(first: object) -> str:
    """``PYTHONPATH`` for a worker or a child process that must import from ``first``:
    ahead of the inherited path, which may be where trioserve itself is found."""
    return os.pathsep.join(p for p in (str(first), os.environ.get("PYTHONPATH", "")) if p)


def config(*models: ModelConfig, **runtime: Any) -> trioserve.Config:
    """A config serving ``models`` to one open default tenant."""
    return trioserve.Config(
        models=models,
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        runtime=trioserve.RuntimeLimits(**runtime),
    )


def callable_model(
    name: str, fn: Any, *, execution: str = "inline", inputs=(X,), outputs=(Y,), **cfg: Any
) -> ModelConfig:
    """A model running ``fn`` over a list of items."""
    backend = CallableBackend(fn, inputs=inputs, outputs=outputs, execution=execution)
    return ModelConfig(name=name, backend=backend, **cfg)


def item(value: float, n: int = 1) -> dict[str, np.ndarray]:
    """Inputs of one item: ``x`` of length ``n`` starting with ``value``."""
    x = np.zeros(n, dtype=np.float32)
    x[0] = value
    return {"x": x}


def key(it: Mapping[str, np.ndarray]) -> float:
    return float(it["x"][0])


class Recorder:
    """An inline model computing ``y = 2x + 1``; records each batch as
    ``(trio time, [x[0] of each item])``. ``fail_on`` makes a batch holding that x[0]
    raise ValueError."""

    def __init__(self, *, fail_on: float | None = None, timed: bool = True) -> None:
        self.batches: list[tuple[float | None, list[float]]] = []
        self.fail_on = fail_on
        self.timed = timed  # False when run in a worker thread (no trio clock there)

    def __call__(self, items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        now = trio.current_time() if self.timed else None
        keys = [key(it) for it in items]
        self.batches.append((now, keys))
        if self.fail_on is not None and self.fail_on in keys:
            raise ValueError(f"poison item {self.fail_on:g}")
        return [{"y": it["x"] * 2 + 1} for it in items]

    @property
    def sizes(self) -> list[int]:
        return [len(keys) for _, keys in self.batches]

    @property
    def times(self) -> list[float | None]:
        return [t for t, _ in self.batches]

    @property
    def seen(self) -> list[float]:
        return [k for _, keys in self.batches for k in keys]


def misshapen(items: list[dict[str, np.ndarray]]) -> Any:
    """A model whose outputs are not what the runtime expects, as the first item's x[0]
    says: 1 None, 2 a generator, 3 an int, 4 two outputs per item, 5 arrays instead of
    mappings; otherwise ``y = x``. Importable, so a worker process can run it."""
    outputs = [{"y": it["x"]} for it in items]
    return {
        1.0: None,
        2.0: (out for out in outputs),
        3.0: 3,
        4.0: outputs * 2,
        5.0: [it["x"] for it in items],
    }.get(key(items[0]), outputs)


#: x[0] of an item -> what ``off_signature`` answers it with (y is declared FP32 [-1]).
OFF_SIGNATURE = {
    1.0: lambda x: {"y": x.astype(np.float64) * 2},  # converted to FP32
    2.0: lambda x: {"y": (x * 2).tolist()},  # a list: converted to an FP32 array
    3.0: lambda x: {"z": x},  # no y
    4.0: lambda x: {"y": np.array(["a", "b"])},  # strings
    5.0: lambda x: {"y": (x * 2).reshape(1, -1)},  # one dimension too many
    6.0: lambda x: {"y": 1.5},  # a scalar: shape []
    7.0: lambda x: {"y": None},
    8.0: lambda x: {"y": (x * 2).astype(np.complex64)},  # no FP32 in it
}


def off_signature(items: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
    """A model whose output for each item is ``OFF_SIGNATURE[x[0]](x)`` (``y = 2x``
    for any other x[0]): outputs against its declared ``y`` FP32 [-1], some
    convertible. Importable, so a worker process can run it."""
    return [OFF_SIGNATURE.get(key(it), lambda x: {"y": x * 2})(it["x"]) for it in items]


class Unprintable(Exception):
    """An exception whose message cannot be read: ``str()`` of it raises."""

    def __str__(self) -> str:
        raise RuntimeError("no message")


def unprintable_on_1(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """``y = x``, but a batch holding an item with x[0] == 1 raises Unprintable.
    Importable, so a worker process can run it."""
    if any(key(it) == 1.0 for it in items):
        raise Unprintable()
    return [{"y": it["x"]} for it in items]


def escapes_on_1(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """``y = x``, but a batch holding an item with x[0] == 1 raises what is not an
    ordinary error in a loop (StopIteration) and one with x[0] == 2 calls
    ``sys.exit``. Importable, so a worker process can run it."""
    if any(key(it) == 1.0 for it in items):
        raise StopIteration("ran out")
    if any(key(it) == 2.0 for it in items):
        sys.exit("model says bye")
    return [{"y": it["x"]} for it in items]


class OwnBaseException(BaseException):
    """A model's own exception class that is not an Exception."""


def interrupts_on_1(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """``y = x``, but a batch holding an item with x[0] == 1 raises KeyboardInterrupt,
    one with x[0] == 2 GeneratorExit and one with x[0] == 3 a BaseException of its
    own. Importable, so a worker process can run it."""
    if any(key(it) == 1.0 for it in items):
        raise KeyboardInterrupt("model interrupts")
    if any(key(it) == 2.0 for it in items):
        raise GeneratorExit("model closes")
    if any(key(it) == 3.0 for it in items):
        raise OwnBaseException("model's own")
    return [{"y": it["x"]} for it in items]


def crash_on_666(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """A model for a worker process: a batch holding an item with x[0] == 666 ends the
    process at once (``os._exit``, as a segfault would); otherwise ``y = x``.
    Importable, so a worker process can run it."""
    if any(key(it) == 666.0 for it in items):
        os._exit(3)
    return [{"y": it["x"]} for it in items]


class Gate:
    """A model for a worker thread that blocks every batch until released (or only
    batches holding ``hold`` as x[0]), so a replica stays busy for as long as a test
    needs. Records the x[0] of every item it was given."""

    def __init__(self, *, hold: float | None = None) -> None:
        self.opened = threading.Event()
        self.hold = hold
        self._lock = threading.Lock()
        self.seen: list[float] = []

    def __call__(self, items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        keys = [key(it) for it in items]
        with self._lock:
            self.seen.extend(keys)
        if self.hold is None or self.hold in keys:
            if not self.opened.wait(GATE_LIMIT_S):
                raise RuntimeError("gate never opened")
        return [{"y": it["x"] * 2 + 1} for it in items]

    def release(self) -> None:
        self.opened.set()


class SplitsInChunks:
    """A model's split of an oversize item into chunks of ``x`` within the budget,
    each costing its length, and the merge of their ``y`` outputs, concatenated."""

    def split(self, it, budget):
        x = it["x"]
        chunks = [x[i : i + budget] for i in range(0, len(x), budget)]
        return [({"x": c}, len(c)) for c in chunks]

    def merge(self, parts):
        return {"y": np.concatenate([p["y"] for p in parts])}


class CostModel(SplitsInChunks, ModelBackend):
    """Items cost their length; an inline runner records each batch's item costs and
    the trio time, and returns ``y = 2x``. With ``splittable`` an oversize item splits
    into chunks within the budget and the chunk outputs are concatenated."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "inline"

    def __init__(self, *, padded: bool = False, splittable: bool = False, fail_on=None):
        self.padded = padded
        self.supports_split = splittable
        self.fail_on = fail_on
        self.batches: list[tuple[float, list[int]]] = []

    def prepare(self, name: str, inputs: Any):
        it, _ = super().prepare(name, inputs)
        return it, int(it["x"].shape[0])

    def load(self, device: str, *, torch_threads: int = 1):
        def run(items):
            self.batches.append((trio.current_time(), [len(it["x"]) for it in items]))
            if self.fail_on is not None and any(key(it) == self.fail_on for it in items):
                raise ValueError(f"poison item {self.fail_on:g}")
            return [{"y": it["x"] * 2} for it in items]

        return run

    @property
    def costs(self) -> list[list[int]]:
        return [c for _, c in self.batches]

    @property
    def times(self) -> list[float]:
        return [t for t, _ in self.batches]


def at(actual: float | None, expected: float) -> bool:
    """``actual`` is the trio time ``expected`` (not before it; equal up to float
    rounding of the clock's jump)."""
    return actual is not None and expected <= actual <= expected + 1e-9


#: The environment variable naming the file :func:`held_until_file` waits for.
GATE_FILE_ENV = "TRIOSERVE_TEST_GATE_FILE"


def held_until_file(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """A model for worker processes, held as a thread model is by a gate: it answers
    ``y = x`` once the file named by ``$TRIOSERVE_TEST_GATE_FILE`` exists (looked for
    every 5 ms, for GATE_LIMIT_S at most). Importable, so a worker process can run
    it."""
    path = os.environ[GATE_FILE_ENV]
    give_up = time.monotonic() + GATE_LIMIT_S
    while not os.path.exists(path) and time.monotonic() < give_up:
        time.sleep(0.005)
    return [{"y": it["x"].copy()} for it in items]


#: The environment variable naming the flag file of :func:`broken_once`.
BROKEN_FLAG_ENV = "TRIOSERVE_TEST_BROKEN_FLAG"
ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"
_broken: bool | None = None  # this process's lot, decided by its first call


def broken_once(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """A model for worker processes, one of which is broken for good, as after a
    sticky CUDA error: the first process to run a batch while the file named by
    ``$TRIOSERVE_TEST_BROKEN_FLAG`` exists takes it (renames it away) and raises on
    every call from then on; the others, its successor included, answer
    ``y = [their pid]``. Importable, so a worker process can run it."""
    global _broken
    if _broken is None:
        flag = os.environ[BROKEN_FLAG_ENV]
        try:
            os.rename(flag, flag + ".taken")  # atomic: one process takes it
            _broken = True
        except FileNotFoundError:
            _broken = False
    if _broken:
        raise RuntimeError(ILLEGAL_ACCESS)
    return [{"y": np.array([os.getpid()], dtype=np.float32)} for _ in items]


def broken_once_config(monkeypatch: Any, tmp_path: Any, *, max_batch_size: int) -> Any:
    """Two worker-process replicas of :func:`broken_once` (no timeout), its flag file
    set up in ``tmp_path`` and ``PYTHONPATH`` leading to this folder, so that the
    workers can import it; returns (config, the flag file)."""
    flag = tmp_path / "broken"
    flag.write_text("")
    monkeypatch.setenv(BROKEN_FLAG_ENV, str(flag))
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(os.path.dirname(os.path.abspath(__file__))))
    cfg = config(
        callable_model(
            "m", broken_once, execution="process", replicas=2,
            max_batch_size=max_batch_size, max_wait_ms=0, timeout_ms=None,
        )
    )
    return cfg, flag


def successor_up(monkeypatch: Any) -> trio.Event:
    """An event set once the successor of a worker process replaced for being broken
    (``workers_broken``) has started. Its start takes real time while a test's clock
    stands still: a test waits for it rather than race it with the requests it sends
    (the other replica may answer them all before it is up)."""
    from trioserve.actors import BatcherActor

    up = trio.Event()
    start_worker = BatcherActor._start_worker

    async def start_and_tell(self: Any) -> None:
        await start_worker(self)
        if self.workers_broken:
            up.set()

    monkeypatch.setattr(BatcherActor, "_start_worker", start_and_tell)
    return up


DEVICE_LOST = "CUDA error: device-side assert triggered"
_device_lost = False  # this process's device is unusable (it ran a negative input)


class LosesItsDevice(ModelBackend):
    """A model whose replicas a negative input leaves with an unusable device (as a
    CUDA device-side assert does a thread's, i.e. the process's, context): the
    batch raises, and ``device_lost`` (patched in by ``lose_devices``) then says so
    for that device. Otherwise ``y = x``."""

    inputs = (X,)
    outputs = (Y,)

    def __init__(self, lost: set[str], execution: str = "thread") -> None:
        self.lost = lost
        self.default_execution = execution

    def load(self, device, *, torch_threads=1):
        def run(items):
            if device in self.lost or any(it["x"][0] < 0 for it in items):
                self.lost.add(device)
                raise RuntimeError(DEVICE_LOST)
            return [{"y": it["x"].copy()} for it in items]

        return run


def breaks_its_device(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """A model for worker processes that a negative x[0] breaks for good, as an
    out-of-range index breaks a CUDA context: the batch holding it raises, and so
    would every later call in that process. The worker's check of its device
    (``context_lost``, which looks at CUDA) is told so, as it would find it on a
    GPU. Otherwise ``y = x``. Importable, so a worker process can run it."""
    global _device_lost
    for name in ("__main__", "trioserve._worker"):  # the worker's module, as it runs
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "context_lost"):
            module.context_lost = lambda device: _device_lost
    if any(it["x"][0] < 0 for it in items):
        _device_lost = True
    if _device_lost:
        raise RuntimeError(DEVICE_LOST)
    return [{"y": it["x"].copy()} for it in items]


# ---------------------------------------------------------------- stragglers, stand-in workers
def straggler_model(fn, **cfg) -> ModelConfig:
    cfg.setdefault("batch_timeout_floor_ms", 50.0)
    cfg.setdefault("batch_timeout_cap_ms", 50.0)
    return callable_model("m", fn, execution="thread", max_batch_size=8, max_wait_ms=5, **cfg)


class _StandIn:
    """What the batcher asks of a worker process besides running batches: its error
    types, its pipeline depth, and closing and waiting for its exit."""

    SLOTS = 3
    Died = WorkerProcess.Died
    Failed = WorkerProcess.Failed
    ended_how: str | None = None
    stderr_tail: str | None = None
    never_started = 0  # not known, unless a stand-in says
    never_read = 0  # not known, unless a stand-in says
    #: how it died, as WorkerProcess.died_of words it, unless a stand-in says
    death = "a stand-in's death"
    #: results written and not read when it was lost ((outputs, seconds) each, as
    #: WorkerProcess.unread_results), unless a stand-in says
    unread: tuple = ()
    _exited: trio.Event

    async def start(self) -> None:
        await trio.lowlevel.checkpoint()

    @property
    def alive(self) -> bool:
        return not self._exited.is_set()

    def kill(self) -> None:
        self._exited.set()

    async def aclose(self) -> None:
        self.kill()
        await trio.lowlevel.checkpoint()

    async def wait_exited(self) -> None:
        await self._exited.wait()

    def unread_results(self) -> list:
        return list(self.unread)

    def died_of(self) -> str:
        return self.death


class NoZygote:
    async def start(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


# ---------------------------------------------------------------- runtime calls
async def call_all(rt, model, inputs, *, stagger: float = 0.0):
    """Infer every input from its own task, the i-th arriving at start + i*stagger.
    Returns {i: (outputs or the exception, trio time answered)}."""
    results: dict[int, tuple[object, float]] = {}
    start = trio.current_time()

    async def one(i, x):
        await trio.sleep_until(start + i * stagger)
        try:
            out = await rt.infer(model, x)
        except Exception as exc:
            out = exc
        results[i] = (out, trio.current_time())

    async with trio.open_nursery() as nursery:
        for i, x in enumerate(inputs):
            nursery.start_soon(one, i, x)
    return results


# ---------------------------------------------------------------- result cache keys
def k(model="m", version="1", namespace="t", digest=b"d"):
    """A result-cache key whose parts default to one model version of tenant ``t``."""
    return CacheKey(namespace, model, version, digest)


class ManualWatchdog(Watchdog):
    """The watchdog on a wall clock that moves only when the test says so
    (:meth:`advance`); what falls due is called at once, in the test's task. Every
    one made is in ``made``."""

    made: list[ManualWatchdog] = []

    def __init__(self) -> None:
        self.wall = 0.0
        super().__init__(clock=lambda: self.wall)
        ManualWatchdog.made.append(self)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        heap = self._heap
        while heap and (heap[0][0] <= self.wall or not heap[0][2].live):
            _, _, entry = heapq.heappop(heap)
            if entry.live:
                entry.live = False
                self._live -= 1
                self.fired += 1
                entry.fn()
