"""The cache actor: the result cache and in-flight coalescing in front of the
schedulers.

``answer(model, version, tenant, item, compute, priority=)`` returns a cached result
at once, or joins an identical request of the same tenant and class already in flight,
or runs ``compute()`` once for every concurrent caller of that key (in the actor's own
nursery, so a caller leaving does not cancel it for the others) and caches what it
returns. A joined caller whose own deadline outlives the one its flight ran with is
not failed by that one passing: it is answered by the batch still running for the
other, if that one passed while it ran (its value, or the model's error for the
item), or the flight runs its own ``compute()`` again.
``answer_many(model, version, tenant, items, compute)`` does the same for several items
at once (``Runtime.infer_batch``): the cached ones from the cache, the others computed
together, each distinct one once. The actor's task also drops expired entries as their
TTLs pass.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import trio
from trioserve import (
    Actor,
    DeadlineExceeded,
    InvalidInput,
    ModelError,
    Overloaded,
    QuotaExceeded,
)

from ._cache import Cache, CacheRule
from ._cachekey import cache_key
from ._singleflight import LateOutcome, SingleFlight, own_error

#: Bytes counted per cached answer besides its arrays' (and an edge answer's body and
#: key's) bytes: the key, the entry, its places in the policy's table, segment, model
#: index and sketch, the answer's dict and array headers. Measured with tracemalloc
#: (CPython 3.11, 1,000 to 50,000 entries, a full gc before each snapshot): 880 to
#: 1,030 bytes an item entry (an echo of one float32, of 4 KiB, ``mlp``'s 16 floats),
#: 900 to 1,000 an edge entry (docs/cache.md, "Sizes of kept answers").
OVERHEAD = 1024

#: For the edge, which keeps a request's encoded answer: the earliest expiry of the
#: answers the current task was given since :meth:`CacheActor.track_expiry` (a
#: one-item list; None: nobody asks). An answer encoded from a cached result must
#: not outlive that result's TTL.
_answered_until: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar(
    "trioserve_cache_answered_until", default=None
)


def _answered(expires: float) -> None:
    box = _answered_until.get()
    if box is not None and expires < box[0]:
        box[0] = expires


#: For the rollout's checks and its shadow: which answers the current task was given
#: that the model did not run for (a cache hit, a join of an identical request in
#: flight, an item repeated within one call) within :meth:`CacheActor.counting_shared`:
#: their positions in the counted call's items (a set; None: nobody asks).
_shared_answers: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar(
    "trioserve_cache_shared_answers", default=None
)

#: Where the items of the current task's cache calls are among the counted call's
#: items (its item i is the call's ``positions[i]``, :meth:`CacheActor.items_at`);
#: None: at their own positions.
_item_positions: contextvars.ContextVar[Sequence[int] | None] = contextvars.ContextVar(
    "trioserve_cache_item_positions", default=None
)


def _shared(where: Iterable[int] = (0,)) -> None:
    """The answers of the items at ``where`` (positions in the cache's call: a
    single item's is 0) were not computed for them."""
    box = _shared_answers.get()
    if box is not None:
        at = _item_positions.get()
        box.update(where if at is None else (at[i] for i in where))


def answer_size(value: Any) -> int:
    """Bytes a model's answer holds: its values (an object array's elements, a list's
    items, counted too), plus a fixed overhead."""
    if isinstance(value, Mapping):
        return OVERHEAD + sum(_size(v) for v in value.values())
    return OVERHEAD + _size(value)


def _size(v: Any, depth: int = 0) -> int:
    if isinstance(v, np.ndarray):
        if v.dtype.kind == "O":  # BYTES: pointers, and what they point to
            return v.nbytes + sum(_size(x, depth + 1) for x in v.flat)
        return v.nbytes
    nbytes = getattr(v, "nbytes", None)  # a torch tensor, a numpy scalar, a buffer
    if type(nbytes) is int:
        return nbytes
    size = sys.getsizeof(v)
    if depth < 8 and isinstance(v, list | tuple):
        size += sum(_size(x, depth + 1) for x in v)
    elif depth < 8 and isinstance(v, Mapping):
        size += sum(_size(x, depth + 1) for x in v.values())
    return size


def _kept(value: Any) -> Any:
    """An answer as the cache (or a flight's waiters) keep it: every array its own
    copy, read-only. One answer object goes to many callers: none may change it under
    the others. A copy, since the model may hand back its input itself (``echo``: the
    caller's own buffer, which must stay the caller's and writable), or a view of a
    batch's output (which would keep the whole batch alive, counted at its own
    size)."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if isinstance(v, np.ndarray):
                v = v.copy()
                v.flags.writeable = False
            out[k] = v
        return out
    return value


def deadline_bound(exc: BaseException, deadline: float) -> float | None:
    """For :class:`SingleFlight`: the deadline an error of a flight's computation, run
    with its driver's ``deadline``, belongs to (None: it belongs to the computation,
    and is every waiter's answer). DeadlineExceeded is that deadline passing; a
    refusal measured against a deadline (credits that refill only after it, an
    estimated wait past it) says which (``Overloaded.deadline``). A joined caller
    whose own deadline is later is not failed by another's: the flight runs again
    for it."""
    if isinstance(exc, DeadlineExceeded):
        return deadline
    if isinstance(exc, Overloaded):
        return exc.deadline
    return None


def input_error(exc: BaseException) -> bool:
    """For :class:`SingleFlight`: whether an error that the batch of a driver answered
    before it ended brought for its item (a late outcome) is the input's own doing,
    every waiter's answer, rather than a reason to run the item again. A ModelError
    is the model's error for that item, the one its own caller would have got, which
    the runtime never retries: it raised on it alone (on a second replica too, when
    another was ready), the item is poison (it hung or killed its worker each time
    it ran alone), its outputs too large for a worker's message, refused by the
    model's signature, or its batch left its device unusable (strictly its own doing
    only in a batch of one; the batch's other callers get that error too, not
    retried); or the model's queue was retired,
    which would refuse a rerun with that same error. So is an InvalidInput: the
    item refused before it ran (its inputs too large for a worker's message; a
    reloaded model that takes other inputs), as a rerun would be. Anything else
    (the replica crashed under it, the runtime shuts down) is no answer of the
    item's: the flight runs again."""
    return isinstance(exc, (ModelError, InvalidInput))


def _waited_out(
    model: str, arrival: float, deadline: float
) -> Callable[[BaseException], BaseException]:
    """For :meth:`SingleFlight.call`: a joined caller's own error for an error of the
    deadline of the caller its flight ran for. Its own deadline passed too (at once,
    or while it waited for that caller's batch), and it is told so in its own figures:
    how long it waited, for what. A DeadlineExceeded it gets is ``in_queue``: it
    reached no device of its own and is charged nothing. A refusal measured against
    that deadline (``Overloaded.deadline``: credits that refill only after it, an
    estimated wait past it) holds for its own, no later: it is refused of the same
    class, with the same ``retry_after``, against its own deadline, with its time
    left and its wait. Any other error is its own copy, as is."""

    def as_own(exc: BaseException) -> BaseException:
        if isinstance(exc, Overloaded) and exc.deadline is not None:
            now = trio.current_time()
            why = (
                "the tenant's credits refill only after its deadline"
                if isinstance(exc, QuotaExceeded)
                else "the estimated time to serve it exceeds its deadline"
            )
            return type(exc)(
                f"model {model!r}: refused: {why} ({max(0.0, deadline - now) * 1e3:.0f} "
                f"ms left), after {now - arrival:.3f}s waiting for the computation of "
                "an identical request it joined in flight",
                retry_after=exc.retry_after,
                deadline=deadline,
            )
        if not isinstance(exc, DeadlineExceeded):
            return own_error(exc)
        return DeadlineExceeded(
            f"model {model!r}: deadline passed after {deadline - arrival:.3f}s waiting "
            "for the computation of an identical request it joined in flight (limit: "
            "the model's or its class's timeout_ms)",
            in_queue=True,
        )

    return as_own


def _own(value: Any) -> Any:
    """A caller's own mapping of a shared answer (its arrays stay shared, read-only):
    a caller that changes its dict must not change what later callers get."""
    return dict(value) if type(value) is dict else value


class CacheActor(Actor):
    """Owns a :class:`Cache` (None: no result cache, coalescing only) and a
    :class:`SingleFlight` table. ``rules`` say per model whether it is cached or
    coalesced at all."""

    def __init__(
        self,
        cache: Cache | None,
        *,
        coalesce: Mapping[str, bool],
    ) -> None:
        super().__init__()
        self.name = "cache"
        self.cache = cache
        self._coalesce = dict(coalesce)
        self._flights: SingleFlight | None = None
        self._wake = trio.lowlevel.ParkingLot()
        #: invalidations per model, when there is no Cache to count them
        self._generations: dict[str, int] = {}

    def handles(self, model: str) -> bool:
        """Whether requests of ``model`` go through the cache actor at all."""
        return self._coalesce.get(model, False) or (
            self.cache is not None and self.cache.rule(model).enabled
        )

    def invalidate(self, model: str, version: str | None = None) -> int:
        """The model's weights changed: drop its cached results (of one ``version`` if
        given) and return how many; from now on no request joins a computation started
        before, cached or only coalesced."""
        if self.cache is not None:
            return self.cache.invalidate(model, version)
        self._generations[model] = self._generations.get(model, 0) + 1
        return 0

    @staticmethod
    def track_expiry() -> list[float]:
        """From now on, for the calling task, record the earliest expiry of the
        answers it gets (of a model with a TTL): the returned list's one item, inf
        until one is given. Not a checkpoint."""
        box = [math.inf]
        _answered_until.set(box)
        return box

    @staticmethod
    @contextlib.contextmanager
    def counting_shared() -> Iterator[set[int]]:
        """Within the block, note for the calling task (and the tasks it starts)
        the answers it is given that the model did not run for: a cache hit, a join
        of an identical request already in flight, an item repeated within one
        ``answer_many`` call. Yields a set, filled with their positions among the
        items of the call made in the block (``infer_batch``'s; a single item's is
        0): its size is how many there were. Not a checkpoint."""
        box: set[int] = set()
        token = _shared_answers.set(box)
        try:
            yield box
        finally:
            _shared_answers.reset(token)

    @staticmethod
    @contextlib.contextmanager
    def items_at(positions: Sequence[int]) -> Iterator[None]:
        """Within the block, the calling task's cache calls answer part of the call
        that :meth:`counting_shared` counts: their item i is its item
        ``positions[i]`` (an ``infer_batch``'s items within the token budget, or one
        run alone). Not a checkpoint."""
        outer = _item_positions.get()
        token = _item_positions.set(
            positions if outer is None else [outer[p] for p in positions]
        )
        try:
            yield
        finally:
            _item_positions.reset(token)

    def keep(
        self, key: Any, value: Any, *, size: int, tenant: str, expires: float = math.inf
    ) -> bool:
        """``Cache.put`` now (trio time), for a value made outside :meth:`answer` (the
        edge's encoded answers): the actor's timer is moved up if the value expires
        before everything else kept, so that it is dropped when its TTL passes, not at
        the next lookup. ``size``: the value's own bytes (and its key's); it is
        charged :data:`OVERHEAD` more, as an answer kept by :meth:`answer` is.
        Returns whether it is resident. Not a checkpoint."""
        cache = self.cache
        assert cache is not None
        before = cache.next_expiry()
        kept = cache.put(
            key, value, size=size + OVERHEAD, now=trio.current_time(), tenant=tenant,
            expires=expires,
        )
        if cache.next_expiry() < before:
            self._wake.unpark_all()
        return kept

    def generation(self, model: str) -> int:
        """How many times ``model`` was invalidated (:meth:`Cache.generation`)."""
        if self.cache is not None:
            return self.cache.generation(model)
        return self._generations.get(model, 0)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._flights = SingleFlight(
                nursery, deadline_bound=deadline_bound, late_outcomes=True,
                input_error=input_error,
            )
            task_status.started(self)
            try:
                while True:
                    deadline = self.cache.next_expiry() if self.cache is not None else None
                    with trio.move_on_at(deadline if deadline is not None else float("inf")):
                        await self._wake.park()
                    if self.cache is not None:
                        self.cache.expire(trio.current_time())
            finally:
                self._flights = None

    async def answer(
        self,
        model: str,
        version: str,
        tenant: str,
        item: Any,
        compute: Callable[[LateOutcome | None], Awaitable[Any]],
        *,
        priority: str | None = None,
        deadline: float = math.inf,
    ) -> Any:
        """The answer for ``item``: cached, joined, or computed once. A checkpoint.

        A request joins only a flight of its own tenant and class (``priority``): the
        flight runs with its first caller's class, credits and deadline, which a
        caller of another class or tenant must not inherit (a realtime request would
        wait behind a batch one's queue, or for another tenant's credits). The cached
        answer, once kept, is shared as the model's rule says.

        ``deadline``: the caller's own (its model's or class's timeout from its
        arrival), the one its ``compute`` submits with. A caller that joined a flight
        is not failed by an earlier caller's deadline passing (DeadlineExceeded, or a
        refusal measured against it): if its own is later, the flight runs its
        ``compute`` again (:class:`SingleFlight`), unless the earlier one's passed
        while its batch ran and that batch answers it.

        ``compute(late)``: submit the item, hanging ``late`` (a :class:`LateOutcome`,
        or None when no one else waits) on its request (``Reply.late``), so that the
        batch's answer reaches the flight's other callers should the request be
        answered before its batch ends.
        """
        cache = self.cache
        rule = cache.rule(model) if cache is not None else CacheRule(enabled=False)
        try:
            if rule.enabled:
                key = cache.key(model, version, tenant, item)  # type: ignore[union-attr]
            else:
                key = cache_key(model, version, tenant, item)
        except TypeError:  # an input the key cannot encode (the model may take it)
            return await compute(None)
        if rule.enabled:
            now = trio.current_time()
            hit = cache.get(key, now)  # type: ignore[union-attr]
            if hit is not None:
                if rule.ttl < math.inf:
                    _answered(cache.expiry(key))  # type: ignore[union-attr,arg-type]
                _shared()
                await trio.lowlevel.checkpoint()
                return _own(hit)
        flights = self._flights
        if flights is None:  # not running (shutting down): compute without sharing
            return await compute(None)
        arrival = trio.current_time()

        # Read for a model that is only coalesced too: its flights must not outlive an
        # invalidation either.
        generation = self.generation(model)

        def keep(value: Any) -> tuple[Any, float]:
            value = _kept(value)
            now = trio.current_time()
            if rule.enabled and cache.generation(model) == generation:  # type: ignore[union-attr]
                before = cache.next_expiry()  # type: ignore[union-attr]
                cache.put(  # type: ignore[union-attr]
                    key, value, size=answer_size(value), now=now, tenant=tenant
                )
                if cache.next_expiry() < before:  # type: ignore[union-attr]
                    self._wake.unpark_all()
            return value, now + rule.ttl

        async def compute_and_keep(*, late: LateOutcome | None = None) -> tuple[Any, float]:
            if late is not None:
                # a late answer (the batch of a request answered before it ended)
                # is kept as this computation's own would be
                late.keep = keep
            return keep(await compute(late))

        # A caller after an invalidation must not join a flight from before it: that
        # answer may come from the old weights.
        flight = (key, tenant, priority, generation)
        if flight in flights:
            _shared()  # joins a computation started for another caller
        value, expires = await flights.call(
            flight, compute_and_keep, deadline=deadline,
            as_own=_waited_out(model, arrival, deadline) if deadline < math.inf else None,
        )
        if expires < math.inf:
            _answered(expires)
        return _own(value)

    async def answer_many(
        self,
        model: str,
        version: str,
        tenant: str,
        items: Sequence[Any],
        compute: Callable[[list[int]], Awaitable[list[Any]]],
    ) -> list[Any]:
        """The answers for ``items``, in order: each cached one from the cache; the
        others by one call of ``compute(indices)`` (the answers for ``items[i]``, i in
        ``indices``, in order), where an item repeated in ``items`` appears once, and
        kept in the cache. Each distinct item is looked up once (one access, one hit
        or miss). A checkpoint. If ``compute`` raises, nothing is kept.

        Unlike :meth:`answer` it does not join single requests in flight, nor do they
        join it: the misses run as one submission, as ``infer_batch`` promises. A model
        that is coalesced but not cached just computes every item.
        """
        cache = self.cache
        if cache is None or not cache.rule(model).enabled:
            return await compute(list(range(len(items))))
        wanted: dict[Any, list[int]] = {}  # key -> the positions that want it
        try:
            for i, item in enumerate(items):
                wanted.setdefault(cache.key(model, version, tenant, item), []).append(i)
        except TypeError:  # an input the key cannot encode: compute them all
            return await compute(list(range(len(items))))
        # One lookup per distinct key: a repeat within the batch is neither a second
        # access for the policy's counts nor a second miss.
        now = trio.current_time()
        ttl = cache.rule(model).ttl
        out: list[Any] = [None] * len(items)
        missing: dict[Any, list[int]] = {}
        for key, where in wanted.items():
            hit = cache.get(key, now)
            if hit is None:
                missing[key] = where
                _shared(where[1:])  # its repeats share its one computation
            else:
                _shared(where)
                if ttl < math.inf:
                    _answered(cache.expiry(key))  # type: ignore[arg-type]
                for i in where:
                    out[i] = _own(hit)
        if not missing:
            await trio.lowlevel.checkpoint()
            return out
        keys = list(missing)
        generation = cache.generation(model)
        values = await compute([missing[k][0] for k in keys])
        keep = cache.generation(model) == generation  # no invalidation meanwhile
        now = trio.current_time()
        if ttl < math.inf:
            _answered(now + ttl)
        before = cache.next_expiry()
        for k, value in zip(keys, values, strict=True):
            value = _kept(value)
            if keep:
                cache.put(k, value, size=answer_size(value), now=now, tenant=tenant)
            for i in missing[k]:
                out[i] = _own(value)
        if cache.next_expiry() < before:
            self._wake.unpark_all()
        return out

    def statistics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.cache is not None:
            s = self.cache.statistics()
            out.update(
                policy=s.policy, capacity_bytes=s.capacity, bytes_used=s.bytes_used,
                entries=s.entries, hits=s.hits, misses=s.misses, hit_rate=s.hit_rate,
                evictions=s.evictions, admissions_rejected=s.admissions_rejected,
                expirations=s.expirations, invalidations=s.invalidations,
                expirations_by_model=dict(s.expirations_by_model),
                invalidations_by_model=dict(s.invalidations_by_model),
            )
        if self._flights is not None:
            f = self._flights.statistics()
            out.update(
                coalesced=f.coalesced, computations=f.started, reruns=f.reruns,
                late_answers=f.late_answers, in_flight=f.in_flight,
            )
        return out
