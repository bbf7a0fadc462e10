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

Ray is imported only here, and only when a model runs on it (an optional extra).
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from ._config import ModelConfig
from ._errors import ConfigError
from ._model import ModelBackend
from ._process import FrameTooLarge, WorkerDied, WorkerError, _portable, unstack_outputs
from ._ray_config import RayConfig, RayReplicaConfig, amounts, unplaceable

log = logging.getLogger("trioserve")

RAY_INSTALL_HINT = "pip install 'trioserve[ray]'"


def ray_available() -> bool:
    """Whether Ray can be imported here."""
    return importlib.util.find_spec("ray") is not None


def check_ray_installed(models: list[ModelConfig]) -> None:
    """Raise ConfigError, naming the first model on Ray, when Ray is not installed."""
    if models and not ray_available():
        raise ConfigError(
            f'models.{models[0].name}.execution: "ray" needs Ray, which is not '
            f"installed here: {RAY_INSTALL_HINT}"
        )


#: Runtimes of this process using the Ray that :func:`start_ray` connected (0: none,
#: or a Ray the process's own code connected, left alone). The last to stop it
#: disconnects it: a runtime closing never stops Ray under another still serving.
_users = 0
#: Held while the users are counted and Ray's state is read or changed (in threads:
#: two runtimes may run in two threads); never while ``ray.init`` runs, which may hang.
_users_lock = threading.Lock()
#: The thread that connected the Ray :func:`start_ray` connected, while it is.
_owner: RayThread | None = None
#: The thread of a ``ray.init`` under way, or given up at its start timeout and not
#: returned yet: no other ``ray.init`` starts while it runs.
_connecting: RayThread | None = None
#: The thread of a ``ray.shutdown`` under way (the last runtime using the Ray it
#: connected released it), waited for or not: no ``ray.init`` starts while it runs.
_stopping: RayThread | None = None
#: How long a closing runtime waits for the ``ray.shutdown`` it asked for; then it
#: logs it and goes on (the thread, a daemon, is left to finish).
STOP_TIMEOUT_S = 30.0

#: The level of Ray's own logger in this process (``ray.init(logging_level=...)``):
#: its warnings and errors, not its INFO lines (the local Ray started, the
#: authentication token written), which are chatter in a serving runtime's log.
RAY_LOGGING_LEVEL = logging.WARNING


def init_kwargs(cfg: RayConfig) -> dict[str, Any]:
    """The arguments of ``ray.init`` for ``cfg``."""
    kwargs: dict[str, Any] = {"logging_level": RAY_LOGGING_LEVEL}
    if cfg.address is not None:
        kwargs["address"] = cfg.address
    if cfg.namespace is not None:
        kwargs["namespace"] = cfg.namespace
    return kwargs


class _Latch:
    """A flag that a thread sets once, and the callbacks waiting for it: each is
    called once, by the thread that sets it, or at once by a caller that comes
    after. ``lock`` (shared with its owner) is held for no call."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.is_set = False
        self._waiters: list[Callable[[], object]] = []

    def on_set(self, wake: Callable[[], object]) -> None:
        with self._lock:
            if not self.is_set:
                self._waiters.append(wake)
                return
        wake()

    def set(self) -> None:
        with self._lock:
            self.is_set = True
            waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()


class RayThread:
    """The thread that connects Ray (``ray.init``), stays while it is connected, and
    disconnects it (``ray.shutdown``).

    A local Ray's head processes (its GCS, raylet, dashboard) are started with
    ``PR_SET_PDEATHSIG`` on Linux, which fires when the *thread* that started them
    ends, not the process. Connected from one of trio's worker threads, they were
    killed when that thread went idle (10 s after the call): the actors lived on,
    but the process's Ray threads then spun, retrying the lost GCS, and took the
    GIL from the event loop (batches stalled; Ray ends a driver that cannot reach
    its GCS for a minute).

    ``state`` (read and changed under ``_users_lock``) is "connecting" while
    ``ray.init`` runs, then "connected" (the thread is ``_owner``, with one user, the
    caller) or "failed" (``error``: what it raised; the thread ends); or
    "abandoned", set by a caller that stopped waiting for it: a ``ray.init`` that
    returns then is disconnected at once, as nobody uses it. Once asked to stop
    (:meth:`request_stop`), it is ``_stopping`` until ``ray.shutdown`` returns;
    ``ended`` once its work is done (it then returns)."""

    def __init__(self, init: Callable[[], object], shutdown: Callable[[], object]) -> None:
        self._init = init
        self._shutdown = shutdown
        self._stop = threading.Event()
        self.state = "connecting"
        self.error: BaseException | None = None
        lock = threading.Lock()
        self._settled = _Latch(lock)
        self._ended = _Latch(lock)
        self._thread = threading.Thread(target=self._run, name="trioserve-ray", daemon=True)

    def launch(self) -> None:
        """Start the thread (``ray.init``); returns at once."""
        self._thread.start()

    @property
    def settled(self) -> bool:
        """Whether ``ray.init`` has returned and ``state`` and the module's counts
        say so."""
        return self._settled.is_set

    @property
    def ended(self) -> bool:
        """Whether the thread's work is done (its ``ray.shutdown`` returned, and
        ``_stopping`` says so): it is about to return."""
        return self._ended.is_set

    def on_settled(self, wake: Callable[[], object]) -> None:
        """Have ``wake()`` called (in the thread, or here when it is so already) once
        :attr:`settled`."""
        self._settled.on_set(wake)

    def on_ended(self, wake: Callable[[], object]) -> None:
        """Have ``wake()`` called (in the thread, or here when it is so already) once
        :attr:`ended`."""
        self._ended.on_set(wake)

    def join(self) -> None:
        """Wait until the thread has ended. Blocking."""
        self._thread.join()

    def request_stop(self) -> None:
        """Have the thread disconnect Ray (``ray.shutdown``) and end; returns at once."""
        self._stop.set()

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self._ended.set()

    def _serve(self) -> None:
        global _connecting, _owner, _stopping, _users
        error: BaseException | None = None
        try:
            self._init()
        except BaseException as exc:  # the caller raises it (start_ray)
            error = exc
        with _users_lock:
            abandoned = self.state == "abandoned"
            if not abandoned:
                self.state, self.error = ("connected", None) if error is None else ("failed", error)
                if error is None:
                    _owner, _users = self, 1
                if _connecting is self:
                    _connecting = None
        if abandoned:
            # Nobody waits for this Ray: disconnected before another ray.init may start.
            if error is None:
                log.warning("ray.init returned after its start timeout: disconnecting Ray")
                self._disconnect()
            with _users_lock:
                if _connecting is self:
                    _connecting = None
        self._settled.set()
        if abandoned or error is not None:
            return
        self._stop.wait()
        try:
            self._disconnect()
        finally:
            with _users_lock:
                if _stopping is self:
                    _stopping = None

    def _disconnect(self) -> None:
        try:
            self._shutdown()
        except Exception as exc:  # Ray gone already: nothing left to stop
            log.warning("ray.shutdown() failed: %s: %s", type(exc).__name__, exc)


def _setter(done: trio.Event) -> Callable[..., None]:
    """A callable that any thread may call, with any arguments, to set ``done`` in
    the calling trio run; once the run is over it does nothing (nobody waits)."""
    token = trio.lowlevel.current_trio_token()

    def wake(*_: Any) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    return wake


async def _wait_for(on: Callable[[Callable[[], object]], None]) -> None:
    """Wait until the Ray thread calls what ``on`` is given (``owner.on_settled``:
    its ``ray.init`` has returned; ``owner.on_ended``: its work is done). A
    checkpoint; no thread of ours waits: the Ray thread wakes this task through the
    run's TrioToken. Cancelling it abandons the wait (the wake-up then finds nobody
    waiting)."""
    done = trio.Event()
    on(_setter(done))
    await done.wait()


def _ray_named(cfg: RayConfig) -> str:
    """The Ray ``cfg`` names, for an error."""
    if cfg.address is None:
        return "a local Ray (ray.address is not set: one is started in this process)"
    return f"Ray at {cfg.address!r}"


async def start_ray(cfg: RayConfig) -> bool:
    """Connect this process to Ray (``ray.init`` in a thread of its own, which
    lives until Ray is disconnected: see :class:`RayThread`), unless it is
    connected already. Returns whether the caller is to call
    :func:`stop_ray` at close: Ray was connected here, or by another runtime of
    this process still using it (counted: the last one's ``stop_ray`` disconnects
    it, and stops the local Ray started here). A Ray the process's own code
    connected is used as it is and left running (False).

    Raises ConfigError, naming the Ray and the cause, when ``ray.init`` fails
    (whatever it raises), or when it has not returned within ``cfg.start_timeout_s``
    (it is then left to finish in its thread, and disconnected if it connects; no
    other ``ray.init`` starts meanwhile, and another runtime's start waits for it,
    within its own timeout). While another runtime of the process connects, this
    one waits for it and uses the Ray it connected; while the ``ray.shutdown`` of
    a Ray connected before runs (:func:`stop_ray`), it waits for that, within its
    timeout too (a ConfigError past it), then connects afresh. No lock is held while
    ``ray.init`` runs, so a stop is never held up by it. Cancelling it waits for
    the connection to finish or fail, at most ``cfg.start_timeout_s``."""
    # Ray's own failure-signal handler prints a native stack for every SIGTERM, our
    # drain's signal included, which reads as a crash; the caller's choice stands.
    # Ray reads it once, when it is first imported: set before that.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    import ray

    kwargs = init_kwargs(cfg)
    timeout = cfg.start_timeout_s

    def claim(may_launch: bool) -> bool | tuple[RayThread, str] | None:
        """Under the lock: Ray connected already (True: counted, False: not ours), or
        the thread to wait for and why: "own" (this call's ``ray.init``),
        "connecting" (another's) or "stopping" (its ``ray.shutdown`` runs); None: a
        ``ray.init`` is needed, and ``may_launch`` is False."""
        global _users, _connecting
        with _users_lock:
            if _connecting is not None:
                return _connecting, "connecting"
            if _stopping is not None:
                return _stopping, "stopping"
            if ray.is_initialized():
                if _users == 0:
                    return False  # the process's own: not ours to stop
                _users += 1
                return True
            if not may_launch:
                return None
            log.info("connecting to Ray (%s)", cfg.address or "a local Ray, started here")
            owner = _connecting = RayThread(lambda: ray.init(**kwargs), ray.shutdown)
            owner.launch()
            return owner, "own"

    def give_up(owner: RayThread) -> str:
        """Under the lock: the state ``owner`` ended in; "abandoned" if it had not."""
        with _users_lock:
            if owner.state == "connecting":
                owner.state = "abandoned"
            return owner.state

    # Shielded, and bounded by the timeout: the caller counts on a True it is given
    # (it calls stop_ray), so nothing is given up half way.
    with trio.CancelScope(shield=True):
        deadline = trio.current_time() + timeout
        while True:
            claimed = await trio.to_thread.run_sync(claim, trio.current_time() < deadline)
            if isinstance(claimed, bool):
                return claimed
            if claimed is None:  # no time left to try after another's ray.init failed
                raise ConfigError(
                    f"ray.start_timeout_s: cannot connect to {_ray_named(cfg)}: its "
                    f"{timeout:g} s passed waiting for an earlier ray.init of this process, "
                    "which failed"
                )
            owner, why = claimed
            if why == "stopping":
                with trio.move_on_at(deadline):
                    await _wait_for(owner.on_ended)
                if not owner.ended:
                    raise ConfigError(
                        f"ray.start_timeout_s: cannot connect to {_ray_named(cfg)}: the "
                        "ray.shutdown of the Ray this process connected before has not "
                        f"returned within {timeout:g} s"
                    )
                continue  # disconnected: claim connects afresh
            with trio.move_on_at(deadline):
                await _wait_for(owner.on_settled)
            if why == "own":
                break
            if not owner.settled:
                raise ConfigError(
                    f"ray.start_timeout_s: cannot connect to {_ray_named(cfg)}: an earlier "
                    f"ray.init of this process has not returned within {timeout:g} s"
                )
            # it connected (claim counts this runtime in) or failed (claim tries again)
        state = await trio.to_thread.run_sync(give_up, owner)
        if state == "connected":
            return True
        if state == "abandoned":
            raise ConfigError(
                f"ray.start_timeout_s: cannot connect to {_ray_named(cfg)}: ray.init has "
                f"not returned within {timeout:g} s (it is left to finish, and disconnected "
                "if it connects); check the address, or allow longer"
            )
        await trio.to_thread.run_sync(owner.join)  # it has returned: no thread left
    error = owner.error
    if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: as they are
        raise error  # type: ignore[misc]
    key = "ray" if cfg.address is None else "ray.address"
    raise ConfigError(
        f"{key}: cannot connect to {_ray_named(cfg)}: {type(error).__name__}: {error}"
    ) from error


async def stop_ray() -> None:
    """Release the Ray :func:`start_ray` connected: the last runtime using it
    disconnects it (``ray.shutdown``, on the thread that connected it) and waits,
    shielded, at most ``STOP_TIMEOUT_S`` for that. A shutdown that has not returned
    by then is logged and left to finish in its thread (a daemon). No lock is held
    while it runs, and a :func:`start_ray` meanwhile waits for it (no ``ray.init``
    runs beside it).

    Called when no runtime is counted as using it (a start that returned False, or
    a second stop), it logs that and touches nothing: every user counted was counted
    with the thread that connected Ray (``_users`` is 1 when ``_owner`` is set and
    only grows while it is), so the last one out always has that thread to stop it,
    and a Ray without one is the process's own, never ours to disconnect."""

    def release() -> RayThread | None:
        """Under the lock: count this runtime out. The thread that disconnects Ray
        now, if it was the last one (None: others still use it, or nobody did)."""
        global _users, _owner, _stopping
        with _users_lock:
            if _users == 0:
                log.error("stop_ray() with no runtime using the Ray start_ray "
                          "connected: nothing to stop (Ray, if connected, is left as it is)")
                return None
            _users -= 1
            if _users != 0:
                return None
            owner, _owner = _owner, None
            # the users were counted with it (see above)
            assert owner is not None, "Ray's users were counted without its thread"
            _stopping = owner
            owner.request_stop()
            return owner

    with trio.CancelScope(shield=True):
        owner = await trio.to_thread.run_sync(release)
        if owner is None:
            return
        with trio.move_on_after(STOP_TIMEOUT_S):
            await _wait_for(owner.on_ended)
        if not owner.ended:
            log.error("ray.shutdown() has not returned within %g s of the close: the "
                      "runtime closes without waiting for it (it is left to finish in "
                      "its thread; Ray is connected again in this process only once it "
                      "has returned)", STOP_TIMEOUT_S)
            return
        await trio.to_thread.run_sync(owner.join)  # its work is done: it is returning


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
        #: Seconds the actor spent running batches (measured in the actor).
        self.busy_seconds = 0.0
        #: Seconds the actor spent on the last batch whose result was read.
        self.last_run_seconds = 0.0
        self.pid: int | None = None
        #: How the actor ended, in Ray's words, once known.
        self.ended_how: str | None = None
        #: None: what an actor writes goes to Ray's logs, not through us.
        self.stderr_tail: str | None = None

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
            raise WorkerDied(f"its device context was lost: {reply[1]} ({self.name})")
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
        result, or :meth:`wait_exited`): its pid and Ray's reason, those known
        (``pid 4242: it was killed by `ray.kill`.``). Not a checkpoint."""
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
