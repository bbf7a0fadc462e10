"""Calls of several items (``infer_batch``, a split oversize input): submitted at
once without a task per item, all or none across a model's lanes, settled together."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from ._errors import InvalidInput, Overloaded, TrioserveError
from ._messages import CANCELLED, ReplyGroup, Request
from ._outcomes import _never_ran, _note_withdrawal
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
                values = await self._rows(
                    served, model, version, [prepared[i] for i in small], tenant, priority,
                    failed,
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
    ) -> list[Any]:
        """Submit every prepared (item, cost) at once, without a task each, and return
        their outputs in order; the first failure (in item order) is raised, unwrapped,
        after every item is settled (its position appended to ``failed``, if given).
        Cancelling it withdraws every item not yet dispatched. ``latest``, ``due``:
        see :meth:`_infer_prepared`."""
        now = trio.current_time()
        deadline, answer_expiry = self._deadline(served, priority, now, due)
        now, taken = await self._pay(
            tenant, priority, sum(c for _, c in prepared), now, min(deadline, latest),
            served, len(prepared),
        )
        group = ReplyGroup(len(prepared))
        replies = group.replies
        requests = [
            Request(
                model=served.config.name, item=item, cost=cost, tenant=tenant,
                priority=priority, arrival=now, deadline=deadline,
                answer_expiry=answer_expiry, reply=reply,
            )
            for (item, cost), reply in zip(prepared, replies, strict=True)
        ]
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
                # answered meanwhile as pushed out or expired queued never ran either
                unrun = [
                    r for r in requests
                    if r.reply.state is CANCELLED
                    or ((e := r.reply.error) is not None and _never_ran(e))
                ]
                self._refund_unrun(tenant, unrun, taken)
                _note_withdrawal(requests)
                raise
            results: list[Any] = []
            first_error: BaseException | None = None
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
        runs = {id(r.run): r.run for r in replies if r.run is not None}.values()
        if runs:
            m.record_request(
                min(start for start, _ in runs) - now, sum(took for _, took in runs)
            )
        return results

    async def _infer_split(
        self, served: ServedModel, item: Any, tenant: str, priority: str,
        latest: float = math.inf, due: float | None = None,
    ) -> dict[str, Any]:
        # The parts go in as one submission: a part's failure is raised as itself,
        # not wrapped in a nursery's ExceptionGroup.
        parts = served.backend.split(item, served.limits.max_tokens)
        results = await self._submit_all(
            served, parts, tenant, priority, latest=latest, due=due
        )
        return served.backend.merge(results)


def _leading(value: Any) -> int:
    """The leading dimension of a stacked input (0 for a scalar), without converting
    it."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 0
    return len(value) if isinstance(value, list | tuple) else 0
