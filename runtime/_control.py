"""Explicit model control (``server.model_control = "explicit"``): loading, reloading
and unloading a configured model while the runtime serves, as Triton's model control
mode EXPLICIT does (docs/model-control.md).

Every configured model has an entry in ``Runtime.models`` at all times. A model not
loaded is served by a stand-in (``ServedModel.loaded`` false) whose queue refuses every
request with UnknownModel and which has no replica; its metrics are the model's, so
they carry on across unloads and reloads. A loaded model is a *copy*: its queues,
replicas and controllers run in a nursery of their own, in one task of the control's
nursery (itself in the runtime's root nursery), supervised as at the start. A model
whose versions have weights of their own, or with a rollout, is loaded as a whole:
its copy is a ``Family`` (runtime/_versioned.py), every version's queues and
replicas and its rollout's controller, installed in ``Runtime._families`` too.

- **load**: a new copy is started (its replicas' models loaded, each within the
  model's ``load_timeout_s``; every version's, for a family); once it is ready it
  replaces the entry, so new requests go to it, and the copy it replaced (a reload)
  is drained. A reload leaves the model READY (the old copy serves meanwhile).
- **unload**: the stand-in replaces the entry; the copy is drained.
- **draining** a copy: its rollout's controller stops (its shadow's copies in
  flight are withdrawn); its queues hand every new request over to what replaced
  them (a version's to the same version's; a request that looked the model up before
  the swap still gets the new copy, or the stand-in's refusal); what they hold is
  pulled by the copy's replicas, which then retire (each finishes the batches it
  holds, releases its worker process or its model); then the copy's nursery is
  cancelled (its queues' timers, its autoscalers). The drain is bounded by
  ``runtime.unload_timeout_s``: past it, the copy's nursery is cancelled at once
  (its replicas stopped, a worker process killed) and whatever it still holds,
  running or queued, is answered ActorClosed.

A load may bring a configuration of its own (runtime/_load_config.py: keys of the
model's table laid over it, for that load; or Triton's model configuration, as the
config endpoint gives it, read back into them: runtime/_triton_config.py): its copy
runs with it, and a later load without one loads the table again.

Loads and unloads of one model are serialized, in the order asked (each waits for
the one asked before it); a load or unload asked while another of the same kind is
under way shares it (a load: if it loads the same configuration), unless one of the
other kind was asked after it (load, unload, load ends loaded). Each runs as a task
of the control's nursery, so a caller that leaves (cancelled) does not cut it short,
and the runtime's shutdown cancels it cleanly: its callers get ActorClosed.

An unload asked right after loads still to end (under way, or waiting for their
turn) abandons them, as Triton cancels a load on an unload, instead of waiting for
them (a load that hangs is bounded only by ``load_timeout_s``): their callers get
ModelLoadError at once, what the one under way started is cancelled (a load in a
worker thread runs on, and its model is dropped when the thread returns, never
installed). The model's first load is abandoned so, and a reload too: the copy
that served meanwhile serves on until the unload's turn, which then unloads it as
any unload does (its drain bounded by ``runtime.unload_timeout_s``).

Its parts: a model's state and its turns (runtime/_model_state.py), what a request
for a model not loaded gets (runtime/_not_loaded.py), a copy, its drain and the
checks of the requests it hands over (runtime/_model_copy.py,
runtime/_handover_checks.py); the Runtime's methods (runtime/_control_ops.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from ._config import ModelConfig
from ._errors import (
    ActorClosed,
    ConfigError,
    ModelLoadError,
    Overloaded,
    TrioserveError,
    UnknownModel,
    without_model,
)
from ._load_config import changed_keys, with_load_config
from ._model_copy import _close, _Copy, _cut_short, _drain, _install, _invalidate
from ._model_state import ModelState, _Entry, _Op, _turn
from ._not_loaded import LOADING_RETRY_MIN_S, loading_retry_after, not_loaded
from ._served import ServedModel
from ._triton_config import from_triton, triton_shaped
from ._versioned import Family, _MergedQueues

log = logging.getLogger("trioserve")


class ModelControl:
    """Loads, reloads and unloads a runtime's models (see the module's docstring).

    ``prepare(config)`` is what ``start_copy`` needs to start a copy of ``config``
    (its backends), or a function of no arguments that makes it (a backend to make:
    an import, a user's factory), which the load calls in a worker thread when its
    turn comes; or ConfigError when it cannot be (before anything starts; the
    function's, when it fails: nothing starts either);
    ``start_copy(nursery, plan, previous)`` starts a copy of a model in ``nursery``
    (``plan``: what ``prepare`` returned) and returns it once its replicas are
    loaded: a ServedModel, or a Family (every version's, not installed);
    ``previous``: what it replaces (the copy's ServedModel or Family, or the
    stand-in), whose metrics and counters it takes over.
    ``unloaded(config, previous)`` makes a model's stand-in (``previous``: the copy
    it replaces, a ServedModel or a Family, or None).
    ``watchdog`` keeps the wall-clock bound (the model's ``load_timeout_s``) of
    making a backend in a worker thread (None: no bound).
    """

    def __init__(
        self,
        rt: Any,
        *,
        prepare: Callable[[ModelConfig], Any | Callable[[], Any]],
        start_copy: Callable[
            [trio.Nursery, Any, ServedModel | Family], Awaitable[ServedModel | Family]
        ],
        unloaded: Callable[[ModelConfig, ServedModel | Family | None], ServedModel],
        watchdog: Any = None,
    ) -> None:
        self._rt = rt
        self._watchdog = watchdog
        self._prepare = prepare
        self._start_copy = start_copy
        self._unloaded = unloaded
        self._entries = {
            m.name: _Entry(config=m, on_move=self._refuse_as) for m in rt.config.models
        }
        self._nursery: trio.Nursery | None = None
        for m in rt.config.models:
            rt.models[m.name] = unloaded(m, None)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The nursery of the loads, unloads and copies; runs until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self)
            await trio.sleep_forever()

    def state(self, model: str) -> tuple[ModelState, str]:
        entry = self._entry(model)
        return entry.state, entry.reason

    def refusal(self, model: str) -> UnknownModel | Overloaded:
        """What a request for ``model``, configured and not loaded, gets now (by its
        state: :func:`not_loaded`; one loading: with the time its load has left as
        ``retry_after``). Not a checkpoint."""
        entry = self._entry(model)
        if entry.state is ModelState.LOADING:
            return self._loading(entry)
        return not_loaded(model, entry.state)

    def _loading(self, entry: _Entry) -> UnknownModel | Overloaded:
        """The refusal of a request for a model loading, made when it is refused:
        its ``retry_after`` is what the model's last load took less what this one has
        run (:func:`loading_retry_after`; the least once the load has ended, for a
        request handed over to a stand-in replaced since). Not a checkpoint."""
        retry_after: float = LOADING_RETRY_MIN_S
        if entry.state is ModelState.LOADING:
            retry_after = loading_retry_after(
                entry.last_load_s, trio.current_time() - entry.load_began
            )
        return not_loaded(entry.config.name, ModelState.LOADING, retry_after)

    def _refuse_as(self, entry: _Entry) -> None:
        """The model's stand-in (if one takes its requests) refuses them as its
        state says: a request handed over to it (it looked up a copy since
        unloaded) is told the model is unloading, loading or not loaded, as one that
        looks it up now (loading: its Retry-After made when it is refused)."""
        served = self._rt.models.get(entry.config.name)
        if served is not None and not served.loaded:
            served.scheduler.retire(
                not_loaded(entry.config.name, entry.state),
                refusal=(
                    functools.partial(self._loading, entry)
                    if entry.state is ModelState.LOADING else None
                ),
            )

    def _entry(self, model: str) -> _Entry:
        entry = self._entries.get(model) if isinstance(model, str) else None
        if entry is None:
            raise UnknownModel(
                f"unknown model {model!r}: not in the configuration; configured: "
                f"{', '.join(sorted(self._entries))}"
            )
        return entry

    def _ready_nursery(self) -> trio.Nursery:
        if self._nursery is None or self._rt.closed:
            raise ActorClosed("the runtime is shut down")
        return self._nursery

    # ------------------------------------------------------------ load
    async def load(self, model: str, config: Mapping[str, Any] | None = None) -> None:
        """Load ``model``, or reload it if loaded; return once the new copy serves.
        ``config``: keys of the model's table laid over it for this load
        (runtime/_load_config.py), or Triton's model configuration, read back
        into them (runtime/_triton_config.py); None: the table as configured. A
        checkpoint.
        Cancelling it leaves the load under way (its outcome is the model's state).
        Raises UnknownModel, ConfigError (a ``config`` refused: nothing is loaded),
        ModelLoadError (the model kept what it had: a reload's old copy serves on;
        or an unload asked before it ended abandoned it), ActorClosed."""
        try:
            op = self._asked_load(model, config)
        except TrioserveError:
            await trio.lowlevel.checkpoint()  # a refusal still yields
            raise
        await op.wait()

    def _asked_load(self, model: str, config: Mapping[str, Any] | None) -> _Op:
        """The load that ``load(model, config)`` waits for: one under way of the same
        configuration, or a new one, started. Not a checkpoint. Raises as ``load``
        does when the load is refused (nothing started)."""
        entry = self._entry(model)
        nursery = self._ready_nursery()
        if triton_shaped(config):  # Triton's model configuration, as its config gives it
            classes = [c.name for c in self._rt.config.classes]
            # read against the copy its document (GET .../config) describes
            config = from_triton(config, self._rt._probed(model, None), entry.config, classes)
        wanted = entry.config if config is None else with_load_config(entry.config, config)
        op = entry.loading
        if op is None or op is not entry.last or op.config != wanted:
            plan = self._prepare(wanted)  # ConfigError: nothing started
            op = entry.loading = entry.last = _Op(config=wanted, before=entry.last)
            turn = entry.take_turn()
            op.after, op.ends = turn
            nursery.start_soon(self._load, entry, op, turn, plan)
        return op

    async def _load(
        self, entry: _Entry, op: _Op, turn: tuple[trio.Event, trio.Event], plan: Any
    ) -> None:
        name = entry.config.name
        rt = self._rt
        copy: _Copy | None = None
        failure: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                async with _turn(turn):
                    op.began = True
                    if op.abandoned:  # before its turn: not started at all
                        return
                    old = entry.copy
                    was = entry.reason
                    began = entry.load_began = trio.current_time()
                    if old is not None:  # the loaded copy serves meanwhile: READY
                        entry.move(ModelState.READY, "reloading (the loaded copy serves "
                                   "meanwhile)")
                    else:
                        entry.move(ModelState.LOADING, "loading")
                    op.scope = nursery.cancel_scope  # an unload may abandon it
                    if callable(plan):
                        assert op.config is not None
                        try:
                            plan = await _made(
                                name, plan, op.config.load_timeout_s, self._watchdog
                            )
                        except (ConfigError, ModelLoadError) as exc:  # nothing started
                            op.scope = None
                            failure = exc
                            if isinstance(exc, ModelLoadError):  # past its bound
                                log.warning("model %r: %s: the load failed, the model is "
                                            "as it was", name, without_model(name, str(exc)))
                            # the model is as it was (a loaded copy serves on)
                            if old is not None:
                                entry.move(ModelState.READY, old.reason)
                            else:
                                entry.move(ModelState.UNAVAILABLE, was)
                            if entry.loading is op:
                                entry.loading = None
                            return
                    try:
                        started = await self._start_copy(
                            nursery, plan, old.started if old is not None else rt.models[name],
                        )
                    except TrioserveError as exc:
                        if op.abandoned:  # (and failed meanwhile): answered already
                            return
                        failure = (
                            exc if isinstance(exc, ModelLoadError | ConfigError)
                            else ModelLoadError(f"model {name!r}: {without_model(name, str(exc))}")
                        )
                        # the error names the model already, mostly: not twice
                        why = without_model(name, str(failure))
                        if old is not None:
                            entry.move(ModelState.READY, old.reason)
                            log.warning("model %r: reload failed, the loaded copy serves "
                                        "on: %s", name, why)
                        else:
                            entry.move(ModelState.UNAVAILABLE, f"failed to load: {failure}")
                            log.warning("model %r: failed to load: %s", name, why)
                        if entry.loading is op:
                            entry.loading = None
                        # answered once what it started is stopped (the versions
                        # loaded before one failed): nothing of it is left then
                        nursery.cancel_scope.cancel("the model failed to load")
                        return
                    finally:
                        op.scope = None
                    if op.abandoned:
                        # abandoned, but its start ended with no checkpoint since:
                        # never installed, stopped at once
                        nursery.cancel_scope.cancel("the load was abandoned")
                        return
                    copy = _Copy.of(started)
                    assert op.config is not None
                    copy.reason = _runs(entry.config, op.config)
                    entry.copy = copy
                    entry.last_load_s = trio.current_time() - began
                    _install(rt, name, copy)
                    _invalidate(rt, name)
                    entry.move(ModelState.READY, copy.reason)
                    if entry.loading is op:
                        entry.loading = None
                    op.finish()
                    if old is not None:
                        log.info("model %r: reloaded; the copy replaced drains", name)
                        old.retire(copy)
                        entry.replaced.append(old)  # (until it has drained)
                        # nor kept by this task while the new copy serves: only a
                        # request that may run on it keeps it (and the copies after it)
                        old = None
                    else:
                        log.info("model %r: loaded", name)
                    if copy.reason:
                        log.info("model %r: %s", name, copy.reason)
                await copy.stop.wait()
                limit = rt.config.runtime.unload_timeout_s
                with trio.move_on_after(limit) as bound:
                    await _drain(copy)
                if bound.cancelled_caught:
                    copy.cut = _cut_short(name, copy, limit)
                    log.warning("%s", copy.cut)  # it names the model
                # its replicas are stopped (a worker process killed), then what they
                # and its queues still hold is answered (``finally``)
                nursery.cancel_scope.cancel("model copy drained")
        finally:
            if entry.loading is op:
                entry.loading = None
            if failure is not None:
                op.finish(failure)
            op.finish(ActorClosed(
                f"model {name!r}: the runtime shut down before the model loaded"
            ))
            if copy is not None:
                if copy.stop.is_set():  # cut off while draining: answer what it held
                    _close(copy, copy.cut)
                copy.finished.set()
                if copy in entry.replaced:  # drained: the control forgets it
                    entry.replaced.remove(copy)
            op.settled.set()

    # ------------------------------------------------------------ unload
    async def unload(self, model: str) -> None:
        """Unload ``model``: new requests are refused at once (UnknownModel), those
        admitted are answered, then its replicas are released; return then. A model
        not loaded: nothing to do. The loads asked just before it and still to end,
        under way or waiting for their turn, are abandoned, not waited for
        (:meth:`_abandon`, :func:`_loads_before`): the model's first load, or a
        reload (the copy that served meanwhile is then unloaded). A checkpoint;
        cancelling it leaves the unload under way. Raises UnknownModel,
        ActorClosed."""
        try:
            op = self._asked_unload(model)
        except TrioserveError:
            await trio.lowlevel.checkpoint()  # a refusal still yields
            raise
        await op.wait()

    def _asked_unload(self, model: str) -> _Op:
        """The unload that ``unload(model)`` waits for: the one asked last, or a new
        one, started (abandoning the loads asked before it). Not a checkpoint."""
        entry = self._entry(model)
        nursery = self._ready_nursery()
        op = entry.unloading
        if op is None or op is not entry.last:
            loads = _loads_before(entry)
            op = entry.unloading = entry.last = _Op(before=entry.last)
            for load in loads:
                self._abandon(entry, load)
            op.abandoned_loads = loads
            nursery.start_soon(self._unload, entry, op, entry.take_turn())
        return op

    def _abandon(self, entry: _Entry, op: _Op) -> None:
        """Abandon ``op``, a load still to end, an unload having been asked after it
        (as Triton cancels a load on an unload): its callers get ModelLoadError at
        once, and what it started is cancelled (a replica's worker process is
        stopped; a load in a worker thread cannot be stopped: its model, when the
        thread returns, is dropped, never installed). The model's first load leaves
        the model UNLOADING until that has stopped; a reload leaves it READY, the
        copy that served meanwhile serving on until the unload's turn. One whose
        turn has not come is not started at all. Not a checkpoint."""
        name = entry.config.name
        op.abandoned = True
        if entry.loading is op:
            entry.loading = None
        op.finish(ModelLoadError(
            f"model {name!r}: its load was abandoned: an unload of the model was asked "
            "before it ended"
        ))
        if op.scope is None:
            log.info("model %r: a load not begun yet is abandoned: an unload was "
                     "asked after it", name)
            return
        op.scope.cancel("an unload was asked while the model loaded")
        op.scope = None
        assert op.ends is not None
        op.ends.set()  # the unload's turn: it need not wait for the stop of the load
        if entry.copy is None:
            entry.move(ModelState.UNLOADING, "unloading (its load abandoned)")
        else:  # a reload: the loaded copy serves until the unload's turn
            entry.move(ModelState.READY, entry.copy.reason)
            log.info("model %r: a reload is abandoned: an unload was asked while it "
                     "loaded", name)

    async def _unload(
        self, entry: _Entry, op: _Op, turn: tuple[trio.Event, trio.Event]
    ) -> None:
        name = entry.config.name
        rt = self._rt
        try:
            async with _turn(turn):
                copy = entry.copy
                if copy is not None:  # (a reload it abandoned: the copy that served)
                    entry.move(ModelState.UNLOADING, "unloading (requests admitted finish)")
                    stand_in = self._unloaded(entry.config, copy.started)
                    rt.models[name] = stand_in
                    self._refuse_as(entry)  # (unloading)
                    rt._families.pop(name, None)
                    entry.copy = None
                    _invalidate(rt, name)
                    copy.retire(stand_in)
                    await copy.finished.wait()
                    # and a copy an earlier reload replaced, if it is still draining:
                    # once unloaded, nothing of the model holds a worker or a device
                    for older in list(entry.replaced):  # (each leaves it as it ends)
                        await older.finished.wait()
                # its turn came as the loads it abandoned were cancelled: what they
                # started has stopped once their tasks end (a thread's load is not
                # waited for: its model is dropped when the thread returns)
                for load in op.abandoned_loads:
                    await load.settled.wait()
                if copy is not None:
                    if copy.family is not None and len(copy.family.groups) > 1:
                        # the stand-in's flows were the versions' added up when the
                        # unload began: again, with the requests the drain answered
                        stand_in.scheduler.policy.stats = _MergedQueues(
                            [g.scheduler.policy for g in copy.family.groups]
                        ).stats
                    entry.move(ModelState.UNAVAILABLE, "unloaded")
                    log.info("model %r: unloaded", name)
                elif op.abandoned_loads and entry.state is ModelState.UNLOADING:
                    entry.move(ModelState.UNAVAILABLE, "unloaded")
                    log.info("model %r: unloaded while it loaded: its load was "
                             "abandoned", name)
                if entry.unloading is op:
                    entry.unloading = None
                op.finish()
        finally:
            if entry.unloading is op:
                entry.unloading = None
            op.finish(ActorClosed(
                f"model {name!r}: the runtime shut down before the model unloaded"
            ))


def _runs(table: ModelConfig, config: ModelConfig) -> str:
    """The index's reason for a copy of ``config``: "" for the table itself."""
    if config is table:
        return ""
    return ("runs the configuration its load gave (changed: "
            f"{', '.join(changed_keys(table, config))})")


def _loads_before(entry: _Entry) -> list[_Op]:
    """The loads of ``entry`` asked since its last unload, or since the last load
    that ended, and still to end (those an unload asked now abandons), in the order
    asked: the first may be under way (a first load or a reload), the others wait
    for their turn (loads asked in a row share one unless their configurations
    differ). A load whose start has ended (it failed, and is stopping what it
    started) has its own outcome: neither it nor those asked before it are taken."""
    loads: list[_Op] = []
    op = entry.last
    while op is not None and op.config is not None and not op.done.is_set():
        if op.began and op.scope is None:
            break  # its start has ended: its outcome is its own
        loads.append(op)
        assert op.after is not None
        if op.after.is_set():  # the one asked before it has ended
            break
        op = op.before
    return loads[::-1]


async def _made(
    model: str, make: Callable[[], Any], limit: float | None, watchdog: Any
) -> Any:
    """What ``make`` returns (the plan of a copy whose backend it makes: an import, a
    user's factory), called in a worker thread: a slow one does not stall the event
    loop. Bounded by ``limit`` seconds of wall time (the model's ``load_timeout_s``;
    None: unbounded), kept by ``watchdog`` as a replica's load is (a trio timer
    would fire at once under an autojumping MockClock while the thread runs). A
    checkpoint; cancelled, or past its bound, the thread runs on and what it makes
    is dropped. Raises ConfigError: ``make``'s own, or one saying what else it
    raised; ModelLoadError past the bound."""
    with trio.CancelScope() as bound:
        armed = (
            watchdog.arm(limit, bound) if limit is not None and watchdog is not None
            else None
        )
        try:
            return await trio.to_thread.run_sync(make, abandon_on_cancel=True)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"models.{model}.backend: its backend could not be made with the load's "
                f"options: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            if armed is not None:
                watchdog.disarm(armed)
    # Only the bound cancels this scope alone. An unload's cancel of the load's scope
    # (around this one) that comes with the bound's, in the same step of the loop in
    # either order, is not caught here: trio's scope catches Cancelled only when no
    # enclosing scope's cancellation reaches it, so it goes on to the load's scope and
    # the abandonment wins. Once caught here, no checkpoint comes before the raise
    # below: an unload cannot come in between.
    assert limit is not None
    raise ModelLoadError(
        f"model {model!r}: the backend the load's options make did not return within "
        f"load_timeout_s ({limit:g} s)"
    )
