"""``Runtime``, the in-process front door: ``infer`` and ``infer_batch``, the
classification of a call (model, tenant, class, deadline), a single item's submission,
and the shutdown's drain. Its other concerns are mixins, one module each: several items
(``_many``), credits (``_credits``), hedging (``_hedging``), statistics and health
(``_statistics``) and the edge cache (``_edge_cache``). ``open_runtime`` (``_runtime``)
builds it."""

from __future__ import annotations

import collections
import math
import operator
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

import trio

from ._config import Config
from ._control_ops import _Control
from ._credits import _Credits
from ._edge_cache import _EdgeCache
from ._errors import (
    ActorClosed,
    Forbidden,
    InvalidInput,
    TrioserveError,
    Unauthorized,
    UnknownModel,
)
from ._hedging import _Hedging
from ._many import _ManyItems
from ._messages import Reply, Request
from ._model import item_list
from ._outcomes import _never_ran, _note_withdrawal, _prepare_failed, _refund_if_unrun
from ._rollout_ops import _RolloutOps
from ._served import ServedModel
from ._statistics import _Statistics
from ._versioned import _Versioned

T = TypeVar("T")


def _another_run() -> RuntimeError:
    """A call from a trio run other than the runtime's (``trio.run`` in another
    thread): its queues and events would be touched from the wrong thread."""
    return RuntimeError(
        "this runtime belongs to another trio run: call it from the trio run that "
        "opened it (from another thread: trio.from_thread.run(rt.infer, ..., "
        "trio_token=...)), or serve blocking code with trioserve.serve_in_thread"
    )


class Runtime(
    _ManyItems, _Credits, _Hedging, _Versioned, _Statistics, _EdgeCache, _Control, _RolloutOps
):
    """A running trioserve: call :meth:`infer`. Made by :func:`open_runtime`."""

    def __init__(self, config: Config) -> None:
        self.config = config
        #: the trio run that opened it: its tasks, queues and events belong to that run
        self._token = trio.lowlevel.current_trio_token()
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
        #: every health a replica may have (``BatcherActor.health``), in the order
        #: statistics list them; set by the assembly
        self._replica_healths: tuple[str, ...] = ()
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
        #: models whose versions have weights of their own or a rollout (``_versioned``)
        self._families: dict[str, Any] = {}
        #: the file keeping the rollouts' decisions (``runtime.rollout_state_file``)
        self._rollout_state: Any = None

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
        outputs), ActorClosed (shut down); RuntimeError when called from another
        trio run than the one that opened the runtime. A refusal
        before the request waited anywhere is a checkpoint too, so a caller that
        retries at once cannot hold the event loop (and the queue it waits to enter)
        to itself.
        """
        if trio.lowlevel.current_trio_token() is not self._token:
            raise _another_run()
        if version is None and self._families and self._routed(model):
            return await self._infer_routed(model, inputs, tenant, priority)
        try:
            served = self._served(model, version)
            tenant, priority = self._classify(tenant, priority)
            try:
                item, cost = served.backend.prepare(model, inputs)
            except TrioserveError:
                raise
            except Exception as exc:
                raise _prepare_failed(model, exc) from exc
        except TrioserveError:
            await trio.lowlevel.checkpoint()
            raise
        max_tokens = served.limits.max_tokens
        if model in self._cached or (max_tokens is not None and cost > max_tokens):
            call = self._answer_prepared(served, model, version, item, cost, tenant, priority)
        else:
            # uncached and within the budget: what _answer_prepared would do, one
            # coroutine call instead of three
            call = self._submit(served, item, cost, tenant, priority)
        if served.slo is not None:
            return await _within_slo(served.slo, call)
        return await call

    async def _answer_prepared(
        self, served: ServedModel, model: str, version: str | None, item: Any, cost: int,
        tenant: str, priority: str,
    ) -> dict[str, Any]:
        if model in self._cached:
            # The computation runs in the cache actor's nursery, outside this caller's
            # cancel scopes: its wait for credits is bounded by the caller's deadline
            # here, as it is uncached (a refusal at once, not the caller's timeout).
            # Its deadline in the queue is this caller's timeout from now, whoever's
            # flight runs it: a joined caller whose own is later is not failed by it
            # (the flight runs again for it).
            latest = trio.current_effective_deadline()
            due = trio.current_time() + self._timeout(served, priority)
            return await self.cache.answer(
                model, version or served.config.versions[-1], tenant, item,
                lambda late: self._infer_prepared(
                    served, item, cost, tenant, priority, latest, due, late
                ),
                priority=priority, deadline=due,
            )
        return await self._infer_prepared(served, item, cost, tenant, priority)

    async def _infer_prepared(
        self, served: ServedModel, item: Any, cost: int, tenant: str, priority: str,
        latest: float = math.inf, due: float | None = None, late: Any = None,
    ) -> dict[str, Any]:
        """Submit one prepared item (split or refused if oversize). ``latest``: the
        latest time to wait for its credits until, besides its deadline (the caller's
        deadline, for a computation the cache actor runs). ``due``: when its model's
        or class's timeout passes, if counted from an earlier arrival than now (see
        :meth:`_deadline`). ``late``: hung on its request (``Reply.late``: others
        wait for what its batch computes); an item split in parts hangs one on each
        part, which feed it (``_SplitLate``)."""
        model = served.config.name
        limits = served.limits
        if limits.max_tokens is not None and cost > limits.max_tokens:
            if limits.oversize == "split" and served.backend.supports_split:
                return await self._infer_split(
                    served, item, tenant, priority, latest, due, late
                )
            if limits.oversize != "alone":
                await trio.lowlevel.checkpoint()
                raise InvalidInput(
                    f"model {model!r}: request cost {cost} exceeds max_batch_tokens "
                    f"{limits.max_tokens} (oversize policy {limits.oversize!r})"
                )
        return await self._submit(served, item, cost, tenant, priority, latest, due, late)

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
        if trio.lowlevel.current_trio_token() is not self._token:
            raise _another_run()
        if version is None and self._families and self._routed(model):
            return await self._batch_routed(model, items, tenant, priority)
        try:
            served = self._served(model, version)
            tenant, priority = self._classify(tenant, priority)
            given = items
            items = item_list(model, items, "infer_batch")  # any iterable, as before
            self._check_count(served, items, tenant)
            try:
                if isinstance(items, Mapping):
                    prepared = served.backend.prepare_rows(model, items)
                    items = [item for item, _ in prepared]
                else:
                    prepared = []
                    for i, x in enumerate(items):
                        try:
                            prepared.append(served.backend.prepare(model, x))
                        except InvalidInput as exc:
                            raise _of_item(exc, i, len(items), given) from exc
            except TrioserveError:
                raise
            except Exception as exc:
                raise _prepare_failed(model, exc) from exc
        except TrioserveError:
            await trio.lowlevel.checkpoint()
            raise
        if served.slo is not None:
            return await _within_slo(served.slo, self._batch_prepared(
                served, model, version, prepared, tenant, priority
            ))
        return await self._batch_prepared(served, model, version, prepared, tenant, priority)

    async def _batch_prepared(
        self, served: ServedModel, model: str, version: str | None,
        prepared: list[tuple[Any, int]], tenant: str, priority: str,
    ) -> list[dict[str, Any]]:
        """:meth:`infer_batch` for its items checked and prepared."""
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
        draining its connections first) sets it then (past its drain delay), so that
        its drain and the runtime's close share one grace instead of one each. Setting it while the
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
            if served.slo is not None:  # refused for the server's reason: bad
                served.slo.failed(trio.current_time())
            raise ActorClosed("the runtime is shut down")
        if not served.loaded:
            raise self._not_loaded(model)
        return served

    def _known(self, model: str, version: str | None) -> ServedModel:
        """The model ``model`` serves, with ``version`` (if given) one of its own."""
        served = self.models.get(model) if isinstance(model, str) else None
        if served is None:
            raise UnknownModel.not_served(model, self.models)
        if version is not None and version not in served.config.versions:
            if not isinstance(version, str):
                # as in the config, where versions are names: 2 is not "02" or "v2"
                raise InvalidInput(
                    f"model {model!r}: version must be a string, one of "
                    f"{', '.join(map(repr, served.config.versions))} (as the config "
                    f"names them), got {type(version).__name__} {version!r}"
                )
            raise UnknownModel.no_version(model, version, served.config.versions)
        if version is not None and model in self._families:
            return self._served_version(model, version)
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
                raise Unauthorized(
                    "no tenant given and no default tenant is configured: pass tenant= "
                    f"one of {', '.join(map(repr, sorted(self._tenants)))}, or set "
                    "default = true on a tenant in the config"
                )
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

    def _timeout(self, served: ServedModel, priority: str) -> float:
        """The model's or the class's timeout, whichever is sooner, in seconds (inf:
        none)."""
        timeout = served.timeout
        cls_timeout = self._class_timeouts[priority]
        return cls_timeout if cls_timeout < timeout else timeout

    def _deadline(
        self, served: ServedModel, priority: str, now: float, due: float | None = None
    ) -> tuple[float, bool]:
        """The request's deadline and whether the runtime answers its expiry.

        It is the caller's deadline, or the model's (or the class's) timeout when that
        is sooner; in the second case the runtime answers DeadlineExceeded itself.
        ``due``: that timeout's end, when it counts from an earlier arrival than
        ``now`` (a coalesced caller's, whose flight runs for it later).
        """
        caller_deadline = trio.current_effective_deadline()
        own = now + self._timeout(served, priority) if due is None else due
        if own < caller_deadline:
            return own, True
        return caller_deadline, False

    async def _submit(
        self, served: ServedModel, item: Any, cost: int, tenant: str, priority: str,
        latest: float = math.inf, due: float | None = None, late: Any = None,
    ) -> dict[str, Any]:
        now = trio.current_time()
        deadline, answer_expiry = self._deadline(served, priority, now, due)
        taken = 0
        if self.buckets:
            now, taken = await self._pay(
                tenant, priority, cost, now, min(deadline, latest), served
            )
        else:  # no tenant has credits: nothing to await on the hot path
            self.credits_used[tenant] += cost
        reply = Reply()
        if late is not None:
            reply.late = late
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
        # A copy needs another replica than its original's to run on, and thread
        # replicas send none while fewer than three are ready (``hedge_room``): no
        # wait for a copy that would be refused.
        if (
            hedge is not None and priority == self._class_order[0]
            and scheduler.replicas > 1 and scheduler.hedge_room()
        ):
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
                    # withdrawn while queued, or answered as it left, it never ran;
                    # dispatched, it may yet never run (then it is refunded)
                    _refund_if_unrun([reply], lambda: self._refund(tenant, cost, taken))
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
            for served in self._all_served():
                for b in served.batchers:
                    await b.join_thread()
        self._grace_wait = None


async def _within_slo(slo: Any, call: Awaitable[T]) -> T:
    """``call`` awaited and counted against a model's objective (``SloTracker``): a
    result, good or late; a failure of the server's (5xx: the model raised, a
    deadline of the model's or class's passed, shed, shut down), bad. The client's
    errors (4xx) say nothing of the service, nor does a caller that leaves (its
    cancel scope, an HTTP request's timeout_ms, a hang-up) within ``slo_ms``; one
    that leaves later was already failed by the server: bad."""
    t0 = trio.current_time()
    try:
        result = await call
    except TrioserveError as exc:
        if exc.status >= 500:
            slo.failed(trio.current_time())
        raise
    except BaseException:
        now = trio.current_time()
        if now - t0 > slo.slo_s:
            slo.failed(now)
        raise
    now = trio.current_time()
    slo.answered(now, now - t0)
    return result


def _of_item(exc: InvalidInput, i: int, n: int, given: Any) -> InvalidInput:
    """``exc``, an item's refusal in ``infer_batch``, naming the item: which of a
    thousand was bad was left to guess. A 1-D array given as the items is read as
    its values, one item each: the refusal of its first says so."""
    if type(exc) is not InvalidInput:  # a subclass keeps its own words
        return exc
    text = f"item {i} of {n}: {exc}"
    if getattr(given, "ndim", None) == 1:
        text += (
            f" (a 1-D array is read as its {n} values, one item each: pass [array] "
            "for one item, or the items stacked)"
        )
    return InvalidInput(text)

