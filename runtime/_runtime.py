"""The assembly: ``open_runtime`` wires a scheduler and batchers per model under one
supervising nursery, and ``Runtime.infer`` is the in-process front door."""

from __future__ import annotations

import collections
import logging
import math
import operator
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import outcome
import trio

from ._actor import RestartPolicy, supervise
from ._builtin import resolve_backend
from ._config import Config, ModelConfig, load_config
from ._errors import (
    ActorClosed,
    ConfigError,
    Forbidden,
    InvalidInput,
    ModelLoadError,
    Overloaded,
    QuotaExceeded,
    TrioserveError,
    Unauthorized,
    UnknownModel,
)
from ._messages import CANCELLED, DONE, Reply, ReplyGroup, Request
from ._model import ModelBackend, item_list
from ._zygote import Zygote, ZygoteError

log = logging.getLogger("trioserve")


class _SwitchIntervals:
    """The process's ``sys.setswitchinterval`` while runtimes are open.

    The first runtime to open saves the process's interval, the last to close puts
    it back; meanwhile the smallest interval of the open runtimes applies (each runs
    its loop at least that responsively), whatever order they open and close in.
    Runtimes may run in different threads (``serve_in_thread``), hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[float] = []  # seconds, one per open runtime
        self._saved = 0.0

    def enter(self, seconds: float) -> None:
        with self._lock:
            if not self._open:
                self._saved = sys.getswitchinterval()
            self._open.append(seconds)
            sys.setswitchinterval(min(self._open))

    def exit(self, seconds: float) -> None:
        with self._lock:
            self._open.remove(seconds)
            sys.setswitchinterval(min(self._open) if self._open else self._saved)


_switch_intervals = _SwitchIntervals()


@attrs.define(eq=False)
class ServedModel:
    """A model as served: its config, backend, scheduler, batchers and metrics."""

    config: ModelConfig
    backend: ModelBackend
    scheduler: Any
    batchers: list[Any]
    metrics: Any
    limits: Any
    timeout: float
    #: requests of at least this cost go to the slow lane's own queue and replicas
    slow_cost: int | None = None
    slow_scheduler: Any = None
    #: recent end-to-end latencies; their p95 is when a hedged request sends its copy
    hedge_timer: Any = None

    @property
    def name(self) -> str:
        return self.config.name

    def scheduler_for(self, cost: int) -> Any:
        if self.slow_cost is not None and cost >= self.slow_cost:
            return self.slow_scheduler
        return self.scheduler

    @property
    def schedulers(self) -> list[Any]:
        return [s for s in (self.scheduler, self.slow_scheduler) if s is not None]


class Runtime:
    """A running trioserve: call :meth:`infer`. Made by :func:`open_runtime`."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.models: dict[str, ServedModel] = {}
        self._closed = False
        self._in_flight = 0
        self._drained = trio.Event()
        self._grace_deadline = math.inf
        self._grace_wait: trio.CancelScope | None = None  # a close's wait, while it waits
        self._classes = {c.name: c for c in config.classes}
        #: class -> its timeout in seconds (inf: none)
        self._class_timeouts = {
            c.name: c.timeout_ms / 1e3 if c.timeout_ms is not None else math.inf
            for c in config.classes
        }
        self._class_order = [c.name for c in config.classes]
        self._tenants = {t.name: t for t in config.tenants}
        self._default_tenant = next((t.name for t in config.tenants if t.default), None)
        #: tenant -> its default class (the first it may use) and the set it may use
        self._tenant_classes: dict[str, tuple[str, frozenset[str]]] = {}
        for t in config.tenants:
            allowed = [c for c in self._class_order if not t.classes or c in t.classes]
            self._tenant_classes[t.name] = (allowed[0], frozenset(allowed))
        #: per-tenant token buckets (tenants with a credit_rate), made at start
        self.buckets: dict[str, Any] = {}
        #: cost units admitted per tenant (what its credits paid for, when it has some)
        self.credits_used: collections.Counter[str] = collections.Counter()
        #: Of what was charged, the cost units given back (requests that never ran).
        self.credits_refunded: collections.Counter[str] = collections.Counter()
        #: Takes that waited for a refill (a class with ``over_quota = "wait"``), and
        #: the seconds they waited, per tenant: a wait before the queue, which the
        #: flows' wait (before dispatch, from the queue) leaves out.
        self.credit_waits: collections.Counter[str] = collections.Counter()
        self.credit_wait_seconds: collections.Counter[str] = collections.Counter()
        #: hedged copies sent (requests still unanswered after the model's p95)
        self.hedges = 0
        #: the result cache and in-flight coalescing (None when no model uses them)
        self.cache: Any = None
        self._cached: frozenset[str] = frozenset()

    # ------------------------------------------------------------ public
    async def infer(
        self,
        model: str,
        inputs: Any,
        *,
        tenant: str | None = None,
        priority: str | int | None = None,
        version: str | None = None,
    ) -> dict[str, Any]:
        """Run one item through ``model`` and return its outputs (name -> numpy array).

        ``inputs`` maps input names to array-likes for ONE item (no batch dimension);
        a single-input model also takes the bare array. The request's deadline is the
        caller's effective deadline (or the model's timeout, if sooner); the request is
        never dispatched after it. A checkpoint. Cancelling it withdraws the request
        if it has not been dispatched yet.

        Raises UnknownModel, InvalidInput, Overloaded, DeadlineExceeded (the model's
        timeout), ModelError (the model raised, or answered against its declared
        outputs), ActorClosed (shut down). A refusal
        before the request waited anywhere is a checkpoint too, so a caller that
        retries at once cannot hold the event loop (and the queue it waits to enter)
        to itself.
        """
        try:
            served = self._served(model, version)
            tenant, priority = self._classify(tenant, priority)
            item, cost = served.backend.prepare(model, inputs)
        except TrioserveError:
            await trio.lowlevel.checkpoint()
            raise
        max_tokens = served.limits.max_tokens
        if model in self._cached or (max_tokens is not None and cost > max_tokens):
            return await self._answer_prepared(
                served, model, version, item, cost, tenant, priority
            )
        # uncached and within the budget: what _answer_prepared would do, one
        # coroutine call instead of three
        return await self._submit(served, item, cost, tenant, priority)

    async def _answer_prepared(
        self, served: ServedModel, model: str, version: str | None, item: Any, cost: int,
        tenant: str, priority: str,
    ) -> dict[str, Any]:
        if model in self._cached:
            # The computation runs in the cache actor's nursery, outside this caller's
            # cancel scopes: its wait for credits is bounded by the caller's deadline
            # here, as it is uncached (a refusal at once, not the caller's timeout).
            latest = trio.current_effective_deadline()
            return await self.cache.answer(
                model, version or served.config.versions[-1], tenant, item,
                lambda: self._infer_prepared(served, item, cost, tenant, priority, latest),
                priority=priority,
            )
        return await self._infer_prepared(served, item, cost, tenant, priority)

    async def _infer_prepared(
        self, served: ServedModel, item: Any, cost: int, tenant: str, priority: str,
        latest: float = math.inf,
    ) -> dict[str, Any]:
        """Submit one prepared item (split or refused if oversize). ``latest``: the
        latest time to wait for its credits until, besides its deadline (the first
        caller's deadline, for a computation the cache actor runs)."""
        model = served.config.name
        limits = served.limits
        if limits.max_tokens is not None and cost > limits.max_tokens:
            if limits.oversize == "split" and served.backend.supports_split:
                return await self._infer_split(served, item, tenant, priority, latest)
            if limits.oversize != "alone":
                await trio.lowlevel.checkpoint()
                raise InvalidInput(
                    f"model {model!r}: request cost {cost} exceeds max_batch_tokens "
                    f"{limits.max_tokens} (oversize policy {limits.oversize!r})"
                )
        return await self._submit(served, item, cost, tenant, priority, latest)

    async def infer_batch(
        self,
        model: str,
        items: Sequence[Any] | Mapping[str, Any],
        *,
        tenant: str | None = None,
        priority: str | int | None = None,
        version: str | None = None,
    ) -> list[dict[str, Any]]:
        """Run several items (each as for :meth:`infer`) and return their outputs in
        order. All are submitted at once, without a task per item; the first failure
        (in item order) is raised after every item is settled. Cancelling it withdraws
        every item not yet dispatched. For a cached model, items found in the cache are
        answered from it and the others (an item repeated in ``items`` once) are
        submitted together and kept; unlike :meth:`infer`, they do not join identical
        requests in flight (a single item does, taking :meth:`infer`'s path).

        ``items`` is a sequence of items, or the items stacked: a mapping input name
        -> array whose leading dimension indexes the items (as a v2 batch dimension);
        stacked inputs are checked once, not item by item. A refusal before waiting
        is a checkpoint, as for :meth:`infer`.
        """
        try:
            served = self._served(model, version)
            tenant, priority = self._classify(tenant, priority)
            items = item_list(model, items, "infer_batch")  # any iterable, as before
            self._check_count(served, items, tenant)
            if isinstance(items, Mapping):
                prepared = served.backend.prepare_rows(model, items)
                items = [item for item, _ in prepared]
            else:
                prepared = [served.backend.prepare(model, x) for x in items]
        except TrioserveError:
            await trio.lowlevel.checkpoint()
            raise
        if len(prepared) == 1:
            item, cost = prepared[0]
            return [await self._answer_prepared(served, model, version, item, cost, tenant,
                                                priority)]
        limits = served.limits
        if limits.max_tokens is not None and any(c > limits.max_tokens for _, c in prepared):
            return await self._rows_with_oversize(
                served, model, version, prepared, tenant, priority
            )
        return await self._rows(served, model, version, prepared, tenant, priority)

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
    ) -> list[Any]:
        """Submit every prepared (item, cost) at once, without a task each, and return
        their outputs in order; the first failure (in item order) is raised, unwrapped,
        after every item is settled (its position appended to ``failed``, if given).
        Cancelling it withdraws every item not yet dispatched. ``latest``: see
        :meth:`_infer_prepared`."""
        now = trio.current_time()
        deadline, answer_expiry = self._deadline(served, priority, now)
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

    def statistics(self) -> dict[str, Any]:
        """Per-model counters and latency summaries (computed now; not for hot paths)."""
        out = {}
        for name, s in self.models.items():
            m = s.metrics
            out[name] = {
                "queue_depth": sum(q.queue_depth() for q in s.schedulers),
                "batches": m.batches,
                "items": m.items,
                "fill_ratio": m.fill_ratio,
                "queue_wait": m.queue_wait.summary(),
                "batch_exec": m.batch_exec.summary(),
                "end_to_end": m.end_to_end.summary(),
                "statuses": dict(m.statuses),
                "replicas": [
                    {"name": b.name, "state": b.state.value, "restarts": b.restarts}
                    for b in s.batchers
                ],
                "ready": self.model_ready(name),
                **self._queue_statistics(s.scheduler.policy),
                "slow_lane": (
                    self._queue_statistics(s.slow_scheduler.policy)
                    if s.slow_scheduler is not None else None
                ),
                "hedges_after_s": s.hedge_timer.value if s.hedge_timer is not None else None,
            }
        return out

    @staticmethod
    def _queue_statistics(policy: Any) -> dict[str, Any]:
        limit = getattr(policy, "limit", None)
        live = policy.queued_by_flow() if hasattr(policy, "queued_by_flow") else {}
        flows = {
            f"{tenant}/{cls}": {
                "queued": live.get((tenant, cls), 0),
                "admitted": f.admitted,
                "shed": f.shed,
                "expired": f.expired,
                "dispatched": f.dispatched,
                "served_cost": f.served_cost,
                "hedged": f.hedged,
                "withdrawn": f.withdrawn,
                "closed": f.closed,
                "pushed_out": f.pushed_out,
                "superseded": f.superseded,
                "gave_way": f.gave_way,
                "wait": f.wait.summary(),
            }
            for (tenant, cls), f in sorted(getattr(policy, "stats", {}).items())
        }
        return {
            "flows": flows,
            "admission_limit": limit.value if limit is not None else None,
            "service_rate": getattr(policy, "rate", None),
        }

    def cache_statistics(self) -> dict[str, Any]:
        """The result cache (hits, misses, hit rate, bytes, evictions, admissions
        rejected) and coalescing (requests that joined one in flight); {} when off."""
        return self.cache.statistics() if self.cache is not None else {}

    # ---- the edge's use of the cache: whole encoded answers, keyed by the raw request
    def response_key(
        self, model: str, version: str | None, tenant: str, raw: bytes, variant: bytes = b""
    ) -> Any:
        """The cache key of a wire request's encoded answer, an opaque value for
        ``cached_response`` and ``keep_response`` (None: ``model`` is not cached).
        Identical bytes from the same tenant get the same answer without being parsed,
        run or encoded again; ``variant`` (a content coding) keeps each form apart."""
        if model not in self._cached or self.cache.cache is None:
            return None
        cache = self.cache.cache
        version = version or self.models[model].config.versions[-1]  # the default: the last
        key = cache.raw_key(model, version, tenant, raw, variant)
        if key is None:
            return None
        # The answer is kept no longer than the cached results it is made of (a
        # model without a TTL: for as long as they are).
        until = self.cache.track_expiry() if cache.rule(model).ttl < math.inf else None
        return key, cache.generation(model), until

    def cached_response(self, key: Any) -> Any:
        """The kept answer of ``key``, or None. A miss here is not counted: the
        request goes on to the item cache, whose lookups count its outcome (else a new
        request counted as two misses)."""
        cache = self.cache.cache
        hit = cache.get(key[0], trio.current_time())
        if hit is None:
            cache.policy.misses -= 1
        return hit

    def keep_response(self, key: Any, answer: Any, size: int, tenant: str) -> None:
        """Keep an encoded answer, unless its model was invalidated since ``key`` was
        made (the answer may come from the weights invalidated), until the first of
        the results it was made of expires (a cached one may be older than it)."""
        key, generation, until = key
        cache = self.cache.cache
        if cache.generation(key.model) == generation:
            size += cache.key_bytes(key)
            cache.put(key, answer, size=size, now=trio.current_time(), tenant=tenant,
                      expires=math.inf if until is None else until[0])

    def invalidate_cache(self, model: str, version: str | None = None) -> int:
        """Drop the cached results of a model (or of one of its versions); return how
        many. Call it when the model's weights change under the same version: from then
        on no request of the model joins a computation started before, whether the
        model is cached or only coalesced.

        Raises UnknownModel for a model or version not served (a name mistyped would
        otherwise drop nothing and say 0), and InvalidInput for a version that is not
        a string, as :meth:`infer` does."""
        self._known(model, version)
        if self.cache is None:
            return 0
        return self.cache.invalidate(model, version)

    def tenant_statistics(self) -> dict[str, dict[str, Any]]:
        """Per tenant: cost units admitted (credits used), refunded, and, for tenants
        with a credit rate, the credits available now and the waits for a refill
        (how many takes waited, and for how many seconds in all)."""
        now = trio.current_time()
        out: dict[str, dict[str, Any]] = {}
        for t in self.config.tenants:
            bucket = self.buckets.get(t.name)
            avail = None
            if bucket is not None:
                avail = min(bucket.burst, bucket.level + max(0.0, now - bucket.stamp) * bucket.rate)
            out[t.name] = {
                "weight": t.weight,
                "credits_used": self.credits_used.get(t.name, 0),
                "credits_refunded": self.credits_refunded.get(t.name, 0),
                "credits_available": avail,
                "credit_waits": self.credit_waits.get(t.name, 0),
                "credit_wait_seconds": self.credit_wait_seconds.get(t.name, 0.0),
            }
        return out

    def model_ready(self, model: str) -> bool:
        """Whether ``model`` can serve now: the runtime is open and at least one of its
        replicas is ready (running, not degraded by a straggler, not replacing its
        worker, its circuit breaker closed)."""
        served = self.models[model]
        return not self._closed and any(
            getattr(b, "ready", False) for b in served.batchers
        )

    def health(self) -> dict[str, Any]:
        """Per model: ready or not, and each replica's health."""
        return {
            name: {
                "ready": self.model_ready(name),
                "replicas": {b.name: getattr(b, "health", b.state.value) for b in s.batchers},
            }
            for name, s in self.models.items()
        }

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def grace_deadline(self) -> float:
        """When the shutdown's grace period ends, in trio time (``inf`` until it begins).

        Leaving :func:`open_runtime` normally begins it unless it has begun already:
        it is then at most ``runtime.graceful_timeout_s`` away. Requests in flight and
        a model call cut off in a worker thread get until this deadline. A server that
        begins its shutdown before leaving the block (``trioserve serve`` on a signal,
        draining its connections first) sets it then, so that its drain and the
        runtime's close share one grace instead of one each. Setting it while the
        runtime closes moves the close's wait: to now or earlier, it ends at once.
        """
        return self._grace_deadline

    @grace_deadline.setter
    def grace_deadline(self, deadline: float) -> None:
        self._grace_deadline = deadline
        if self._grace_wait is not None:
            self._grace_wait.deadline = deadline

    # ------------------------------------------------------------ internals
    def _served(self, model: str, version: str | None) -> ServedModel:
        served = self._known(model, version)
        if self._closed:
            raise ActorClosed("the runtime is shut down")
        return served

    def _known(self, model: str, version: str | None) -> ServedModel:
        """The model ``model`` serves, with ``version`` (if given) one of its own."""
        served = self.models.get(model) if isinstance(model, str) else None
        if served is None:
            raise UnknownModel(
                f"unknown model {model!r}; serving: {', '.join(sorted(self.models))}"
            )
        if version is not None and version not in served.config.versions:
            if not isinstance(version, str):
                # as in the config, where versions are names: 2 is not "02" or "v2"
                raise InvalidInput(
                    f"model {model!r}: version must be a string, one of "
                    f"{', '.join(map(repr, served.config.versions))} (as the config "
                    f"names them), got {type(version).__name__} {version!r}"
                )
            raise UnknownModel(
                f"model {model!r} has no version {version!r}; versions: "
                f"{', '.join(served.config.versions)}"
            )
        return served

    def _classify(self, tenant: str | None, priority: str | int | None) -> tuple[str, str]:
        """The tenant and the request class of a call, checked.

        ``priority`` is a class name, or a Triton-style integer level (1 is the top
        class; 0, or a level past the last class, is the tenant's default, as Triton
        takes a level past its model's ``priority_levels``); None is the tenant's
        default class.
        """
        if tenant is None:
            tenant = self._default_tenant
            if tenant is None:
                raise Unauthorized("no tenant given and no default tenant is configured")
        elif type(tenant) is not str and not isinstance(tenant, str):
            raise InvalidInput(f"a tenant is named by a string, got {tenant!r}")
        classes = self._tenant_classes.get(tenant)
        if classes is None:
            raise Unauthorized(
                f"unknown tenant {tenant!r}; tenants: {', '.join(sorted(self._tenants))}"
            )
        default, allowed = classes
        if priority is None:
            return tenant, default
        if not isinstance(priority, str) or priority not in self._classes:
            level = self._class_of_level(priority)
            if level is None:
                return tenant, default
            priority = level
        if priority not in allowed:
            raise Forbidden(
                f"tenant {tenant!r} may not use request class {priority!r}; "
                f"allowed: {', '.join(c for c in self._class_order if c in allowed)}"
            )
        return tenant, priority

    def _class_of_level(self, priority: Any) -> str | None:
        level = priority
        if isinstance(level, str):
            if level.isascii() and level.isdigit():
                digits = level.lstrip("0") or "0"
                # past the last class either way (and int() refuses 4,300 digits)
                level = int(digits) if len(digits) <= 18 else len(self._class_order) + 1
        elif not isinstance(level, bool | int) and hasattr(type(level), "__index__"):
            try:
                level = operator.index(level)  # a numpy integer, say
            except TypeError:
                pass  # refused below
        if isinstance(level, int) and not isinstance(level, bool) and level >= 0:
            if level == 0 or level > len(self._class_order):
                return None
            return self._class_order[level - 1]
        raise InvalidInput(
            f"unknown request class {priority!r}; classes: {', '.join(self._class_order)} "
            "(or an integer level, 1 = highest)"
        )

    def _deadline(self, served: ServedModel, priority: str, now: float) -> tuple[float, bool]:
        """The request's deadline and whether the runtime answers its expiry.

        It is the caller's deadline, or the model's (or the class's) timeout when that
        is sooner; in the second case the runtime answers DeadlineExceeded itself.
        """
        timeout = served.timeout
        cls_timeout = self._class_timeouts[priority]
        if cls_timeout < timeout:
            timeout = cls_timeout
        caller_deadline = trio.current_effective_deadline()
        own = now + timeout
        if own < caller_deadline:
            return own, True
        return caller_deadline, False

    async def _pay(
        self, tenant: str, priority: str, cost: int, now: float, deadline: float,
        served: ServedModel, n: int = 1,
    ) -> tuple[float, int]:
        """Take ``cost`` from the tenant's credits for ``n`` requests to ``served``,
        waiting for them when its class allows (at most until ``deadline``); return the
        time the requests reach the queue and the take's number (for ``_refund``).
        Raises QuotaExceeded (429) with the refill time as retry_after; the requests
        count as shed for their flow."""
        bucket = self.buckets.get(tenant)
        if bucket is None:
            self.credits_used[tenant] += cost
            return now, 0
        if self._classes[priority].over_quota == "reject":
            wait = bucket.try_take(cost, now)
            if wait > 0.0:
                served.scheduler.policy.note_shed(tenant, priority, n)
                await trio.lowlevel.checkpoint()  # a refusal still yields
                raise QuotaExceeded(
                    f"tenant {tenant!r} is over its credit rate "
                    f"({bucket.rate:g}/s, burst {bucket.burst:g}); "
                    f"{cost} more available in {_seconds(wait)}",
                    retry_after=wait,
                )
            self.credits_used[tenant] += cost
            return now, bucket.seq
        at = bucket.reserve(cost, now, deadline)
        if at is None:
            served.scheduler.policy.note_shed(tenant, priority, n)
            await trio.lowlevel.checkpoint()
            raise QuotaExceeded(
                f"tenant {tenant!r} is over its credit rate ({bucket.rate:g}/s) and its "
                "credits refill only after the request's deadline",
                retry_after=bucket.wait_time(cost, now),
            )
        self.credits_used[tenant] += cost
        taken = bucket.seq
        if at > now:
            self.credit_waits[tenant] += 1
            try:
                await trio.sleep_until(at)
            except trio.Cancelled:
                bucket.refund(cost)  # never used: give the credits back
                self.credits_used[tenant] -= cost
                self.credits_refunded[tenant] += cost
                raise
            finally:
                self.credit_wait_seconds[tenant] += trio.current_time() - now
            now = trio.current_time()
        return now, taken

    def _refund(self, tenant: str, cost: int, since: int) -> None:
        """Give back the credits of a request that never ran (the queue refused it,
        pushed it out, or held it past its deadline, or its caller withdrew it while
        queued); ``since`` is the bucket's ``seq`` of its take (see
        TokenBucket.refund)."""
        self.credits_used[tenant] -= cost
        self.credits_refunded[tenant] += cost
        bucket = self.buckets.get(tenant)
        if bucket is not None:
            bucket.refund(cost, since=since)

    def _refund_unrun(self, tenant: str, unrun: list[Request], since: int) -> None:
        """``_refund`` for the items of one take that never ran, at once."""
        if unrun:
            self._refund(tenant, sum(r.cost for r in unrun), since)

    async def _submit(
        self, served: ServedModel, item: Any, cost: int, tenant: str, priority: str,
        latest: float = math.inf,
    ) -> dict[str, Any]:
        now = trio.current_time()
        deadline, answer_expiry = self._deadline(served, priority, now)
        taken = 0
        if self.buckets:
            now, taken = await self._pay(
                tenant, priority, cost, now, min(deadline, latest), served
            )
        else:  # no tenant has credits: nothing to await on the hot path
            self.credits_used[tenant] += cost
        reply = Reply()
        request = Request(
            model=served.config.name, item=item, cost=cost, tenant=tenant,
            priority=priority, arrival=now, deadline=deadline,
            answer_expiry=answer_expiry, reply=reply,
        )
        scheduler = served.scheduler_for(cost)
        try:
            scheduler.submit_nowait(request)
        except BaseException as exc:
            self._refund(tenant, cost, taken)
            if isinstance(exc, TrioserveError):
                await trio.lowlevel.checkpoint()  # a refusal still yields
            raise
        self._in_flight += 1
        hedge = served.hedge_timer
        delay = None  # when to send a hedged copy (None: never)
        # A copy needs another replica than its original's to run on.
        if hedge is not None and priority == self._class_order[0] and scheduler.replicas > 1:
            delay = served.config.hedge_after_ms
            delay = delay / 1e3 if delay is not None else hedge.value
        try:
            if delay is not None:
                result = await self._hedged(
                    scheduler, request, delay, lambda: self._refund(tenant, cost, taken)
                )
            else:
                try:
                    result = await reply.wait()
                except trio.Cancelled:
                    if reply.state is CANCELLED:  # withdrawn while queued: never ran
                        self._refund(tenant, cost, taken)
                        _note_withdrawal([request])
                    raise
        except TrioserveError as exc:
            # Admitted, then pushed out of a full queue by another tenant, or expired
            # in the queue: it never ran, so it is not charged. (A hedged request
            # raises such an error only when its copy did not run either.)
            if _never_ran(exc):
                self._refund(tenant, cost, taken)
            raise
        finally:
            self._in_flight -= 1
            if self._closed and not self._in_flight:
                self._drained.set()
        elapsed = trio.current_time() - now
        m = served.metrics
        m.end_to_end.record(elapsed)
        run = request.reply.run
        if run is not None:
            m.record_request(run[0] - now, run[1])
        if hedge is not None:
            hedge.record(elapsed)
        return result

    async def _hedged(
        self, scheduler: Any, request: Request, delay: float, refund: Callable[[], None]
    ) -> Any:
        """Wait for ``request``; if it is not answered within ``delay``, queue a copy
        for another replica (only into free room: with none, there is no hedge) and
        take whichever answer comes first. The other is withdrawn (or, if already
        running, its answer dropped).

        An error that says a request never ran (refused, pushed out or given its room
        back, expired queued) is no answer while the other may still run: a copy
        pushed out of the queue while its original runs does not fail the caller.
        When neither ran, the original's error is raised.

        ``refund`` is called when the caller leaves (is cancelled) and neither the
        original nor its copy ever ran.
        """
        answer: list[outcome.Outcome] = []
        unrun: list[outcome.Outcome | None] = [None, None]  # the original's, the copy's
        won: list[int] = []  # which of the two answered first (not a never-ran error)
        pending = 1
        copy: Request | None = None
        left = False
        try:
            async with trio.open_nursery() as nursery:

                async def wait_for(i: int, reply: Reply) -> None:
                    nonlocal pending
                    try:
                        value: outcome.Outcome = outcome.Value(await reply.wait())
                        # the caller reads the execution that answered from its own
                        if reply is not request.reply and not answer:
                            request.reply.run = reply.run
                    except Exception as exc:
                        value = outcome.Error(exc)
                        if _never_ran(exc):
                            unrun[i] = value
                            pending -= 1
                            if pending:
                                return  # the other may still run
                            value = unrun[0] or value
                            i = -1  # neither ran: no answer came first
                    if not answer:
                        answer.append(value)
                        if i >= 0:
                            won.append(i)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(wait_for, 0, request.reply)
                await trio.sleep(delay)
                copy = attrs.evolve(request, reply=Reply(), arrival=trio.current_time())
                if scheduler.submit_copy_nowait(request, copy):
                    self.hedges += 1
                    pending += 1
                    nursery.start_soon(wait_for, 1, copy.reply)
                else:
                    copy = None  # no free room: wait for the original alone
        except BaseException:  # the caller left: a group of Cancelled, from the nursery
            # Both waits withdrew their requests. Neither ran if each was withdrawn
            # while queued or had been answered a never-ran error.
            left = True
            if (request.reply.state is CANCELLED or unrun[0] is not None) and (
                copy is None or copy.reply.state is CANCELLED or unrun[1] is not None
            ):
                refund()
            raise
        finally:
            if copy is not None:
                scheduler.forget_copy(request, copy)
            _note_hedge_over(request, copy, won, left=left)
        return answer[0].unwrap()

    async def _infer_split(
        self, served: ServedModel, item: Any, tenant: str, priority: str,
        latest: float = math.inf,
    ) -> dict[str, Any]:
        # The parts go in as one submission: a part's failure is raised as itself,
        # not wrapped in a nursery's ExceptionGroup.
        parts = served.backend.split(item, served.limits.max_tokens)
        results = await self._submit_all(served, parts, tenant, priority, latest=latest)
        return served.backend.merge(results)

    async def _drain(self) -> None:
        """Refuse new requests; wait for those in flight until the grace deadline."""
        self._closed = True
        if self._in_flight:
            with trio.move_on_at(self._grace_deadline) as self._grace_wait:
                await self._drained.wait()
            self._grace_wait = None

    async def _join_threads(self) -> None:
        """Wait until the grace deadline (shielded) for every model call still
        running in a worker thread to return."""
        with trio.CancelScope(deadline=self._grace_deadline, shield=True) as self._grace_wait:
            for served in self.models.values():
                for b in served.batchers:
                    await b.join_thread()
        self._grace_wait = None


def _limits(cfg: ModelConfig, backend: ModelBackend) -> Any:
    from trioserve.actors import BatchLimits

    return BatchLimits(
        max_size=cfg.max_batch_size,
        max_tokens=cfg.max_batch_tokens,
        max_wait=cfg.max_wait_ms / 1e3,
        padded=backend.padded,
        oversize=cfg.oversize,
    )


@asynccontextmanager
async def open_runtime(config: Config | None = None) -> AsyncIterator[Runtime]:
    """Start the runtime: per model a scheduler and one batcher per replica, each
    supervised; models are loaded before this returns.

    On leaving the block normally, new requests are refused (ActorClosed), requests in
    flight get up to ``runtime.graceful_timeout_s`` to finish (or until
    ``rt.grace_deadline``, when the caller began the grace sooner), then every request
    still waiting is failed with ActorClosed: nothing hangs and nothing is lost. If the block
    raises, or an actor escalates, everything is cancelled at once.
    """
    if config is None:
        config = load_config()
    limits_cfg = config.runtime
    _check_devices(config)
    backends = {m.name: resolve_backend(m) for m in config.models}
    policy = RestartPolicy(
        intensity=limits_cfg.restart_intensity, period=limits_cfg.restart_period_s
    )
    from trioserve.actors import Watchdog

    rt = Runtime(config)
    _make_buckets(rt, trio.current_time())
    zygote: Zygote | None = None
    watchdog = Watchdog()
    watchdog.start()
    switch_interval = limits_cfg.switch_interval_us * 1e-6
    _switch_intervals.enter(switch_interval)
    # The body's own exception is re-raised unwrapped after the nursery closes; only an
    # actor's escalation comes out of the nursery itself.
    body_error: BaseException | None = None
    normal_exit = False  # the body returned: the grace deadline is set
    try:
        async with trio.open_nursery() as nursery:
            try:
                if any(
                    (m.execution or backends[m.name].default_execution) == "process"
                    for m in config.models
                ):
                    zygote = Zygote()
                    log.info("starting worker processes (their parent imports torch)")
                    try:
                        await zygote.start()
                    except ZygoteError as exc:
                        raise ModelLoadError(
                            f"worker processes cannot start: {exc}"
                        ) from exc
                await _start_cache(nursery, rt, policy)
                for m in config.models:
                    await _start_model(
                        nursery, rt, m, backends[m.name], policy, zygote, watchdog
                    )
                yield rt
                # The grace begins now, unless the caller began it already (a server
                # that drained its connections first): then they share it.
                rt.grace_deadline = min(
                    rt.grace_deadline, trio.current_time() + limits_cfg.graceful_timeout_s
                )
                normal_exit = True
                await rt._drain()
            except BaseException as exc:
                body_error = exc
            finally:
                rt._closed = True
                nursery.cancel_scope.cancel("runtime shutting down")
    except BaseExceptionGroup as group:
        leaves = [e for e in _leaves(group) if not isinstance(e, trio.Cancelled)]
        if len(leaves) == 1:
            # Unwrapped, but still chained to its own cause (an escalation's last crash).
            raise leaves[0] from leaves[0].__cause__
        raise
    finally:
        _switch_intervals.exit(switch_interval)
        closed = ActorClosed("the runtime shut down before this request was answered")
        for served in rt.models.values():
            for b in served.batchers:
                b.close()
            for scheduler in served.schedulers:
                scheduler.close(closed)
        # A model call cut off in a worker thread still runs (a thread cannot be
        # stopped): on a normal exit, give it what is left of the grace to return, so
        # that the process does not exit under it (torch aborts the process when such
        # a thread resumes during the interpreter's finalisation).
        if normal_exit:
            await rt._join_threads()
        watchdog.stop()
        if zygote is not None:
            await zygote.aclose()
    if body_error is not None:
        raise body_error


async def _start_cache(nursery: trio.Nursery, rt: Runtime, policy: RestartPolicy) -> None:
    """The cache actor, when the cache has a capacity or a model coalesces."""
    from trioserve.actors import Cache, CacheActor, CacheRule

    cfg = rt.config
    cache = None
    if cfg.cache.capacity_bytes > 0:
        cache = Cache(
            cfg.cache.capacity_bytes,
            policy=cfg.cache.policy,
            rules={
                m.name: CacheRule(
                    enabled=m.cache,
                    ttl=m.cache_ttl_s if m.cache_ttl_s is not None else math.inf,
                    shareable=m.cache_shared,
                )
                for m in cfg.models
            },
            default_quota=cfg.cache.tenant_quota_bytes,
        )
    actor = CacheActor(cache, coalesce={m.name: m.coalesce for m in cfg.models})
    cached = frozenset(m.name for m in cfg.models if actor.handles(m.name))
    if not cached:
        return
    rt.cache = actor
    rt._cached = cached
    await nursery.start(supervise, actor, policy)


def _make_buckets(rt: Runtime, now: float) -> None:
    from trioserve.actors import TokenBucket

    for t in rt.config.tenants:
        if t.credit_rate is not None:
            rt.buckets[t.name] = TokenBucket(t.credit_rate, t.burst, now)


def _check_devices(config: Config) -> None:
    wanted = {(m.name, d) for m in config.models for d in m.devices if d.startswith("cuda")}
    if not wanted:
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for model, device in sorted(wanted):
        index = int(device.partition(":")[2] or 0)
        if index >= n:
            raise ConfigError(
                f"models.{model}.devices: {device} is not available "
                f"(torch sees {n} CUDA device{'s' if n != 1 else ''})"
            )


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


async def _start_model(
    nursery: trio.Nursery,
    rt: Runtime,
    m: ModelConfig,
    backend: ModelBackend,
    policy: RestartPolicy,
    zygote: Zygote | None,
    watchdog: Any,
) -> None:
    from trioserve.actors import (
        BatcherActor,
        BatchTimer,
        Breaker,
        ClassSpec,
        FairQueue,
        ModelMetrics,
        RecentQuantile,
        SchedulerActor,
        StragglerPolicy,
    )

    limits = _limits(m, backend)
    cfg = rt.config
    queue = FairQueue(
        limits,
        bound=cfg.runtime.queue_bound,
        classes=[ClassSpec(name=c.name, aging=c.max_queue_wait_ms / 1e3) for c in cfg.classes],
        weights={t.name: t.weight for t in cfg.tenants},
        shares={t.name: t.queue_share for t in cfg.tenants},
        model=m.name,
        adaptive=m.adaptive_limit,
        min_limit=2 * m.max_batch_size * len(m.replica_devices),
    )
    scheduler = SchedulerActor(m.name, queue)
    n_replicas = len(m.replica_devices)
    slow = None
    if m.slow_lane_cost is not None:
        if m.slow_lane_replicas >= n_replicas:
            raise ConfigError(
                f"models.{m.name}.slow_lane_replicas: the slow lane needs its own replicas "
                f"and the fast lane at least one: must be < replicas ({n_replicas}), "
                f"got {m.slow_lane_replicas}"
            )
        slow = SchedulerActor(m.name, FairQueue(
            limits,
            bound=cfg.runtime.queue_bound,
            classes=queue.classes,
            weights=queue.weights,
            shares=queue.shares,
            model=m.name,
            adaptive=m.adaptive_limit,
            min_limit=2 * m.max_batch_size * m.slow_lane_replicas,
        ))
        slow.name = f"scheduler[{m.name}:slow]"
        scheduler.lanes = slow.lanes = [scheduler, slow]
        scheduler.lane = f"fast lane (requests of cost below {m.slow_lane_cost})"
        slow.lane = f"slow lane (requests of cost {m.slow_lane_cost} or more)"
    metrics = ModelMetrics(model=m.name, max_batch_size=m.max_batch_size)
    served = ServedModel(
        config=m,
        backend=backend,
        scheduler=scheduler,
        batchers=[],
        metrics=metrics,
        limits=limits,
        timeout=m.timeout_ms / 1e3 if m.timeout_ms is not None else math.inf,
        slow_cost=m.slow_lane_cost,
        slow_scheduler=slow,
        hedge_timer=RecentQuantile(0.95) if m.hedge else None,
    )
    rt.models[m.name] = served
    if m.batch_timeout_cap_ms < m.batch_timeout_floor_ms:
        raise ConfigError(
            f"models.{m.name}.batch_timeout_cap_ms: must be >= batch_timeout_floor_ms "
            f"({m.batch_timeout_floor_ms:g}), got {m.batch_timeout_cap_ms:g}"
        )
    timer = BatchTimer(
        StragglerPolicy(
            factor=m.batch_timeout_factor,
            floor=m.batch_timeout_floor_ms / 1e3,
            cap=m.batch_timeout_cap_ms / 1e3,
            poison_attempts=m.poison_attempts,
        )
    )
    await nursery.start(supervise, scheduler, policy)
    if slow is not None:
        await nursery.start(supervise, slow, policy)
    execution = m.execution or backend.default_execution
    started = trio.current_time()
    log.info(
        "model %r: loading %s (%s)", m.name,
        _count(n_replicas, "replica"), f"{execution} on {', '.join(m.devices)}",
    )
    for i, device in enumerate(m.replica_devices):
        lane = slow if slow is not None and i >= n_replicas - m.slow_lane_replicas else scheduler
        batcher = BatcherActor(
            config=m,
            backend=backend,
            scheduler=lane,
            metrics=metrics,
            device=device,
            index=i,
            execution=execution,
            torch_threads=m.torch_threads,
            zygote=zygote,
            timer=timer,
            breaker=Breaker(),
            watchdog=watchdog,
        )
        served.batchers.append(batcher)
        lane.replicas += 1
        lane.batchers.append(batcher)
        await nursery.start(supervise, batcher, policy)
    log.info("model %r: ready in %.2f s", m.name, trio.current_time() - started)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


__all__ = ["Runtime", "ServedModel", "open_runtime"]


def _note_withdrawal(requests: Sequence[Request]) -> None:
    """The caller of ``requests`` (one deadline) left: count those it withdrew from a
    queue in their flows, as withdrawn, or, if it left because their deadline passed,
    as that queue's expiries (as if the queue had answered them). (The queue's own
    expiry withdraws a request too, but counts it and clears its ``on_cancel``
    first.)"""
    if not requests:
        return
    now = trio.current_time()
    at_deadline = now >= requests[0].deadline
    for r in requests:
        reply = r.reply
        if reply.state is CANCELLED:
            queue = getattr(reply.on_cancel, "__self__", None)
            if at_deadline:
                note = getattr(queue, "withdrawn_at_deadline", None)
                if note is not None:
                    note(r, now)
            else:
                note = getattr(queue, "withdrawn_by_caller", None)
                if note is not None:
                    note(r)


def _note_hedge_over(
    request: Request, copy: Request | None, won: list[int], *, left: bool
) -> None:
    """A hedged caller is done with ``request`` and its ``copy`` (None: none was
    queued); ``won`` holds which of the two answered first, if one did. Count the other
    in its flow's ``superseded`` if it was withdrawn queued; or, if the caller left
    before any answer, count each one it withdrew queued as ``_note_withdrawal`` does
    (so a copy withdrawn so counts as its original would)."""
    pair = (request,) if copy is None else (request, copy)
    if not won and left and copy is not None:
        # An answer delivered as the caller left, before its wait took it, still came
        # first (the replica withdrew the other at once).
        won = [i for i, r in enumerate(pair) if r.reply.state is DONE and r.reply.run][:1]
    if won:
        if copy is not None:
            other = pair[1 - won[0]].reply
            if other.state is CANCELLED:
                note = getattr(getattr(other.on_cancel, "__self__", None), "note_superseded", None)
                if note is not None:
                    note(pair[1 - won[0]])
    elif left:
        _note_withdrawal(pair)


def _never_ran(exc: BaseException) -> bool:
    """Whether a request answered with ``exc`` never reached a device: pushed out of
    (or refused by) the queue, or answered while queued (expired, or failed by a
    queue that closed: ``in_queue``)."""
    return isinstance(exc, Overloaded) or (
        isinstance(exc, TrioserveError) and exc.in_queue
    )


def _leading(value: Any) -> int:
    """The leading dimension of a stacked input (0 for a scalar), without converting
    it."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 0
    return len(value) if isinstance(value, list | tuple) else 0


def _seconds(s: float) -> str:
    """A wait as it reads in a message: ``0.500s``; ``1e+300s`` past a year, whose
    digits say nothing more."""
    return f"{s:.3f}s" if s < 365 * 86_400 else f"{s:.3g}s"
