"""The rollout's actor: one per model with ``[models.NAME.rollout]``, supervised in
the runtime's root nursery next to the model's schedulers and batchers.

It holds the model's :class:`Rollout` (the sans-IO decisions): the runtime routes
each unversioned request by it and records each outcome here; the actor drives the
time (the end of a step's ``step_s``), logs each step (INFO), promotion (INFO) and
rollback (WARNING), and counts them.

With a ``shadow`` version it also runs the shadow's copies: a share of the
unversioned requests stable's model ran for (the runtime offers no cache hit nor
coalesced join) are offered (``shadow_copy``, never a checkpoint) to a bounded
channel; when it is full the copy is dropped and counted.
A few worker tasks take the copies, run them on the shadow version at the lowest
request class (never cached, never returned to anyone) and compare their outputs
with stable's: match, mismatch or error.

With a ``keeper`` (the runtime's state file, ``runtime.rollout_state_file``) each
change that is to outlast a restart (a step begun, promoted, rolled back, paused,
resumed, a trial started) is handed to it (``keeper.decided(rollout, now)``, never
a checkpoint: the keeper writes it later, off the event loop), and so is a trial's
progress when the runtime closes (``keep_progress``).

``close()`` stops it for good (its model's copy was unloaded or replaced, under
explicit model control): it takes no more outcomes nor copies, and its run returns,
its shadow's copies in flight withdrawn.
"""

from __future__ import annotations

import collections
import copy
import logging
import math
from collections.abc import Awaitable, Callable
from fractions import Fraction
from typing import Any

import numpy as np
import trio
from trioserve import Actor, ConfigError, Overloaded, TrioserveError

from ._rollout import Rollout, RolloutEvent, RolloutRules, RolloutState

log = logging.getLogger("trioserve")

#: What a shadow's copy came to: its outputs matched stable's or not, it failed,
#: or it was dropped (its queue full, or the shadow's queue shed it).
SHADOW_RESULTS = ("match", "mismatch", "error", "dropped")
#: The rollout's events, as counted (paused, resumed and started: the operator's only).
ROLLOUT_EVENTS = ("step", "promoted", "rolled_back", "paused", "resumed", "started")


#: How a trial's stable was determined (``Rollout.stable_from``), as logged.
_STABLE_FROM = {
    "configuration": "the configuration's",
    "promoted": "the last trial's canary, promoted",
    "previous": "the last trial's stable",
}


def same_outputs(a: Any, b: Any, *, rtol: float, atol: float) -> bool:
    """Whether two answers agree: the same output names, shapes and dtypes, and
    values equal (floats within ``rtol`` / ``atol``, others exactly)."""
    if not isinstance(a, dict) or not isinstance(b, dict) or a.keys() != b.keys():
        return False
    for name, x in a.items():
        x, y = np.asarray(x), np.asarray(b[name])
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if np.issubdtype(x.dtype, np.inexact):
            if not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
                return False
        elif not np.array_equal(x, y):
            return False
    return True


class RolloutController(Actor):
    """Drives one model's rollout and runs its shadow (see the module's docstring).

    ``run_shadow(inputs, tenant)`` runs a copy on the shadow version and returns
    its outputs; ``closing()``: whether the runtime is shutting down; ``keeper``:
    what keeps its decisions across restarts (``decided(rollout, now)`` and
    ``statistics()``), or None; ``config``: the configuration's rollout, and
    ``versions``: the model's (what a trial the operator starts is checked
    against).
    """

    def __init__(
        self,
        *,
        model: str,
        rollout: Rollout,
        shadow: str | None = None,
        shadow_share: float = 1.0,
        shadow_rtol: float = 1e-5,
        shadow_atol: float = 1e-6,
        shadow_queue: int = 64,
        shadow_workers: int = 4,
        run_shadow: Callable[[Any, str], Awaitable[Any]] | None = None,
        closing: Callable[[], bool] = lambda: False,
        keeper: Any = None,
        config: Any = None,
        versions: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.model = model
        self.name = f"rollout[{model}]"
        self.rollout = rollout
        self.shadow = shadow
        self.events: collections.Counter[str] = collections.Counter()
        self.shadow_results: collections.Counter[str] = collections.Counter()
        self._shadow_share = Fraction(repr(shadow_share))
        self._shadow_seen = 0
        self._shadow_sent = 0
        self._rtol, self._atol = shadow_rtol, shadow_atol
        self._workers = shadow_workers
        self._run_shadow = run_shadow
        self._closing = closing
        self._keeper = keeper
        #: the configuration's rollout (a ``RolloutConfig``: the rules a trial the
        #: operator starts begins from) and the model's versions
        self.config = config
        self.versions = versions
        self._changed = trio.Event()
        self._counted = trio.lowlevel.ParkingLot()  # waiters for shadow results
        self._send, self._receive = trio.open_memory_channel[Any](shadow_queue)
        self._stopped = False
        self._scope: trio.CancelScope | None = None  # its run's, while it runs

    # ------------------------------------------------------------ the runtime's calls
    def route(self) -> str:
        """The version of the next unversioned request (``Rollout.route``)."""
        return self.rollout.route()

    def record(self, version: str, ok: bool, latency: float) -> None:
        """An unversioned request's outcome on ``version`` (not a checkpoint)."""
        if self._stopped:
            return
        self._apply(self.rollout.record(version, ok, latency, trio.current_time()))

    def record_shared(self, version: str) -> None:
        """An unversioned request on ``version`` answered without the model running
        for it (a cache hit, a join): in no check (not a checkpoint)."""
        self.rollout.record_shared(version)

    def record_late(self, version: str) -> None:
        """An unversioned request on ``version`` whose deadline passed in the queue
        (not a checkpoint)."""
        if self._stopped:
            return
        self._apply(self.rollout.record_late(version, trio.current_time()))

    def shadow_copy(self, version: str, inputs: Any, result: Any, tenant: str) -> None:
        """Offer a copy of a request ``version``'s model ran for (the caller offers
        no answer shared from the cache or another's flight) to the shadow: only
        stable's answers, the shadow's share of them; dropped (counted) when the
        shadow's queue is full. Never a checkpoint: the caller is not delayed."""
        if (
            self.shadow is None or version != self.rollout.stable or self._closing()
            or self._stopped
        ):
            return
        self._shadow_seen += 1
        if math.floor(self._shadow_seen * self._shadow_share) <= self._shadow_sent:
            return
        self._shadow_sent += 1
        room = self._send.statistics()
        if room.tasks_waiting_receive == 0 and (
            room.current_buffer_used >= room.max_buffer_size
        ):
            self.shadow_results["dropped"] += 1
            return
        # The copy runs later: the caller may by then have reused its input buffer
        # or changed the answer's arrays in place, so the copy keeps its own.
        self._send.send_nowait((copy.deepcopy(inputs), copy.deepcopy(result), tenant))

    def close(self) -> None:
        """Stop for good: no more outcomes are recorded nor copies taken; the run
        returns, its shadow's copies in flight withdrawn (those queued dropped
        uncounted). Not a checkpoint."""
        self._stopped = True
        if self._scope is not None:
            self._scope.cancel("the rollout's model copy was unloaded or replaced")

    # ------------------------------------------------------------ the operator's
    def operate(self, action: str, reason: str | None = None) -> None:
        """The operator's ``action``: promote, rollback (for ``reason``), pause or
        resume (``Rollout``'s). Not a checkpoint. ConfigError when the rollout's
        state does not allow it (it has no canary, is final, is (not) paused)."""
        r = self.rollout
        why = r.refusal(action)
        if why is not None:
            raise ConfigError(f"model {self.model!r}: cannot {action} its rollout: {why}")
        now = trio.current_time()
        if action == "rollback":
            events = r.rollback(now, reason or "operator")
        else:
            events = getattr(r, action)(now)
        self._apply(events)

    def start(self, canary: str, rules: dict[str, Any]) -> None:
        """The operator starts a new trial of ``canary`` under ``rules`` (the
        ``RolloutRules``' keys, checked) against the version taking every unversioned request now
        (``Rollout.start``). Not a checkpoint. ConfigError while a canary is on
        trial (paused or not); the caller checks ``canary`` is one of the model's
        versions, not that stable, not the shadow."""
        why = self.rollout.refusal("start")
        if why is not None:
            raise ConfigError(f"model {self.model!r}: cannot start a rollout: {why}")
        self._apply(self.rollout.start(canary, RolloutRules(**rules), trio.current_time()))

    def keep_progress(self) -> None:
        """Hand a canary on trial's progress (its step, the time served in it) to
        the keeper: the runtime is closing. Not a checkpoint."""
        if self._keeper is not None and self.rollout.on_trial and not self._stopped:
            self._keeper.decided(self.rollout, trio.current_time())

    # ------------------------------------------------------------ the actor
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as self._scope:
            if self._stopped:
                self._scope.cancel("the rollout's model copy was unloaded or replaced")
            async with trio.open_nursery() as nursery:
                if self.shadow is not None and self._run_shadow is not None:
                    for _ in range(self._workers):
                        nursery.start_soon(self._shadow_worker)
                task_status.started(self)
                while True:
                    self._changed = trio.Event()
                    deadline = self.rollout.next_deadline()
                    if deadline <= trio.current_time():
                        # the step lasted long enough: the canary's next answer ends it
                        deadline = math.inf
                    with trio.move_on_at(deadline):
                        await self._changed.wait()
                    self._apply(self.rollout.tick(trio.current_time()))
        self._scope = None

    async def _shadow_worker(self) -> None:
        assert self._run_shadow is not None
        async for inputs, expected, tenant in self._receive:
            try:
                got = await self._run_shadow(inputs, tenant)
            except Overloaded:
                self.shadow_results["dropped"] += 1
                continue
            except TrioserveError:
                self.shadow_results["error"] += 1
                self._counted.unpark_all()
                continue
            same = same_outputs(got, expected, rtol=self._rtol, atol=self._atol)
            self.shadow_results["match" if same else "mismatch"] += 1
            self._counted.unpark_all()

    async def wait_shadow_results(self, n: int) -> None:
        """Wait until the shadow's copies that ran (match, mismatch or error) are at
        least ``n``. A checkpoint; cancelling it only stops the wait."""
        await trio.lowlevel.checkpoint()
        while sum(self.shadow_results[k] for k in ("match", "mismatch", "error")) < n:
            await self._counted.park()

    def _apply(self, events: list[RolloutEvent]) -> None:
        for e in events:
            self.events[e.kind] += 1
            r = self.rollout
            if e.operator and e.kind != "started":
                # the share it held: a promotion or rollback has moved it to 1 or 0
                held = e.share if e.share_before is None else e.share_before
                log.log(
                    logging.WARNING if e.kind == "rolled_back" else logging.INFO,
                    "model %r: canary %r %s by the operator at step %d, %g of "
                    "unversioned requests%s", self.model, r.canary, e.kind.replace("_", " "),
                    # repr: an operator's reason is one line of the log, whatever it holds
                    e.step + 1, held, f": {e.reason!r}" if e.reason else "",
                )
            elif e.kind == "started":
                log.info(
                    "model %r: rollout started by the operator: canary %r on trial against "
                    "stable %r (%s), at %g of unversioned requests, steps %s",
                    self.model, r.canary, r.stable, _STABLE_FROM[r.stable_from], e.share,
                    list(r.rules.steps),
                )
            elif e.kind == "step":
                log.info(
                    "model %r: canary %r at step %d of %d, %g of unversioned requests",
                    self.model, r.canary, e.step + 1, len(r.rules.steps), e.share,
                )
            elif e.kind == "promoted":
                log.info(
                    "model %r: canary %r promoted: it now takes every unversioned "
                    "request (stable was %r)", self.model, r.canary, r.stable,
                )
            else:
                log.warning(
                    "model %r: canary %r rolled back to %r at step %d: %s",
                    self.model, r.canary, r.stable, e.step + 1, e.reason,
                )
        if events:
            # every event changes what a restart is to start from (a step begun is
            # the trial's progress)
            if self._keeper is not None:
                self._keeper.decided(self.rollout, trio.current_time())
            self._changed.set()

    def statistics(self) -> dict[str, Any]:
        """The rollout now: state, versions, share, step, this step's counts per
        version, a rollback's reason, the recorded state it started from and its
        state file's writes, the events so far, the shadow's counts."""
        r = self.rollout
        return {
            "state": r.state.value,
            "paused": r.state is RolloutState.PAUSED,
            "stable": r.stable,
            "canary": r.canary,
            "share": r.share,
            "step": r.step if r.state is not RolloutState.STABLE else None,
            "steps": list(r.rules.steps),
            "step_started": r.step_started,
            "step_elapsed_s": r.step_elapsed(trio.current_time()),
            "counts": {
                v: {"ok": c.ok, "errors": c.errors, "late": c.late, "shared": c.shared,
                    "p99_ms": c.latency.summary().p99_ms}
                for v, c in r.counts.items()
            },
            "reason": r.reason,
            # the state recorded by an earlier run that it started from (None: afresh)
            "restored": r.restored.value if r.restored is not None else None,
            # the trial: the configuration's or one the operator started, and how
            # its stable was determined
            "origin": r.origin,
            "stable_from": r.stable_from,
            "state_file": self._keeper.statistics() if self._keeper is not None else None,
            "events": {k: self.events[k] for k in ROLLOUT_EVENTS},
            "shadow": (
                {"version": self.shadow, **{k: self.shadow_results[k] for k in SHADOW_RESULTS}}
                if self.shadow is not None else None
            ),
        }
