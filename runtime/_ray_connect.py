"""Connecting this process to Ray and disconnecting it: :func:`start_ray` and
:func:`stop_ray`, the count of runtimes using the Ray they connected, and
:class:`RayThread`, the thread that owns the connection.

A runtime with a model on Ray calls :func:`start_ray` as it opens and
:func:`stop_ray` as it closes; several runtimes in one process share the Ray the
first connected, and the last to close disconnects it. ``ray.init`` and
``ray.shutdown`` run in a thread of their own (never one of trio's), and the trio
task waiting for them is woken through the run's TrioToken. Ray is imported only
when a model runs on it (an optional extra).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import trio

from ._config import ModelConfig
from ._errors import ConfigError
from ._ray_config import RayConfig

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
