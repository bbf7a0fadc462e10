"""A model's state under explicit model control: its lifecycle, its loads and unloads in turn."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from ._config import ModelConfig
from ._model_copy import _Copy


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
