"""The runtime suite's reference of what several replicas of a model do together:
hedge copies (``SchedulerActor.submit_copy_nowait``, ``twins``, ``keep_apart``), a
part of a failed batch run once elsewhere after it raised alone on a replica
(``Reply.raised_on``, ``SchedulerActor._next_retry``), and each replica's circuit
breaker (``Breaker.raised``, ``Breaker.confirmed``, docs/faults.md).

:class:`Replicas` is told every batch a replica starts and ends (by the simulated
device of ``fuzz/_device.py``), and what the scheduler does with hedge copies and
retries (by :func:`scheduler_class`, a subclass of the product's scheduler), and
records violations of:

- ``hedge``: a copy and its original never run in one batch; when one is answered
  with a result, the other is withdrawn at once (queued, it never starts; running,
  its answer is dropped);
- ``elsewhere``: a part of a failed batch that raised alone on a replica while
  another replica of its lane was ready is not taken back by that replica while
  another one is ready (the runtime suite's outcome check adds: nor answered that
  replica's error);
- ``breaker``: after every batch, each replica's breaker holds exactly the failures
  and the open time of a reference fed the evidence docs/faults.md names: a raise of
  a request alone on fresh work once another batch of the model succeeded since the
  replica's run of failures began; a part that raised alone there during the same run
  and was answered with a result by another replica, while the breaker was closed; a
  success closes it and begins a new run.

A request is named by its part and whether it is a hedge copy: ``(item key, offset
of the part, copy)``.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import attrs
from trioserve import RequestState

from ._stats import expect, note

RKey = tuple[int, int, bool]

# The scheduler's paths for several replicas, shown in the summary even when a run
# never takes them.
expect(
    "runtime",
    "hedge: copies queued",
    "hedge: requests kept apart from their twin's replica",
    "hedge: requests kept apart, their twin in flight",
    "elsewhere: parts marked to run on another replica",
    "elsewhere: retry pulls leaving a part to another replica",
    "elsewhere: parts taken back (no other replica ready)",
    "elsewhere: marked parts kept apart from their twin's replica",
    "elsewhere: pulls leaving a part kept apart to another replica",
    "elsewhere: marked parts kept apart, then handed to another replica",
    "elsewhere: parts taken back (no other replica ready), kept apart before",
    "breakers opened",
)


@attrs.define
class BreakerModel:
    """The reference of one replica's ``Breaker`` (its rules as docs/faults.md
    states them; the thresholds read from the product's breaker)."""

    threshold: int
    base: float
    max_cooldown: float
    cooldown: float
    failures: int = 0
    open_until: float = -math.inf
    since: int | None = None
    run: int = 0
    opened: int = 0

    @classmethod
    def like(cls, breaker: Any) -> BreakerModel:
        return cls(
            threshold=breaker.threshold,
            base=breaker.base,
            max_cooldown=breaker.max_cooldown,
            cooldown=breaker.base,
        )

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            self.open_until = now + self.cooldown
            self.cooldown = min(self.max_cooldown, self.cooldown * 2)
            self.opened += 1

    def raised(self, now: float, successes: int, *, alone: bool) -> None:
        if self.since is None:
            self.since = successes
            return
        if alone and successes > self.since and now >= self.open_until:
            self.failure(now)  # (while open: a batch staged before, no new evidence)

    def confirmed(self, now: float, run: int) -> bool:
        if run != self.run or now < self.open_until:
            return False
        self.failure(now)
        return True

    def success(self) -> None:
        self.failures = 0
        self.cooldown = self.base
        self.open_until = -math.inf
        self.since = None
        self.run += 1


@attrs.define
class Mark:
    """A part that raised alone on ``replica`` (during its breaker's run ``run``)
    while another replica was ready: it runs once elsewhere. ``pending`` until it
    starts again."""

    replica: int
    run: int
    pending: bool = True


@attrs.define(eq=False)
class Replicas:
    """See the module docstring. ``batchers``: the model's batchers by index, set
    once the runtime is open; ``lane_of``: replica index -> its lane."""

    lane_of: Any
    #: compare the breakers with the reference (not when the replicas run on
    #: workers, ``Scenario.running``: a worker's loss counts too, which the
    #: reference does not model)
    breakers: bool = True
    batchers: list[Any] = attrs.Factory(list)
    violations: list[tuple[str, str]] = attrs.Factory(list)
    #: id(reply) -> the other reply of its hedge (both ways)
    twin: dict[int, Any] = attrs.Factory(dict)
    #: id(reply) of each copy -> (original request, copy request)
    copies: dict[int, tuple[Any, Any]] = attrs.Factory(dict)
    #: how many times each request started on a replica
    starts: collections.Counter[RKey] = attrs.Factory(collections.Counter)
    #: the requests that ran in a batch that failed (the model raised, or its worker
    #: was cut off or died running it): their next batch is a retry, which says
    #: nothing of its replica (a batch staged behind, handed back as it was, is not)
    suspects: set[RKey] = attrs.Factory(set)
    #: the execution each request is running now (started, not ended)
    running: dict[RKey, Any] = attrs.Factory(dict)
    marks: dict[RKey, Mark] = attrs.Factory(dict)
    models: dict[int, BreakerModel] = attrs.Factory(dict)
    successes: int = 0
    #: (original's RKey) -> "copy" or "original": which answered a hedged request
    answered_by: dict[RKey, str] = attrs.Factory(dict)

    # ---------------------------------------------------------------- naming
    def rkey(self, part: tuple[int, int], req: Any) -> RKey:
        return (part[0], part[1], id(req.reply) in self.copies)

    def _fail(self, invariant: str, message: str) -> None:
        self.violations.append((invariant, message))

    def _model(self, index: int) -> BreakerModel:
        m = self.models.get(index)
        if m is None:
            m = self.models[index] = BreakerModel.like(self.batchers[index]._breaker)
        return m

    def others_ready(self, index: int) -> list[int]:
        """The replicas of ``index``'s lane, other than it, ready now."""
        lane = self.lane_of(index)
        return [
            b.index for b in self.batchers
            if b.index != index and self.lane_of(b.index) == lane and b.ready
        ]

    # ---------------------------------------------------------------- the scheduler
    def copy_offered(self, original: Any, copy: Any, taken: bool) -> None:
        if not taken:
            note("runtime", "hedge: copies declined (no free room)")
            return
        note("runtime", "hedge: copies queued")
        if original.reply.state is RequestState.DISPATCHED:
            note("runtime", "hedge: copies queued while the original was dispatched")
        self.twin[id(original.reply)] = copy.reply
        self.twin[id(copy.reply)] = original.reply
        self.copies[id(copy.reply)] = (original, copy)

    def handed_back(self, puller: Any, batch: list[Any], part_of: Any, how: str) -> None:
        """``_next_retry`` or ``_next_apart`` (``how``: "retry", "apart") gave
        ``batch`` to ``puller``: a part marked to run elsewhere goes back to the
        replica it raised on only if no other is ready."""
        for req in batch:
            key = self.rkey(part_of(req), req)
            mark = self.marks.get(key)
            if mark is None or not mark.pending:
                continue
            if mark.replica != puller.index:
                if how == "apart":
                    note(
                        "runtime",
                        "elsewhere: marked parts kept apart, then handed to another replica",
                    )
                continue
            ready = self.others_ready(puller.index)
            if ready:
                self._fail(
                    "elsewhere",
                    f"item {key[0]} (part at {key[1]}{', hedge copy' if key[2] else ''}) "
                    f"raised alone on replica {mark.replica} as a retry while another "
                    f"replica was ready, and was handed back to replica {puller.index}"
                    + (" (kept apart from its hedge twin's replica)" if how == "apart" else "")
                    + f" while replica(s) {ready} were ready: it runs once elsewhere",
                )
            else:
                note(
                    "runtime",
                    "elsewhere: parts taken back (no other replica ready)"
                    + (", kept apart before" if how == "apart" else ""),
                )

    # ---------------------------------------------------------------- the replicas
    def started(self, ex: Any, batch: list[Any]) -> None:
        keys = [self.rkey(p, req) for p, req in zip(ex.parts, batch, strict=True)]
        ex.keys = keys
        ex.retried = [k in self.suspects for k in keys]
        replies = {id(req.reply) for req in batch}
        for k, req in zip(keys, batch, strict=True):
            self.starts[k] += 1
            self.running[k] = ex
            twin = self.twin.get(id(req.reply))
            if twin is not None and id(twin) in replies and k[2]:
                self._fail(
                    "hedge",
                    f"replica {ex.replica} started item {k[0]} and its hedge copy in one "
                    f"batch at t={ex.at:.6g}: a copy never runs on its original's replica",
                )
            if k[2] and (k[0], k[1], False) in self.running:
                note("runtime", "hedge: copies started while their original ran")
            mark = self.marks.get(k)
            if mark is not None and mark.pending:
                mark.pending = False
                if mark.replica == ex.replica:
                    note("runtime", "elsewhere: marked parts run again on their replica")
                else:
                    note("runtime", "elsewhere: marked parts run on another replica")

    def at_model(self, ex: Any, batch: list[Any], broken: bool) -> None:
        """The model is called on ``ex`` (its answers follow at once): what the
        batcher will see of the replies and the other replicas."""
        ex.broken = broken
        ex.answerable = [req.reply.answerable for req in batch]
        ex.others_ready = bool(self.others_ready(ex.replica))
        ex.twins_answerable = [
            (t is not None and t.answerable)
            for t in (self.twin.get(id(req.reply)) for req in batch)
        ]

    def left(self, ex: Any) -> None:
        """``ex`` left its worker unanswered: the worker was killed (a cut-off, a
        loss, a replacement) or died; the replica hands it back."""
        for k in ex.keys:
            if self.running.get(k) is ex:
                del self.running[k]
        if ex.status in ("killed", "died"):
            self.suspects.update(ex.keys)

    def ended(self, ex: Any, batch: list[Any], now: float) -> None:
        """``ex`` ended (its model answered or raised; the batcher has delivered)."""
        for k in ex.keys:
            if self.running.get(k) is ex:
                del self.running[k]
        if ex.status not in ("ok", "error"):
            return
        model = self._model(ex.replica)
        if ex.status == "ok":
            model.success()
            self.successes += 1
            for k, ans in zip(ex.keys, ex.answerable, strict=True):
                mark = self.marks.get(k)
                if ans and mark is not None and mark.replica != ex.replica:
                    origin = self._model(mark.replica)
                    stale = mark.run != origin.run
                    if origin.confirmed(now, mark.run):
                        note("runtime", "elsewhere: results elsewhere counted against a replica")
                    else:
                        note(
                            "runtime",
                            "elsewhere: results elsewhere not counted ("
                            + ("it succeeded since" if stale else "its breaker open") + ")",
                        )
            self._twins_withdrawn(ex, batch)
        else:
            self.suspects.update(ex.keys)
            if not all(ex.retried):
                model.raised(now, self.successes, alone=len(batch) == 1)
            k = ex.keys[0]
            if (
                len(batch) == 1 and ex.answerable[0] and ex.retried[0]
                and k not in self.marks and ex.others_ready
            ):
                self.marks[k] = Mark(replica=ex.replica, run=model.run)
                ex.marked = True
                note("runtime", "elsewhere: parts marked to run on another replica")
        self._compare(now)

    def _twins_withdrawn(self, ex: Any, batch: list[Any]) -> None:
        for k, req, ans, twin_was in zip(
            ex.keys, batch, ex.answerable, ex.twins_answerable, strict=True
        ):
            twin = self.twin.get(id(req.reply))
            if twin is None:
                continue
            if twin.answerable:
                self._fail(
                    "hedge",
                    f"replica {ex.replica} answered item {k[0]}"
                    f"{' (the hedge copy)' if k[2] else ''} at t={ex.at:.6g}+ with a "
                    f"result, but its hedge twin is still {twin.state.value}: the other "
                    "is withdrawn at once",
                )
                continue
            if ans and twin_was:
                original = (k[0], k[1], False)
                self.answered_by.setdefault(original, "copy" if k[2] else "original")
                note(
                    "runtime",
                    "hedge: answered by the " + ("copy" if k[2] else "original") + ", the "
                    "other withdrawn "
                    + ("while queued" if twin.state is RequestState.CANCELLED else "running"),
                )

    def _compare(self, now: float) -> None:
        if not self.breakers:
            return
        for b in self.batchers:
            model = self.models.get(b.index)
            if model is None:
                continue
            br = b._breaker
            if br.failures != model.failures or br.open_until != model.open_until:
                self._fail(
                    "breaker",
                    f"at t={now:.6g} replica {b.index}'s breaker counts {br.failures} "
                    f"failure(s), open until {br.open_until:.6g}; the reference "
                    f"{model.failures}, open until {model.open_until:.6g} (run {model.run})",
                )
                self.models[b.index] = attrs.evolve(
                    model, failures=br.failures, open_until=br.open_until
                )  # report once

    def finish(self) -> None:
        note("runtime", "breakers opened", sum(m.opened for m in self.models.values()))


def scheduler_class(base: type, replicas: Replicas, part_of: Any) -> type:
    """The product's scheduler (``base``), telling ``replicas`` the hedge copies it
    takes or declines, the requests it keeps apart, and the retries and requests
    kept apart it hands out."""

    class ObservedScheduler(base):  # type: ignore[misc, valid-type]
        def submit_copy_nowait(self, original: Any, copy: Any) -> bool:
            taken = super().submit_copy_nowait(original, copy)
            replicas.copy_offered(original, copy, taken)
            return taken

        def keep_apart(self, request: Any) -> None:
            note("runtime", "hedge: requests kept apart from their twin's replica")
            twin = self.twins.get(request.reply)
            if twin is not None and any(b.holds(twin) for b in self.batchers):
                note("runtime", "hedge: requests kept apart, their twin in flight")
            if request.reply.raised_on is not None:
                note("runtime", "elsewhere: marked parts kept apart from their twin's replica")
            super().keep_apart(request)

        def _next_retry(self, puller: Any, now: float) -> list[Any] | None:
            return handed_out(
                super()._next_retry(puller, now), puller, "retry",
                "elsewhere: retry pulls leaving a part to another replica",
            )

        def _next_apart(self, puller: Any, now: float) -> list[Any] | None:
            # a part marked to run elsewhere may be kept apart from its twin's
            # replica too: the same rule holds for its next pull
            return handed_out(
                super()._next_apart(puller, now), puller, "apart",
                "elsewhere: pulls leaving a part kept apart to another replica",
            )

    def handed_out(
        batch: list[Any] | None, puller: Any, how: str, left: str
    ) -> list[Any] | None:
        """``batch`` given to ``puller`` is checked against the elsewhere rule; None
        (each waits for another replica) is noted as ``left``."""
        if batch is None:
            note("runtime", left)
        elif batch and puller is not None:
            replicas.handed_back(puller, batch, part_of, how)
        return batch

    ObservedScheduler.__name__ = ObservedScheduler.__qualname__ = f"Observed{base.__name__}"
    return ObservedScheduler
