"""Sans-IO result-cache policies, sized in bytes: W-TinyLFU (Caffeine's design) and LRU.

Nothing here awaits or reads a clock: ``now`` is an argument of every call that
needs it. The cache actor calls these objects; tests and the trace bench drive them
directly.

W-TinyLFU (Einziger, Friedman, Manes, "TinyLFU: A Highly Efficient Cache Admission
Policy", and Caffeine's implementation of it): a new entry enters a small LRU
*window* (1% of the bytes). What overflows the window is a *candidate* for the *main*
space, a segmented LRU (*probation* 20%, *protected* 80%). A candidate enters main
only if a count-min sketch of recent access frequencies says it is used more often
than the *victim* it would displace (probation's least recent entry); otherwise the
candidate is dropped. The sketch ages: every counter is halved after a sample of
accesses forty times the expected entry count (Caffeine: ten), so old popularity
fades. The window lets a burst of new keys in; the filter keeps one-time keys (scans)
from flushing the frequently used ones.

Popularity shifts: the sketch forgets an old hot set only after several halvings, so
when the popular keys change at once, the stale ones keep out the new for a while.
W-TinyLFU watches, per period of requests, the share of requests that miss on a key
that missed recently (a ghost of recent misses, as ARC keeps): steady under a
stationary load, lower during a scan (its keys never come back), and higher at once
when a new hot set arrives and is turned away. When it rises by 4 points over the
last period, the sketch is cleared and the protected segment becomes the cold end of
probation, so the new keys compete with the stale ones on equal terms. Because the
detector forgets an old hot set at once, the periodic aging can be slow: the long
sample keeps four times Caffeine's history, which ranks the keys at the cache's
boundary better (docs/cache.md has the figures).

Every entry has a size in bytes; the sum never exceeds ``capacity`` after a call
returns, and an entry larger than ``capacity`` (or its tenant's quota) is never
admitted. Entries may carry an absolute expiry time and a tenant, charged against
that tenant's optional byte quota. Keys are any hashables; :class:`CacheKey` keys are
also indexed by model and version so ``invalidate(model, version)`` touches only
their entries.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import attrs

from ._cachekey import CacheKey
from ._sketch import CountMinSketch

#: A candidate at least this frequent that ties or loses against the victim is admitted
#: anyway with probability 1/128 (Caffeine's ADMIT_HASHDOS_THRESHOLD): otherwise hot
#: keys that collide in the sketch with a hot victim could never get in.
_WARM = 6

#: Shift detection (see ``WTinyLFU``): requests per period at least this many (else the
#: sketch's expected entry count), and the rise, in requests per request, of misses on
#: recently missed keys from one period to the next that signals a popularity shift.
_SHIFT_MIN_PERIOD = 2048
_SHIFT_RISE = 0.04
#: Periods after the start (or a rebuilt sketch) before the detector may fire: while
#: the cache and its ghost fill, the share of ghost misses climbs on its own.
_SHIFT_WARMUP = 4

@attrs.frozen(kw_only=True)
class CacheStatistics:
    """A snapshot of a cache's counters. ``evictions`` counts entries removed to make
    room (capacity or a tenant's quota); ``admissions_rejected`` counts entries refused
    (by the frequency filter, or larger than the capacity or the tenant's quota)."""

    policy: str
    capacity: int
    bytes_used: int
    entries: int
    hits: int
    misses: int
    evictions: int
    admissions_rejected: int
    expirations: int
    invalidations: int
    #: ``expirations`` and ``invalidations`` of entries with a :class:`CacheKey`, by
    #: model (other keys have no model: they are in the totals only).
    expirations_by_model: Mapping[str, int] = attrs.field(factory=dict)
    invalidations_by_model: Mapping[str, int] = attrs.field(factory=dict)

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class _Entry:
    __slots__ = ("expires", "key", "segment", "size", "tenant", "tenant_lru", "value")

    def __init__(
        self, key: Hashable, value: Any, size: int, expires: float, tenant: str | None
    ) -> None:
        self.key = key
        self.value = value
        self.size = size
        self.expires = expires
        self.tenant = tenant
        self.tenant_lru: OrderedDict[Hashable, _Entry] | None = None
        self.segment: OrderedDict[Hashable, _Entry] | None = None


class _BytePolicy:
    """What both policies share: the entry table, byte and tenant accounting, expiry,
    the model index and the counters. Subclasses place entries (``_link``), take them
    out of their segments (``_unlink``) and implement ``get``."""

    name = "?"

    def __init__(
        self,
        capacity: int,
        *,
        quotas: Mapping[str, int] | None = None,
        default_quota: int | None = None,
    ) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"cache capacity must be a positive number of bytes, got {capacity!r}")
        for tenant, q in (quotas or {}).items():
            if q < 1:
                raise ValueError(f"cache quota of tenant {tenant!r} must be >= 1 byte, got {q!r}")
        if default_quota is not None and default_quota < 1:
            raise ValueError(f"default cache quota must be >= 1 byte, got {default_quota!r}")
        self.capacity = capacity
        self.quotas = dict(quotas or {})
        self.default_quota = default_quota
        self._data: dict[Hashable, _Entry] = {}
        self.bytes_used = 0
        self._tenant_bytes: dict[str, int] = {}
        self._tenant_lru: dict[str, OrderedDict[Hashable, _Entry]] = {}
        self._index: dict[str, dict[str, set[CacheKey]]] = {}
        self._expiry: list[tuple[float, int, _Entry]] = []
        self._seq = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.admissions_rejected = 0
        self.expirations = 0
        self.invalidations = 0
        self._expirations_by_model: dict[str, int] = {}
        self._invalidations_by_model: dict[str, int] = {}

    # ------------------------------------------------------------ policy hooks
    def get(self, key: Hashable, now: float, default: Any = None) -> Any:
        raise NotImplementedError

    def _link(self, e: _Entry) -> None:
        """Place a new entry (already in the table and accounted), evicting or
        rejecting as the policy decides, so that ``bytes_used <= capacity`` after."""
        raise NotImplementedError

    def _unlink(self, e: _Entry) -> None:
        """Take an entry out of the policy's segments."""
        raise NotImplementedError

    # ------------------------------------------------------------ public API
    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        """Whether the key is resident (expired or not); records nothing."""
        return key in self._data

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._data))

    def peek(self, key: Hashable, now: float, default: Any = None) -> Any:
        """The value if resident and unexpired, without recording an access."""
        e = self._data.get(key)
        if e is None or e.expires <= now:
            return default
        return e.value

    def put(
        self,
        key: Hashable,
        value: Any,
        *,
        size: int,
        now: float,
        expires: float = math.inf,
        tenant: str | None = None,
    ) -> bool:
        """Offer a value of ``size`` bytes (>= 1), valid until ``expires`` (absolute time),
        charged to ``tenant``'s quota. A resident value of the same key is dropped first.

        Returns True when the entry is resident after the call. It is refused when it
        is larger than the capacity or the tenant's quota, or already expired; W-TinyLFU
        may also drop it at once when it overflows the window and loses to the victim.
        To stay within a quota, the tenant's own least recently used entries go first
        (before the policy decides whether the new entry stays).
        ``put`` does not count an access: the ``get`` that missed already did.
        """
        if size < 1:
            raise ValueError(f"cache entry size must be >= 1 byte, got {size!r}")
        old = self._data.get(key)
        if old is not None:
            self._unlink(old)
            self._forget(old)
        if expires <= now:
            return False
        if size > self.capacity:
            self.admissions_rejected += 1
            return False
        quota = None if tenant is None else self.quotas.get(tenant, self.default_quota)
        if quota is not None:
            if size > quota:
                self.admissions_rejected += 1
                return False
            used = self._tenant_bytes.get(tenant, 0)  # type: ignore[arg-type]
            if used + size > quota:
                lru = self._tenant_lru[tenant]  # type: ignore[index]
                while used + size > quota:
                    victim = lru[next(iter(lru))]
                    used -= victim.size
                    self._unlink(victim)
                    self._forget(victim)
                    self.evictions += 1
        e = _Entry(key, value, size, expires, tenant)
        self._data[key] = e
        self.bytes_used += size
        if tenant is not None:
            self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
            if quota is not None:
                lru = self._tenant_lru.get(tenant)
                if lru is None:
                    lru = self._tenant_lru[tenant] = OrderedDict()
                lru[key] = e
                e.tenant_lru = lru
        if type(key) is CacheKey:
            self._index.setdefault(key.model, {}).setdefault(key.version, set()).add(key)
        if expires < math.inf:
            self._seq += 1
            heapq.heappush(self._expiry, (expires, self._seq, e))
            if len(self._expiry) > 2 * len(self._data) + 64:
                self._compact_expiry()
        self._link(e)
        return self._data.get(key) is e

    def remove(self, key: Hashable) -> bool:
        """Drop one entry; returns whether it was resident."""
        e = self._data.get(key)
        if e is None:
            return False
        self._unlink(e)
        self._forget(e)
        return True

    def invalidate(self, model: str, version: str | None = None) -> int:
        """Drop every entry of ``model`` (of one ``version`` if given) whose key is a
        :class:`CacheKey`; returns how many. Cost: the entries dropped, not the cache."""
        versions = self._index.get(model)
        if not versions:
            return 0
        keysets = [versions.get(version, set())] if version is not None else list(versions.values())
        n = 0
        for keys in keysets:
            for key in list(keys):
                e = self._data[key]
                self._unlink(e)
                self._forget(e)
                n += 1
        self.invalidations += n
        if n:
            by_model = self._invalidations_by_model
            by_model[model] = by_model.get(model, 0) + n
        return n

    def expire(self, now: float) -> int:
        """Drop every entry whose expiry time has come; returns how many."""
        h = self._expiry
        n = 0
        while h and h[0][0] <= now:
            _, _, e = heapq.heappop(h)
            if self._data.get(e.key) is e:
                self._unlink(e)
                self._forget(e)
                self._count_expiry(e)
                n += 1
        self.expirations += n
        return n

    def next_expiry(self) -> float:
        """The earliest expiry time of a resident entry (inf when none)."""
        h = self._expiry
        while h and self._data.get(h[0][2].key) is not h[0][2]:
            heapq.heappop(h)
        return h[0][0] if h else math.inf

    def expiry(self, key: Hashable) -> float | None:
        """When a resident entry expires (inf: never); None when it is not resident.
        Records nothing."""
        e = self._data.get(key)
        return None if e is None else e.expires

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes of the resident entries charged to ``tenant``."""
        return self._tenant_bytes.get(tenant, 0)

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        for e in list(self._data.values()):
            self._unlink(e)
            self._forget(e)
        self._expiry.clear()

    def statistics(self) -> CacheStatistics:
        return CacheStatistics(
            policy=self.name,
            capacity=self.capacity,
            bytes_used=self.bytes_used,
            entries=len(self._data),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            admissions_rejected=self.admissions_rejected,
            expirations=self.expirations,
            invalidations=self.invalidations,
            expirations_by_model=dict(self._expirations_by_model),
            invalidations_by_model=dict(self._invalidations_by_model),
        )

    # ------------------------------------------------------------ internals
    def _forget(self, e: _Entry) -> None:
        """Remove an entry (already unlinked) from the table and every account."""
        key = e.key
        del self._data[key]
        self.bytes_used -= e.size
        tenant = e.tenant
        if tenant is not None:
            left = self._tenant_bytes[tenant] - e.size
            if left:
                self._tenant_bytes[tenant] = left
            else:
                del self._tenant_bytes[tenant]
            if e.tenant_lru is not None:
                del e.tenant_lru[key]
                e.tenant_lru = None
        if type(key) is CacheKey:
            versions = self._index[key.model]
            keys = versions[key.version]
            keys.discard(key)
            if not keys:
                del versions[key.version]
                if not versions:
                    del self._index[key.model]

    def _expired_miss(self, e: _Entry) -> None:
        self._unlink(e)
        self._forget(e)
        self._count_expiry(e)
        self.expirations += 1
        self.misses += 1

    def _count_expiry(self, e: _Entry) -> None:
        """Count an expired entry for its model (the total is the caller's)."""
        key = e.key
        if type(key) is CacheKey:
            by_model = self._expirations_by_model
            by_model[key.model] = by_model.get(key.model, 0) + 1

    def _compact_expiry(self) -> None:
        data = self._data
        self._expiry = [t for t in self._expiry if data.get(t[2].key) is t[2]]
        heapq.heapify(self._expiry)


class LruPolicy(_BytePolicy):
    """Least recently used, sized in bytes: the baseline W-TinyLFU is compared with."""

    name = "lru"

    def __init__(
        self,
        capacity: int,
        *,
        quotas: Mapping[str, int] | None = None,
        default_quota: int | None = None,
    ) -> None:
        super().__init__(capacity, quotas=quotas, default_quota=default_quota)
        self._order: OrderedDict[Hashable, _Entry] = OrderedDict()

    def get(self, key: Hashable, now: float, default: Any = None) -> Any:
        """The value if resident and unexpired (and it becomes the most recent), else
        ``default``. An expired entry found here is dropped."""
        e = self._data.get(key)
        if e is None:
            self.misses += 1
            return default
        if e.expires <= now:
            self._expired_miss(e)
            return default
        self.hits += 1
        self._order.move_to_end(key)
        tl = e.tenant_lru
        if tl is not None:
            tl.move_to_end(key)
        return e.value

    def keys_by_recency(self) -> list[Hashable]:
        """Resident keys, least recent first."""
        return list(self._order)

    def _link(self, e: _Entry) -> None:
        order = self._order
        order[e.key] = e
        e.segment = order
        while self.bytes_used > self.capacity:
            victim = order[next(iter(order))]
            self._unlink(victim)
            self._forget(victim)
            self.evictions += 1

    def _unlink(self, e: _Entry) -> None:
        del self._order[e.key]
        e.segment = None


class WTinyLFU(_BytePolicy):
    """W-TinyLFU, sized in bytes. See the module docstring for the algorithm.

    ``window_fraction`` of the capacity is the admission window (1%, Caffeine's start);
    ``protected_fraction`` of the main space is the protected segment (80%).
    ``expected_entries`` sizes the sketch; when None it starts small and is rebuilt
    twice as large whenever the entry count outgrows it (the counts start afresh).
    ``seed`` makes the rare random admission of a warm candidate reproducible.
    ``detect_shifts`` turns on the popularity-shift detector (module docstring);
    ``shifts`` counts how often it fired.
    """

    name = "tinylfu"

    def __init__(
        self,
        capacity: int,
        *,
        window_fraction: float = 0.01,
        protected_fraction: float = 0.8,
        expected_entries: int | None = None,
        counters_per_entry: int = 16,
        sample_factor: int = 40,
        seed: int = 0,
        detect_shifts: bool = True,
        quotas: Mapping[str, int] | None = None,
        default_quota: int | None = None,
    ) -> None:
        super().__init__(capacity, quotas=quotas, default_quota=default_quota)
        if not 0.0 <= window_fraction < 1.0 or not 0.0 < protected_fraction < 1.0:
            raise ValueError(
                f"W-TinyLFU: window_fraction must be in [0, 1) and protected_fraction in "
                f"(0, 1), got {window_fraction}, {protected_fraction}"
            )
        self.window_max = max(1, int(capacity * window_fraction))
        self.protected_max = int((capacity - self.window_max) * protected_fraction)
        self._window: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._probation: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._protected: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.window_bytes = 0
        self.protected_bytes = 0
        self._grow = expected_entries is None
        self._sketch_options = {
            "counters_per_entry": counters_per_entry,
            "sample_factor": sample_factor,
        }
        self.sketch = CountMinSketch(expected_entries or 1024, **self._sketch_options)
        self._rng = random.Random(seed)
        # Shift detection: a ghost of recently missed keys' hashes (bounded by the
        # sketch's expected entries) and this period's counts.
        self.detect_shifts = detect_shifts
        self.shifts = 0
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._period: float = (
            max(self.sketch.expected_entries, _SHIFT_MIN_PERIOD) if detect_shifts else math.inf
        )
        self._period_requests = 0
        self._ghost_misses = 0
        self._ghost_ref: float | None = None
        self._periods = 0  # since the start or the sketch's last rebuild

    @property
    def main_max(self) -> int:
        return self.capacity - self.window_max

    @property
    def probation_bytes(self) -> int:
        return self.bytes_used - self.window_bytes - self.protected_bytes

    def segments(self) -> tuple[list[Hashable], list[Hashable], list[Hashable]]:
        """Resident keys of (window, probation, protected), least recent first."""
        return list(self._window), list(self._probation), list(self._protected)

    def get(self, key: Hashable, now: float, default: Any = None) -> Any:
        """The value if resident and unexpired, else ``default``. Records the access in
        the sketch (hit or miss); a hit in probation promotes the entry to protected.
        An expired entry found here is dropped."""
        h = hash(key)
        self.sketch.increment(h)
        n = self._period_requests = self._period_requests + 1
        if n >= self._period:
            self._end_period()
        e = self._data.get(key)
        if e is None:
            self.misses += 1
            self._ghost_miss(h)
            return default
        if e.expires <= now:
            self._expired_miss(e)
            self._ghost_miss(h)
            return default
        self.hits += 1
        seg = e.segment
        if seg is self._probation:
            self._promote(e)
        else:
            seg.move_to_end(key)  # type: ignore[union-attr]
        tl = e.tenant_lru
        if tl is not None:
            tl.move_to_end(key)
        return e.value

    def _ghost_miss(self, h: int) -> None:
        if not self.detect_shifts:
            return
        ghost = self._ghost
        if h in ghost:
            self._ghost_misses += 1
            ghost.move_to_end(h)
        else:
            ghost[h] = None
            if len(ghost) > self.sketch.expected_entries:
                ghost.popitem(last=False)

    def _end_period(self) -> None:
        """Compare this period's share of misses on recently missed keys with the last
        period's; a rise of ``_SHIFT_RISE`` after the first ``_SHIFT_WARMUP`` periods
        (not while the cache warms up) is a popularity shift."""
        rate = self._ghost_misses / self._period_requests
        ref = self._ghost_ref
        self._periods += 1
        if ref is not None and self._periods > _SHIFT_WARMUP and rate > ref + _SHIFT_RISE:
            self._shifted()
            self._ghost_ref = None  # the next period sets a new reference
        else:
            self._ghost_ref = rate
        self._period_requests = self._ghost_misses = 0
        self._period = max(self.sketch.expected_entries, _SHIFT_MIN_PERIOD)

    def _shifted(self) -> None:
        """The popular set changed: clear the sketch, and make every protected entry
        probation's least recent, so the next candidates displace stale entries first.
        (Halving is not enough: the old hot keys sit at the 4-bit cap of 15, the new
        ones at one to three, and stay apart until four halvings, which is a clear.)
        Costs the probation segment (the protected one changes role in place)."""
        self.shifts += 1
        self.sketch.clear()
        protected, probation = self._protected, self._probation
        for key, e in probation.items():
            protected[key] = e
            e.segment = protected
        self._probation = protected
        self._protected = OrderedDict()
        self.protected_bytes = 0

    def _promote(self, e: _Entry) -> None:
        """Probation → protected (most recent); protected's overflow, least recent
        first, goes back to probation as its most recent entries."""
        key = e.key
        del self._probation[key]
        self._protected[key] = e
        e.segment = self._protected
        self.protected_bytes += e.size
        if self.protected_bytes > self.protected_max:
            self._demote_protected_overflow()

    def _link(self, e: _Entry) -> None:
        if self._grow and len(self._data) > self.sketch.expected_entries:
            self.sketch = CountMinSketch(2 * len(self._data), **self._sketch_options)
            self._periods = 0  # the counts start afresh: warming up again
        window = self._window
        window[e.key] = e
        e.segment = window
        wb = self.window_bytes + e.size
        if wb > self.window_max:
            # The window's overflow, least recent first, are candidates for main.
            candidates = []
            while wb > self.window_max:
                _, c = window.popitem(last=False)
                wb -= c.size
                c.segment = None
                candidates.append(c)
            self.window_bytes = wb
            pending = sum(c.size for c in candidates)
            for c in candidates:
                pending -= c.size
                self._admit(c, pending)
        else:
            self.window_bytes = wb
        # Main may hold what the window does not use; a window filling up again can
        # push the total over: evict plain LRU-of-main victims, no contest.
        while self.bytes_used > self.capacity:
            victim = self._victim()
            self._unlink(victim)
            self._forget(victim)
            self.evictions += 1

    def _demote_protected_overflow(self) -> None:
        protected, probation = self._protected, self._probation
        pb = self.protected_bytes
        while pb > self.protected_max:
            k, d = protected.popitem(last=False)
            pb -= d.size
            probation[k] = d
            d.segment = probation
        self.protected_bytes = pb

    def _victim(self) -> _Entry:
        for seg in (self._probation, self._protected, self._window):
            if seg:
                return seg[next(iter(seg))]
        raise AssertionError("over capacity with no entry resident")

    def _admit(self, c: _Entry, pending: int) -> None:
        """Let candidate ``c`` into probation if it beats each victim it must displace
        (``pending`` bytes of later candidates are not counted yet)."""
        excess = self.bytes_used - pending - self.capacity
        if excess > 0:
            sketch = self.sketch
            cf = sketch.frequency(hash(c.key))
            while excess > 0:
                victim = self._victim()
                vf = sketch.frequency(hash(victim.key))
                if cf > vf or (cf >= _WARM and self._rng.getrandbits(7) == 0):
                    excess -= victim.size
                    self._unlink(victim)
                    self._forget(victim)
                    self.evictions += 1
                else:
                    self._forget(c)  # not linked anywhere: it was popped off the window
                    self.admissions_rejected += 1
                    return
        probation = self._probation
        probation[c.key] = c
        c.segment = probation

    def _unlink(self, e: _Entry) -> None:
        seg = e.segment
        if seg is None:
            return
        del seg[e.key]
        if seg is self._window:
            self.window_bytes -= e.size
        elif seg is self._protected:
            self.protected_bytes -= e.size
        e.segment = None


CACHE_POLICIES: dict[str, type[_BytePolicy]] = {"tinylfu": WTinyLFU, "lru": LruPolicy}
