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
"""

from __future__ import annotations

import enum
import functools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import attrs
import trio

from ._actor import ActorState
from ._config import ModelConfig
from ._errors import (
    ActorClosed,
    ConfigError,
    InvalidInput,
    ModelLoadError,
    Overloaded,
    TrioserveError,
    UnknownModel,
    without_model,
)
from ._load_config import changed_keys, with_load_config
from ._messages import Request
from ._model import ModelBackend, TensorSpec
from ._served import ServedModel
from ._triton_config import from_triton, triton_config, triton_platform, triton_shaped
from ._versioned import Family, _MergedQueues

log = logging.getLogger("trioserve")


class ModelState(enum.Enum):
    """A configured model's state, as Triton's repository index names them."""

    UNAVAILABLE = "UNAVAILABLE"  # not loaded (never, unloaded, or its load failed)
    LOADING = "LOADING"  # a copy is loading, and none serves
    READY = "READY"  # loaded (also while it reloads: the loaded copy serves meanwhile)
    UNLOADING = "UNLOADING"  # refusing new requests; those admitted finish


_MOVES = {
    ModelState.UNAVAILABLE: {ModelState.LOADING},
    # LOADING to UNLOADING: an unload abandons the load (what it started stops)
    ModelState.LOADING: {ModelState.READY, ModelState.UNAVAILABLE, ModelState.UNLOADING},
    # READY to READY: a reload begins (its reason says so) or ends
    ModelState.READY: {ModelState.READY, ModelState.UNLOADING},
    ModelState.UNLOADING: {ModelState.UNAVAILABLE},
}


#: A request for a model whose first load is under way: the bounds of its
#: Retry-After (whole seconds), the time the load has left by the model's last load.
LOADING_RETRY_MIN_S = 1
LOADING_RETRY_MAX_S = 30


def loading_retry_after(last_load_s: float | None, loading_for: float) -> float:
    """The Retry-After of a request for a model whose load has run ``loading_for``
    seconds: what is left of ``last_load_s`` (what the model's last load in this
    process took; None: it has not loaded before, and no load time is configured to
    expect) rounded up to whole seconds, within ``LOADING_RETRY_MIN_S`` and
    ``LOADING_RETRY_MAX_S``; the least with no last load. Not a checkpoint."""
    if last_load_s is None:
        return float(LOADING_RETRY_MIN_S)
    left = math.ceil(last_load_s - loading_for)
    return float(min(max(left, LOADING_RETRY_MIN_S), LOADING_RETRY_MAX_S))


def not_loaded(
    model: str, state: ModelState = ModelState.UNAVAILABLE,
    retry_after: float = LOADING_RETRY_MIN_S,
) -> UnknownModel | Overloaded:
    """What a request for a configured model that is not loaded gets, by the model's
    ``state``: one loading is 503 (Overloaded: retry after ``retry_after`` s, as
    Triton answers a model not at its ready state), one unloading or not loaded 404
    (UnknownModel; only the second is told to load it, at a URL the name is
    percent-encoded in)."""
    if state is ModelState.LOADING:
        return Overloaded(
            f"model {model!r} is loading: it serves once its load ends; retry shortly",
            retry_after=retry_after,
        )
    if state is ModelState.UNLOADING:
        return UnknownModel(
            f"model {model!r} is unloading: it takes no new requests (those it "
            "admitted are answered)"
        )
    return UnknownModel(
        f"model {model!r} is not loaded (model control is explicit: load it with "
        f"POST /v2/repository/models/{quote(model, safe='')}/load, or "
        "Runtime.load_model)"
    )


@attrs.define(eq=False)
class _Op:
    """A load or an unload under way; its callers share its outcome."""

    done: trio.Event = attrs.Factory(trio.Event)
    error: BaseException | None = None
    #: a load's: the configuration it loads (the table's, or one a load gave); only a
    #: load of the same configuration shares it
    config: ModelConfig | None = None
    #: set when the one asked before it has ended (its turn may come)
    after: trio.Event | None = None
    #: a load: set when its turn has ended (the next one asked may run); an unload
    #: that abandons it under way sets it at once (what it started stops meanwhile,
    #: never installed)
    ends: trio.Event | None = None
    #: its turn has come
    began: bool = False
    #: a load abandoned by an unload asked after it (``ModelControl._abandon``):
    #: its callers were answered; nothing it started is ever installed
    abandoned: bool = False
    #: a load under way: the scope of what it starts, which an unload asked
    #: meanwhile cancels; None again once its start has ended
    scope: trio.CancelScope | None = None
    #: a load: set once its task has ended (what it started has stopped)
    settled: trio.Event = attrs.Factory(trio.Event)
    #: an unload: the loads it abandoned, whose end it waits for
    abandoned_loads: list[_Op] = attrs.Factory(list)
    #: the load or unload asked just before it (``_Entry.last`` then), while it is
    #: still to end: an unload follows it back to the loads it abandons
    before: _Op | None = None

    def finish(self, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()
        self.before = None  # ended: no op is followed back past it (nor kept alive)

    async def wait(self) -> None:
        await self.done.wait()
        if self.error is not None:
            # a copy for each caller: one exception raised in several tasks would
            # gather their tracebacks
            error = self.error
            raise type(error)(str(error)) from error


@attrs.define(eq=False)
class _Copy:
    """A loaded copy of a model, served by one task of the control's nursery."""

    #: what ``Runtime.models`` holds for it (a family: its default version's)
    served: ServedModel
    #: a model whose versions have weights of their own, or a rollout: all of them
    family: Family | None = None
    #: set when it is to drain, with ``successor`` (what replaced it: a new copy,
    #: or the stand-in of the model unloaded)
    stop: trio.Event = attrs.Factory(trio.Event)
    successor: _Copy | ServedModel | None = None
    #: set when it has drained (or its task ended)
    finished: trio.Event = attrs.Factory(trio.Event)
    #: what its requests still unanswered get when the drain is cut short
    #: (``runtime.unload_timeout_s`` passed); None: it was not
    cut: ActorClosed | None = None
    #: the repository index's reason while it serves: "" for the configuration's
    #: table, else the keys its load's config changed
    reason: str = ""

    @classmethod
    def of(cls, started: ServedModel | Family) -> _Copy:
        if isinstance(started, Family):
            return cls(served=started.by_version[started.default], family=started)
        return cls(served=started)

    @property
    def groups(self) -> list[ServedModel]:
        """Each distinct ServedModel of the copy (a family: one per group of versions)."""
        return list(self.family.groups) if self.family is not None else [self.served]

    @property
    def started(self) -> ServedModel | Family:
        """What was started: the family, or the one ServedModel."""
        return self.family if self.family is not None else self.served

    def retire(self, successor: _Copy | ServedModel) -> None:
        """To drain, ``successor`` taking its new requests; its rollout (if any) stops
        at once: the outcomes and the shadow's copies are the successor's from now.
        A new copy (a reload) is each group's ``ServedModel.successor`` from now."""
        self.successor = successor
        if isinstance(successor, _Copy):
            for group in self.groups:
                group.successor = self.heir(group)
        for group in self.groups:  # a request waiting for credits goes on, or is refused
            group.retired.set()
        if self.family is not None and self.family.controller is not None:
            if not isinstance(successor, _Copy):
                # unloaded: its trial's progress is what its next load resumes
                self.family.controller.keep_progress()
            self.family.controller.close()
        self.stop.set()

    def heir(self, group: ServedModel) -> ServedModel:
        """What takes over the new requests of ``group`` (one of this copy's) once
        it drains: the same versions' group of the copy that replaced it, or the
        stand-in of the model unloaded."""
        after = self.successor
        assert after is not None
        if isinstance(after, ServedModel):
            return after
        if self.family is None or after.family is None:
            return after.served
        version = next(v for v, g in self.family.by_version.items() if g is group)
        return after.family.by_version[version]


def _done() -> trio.Event:
    event = trio.Event()
    event.set()
    return event


@asynccontextmanager
async def _turn(turn: tuple[trio.Event, trio.Event]) -> AsyncIterator[None]:
    """Wait for the operations asked before this one, then run it; its end lets the
    next one run (also when it fails or is cancelled)."""
    before, mine = turn
    try:
        await before.wait()
        yield
    finally:
        mine.set()


@attrs.define(eq=False)
class _Entry:
    """One configured model under control."""

    config: ModelConfig
    state: ModelState = ModelState.UNAVAILABLE
    reason: str = "not loaded"
    #: set when the load or unload asked last has had its turn: each waits for the
    #: one asked before it (a lock would let two asked at once go in either order)
    tail: trio.Event = attrs.Factory(_done)
    copy: _Copy | None = None  # the copy serving (None: not loaded)
    #: copies replaced by a reload, draining (an unload waits for them too); each
    #: leaves it once drained, so that the control keeps none past its drain
    replaced: list[_Copy] = attrs.Factory(list)
    loading: _Op | None = None
    unloading: _Op | None = None
    #: the load or unload asked last: one asked again shares it only if it is
    #: (load, unload, load must end loaded, not share the first load)
    last: _Op | None = None
    #: called after each move (the stand-in's refusal follows the state)
    on_move: Callable[[_Entry], None] | None = None
    #: when the load under way had its turn (trio time; a first load's or a reload's)
    load_began: float = 0.0
    #: how long the model's last load that installed a copy took, in seconds, from its
    #: turn (None: none has yet): a first load's Retry-After is what is left of it
    last_load_s: float | None = None

    def take_turn(self) -> tuple[trio.Event, trio.Event]:
        """A new load's or unload's turn: the end of the one asked before it, and
        its own end, to set when it is done (each runs after all asked before it)."""
        before, self.tail = self.tail, trio.Event()
        return before, self.tail

    def move(self, to: ModelState, reason: str = "") -> None:
        """The one transition function: refuses a move the lifecycle does not have."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(
                f"model {self.config.name!r}: no move from {self.state.value} to {to.value}"
            )
        self.state = to
        self.reason = reason
        if self.on_move is not None:
            self.on_move(self)


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
            config = from_triton(config, self._rt.models[model], entry.config, classes)
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
                    log.warning("model %r: %s", name, copy.cut)
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


def _install(rt: Any, model: str, copy: _Copy) -> None:
    """Make ``copy`` the one serving ``model``: its ServedModel and, for a family,
    its versions' routing (no checkpoint between the two)."""
    rt.models[model] = copy.served
    if copy.family is not None:
        rt._families[model] = copy.family
    else:
        rt._families.pop(model, None)


def _invalidate(rt: Any, model: str) -> None:
    """Drop the model's cached results: they may come from the copy gone."""
    if rt.cache is not None and model in rt._cached:
        rt.cache.invalidate(model, None)


def _retiring(batcher: Any) -> bool:
    """Whether ``batcher`` can retire (one that lost its device, or stopped, pulls
    nothing and holds nothing)."""
    return batcher.lost is None and batcher.state not in (ActorState.STOPPED, ActorState.BROKEN)


async def _drain(copy: _Copy) -> None:
    """Drain a copy replaced by ``copy.successor`` (its rollout's controller stopped
    by ``retire``: the shadow's copies in flight withdrawn): new requests go to the successor
    (each version's to the same version's); those queued here are pulled by the
    copy's replicas, which retire once every one is answered (a batch that fails is
    run again in parts, by them)."""
    groups = copy.groups
    reloaded = isinstance(copy.successor, _Copy)  # (else: the stand-in refuses them all)
    for served in groups:
        successor = copy.heir(served)
        for lane in served.schedulers:
            after = successor.slow_scheduler if lane is served.slow_scheduler else None
            check = _handed_check(served, successor, lane) if reloaded else None
            lane.hand_over(after if after is not None else successor.scheduler, check)
    for served in groups:
        for lane in served.schedulers:
            await lane.wait_empty()
    going = [b for served in groups for b in served.batchers if _retiring(b)]
    for b in going:
        b.retire()
    for b in going:
        await b.wait_retired()
    _close(copy)


def _handed_check(
    before: ServedModel, after: ServedModel, lane: Any
) -> Callable[[Request], None] | None:
    """What checks a request handed over by ``lane`` (a queue of ``before``, a
    replaced copy's) at a reload's swap, to ``after``'s: None when ``after`` takes
    the inputs ``before`` takes (so that the requests handed over pay nothing: they
    are then as ``after``'s own, which hands them on as it does its own); else one
    that checks each against the copy whose queue takes it
    (``SchedulerActor.heir``: ``after``'s, or that of a copy a later reload put in
    its place), made once per such copy (:func:`_inputs_check`). A request handed on
    to an unloaded model's queue is not checked: that queue refuses it."""
    model = before.config.name
    if _inputs_check(model, before.backend, after.backend) is None:
        return None
    made: list[Any] = [None, None]  # the queue it was made for, and the check

    def check(request: Request) -> None:
        end = lane.heir()
        if made[0] is not end:
            served = before.successor
            while served is not None and end not in served.schedulers:
                served = served.successor
            made[:] = end, (
                None if served is None else _inputs_check(model, before.backend, served.backend)
            )
        if made[1] is not None:
            made[1](request)

    return check


def _inputs_check(
    model: str, before: ModelBackend, after: ModelBackend
) -> Callable[[Request], None] | None:
    """What checks a request checked against ``before`` (the model of the copy it
    looked up) and handed to a copy whose model is ``after``: None when ``after``
    takes the same inputs (or any); else a function that raises InvalidInput for
    one ``after`` cannot take, as a request sent to it would be refused (naming the
    input, what the model takes now, and that it was reloaded meanwhile), and
    converts the item's arrays to what ``after`` takes (a dtype it converts) for one
    it can. A backend that prepares its items its own way (its items are not its
    inputs as sent): every request handed over is refused, to be sent again."""
    if after.open_inputs or (
        before.open_inputs == after.open_inputs and tuple(before.inputs) == tuple(after.inputs)
    ):
        return None
    reloaded = (
        "the model was reloaded while this request waited: it now takes "
        f"{TensorSpec.listed(after.inputs)}"
    )
    plain = ModelBackend.prepare
    if type(before).prepare is not plain or type(after).prepare is not plain:

        def refuse(request: Request) -> None:
            raise InvalidInput(f"model {model!r}: {reloaded}; send the request again")

        return refuse

    def check(request: Request) -> None:
        try:
            item, _ = after.prepare(model, request.item)
        except InvalidInput as exc:
            raise InvalidInput(f"{exc} ({reloaded})") from None
        request.item.update(item)  # the same inputs, each of the dtype ``after`` takes

    return check


def _cut_short(model: str, copy: _Copy, limit: float) -> ActorClosed:
    """What the requests a copy still holds get when its drain took ``limit`` s."""
    how = (
        "was reloaded, and the copy it replaced unloaded," if isinstance(copy.successor, _Copy)
        else "was unloaded"
    )
    return ActorClosed(
        f"model {model!r} {how} before this request was answered: the requests it held "
        f"did not finish within runtime.unload_timeout_s ({limit:g} s)"
    )


def _close(copy: _Copy, gone: ActorClosed | None = None) -> None:
    """Answer whatever a drained (or cut off) copy still holds with ``gone``: nothing,
    unless a retiring replica handed a batch back, its drain was cut short
    (``runtime.unload_timeout_s``), or the runtime shut down meanwhile. Call it once
    its replicas' tasks have stopped (or retired)."""
    if gone is None:
        gone = ActorClosed(
            f"model {copy.served.name!r}: its copy was unloaded before this request was "
            "answered"
        )
    for served in copy.groups:
        for b in served.batchers:
            b.fail_current(gone)
        for lane in served.schedulers:
            lane.close(gone)


class _Control:
    """The Runtime's model control methods (``load_model``, ``unload_model``)."""

    #: the model control (None: ``server.model_control = "none"``); set by the assembly
    _control: ModelControl | None = None

    async def load_model(self, model: str, config: Mapping[str, Any] | None = None) -> None:
        """Load ``model`` (one of the configuration's), or reload it if it is loaded:
        a new copy is started and made ready, then takes the new requests, then the
        old copy drains (the requests it holds are answered by it). Returns once the
        new copy serves. Two loads of a model at once (of the same configuration)
        share one; loads and unloads of a model are serialized. A checkpoint;
        cancelling it leaves the load under way.

        ``config``: keys of the model's ``[models.NAME]`` table that this load runs
        with instead of the configuration's (those of one copy: replicas, batching,
        timers, options; docs/model-control.md), or Triton's model configuration
        (as ``GET /v2/models/NAME/config`` gives it, edited), read back into them; a
        later load without it goes back to the table.

        Raises ConfigError (model control is off, or ``config`` refused: a key
        unknown or not one a load may change, or a bad value; nothing is loaded
        then), UnknownModel (not configured), ModelLoadError (it failed to load: the
        model keeps what it had; or an unload asked before it ended abandoned it),
        ActorClosed.
        """
        try:
            control = self._controlled("load", model)
        except ConfigError:
            await trio.lowlevel.checkpoint()  # a refusal still yields
            raise
        await control.load(model, config)

    async def unload_model(self, model: str) -> None:
        """Unload ``model``: from now on its requests get UnknownModel (not loaded);
        those admitted are answered; then its replicas are closed and their workers
        or models released. Returns then. Unloading a model not loaded does nothing;
        a load still to end (the model's first load, or a reload: the copy that
        served meanwhile is unloaded) is abandoned (its callers get ModelLoadError),
        not waited for.
        A checkpoint; cancelling it leaves the unload under way. Raises as
        :meth:`load_model` (but ModelLoadError)."""
        try:
            control = self._controlled("unload", model)
        except ConfigError:
            await trio.lowlevel.checkpoint()  # a refusal still yields
            raise
        await control.unload(model)

    def check_loaded(self, model: str) -> None:
        """Raise UnknownModel unless ``model`` is served and loaded (under explicit
        model control, a configured model may not be; one whose first load is under
        way: Overloaded, 503, to retry shortly). Not a checkpoint."""
        if not self._known(model, None).loaded:  # type: ignore[attr-defined]
            raise self._not_loaded(model)

    def _not_loaded(self, model: str) -> UnknownModel | Overloaded:
        """What a request for ``model``, configured and not loaded, gets now: as its
        state says (loading, unloading or not loaded: :func:`not_loaded`)."""
        if self._control is None:
            return not_loaded(model)
        return self._control.refusal(model)

    def triton_config(self, model: str, version: str | None = None) -> dict[str, Any]:
        """``model``'s configuration as Triton's ``ModelConfig`` document, as ``GET
        /v2/models/NAME[/versions/V]/config`` answers it (``tritonclient``'s
        ``get_model_config``): the copy serving it (a version with weights of its
        own: that version's tensors and replicas). Edited, it is a load's config
        (docs/model-control.md). Not a checkpoint. Raises UnknownModel for a model
        or version not served, or a model not loaded."""
        self.check_loaded(model)
        served = self._known(model, version)  # type: ignore[attr-defined]
        backend = self.models[model].backend  # type: ignore[attr-defined]
        classes = [c.name for c in self.config.classes]  # type: ignore[attr-defined]
        return triton_config(served, triton_platform(backend), classes)

    def model_state(self, model: str) -> tuple[str, str]:
        """``model``'s state and why, as Triton's repository index gives them:
        READY, UNAVAILABLE, LOADING or UNLOADING, and a reason ("" when ready, but
        while it reloads: the loaded copy serves meanwhile, READY; and for a copy
        loaded with a config of its own: the keys it changed).
        UnknownModel for a model not configured."""
        if self._control is None:
            self._known(model, None)  # type: ignore[attr-defined]
            state, reason = ModelState.READY, ""
        else:
            state, reason = self._control.state(model)
        if self.closed:  # type: ignore[attr-defined]
            return ModelState.UNAVAILABLE.value, "the runtime is shut down"
        if state is ModelState.READY and not self.model_ready(model):  # type: ignore[attr-defined]
            return ModelState.UNAVAILABLE.value, "no replica ready"
        return state.value, reason

    def _controlled(self, action: str, model: str) -> ModelControl:
        if self._control is None:
            raise ConfigError(
                f"cannot {action} model {model!r}: model control is off "
                '(server.model_control = "none"): the models served are the '
                "configuration's, loaded at start"
            )
        return self._control
