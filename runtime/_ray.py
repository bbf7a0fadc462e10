"""A model replica as a Ray actor (``execution = "ray"``).

:class:`RayReplica` has :class:`~trioserve.WorkerProcess`'s shape (``start``,
``submit`` / ``result`` with several batches in flight, ``kill``, ``aclose``,
``wait_exited``, its ``Died`` and ``Failed``), so the batcher's worker feed
(actors/_worker_feed.py) drives an actor as it drives a worker process: the batch
deadline, a dead or straggling actor killed (``ray.kill``) and a fresh one started,
its batches handed back. The actor (:class:`ReplicaServer`, one per replica) loads
the model's backend as a worker process does and runs the batches in the order
they were sent. An ObjectRef is awaited with no thread of ours: its future's
done-callback wakes the waiting trio task through the run's TrioToken.

Connecting this process to Ray (``start_ray``, ``stop_ray``) is in
runtime/_ray_connect.py. Ray is imported only in these two modules, and only when a
model runs on it (an optional extra).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from typing import Any

import numpy as np
import trio

from ._config import ModelConfig
from ._model import ModelBackend
from ._process import FrameTooLarge, WorkerDied, WorkerError, _portable, unstack_outputs
from ._ray_config import RayReplicaConfig, amounts, unplaceable
from ._ray_connect import _setter

log = logging.getLogger("trioserve")


async def wait_ref(ref: Any) -> Any:
    """The value of the ObjectRef ``ref``; raises what ``ray.get`` would. A
    checkpoint. No thread waits for it: the future's done-callback reschedules this
    task through the TrioToken. Cancelling it abandons the wait (the value, if it
    comes, is dropped with the ref); the callback then finds nobody waiting."""
    fut = ref.future()
    if fut.done():
        await trio.lowlevel.checkpoint()
        return fut.result()
    done = trio.Event()
    fut.add_done_callback(_setter(done))
    await done.wait()
    return fut.result()


class RayReplica:
    """One replica's Ray actor, driven as a :class:`~trioserve.WorkerProcess` is."""

    Died = WorkerDied
    Failed = WorkerError
    TooLarge = FrameTooLarge
    #: What the log calls it.
    KIND = "Ray actor"
    #: Batches in flight per actor: one running, the rest queued in the actor, which
    #: runs them in the order they were sent (one thread for batches).
    SLOTS = 3

    def __init__(
        self,
        cfg: ModelConfig,
        backend: ModelBackend,
        device: str,
        torch_threads: int,
        *,
        name: str,
    ) -> None:
        self._cfg = cfg
        self._backend = backend
        self._device = device
        self._torch_threads = torch_threads
        ray_cfg = cfg.ray or RayReplicaConfig()
        self._options = ray_cfg.actor_options()
        self._asked = ray_cfg.asked()
        #: done once Ray has placed the actor (a future of its ``__ray_ready__``)
        self._placed: Any = None
        #: the actor's name in its namespace: the replica's, and a suffix of its own
        self.name = f"trioserve:{name}:{uuid.uuid4().hex[:8]}"
        self._actor: Any = None
        self._killed = False
        self._watch: Any = None  # a call that returns only when the actor dies
        self._refs: collections.deque[Any] = collections.deque()
        self.in_flight = 0
        #: Which of the batches left in flight it never started is not known (an
        #: actor tells nothing of its queue): 0, as a worker process says then.
        self.never_started = 0
        #: Nor which it never read (as a worker process says once killed): 0.
        self.never_read = 0
        #: Seconds the actor spent running batches (measured in the actor).
        self.busy_seconds = 0.0
        #: Seconds the actor spent on the last batch whose result was read.
        self.last_run_seconds = 0.0
        self.pid: int | None = None
        #: How the actor ended, in Ray's words, once known.
        self.ended_how: str | None = None
        #: None: what an actor writes goes to Ray's logs, not through us.
        self.stderr_tail: str | None = None
        #: What it said it died of (its device context was lost), when it said so.
        self.cause: str | None = None

    async def start(self) -> None:
        """Create the actor (with the model's Ray options) and wait until its model
        is loaded. Raises WorkerDied (with ``details``, the load's traceback, when
        the model failed to load), at once when this process started the Ray (a
        local one: no node joins it) and none of its nodes has what the actor asks
        for. Otherwise an actor Ray cannot place waits for resources (a cluster's
        autoscaler may add a node): the model's ``load_timeout_s`` bounds that, and
        :meth:`unplaced` then says so."""
        import ray

        cfg = self._cfg
        nodes = await trio.to_thread.run_sync(_local_nodes)
        why = None if nodes is None else unplaceable(self._asked, nodes)
        if why is not None:
            raise WorkerDied(
                f"its Ray actor could never be placed: {why}, and no node joins the local "
                f"Ray this process started; ask for less in models.{cfg.name}.ray"
            )
        backend = cfg.backend if isinstance(cfg.backend, str) else self._backend
        actor_class = _actor_class()
        try:
            self._actor = actor_class.options(
                name=self.name, max_restarts=0, max_task_retries=0, max_concurrency=1,
                **self._options,
            ).remote(_portable(cfg, backend), self._device, self._torch_threads)
        except (ray.exceptions.RayError, TypeError, ValueError) as exc:
            raise WorkerDied(
                f"model {cfg.name!r}: its Ray actor cannot be created ({exc})"
            ) from None
        self._placed = self._actor.__ray_ready__.remote().future()
        # in a concurrency group of its own: it holds no batch up
        self._watch = self._actor.watch.options(concurrency_group="watch").remote()
        try:
            reply = await wait_ref(self._actor.load.remote())
        except ray.exceptions.RayError as exc:
            self.kill()
            raise WorkerDied(f"its Ray actor died ({self._death(exc)})") from None
        if reply[0] != "ready":
            self.kill()
            died = WorkerDied(f"Ray actor for model {cfg.name!r} failed to load:\n{reply[1]}")
            died.details = reply[1]
            raise died
        self.pid = reply[1]

    def unplaced(self) -> str | None:
        """Why the actor has not loaded, when Ray has not placed it yet (no node had
        the resources it asks for free); None once placed, or if never created. Not
        a checkpoint."""
        if self._placed is None or self._placed.done():
            return None
        return (
            f"its Ray actor was never placed: no node had {amounts(self._asked)} free "
            f"for it (models.{self._cfg.name}.ray; ray status shows what holds them)"
        )

    @property
    def alive(self) -> bool:
        """Started and not killed (it may still have died on its own)."""
        return self._actor is not None and not self._killed

    async def run(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run one batch on the actor: :meth:`submit` then :meth:`result`."""
        await self.submit(items)
        return await self.result()

    async def submit(self, items: list[dict[str, Any]]) -> None:
        """Send a batch (at most SLOTS in flight). A checkpoint, before anything is
        sent: cancelled, the batch was not sent. Raises WorkerDied when the actor was
        killed."""
        await trio.lowlevel.checkpoint()
        if self.in_flight >= self.SLOTS:
            raise RuntimeError(f"at most {self.SLOTS} batches may be in flight per actor")
        if not self.alive:
            raise WorkerDied(f"the Ray actor {self.name} was killed")
        stacked = _stack(items)
        if stacked is not None:
            ref = self._actor.run.remote("stacked", len(items), stacked)
        else:
            ref = self._actor.run.remote("items", len(items), items)
        self._refs.append(ref)
        self.in_flight += 1

    async def result(self) -> list[dict[str, Any]]:
        """The outputs of the oldest batch in flight. Raises WorkerError (the model
        raised: the actor goes on) or WorkerDied (the actor is gone, or its model left
        its device unusable; or it was killed, before or during the call).
        Cancelling it abandons the wait: kill the actor after a cancelled call."""
        import ray

        if not self.alive:
            raise WorkerDied(f"the Ray actor {self.name} was killed")
        ref = self._refs[0]
        try:
            reply = await wait_ref(ref)
        except ray.exceptions.RayTaskError as exc:  # not the model's: it is caught there
            reply = ("error", f"{type(exc).__name__}: {exc}")
        except ray.exceptions.RayError as exc:
            raise WorkerDied(self._death(exc)) from None
        if not self.alive:  # killed by another task while this one waited
            raise WorkerDied(f"the Ray actor {self.name} was killed")
        self._refs.popleft()
        self.in_flight -= 1
        if reply[0] == "error":
            raise WorkerError(reply[1])
        if reply[0] == "lost":
            self.cause = f"its device context was lost: {reply[1]}"
            raise WorkerDied(f"{self.cause} ({self.name})")
        n, out, seconds = reply[1], reply[2], reply[3]
        self.busy_seconds += seconds
        self.last_run_seconds = seconds
        return unstack_outputs(n, _writable(out))

    async def wait_exited(self) -> None:
        """Wait until the actor is dead, killed or on its own. A checkpoint."""
        import ray

        if self._watch is None:
            await trio.sleep_forever()
        try:
            await wait_ref(self._watch)
        except ray.exceptions.RayError as exc:
            if self.ended_how is None:
                self.ended_how = _how(exc)

    def unread_results(self) -> list[tuple[Any, float]]:
        """As a worker process's (:meth:`WorkerProcess.unread_results`): an actor's
        results are its calls' own, each read as it comes, so none waits unread:
        none. Not a checkpoint."""
        return []

    def kill(self) -> None:
        """Kill the actor (``ray.kill``, no restart) and drop its batches' refs.
        Synchronous; the actor may still be exiting when it returns: :meth:`aclose`
        waits for it."""
        if self._actor is not None and not self._killed:
            import ray

            try:
                ray.kill(self._actor, no_restart=True)
            except Exception as exc:  # Ray is gone already (it took its actors)
                log.debug("ray.kill(%s): %s", self.name, exc)
        self._killed = True
        self._refs.clear()
        self.in_flight = 0

    async def aclose(self) -> None:
        """Kill the actor and wait until Ray reports it dead (shielded, bounded)."""
        self.kill()
        if self._watch is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self.wait_exited()
            self._watch = None

    def _death(self, exc: BaseException) -> str:
        if self.ended_how is None:
            self.ended_how = _how(exc)
        return self.died_of()

    def died_of(self) -> str:
        """The actor's death in one wording, whichever call found it (a batch's
        result, or :meth:`wait_exited`): what it said it died of, its pid and Ray's
        reason, those known (``pid 4242: it was killed by `ray.kill`.``; ``its
        device context was lost: …; pid 4242``, where Ray's reason would be the kill
        that followed its word). Not a checkpoint."""
        if self.cause is not None:
            pid = f"; pid {self.pid}" if self.pid is not None else ""
            return f"{self.cause}{pid}"
        known = [f"pid {self.pid}" if self.pid is not None else "", self.ended_how or ""]
        return ": ".join(k for k in known if k) or "Ray gave no reason"


def _local_nodes() -> list[dict[str, float]] | None:
    """Each live node's total resources, when this process started the Ray it is
    connected to (``ray.init`` with no address, here or by the process's own code: a
    local Ray, its head node this process's, which no node joins and no autoscaler
    grows); None for a cluster's, which may yet get a node with what an actor asks
    for. Blocking (a call to Ray's GCS)."""
    import ray
    from ray._private import worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    if node is None or not node.is_head():
        return None
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def _how(exc: BaseException) -> str:
    """Ray's reason for an actor's death, on one line (its message is several)."""
    text = str(exc)
    for line in text.splitlines():
        if line.startswith("The actor is dead because"):
            text = line.removeprefix("The actor is dead because").strip()
            text = text.partition(" Some common causes")[0]  # Ray's advice, not news
            break
    else:
        text = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _writable(out: Any) -> Any:
    """Outputs as Ray returned them, with their arrays writable (Ray's are read-only
    views of its object store): the caller owns its answer, as from a worker process."""
    if isinstance(out, dict):
        return {k: _own(a) for k, a in out.items()}
    return [o if isinstance(o, Exception) else {k: _own(a) for k, a in o.items()} for o in out]


def _own(a: Any) -> Any:
    return a.copy() if isinstance(a, np.ndarray) and not a.flags.writeable else a


def _stack(items: list[dict[str, Any]]) -> dict[str, np.ndarray] | None:
    """The batch as one array per input, when every item has the same inputs of one
    shape and dtype (one buffer per input for Ray to send, not one per item); else
    None: it travels as items."""
    first = items[0]
    names = first.keys()
    out = {}
    for name, arr in first.items():
        if not isinstance(arr, np.ndarray) or arr.dtype.kind == "O":
            return None
        column = []
        for it in items:
            a = it.get(name)
            if (
                len(it) != len(names) or not isinstance(a, np.ndarray)
                or a.shape != arr.shape or a.dtype != arr.dtype
            ):
                return None
            column.append(a)
        out[name] = np.stack(column)
    return out


def _actor_class() -> Any:
    """ReplicaServer as a Ray actor class: batches on one thread (in order), and a
    second concurrency group for :meth:`ReplicaServer.watch`."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray

        _ACTOR_CLASS = ray.remote(concurrency_groups={"watch": 1})(ReplicaServer)
    return _ACTOR_CLASS


_ACTOR_CLASS: Any = None


class ReplicaServer:
    """The actor's side: loads one replica's model, then runs batches."""

    def __init__(self, cfg: ModelConfig, device: str, torch_threads: int) -> None:
        self._cfg = cfg
        self._device = device
        self._torch_threads = torch_threads
        self._backend: Any = None
        self._runner: Any = None

    def load(self) -> tuple[str, Any]:
        """``("ready", pid)``, or ``("error", traceback)`` when the model failed to load."""
        import traceback

        from ._builtin import resolve_backend
        from ._model import load_runner

        try:
            self._backend = resolve_backend(self._cfg)
            self._runner = load_runner(self._backend, self._device, self._torch_threads)
        except (Exception, SystemExit) as exc:  # a load's sys.exit() is its failure too
            tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
            return ("error", "".join(traceback.format_exception(type(exc), exc, tb, limit=-20)))
        return ("ready", os.getpid())

    def run(self, kind: str, n: int, payload: Any) -> tuple:
        """``("ok", n, outputs, seconds)``, ``("error", text)`` (the model raised), or
        ``("lost", text)`` (it raised and left its device unusable: the runtime kills
        this actor)."""
        from ._errors import exception_text
        from ._model import check_outputs
        from ._worker import context_lost, stack_outputs

        backend, cfg = self._backend, self._cfg
        started = time.perf_counter()  # busy time, reported back (no trio loop here)
        try:
            if kind == "stacked":
                # Ray hands large arrays over read-only (in its object store): the
                # model gets its own, as it does in a worker process
                payload = {k: a if a.flags.writeable else a.copy() for k, a in payload.items()}
                stacked_run = getattr(self._runner, "stacked", None)
                if stacked_run is not None:
                    out = backend.conform_rows(cfg.name, stacked_run(payload), n)
                else:
                    items = [{k: a[i] for k, a in payload.items()} for i in range(n)]
                    out = stack_outputs(
                        backend.conform_outputs(cfg.name, check_outputs(self._runner(items), n))
                    )
            else:
                out = stack_outputs(
                    backend.conform_outputs(cfg.name, check_outputs(self._runner(payload), n))
                )
        # The model's sys.exit() ends no actor; its KeyboardInterrupt (its own: the
        # runtime stops a straggler with ray.kill, never ray.cancel) read as Ray's
        # "task was cancelled"; any BaseException is the model's error, as in a
        # worker process.
        except BaseException as exc:
            text = exception_text(exc)
            if context_lost(self._device):
                return ("lost", text)
            return ("error", text)
        return ("ok", n, out, time.perf_counter() - started)

    def watch(self) -> None:
        """Never returns: its call fails when the actor dies, which is how the runtime
        learns of a death while the replica is idle."""
        threading.Event().wait()
