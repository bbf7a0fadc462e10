"""A loaded copy of a model: its install, its retirement and drain, cut short or closed."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from ._actor import ActorState
from ._errors import ActorClosed
from ._handover_checks import _handed_check
from ._served import ServedModel
from ._versioned import Family


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
    run again in parts, by them). Unloaded, a request held apart for its input
    (it hung a thread earlier) is answered the unload's refusal at once instead."""
    groups = copy.groups
    reloaded = isinstance(copy.successor, _Copy)  # (else: the stand-in refuses them all)
    for served in groups:
        successor = copy.heir(served)
        for lane in served.schedulers:
            after = successor.slow_scheduler if lane is served.slow_scheduler else None
            check = _handed_check(served, successor, lane) if reloaded else None
            # unloaded: what a queue holds apart for its input (it hung a thread
            # earlier) is refused now, never run, not waited for; a reload keeps it
            lane.hand_over(
                after if after is not None else successor.scheduler, check,
                refuse_held=not reloaded,
            )
    for served in groups:
        for lane in served.schedulers:
            await lane.wait_empty()
    going = [b for served in groups for b in served.batchers if _retiring(b)]
    for b in going:
        b.retire()
    for b in going:
        await b.wait_retired()
    _close(copy)


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
