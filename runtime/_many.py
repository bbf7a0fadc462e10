"""Calls of several items (``infer_batch``, a split oversize input): submitted at
once without a task per item, all or none across a model's lanes, settled together."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import outcome
import trio

from ._errors import InvalidInput, ModelError, Overloaded, TrioserveError
from ._messages import ABANDONED, CANCELLED, ReplyGroup, ReplyRelay, Request
from ._outcomes import _never_ran, _note_withdrawal, _refund_if_unrun
from ._served import ServedModel


class _ManyItems:
    """The Runtime's methods for several items in one call."""

    async def _rows(
        self, served: ServedModel, model: str, version: str | None,
        prepared: list[tuple[Any, int]], tenant: str, priority: str,
        failed: list[int] | None = None,
    ) -> list[Any]:
        """The outputs of prepared items within the token budget, submitted at once
        (through the cache for a cached model). ``failed``: see :meth:`_submit_all`."""
        if model in self._cached:
            return await self.cache.answer_many(
                model, version or served.config.versions[-1], tenant,
                [item for item, _ in prepared],
                lambda idx: self._submit_all(served, [prepared[i] for i in idx], tenant, priority),
            )
        return await self._submit_all(served, prepared, tenant, priority, failed)

    async def _rows_with_oversize(
        self, served: ServedModel, model: str, version: str | None,
        prepared: list[tuple[Any, int]], tenant: str, priority: str,
    ) -> list[Any]:
        """Items some of which cost more than ``max_batch_tokens`` (rare). Under the
        ``reject`` policy (or ``split`` for a model that cannot split) the call is
        refused before anything runs; otherwise the items within the budget are
        submitted together and each oversize one by its policy, all at once, and the
        first failure in item order is raised after every item is settled."""
        limits = served.limits
        budget = limits.max_tokens
        assert budget is not None
        big = [i for i, (_, c) in enumerate(prepared) if c > budget]
        if not (
            limits.oversize == "alone"
            or (limits.oversize == "split" and served.backend.supports_split)
        ):
            await trio.lowlevel.checkpoint()
            raise InvalidInput(
                f"model {model!r}: item {big[0]} costs {prepared[big[0]][1]}, over "
                f"max_batch_tokens {budget} (oversize policy {limits.oversize!r})"
            )
        small = [i for i, (_, c) in enumerate(prepared) if c <= budget]
        out: list[Any] = [None] * len(prepared)
        errors: dict[int, Exception] = {}

        async def run_small() -> None:
            failed: list[int] = []
            try:
                with self._items_at(model, small):
                    values = await self._rows(
                        served, model, version, [prepared[i] for i in small], tenant,
                        priority, failed,
                    )
            except Exception as exc:
                # where the first failure was (a cached model's: its first item)
                errors[small[failed[0] if failed else 0]] = exc
                return
            for i, value in zip(small, values, strict=True):
                out[i] = value

        async def run_big(i: int) -> None:
            item, cost = prepared[i]
            try:
                with self._items_at(model, [i]):
                    out[i] = await self._answer_prepared(
                        served, model, version, item, cost, tenant, priority
                    )
            except Exception as exc:
                errors[i] = exc

        async with trio.open_nursery() as nursery:
            if small:
                nursery.start_soon(run_small)
            for i in big:
                nursery.start_soon(run_big, i)
        if errors:
            raise errors[min(errors)]
        return out

    def _items_at(self, model: str, positions: Sequence[int]) -> AbstractContextManager[None]:
        """Within the block, the calling task's items are the call's ``positions``
        (``CacheActor.items_at``: which of its answers the model did not run for is
        told by their place in the call, for a rollout's checks and shadow)."""
        if model in self._cached:
            return self.cache.items_at(positions)
        return contextlib.nullcontext()

    def _check_count(
        self, served: ServedModel, items: Sequence[Any] | Mapping[str, Any], tenant: str
    ) -> None:
        """Refuse more items in one call than the queue ever holds for the tenant (the
        bound, or the tenant's share of it), before any per-item work: they could
        never be admitted together, so no retry could help, and a batch dimension of
        items of size zero costs nothing to send (``[1000000000, 0]`` is a few
        bytes)."""
        if isinstance(items, Mapping):
            n = max(map(_leading, items.values()), default=0)
        else:
            n = len(items)
        bound = self.config.runtime.queue_bound
        if n > bound:
            raise InvalidInput(
                f"model {served.config.name!r}: {n} items in one request; at most "
                f"{bound} (the queue's bound, runtime.queue_bound)"
            )
        most = served.scheduler.policy.most_queued(tenant)
        if n > most:
            raise InvalidInput(
                f"model {served.config.name!r}: {n} items in one request; tenant "
                f"{tenant!r} may queue at most {most} (its queue_share of "
                f"runtime.queue_bound, {bound})"
            )

    def _submit_split(
        self, served: ServedModel, requests: list[Request], tenant: str, priority: str
    ) -> None:
        """Queue the requests of one call whose items go to both of a model's lanes,
        all or none: each lane decides on its items first (``plan_all_nowait``,
        changing nothing), and only once both admit them are they queued, so a call
        refused in one lane pushes nobody out of the other. A refusal (the first
        lane's, the lane of the call's first item, when both refuse) counts every
        item shed in its own lane and is raised; the caller withdraws the replies."""
        lanes: dict[Any, list[Request]] = {}
        for req in requests:
            lanes.setdefault(served.scheduler_for(req.cost), []).append(req)
        try:
            plans = [(lane, lane.plan_all_nowait(items)) for lane, items in lanes.items()]
        except Overloaded:
            for lane, items in lanes.items():
                lane.policy.note_shed(tenant, priority, len(items))
            raise
        for lane, planned in plans:
            lane.submit_planned_nowait(planned)

    async def _submit_all(
        self,
        served: ServedModel,
        prepared: list[tuple[Any, int]],
        tenant: str,
        priority: str,
        failed: list[int] | None = None,
        *,
        latest: float = math.inf,
        due: float | None = None,
        late: _SplitLate | None = None,
    ) -> list[Any]:
        """Submit every prepared (item, cost) at once, without a task each, and return
        their outputs in order; the first failure (in item order) is raised, unwrapped,
        after every item is settled (its position appended to ``failed``, if given).
        Cancelling it withdraws every item not yet dispatched. ``latest``, ``due``:
        see :meth:`_infer_prepared`. ``late``: the late hooks of the parts of one
        item (``Reply.late``), told of the outcomes before a failure is raised."""
        now = trio.current_time()
        deadline, answer_expiry = self._deadline(served, priority, now, due)
        now, taken = await self._pay(
            tenant, priority, sum(c for _, c in prepared), now, min(deadline, latest),
            served, len(prepared),
        )
        group = ReplyGroup(len(prepared))
        replies = group.replies
        requests = Request.for_items(
            prepared, replies, model=served.config.name, tenant=tenant, priority=priority,
            arrival=now, deadline=deadline, answer_expiry=answer_expiry,
        )
        if late is not None:
            for reply, hook in zip(replies, late.parts, strict=True):
                reply.late = hook
        submitted = 0
        self._in_flight += 1
        try:
            try:
                scheduler = served.scheduler
                if served.slow_scheduler is None or all(
                    served.scheduler_for(r.cost) is scheduler for r in requests
                ):
                    scheduler.submit_all_nowait(requests)
                    submitted = len(requests)
                else:  # split between the lanes: decided in both, then queued in both
                    self._submit_split(served, requests, tenant, priority)
                    submitted = len(requests)
            except BaseException as exc:
                # none of them will run: withdraw those queued before anything (a
                # batcher, at the checkpoint below) can take them
                for reply in replies:
                    reply.withdraw()
                self._refund(tenant, sum(c for _, c in prepared), taken)
                if isinstance(exc, TrioserveError):
                    await trio.lowlevel.checkpoint()  # a refusal still yields
                raise
            try:
                answers = await group.wait()
            except trio.Cancelled:
                # the caller left: the items still queued were withdrawn, and those
                # answered meanwhile as pushed out or expired queued never ran either;
                # one dispatched may yet never run (then it is refunded, alone)
                unrun = [
                    r for r in requests
                    if r.reply.state is CANCELLED
                    or ((e := r.reply.error) is not None and _never_ran(e))
                ]
                self._refund_unrun(tenant, unrun, taken)
                for r in requests:
                    if r.reply.state is ABANDONED:
                        _refund_if_unrun([r.reply], partial(self._refund, tenant, r.cost, taken))
                _note_withdrawal(requests)
                raise
            # every reply is answered and its outcome taken: withdrawing it (below)
            # would change nothing
            submitted = 0
            first_error: BaseException | None = None
            try:
                # nothing failed (as a rule): the values, no outcome unwrapped (none
                # is read again)
                results: list[Any] = [answer.value for answer in answers]
            except AttributeError:
                results = []
                unrun: list[Request] = []
                for i, (answer, req) in enumerate(zip(answers, requests, strict=True)):
                    try:
                        results.append(answer.unwrap())
                    except Exception as exc:
                        if _never_ran(exc):
                            unrun.append(req)
                        if first_error is None:
                            first_error = exc
                            if failed is not None:
                                failed.append(i)
                        results.append(None)
                self._refund_unrun(tenant, unrun, taken)
                if late is not None and first_error is not None:
                    late.answered(answers)
        finally:
            for reply in replies[:submitted]:
                reply.withdraw()
            self._in_flight -= 1
            if self._closed and not self._in_flight:
                self._drained.set()
        if first_error is not None:
            raise first_error
        m = served.metrics
        m.end_to_end.record(trio.current_time() - now)
        # each batch once (its rows share one ``run``), in the order first answered
        first_start = math.inf
        took_all = 0.0
        seen: set[int] = set()
        last = None
        for reply in replies:
            run = reply.run
            if run is None or run is last:
                continue
            last = run
            if id(run) in seen:
                continue
            seen.add(id(run))
            start, took = run
            if start < first_start:
                first_start = start
            took_all += took
        if seen:
            m.record_request(first_start - now, took_all)
        return results

    async def _infer_split(
        self, served: ServedModel, item: Any, tenant: str, priority: str,
        latest: float = math.inf, due: float | None = None, late: Any = None,
    ) -> dict[str, Any]:
        """An oversize item run in parts, their outputs merged. ``late``: the item's
        late hook (see :meth:`_infer_prepared`), fed by its parts' (``_SplitLate``)."""
        # The parts go in as one submission: a part's failure is raised as itself,
        # not wrapped in a nursery's ExceptionGroup.
        parts = served.backend.split(item, served.limits.max_tokens)
        hooks = None if late is None else _SplitLate(late, len(parts), served.backend.merge)
        try:
            results = await self._submit_all(
                served, parts, tenant, priority, latest=latest, due=due, late=hooks
            )
        finally:
            if hooks is not None:
                hooks.close()
        return served.backend.merge(results)


def _leading(value: Any) -> int:
    """The leading dimension of a stacked input (0 for a scalar), without converting
    it."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 0
    return len(value) if isinstance(value, list | tuple) else 0


class _PartLate:
    """The late hook (``Reply.late``) of one part of an item run in parts: what the
    replica tells it (the protocol of the flight's ``LateOutcome``: ``expect``,
    ``settle``, ``carry``) goes to the item's :class:`_SplitLate`."""

    __slots__ = ("_owner", "call_at", "carried", "carrier", "done", "expected", "result")

    def __init__(self, owner: _SplitLate) -> None:
        self._owner = owner
        self.expected = False
        self.carried = False
        self.done = False
        self.result: outcome.Outcome | None = None
        self.call_at: Any = None
        self.carrier: Any = None

    def expect(self, call_at: Any = None) -> None:
        self.expected = True
        self.call_at = call_at
        self._owner._check()

    def settle(self, result: outcome.Outcome | None) -> None:
        if self.done:
            return
        self.done = True
        self.result = result
        self.call_at = None
        self.carrier = None
        self._owner._check()

    def carry(self, reply: Any) -> bool:
        owner = self._owner
        if not self.expected or self.done or owner.over or owner.whole.abandoned:
            return False
        self.carried = True
        self.call_at = None
        self.carrier = reply
        owner.whole.hold(reply)
        owner._check()
        return True


class _SplitLate:
    """The late outcome of an item run in parts, for the flight waiting for it
    (``whole``: its ``LateOutcome``). When the call fails (a part answered
    DeadlineExceeded while its batch ran), the whole outcome is to come if every
    part has an answer or its batch's to come (:meth:`answered`): the whole then
    expects it, on the clock of a part still running (trio's when none), and is
    settled with the parts' outputs merged once each came, or as soon as one fails
    with its error (none when no outcome came of it). A part answered the model's
    error (ModelError), or refused before it ran (InvalidInput: its inputs too
    large for a worker's message, a reloaded model that takes other inputs),
    makes that error the whole outcome at once, as a whole item's late error of
    the input's own is. Otherwise (a part expired queued, or failed otherwise)
    none comes. Either way the parts' batches that still run for it are
    left to others (their carriers withdrawn)."""

    __slots__ = ("_at", "_live", "_merge", "over", "parts", "whole")

    def __init__(self, whole: Any, n: int, merge: Any) -> None:
        self.whole = whole
        self._merge = merge
        self.parts = [_PartLate(self) for _ in range(n)]
        #: the whole expects its outcome (see :meth:`answered`)
        self._live = False
        #: the whole's outcome was given, or none will come
        self.over = False
        self._at: Any = None  # the clock the whole keeps its waits on

    def answered(self, answers: list[outcome.Outcome]) -> None:
        """The call's outcomes, one an error at least: tell the whole to expect its
        outcome if each part has one to come. A part answered the model's error
        (ModelError), or refused before it ran (InvalidInput), has answered the
        whole: its outcome is that error (the first such part's, in item order, as
        a direct caller of the item gets it), as for an item run whole; a rerun
        would only raise it again, or be refused again. (A refused part used to
        leave no outcome: the flight ran the item again for its waiters, to be
        refused the same.) Not a checkpoint."""
        for answer in answers:
            if isinstance(answer, outcome.Error) and isinstance(
                answer.error, (ModelError, InvalidInput)
            ):
                self._live = True
                self.whole.expect(None)
                self._end(outcome.Error(answer.error))
                return
        for answer, part in zip(answers, self.parts, strict=True):
            if isinstance(answer, outcome.Value):
                part.done, part.result = True, outcome.Value(answer.value)
            elif not part.expected:
                self._end(None)  # this part's item will not be computed
                return
        self._live = True
        self._at = self._clock()
        self.whole.expect(self._at)
        self._check()

    def close(self) -> None:
        """The call is over: if the whole expects nothing, nothing is carried for it."""
        if not self._live:
            self._end(None)

    def _clock(self) -> Any:
        for part in self.parts:
            if not part.done and part.call_at is not None:
                return part.call_at
        return None

    def _check(self) -> None:
        if not self._live or self.over:
            return
        pending = False
        for part in self.parts:
            if not part.done:
                pending = True
            elif not isinstance(part.result, outcome.Value):
                self._end(part.result if isinstance(part.result, outcome.Error) else None)
                return
        if pending:
            at = self._clock()
            if at is not self._at:  # the part whose clock it kept is done
                self._at = at
                self.whole.expect(at)
            return
        self._end(outcome.capture(
            self._merge,
            [part.result.value for part in self.parts],  # type: ignore[union-attr]
        ))

    def _end(self, result: outcome.Outcome | None) -> None:
        self.over = True
        for part in self.parts:
            carrier, part.carrier = part.carrier, None
            if carrier is not None and not part.done:
                # through its relay: the queue holding it for a retry drops it now
                ReplyRelay.withdraw_reply(carrier)
        if self._live:
            self.whole.settle(result)
