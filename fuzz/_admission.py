"""Suite ``admission``: a hypothesis state machine over TokenBucket, the tenants'
credits, against an exact reference model (``fractions.Fraction`` arithmetic).

Operations: time advances, ``try_take`` (class over quota "reject"), ``reserve``
(over quota "wait", with a latest start), ``refund`` of a waiting reservation (its
caller left), and ``refund_started`` of a grant that had started (the queue refused or
pushed out its request). Checked after every step:

- the bucket's level, ``used`` and every answer agree with the reference model;
- the level never exceeds the burst;
- ``try_take`` grants exactly when the credits are there, and the wait it returns is
  exactly when they will be;
- a reservation starts no earlier than now and no later than its latest start;
- FIFO among waiters: a reservation never starts before one made earlier that still
  waits (refunds included);
- the envelope: the cost granted with start times in any window [a, b], refunded
  reservations left out, is at most burst + rate x (b - a) + one grant's debt (a cost
  above the burst is granted once the bucket is full, leaving it negative).
"""

from __future__ import annotations

import math
from fractions import Fraction

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ._checker import InvariantViolation
from ._product import PRODUCT, Product
from ._stats import count_example, note

MS = Fraction(1, 1000)
#: Closer than this (relative) is a tie that float rounding may settle either way.
TIE = Fraction(1, 10**9)


@attrs.frozen(kw_only=True)
class BucketSetup:
    rate: float = 1.0
    burst: float = 1.0


@attrs.define(eq=False)
class Grant:
    cost: int
    start: Fraction  # when the caller may go
    made: Fraction  # when it was granted or reserved
    seq: int = 0  # the bucket's number for its take
    refunded: bool = False


class Reference:
    """TokenBucket's documented rules in exact arithmetic.

    Where float rounding could settle a structural choice either way (a reservation
    starting at the very instant a later call is made: still waiting or not), the
    bucket's choice is taken (``kept``, ``entry``); every value is computed exactly.
    """

    MERGE_AT = 16  # TokenBucket keeps this many waiting reservations apart
    LOG = 64  # ... and remembers the level before this many takes

    def __init__(self, rate: Fraction, burst: Fraction, now: Fraction) -> None:
        self.rate, self.burst = rate, burst
        self.level, self.stamp, self.used = burst, now, Fraction(0)
        self.tail: Fraction | None = None  # the latest start handed out
        # the reservations starting after ``stamp``: [start, peak, n, records] (see
        # TokenBucket)
        self.waiting: list[list] = []
        self.events: list[str] = []  # what the last operations exercised (for notes)
        self.seq = 0  # takes so far
        # [number, the level just before it] of each take; for a reservation that
        # waited, the level just before its start (final once it starts)
        self.log: list[list] = []

    def refill(self, now: Fraction, kept: int | None = None) -> None:
        """``kept``: how many waiting reservations the bucket holds after its own
        refill (settles a start within float rounding of ``now``)."""
        if now > self.stamp:
            self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
            self.stamp = now
            tol = TIE * max(1, now)
            w = self.waiting
            while w and w[0][0] < now - tol:
                self._started(w.pop(0))
            while w and w[0][0] <= now + tol:
                if kept is None:
                    if w[0][0] > now:
                        break
                elif sum(e[2] for e in w) <= kept:
                    break
                self._started(w.pop(0))

    @staticmethod
    def _started(entry: list) -> None:
        for record in entry[3]:
            record[1] = entry[1]

    def try_take(
        self, cost: int, now: Fraction, hint: bool, kept: int | None = None
    ) -> tuple[bool, Fraction]:
        """As TokenBucket.try_take: (granted, the wait when not). ``hint`` (whether the
        bucket granted) settles a tie closer than float rounding."""
        self.refill(now, kept)
        need = min(Fraction(cost), self.burst)
        grant = self.level >= need
        if abs(self.level - need) <= TIE * self.burst:
            grant = hint
        if grant:
            self.log.append(self._taken())
            self.level -= cost
            self.used += cost
            return True, Fraction(0)
        return False, max(Fraction(0), need - self.level) / self.rate

    def reserve(
        self,
        cost: int,
        now: Fraction,
        latest: Fraction,
        hint: bool,
        kept: int | None = None,
        entry: bool | None = None,
    ) -> Fraction | None:
        """As TokenBucket.reserve; ``hint`` (whether the bucket reserved) settles a tie
        with ``latest`` closer than float rounding, ``entry`` (whether the bucket counts
        it as waiting) one with ``now``."""
        self.refill(now, kept)
        need = min(Fraction(cost), self.burst)
        level = self.level
        at = now if level >= need else now + (need - level) / self.rate
        pushed = self.tail is not None and at < self.tail
        if pushed:
            at = self.tail  # after every reservation made before
        late = at > latest
        if abs(at - latest) <= TIE * max(1, latest):
            late = not hint
        if late:
            return None
        if pushed:
            self.events.append("reservations behind a refunded one")
        record = self._taken()
        if at > now if entry is None else entry:
            ahead = (at - now) * self.rate
            peak = level + ahead
            if peak > self.burst:  # what would overflow the burst before it starts
                level = self.burst - ahead
                peak = self.burst
            record[1] = peak
            if len(self.waiting) >= self.MERGE_AT:
                self.events.append("waiting reservations merged")
                last = self.waiting[-1]
                last[0], last[1], last[2] = at, max(last[1], peak), last[2] + 1
                last[3].append(record)
            else:
                self.waiting.append([at, peak, 1, [record]])
            self.tail = at
        self.log.append(record)
        self.level = level - cost
        self.used += cost
        return at

    def _taken(self) -> list:
        self.seq += 1
        return [self.seq, self.level]

    def refund(self, cost: int, since: int | None = None) -> None:
        """Back to the level, at most the room under the burst that the waiters leave
        (start times never move): all of them for a grant that had started (``since``:
        its number), the ones after the earliest for a reservation still waiting; and
        for a started one, the room the bucket's levels since its take leave (none when
        more than LOG takes came after it)."""
        if since is not None and self._refund_waiting(cost, since):
            self.events.append("refunds of a start with no call since")
            return
        self.used -= cost
        give = Fraction(cost)
        w = self.waiting
        tops = [e[1] for e in w[1:]] + (
            [w[0][1]] if w and (since is not None or w[0][2] > 1) else []
        )
        if since is not None:
            tops.append(self.level)
            later = [before for n, before in self.log if n > since]
            if self.seq - since > self.LOG:
                tops.append(self.burst)
                self.events.append("refunds after a forgotten take")
            elif later:
                tops.extend(later)
                self.events.append("refunds after later takes")
        if tops:
            give = max(Fraction(0), min(give, self.burst - max(tops)))
            if give < cost:
                self.events.append("refunds cut by the burst")
        for e in w:
            e[1] += give
        if since is not None:  # every level since the grant rises by what goes back
            for record in self.log:
                if record[0] > since:
                    record[1] += give
        self.level = min(self.burst, self.level + give)


    def _refund_waiting(self, cost: int, seq: int) -> bool:
        """The refund of the reservation numbered ``seq`` while it is still on the
        books as waiting (no call since its start, or merged with a later one): at most
        the room the waiters after it leave (and its entry's, when merged); it leaves
        the waiting ones. False, refunding nothing, when it is not there."""
        w = self.waiting
        for i, e in enumerate(w):
            mine = [r for r in e[3] if r[0] == seq]
            if not mine:
                continue
            self.used -= cost
            tops = [later[1] for later in w[i + 1:]] + ([e[1]] if e[2] > 1 else [])
            give = Fraction(cost)
            if tops:
                give = max(Fraction(0), min(give, self.burst - max(tops)))
            e[3].remove(mine[0])
            e[2] -= 1
            if not e[2]:
                del w[i]
            for later in w[i:]:
                later[1] += give
            self.level = min(self.burst, self.level + give)
            return True
        return False


def _waiting_count(bucket) -> int | None:
    """How many reservations the bucket counts as waiting (None: it does not say)."""
    waiting = getattr(bucket, "_waiting", None)
    return None if waiting is None else int(sum(e[2] for e in waiting))


def _close(a: float, b: Fraction, scale: float = 1.0) -> bool:
    return abs(a - float(b)) <= 1e-9 * max(1.0, scale, abs(float(b)))


class BucketMachine(RuleBasedStateMachine):
    """Drives one TokenBucket (``product.bucket_class``) beside the reference."""

    product: Product = PRODUCT

    def __init__(self) -> None:
        super().__init__()
        count_example("admission")
        self.ms = 0
        self.bucket = None
        self.ref: Reference | None = None
        self.grants: list[Grant] = []
        self.waiting: list[Grant] = []  # reservations not started yet, in reservation order

    @property
    def now(self) -> Fraction:
        return self.ms * MS

    @initialize(
        config=st.builds(
            BucketSetup,
            rate=st.sampled_from([0.5, 1.0, 4.0, 100.0, 1000.0]),
            burst=st.sampled_from([0.5, 1.0, 2.0, 10.0, 50.0]),
        )
    )
    def setup(self, config: BucketSetup) -> None:
        self.bucket = self.product.bucket_class(config.rate, config.burst, float(self.now))
        self.ref = Reference(Fraction(config.rate), Fraction(config.burst), self.now)

    @rule(ms=st.sampled_from([1, 2, 10, 100, 250, 1000, 5000]))
    def advance(self, ms: int) -> None:
        self.ms += ms
        self.waiting = [g for g in self.waiting if g.start > self.now]

    @rule(cost=st.integers(1, 60))
    def try_take(self, cost: int) -> None:
        got = self.bucket.try_take(cost, float(self.now))
        granted, want = self.ref.try_take(
            cost, self.now, hint=got == 0.0, kept=_waiting_count(self.bucket)
        )
        if (got == 0.0) != granted:
            raise InvariantViolation(
                "credits",
                f"try_take({cost}) at t={float(self.now):g}: the bucket "
                f"{'granted' if got == 0.0 else f'asked to wait {got:g}s'}, the reference "
                f"{'grants' if granted else f'waits {float(want):g}s'} "
                f"(level {float(self.ref.level):g}, burst {float(self.ref.burst):g})",
            )
        if not _close(got, want, 1.0 / float(self.ref.rate)):
            raise InvariantViolation(
                "credits",
                f"try_take({cost}) at t={float(self.now):g} says wait {got!r}s; the credits "
                f"are there in exactly {float(want)!r}s",
            )
        if granted:
            self.grants.append(
                Grant(cost=cost, start=self.now, made=self.now, seq=self.bucket.seq)
            )

    @rule(cost=st.integers(1, 60), slack_ms=st.none() | st.sampled_from([0, 10, 500, 5000]))
    def reserve(self, cost: int, slack_ms: int | None) -> None:
        latest = math.inf if slack_ms is None else float(self.now + slack_ms * MS)
        ref_latest = Fraction(10**12) if slack_ms is None else self.now + slack_ms * MS
        got = self.bucket.reserve(cost, float(self.now), latest)
        entry = got is not None and got > float(self.now)
        kept = _waiting_count(self.bucket)
        want = self.ref.reserve(
            cost,
            self.now,
            ref_latest,
            hint=got is not None,
            kept=None if kept is None else kept - entry,
            entry=None if kept is None else entry,
        )
        if (got is None) != (want is None) or (
            got is not None and want is not None and not _close(got, want, float(self.now))
        ):
            raise InvariantViolation(
                "credits",
                f"reserve({cost}) at t={float(self.now):g} (latest {latest:g}) returned "
                f"{got!r}; the reference starts it at "
                f"{None if want is None else float(want)!r}",
            )
        if got is None:
            return
        if got < float(self.now) - 1e-9 or got > latest + 1e-9:
            raise InvariantViolation(
                "credits",
                f"reserve({cost}) at t={float(self.now):g} starts at {got:g}, outside "
                f"[now, latest={latest:g}]",
            )
        g = Grant(cost=cost, start=want, made=self.now, seq=self.bucket.seq)
        if self.waiting:
            ahead = max(self.waiting, key=lambda w: w.start)
            if want < ahead.start:
                raise InvariantViolation(
                    "credits",
                    f"reserve({cost}) at t={float(self.now):g} starts at {float(want):g}, "
                    f"before a reservation made earlier (cost {ahead.cost}, at "
                    f"t={float(ahead.made):g}) that waits until {float(ahead.start):g}: "
                    "waiters are not served in the order they reserved",
                )
        self.grants.append(g)
        if want > self.now:
            self.waiting.append(g)
            note("admission", "reservations that wait")
        self._note_events()

    @rule(k=st.integers(0, 1 << 16))
    def refund(self, k: int) -> None:
        """A waiting caller leaves: its credits go back."""
        if not self.waiting:
            return
        g = self.waiting.pop(k % len(self.waiting))
        g.refunded = True
        self.bucket.refund(g.cost)
        self.ref.refund(g.cost)
        note("admission", "refunds")
        self._note_events()

    @rule(k=st.integers(0, 1 << 16))
    def refund_started(self, k: int) -> None:
        """A request that already started is refused or pushed out by the queue: its
        credits go back."""
        started = [g for g in self.grants if not g.refunded and g.start <= self.now]
        if not started:
            return
        g = started[k % len(started)]
        g.refunded = True
        self.bucket.refund(g.cost, since=g.seq)
        self.ref.refund(g.cost, since=g.seq)
        note("admission", "refunds after the start")
        self._note_events()

    def _note_events(self) -> None:
        for event in self.ref.events:
            note("admission", event)
        self.ref.events.clear()

    @invariant()
    def agrees(self) -> None:
        if self.bucket is None:
            return
        b, r = self.bucket, self.ref
        # Compare at the same moment: bring the reference's stamp to the bucket's.
        if b.level > float(r.burst) + 1e-9:
            raise InvariantViolation(
                "credits", f"level {b.level!r} is above the burst {float(r.burst)!r}"
            )
        if float(r.stamp) == b.stamp and not _close(b.level, r.level, float(r.burst)):
            raise InvariantViolation(
                "credits",
                f"at t={b.stamp:g} the bucket holds {b.level!r} credits; the reference "
                f"{float(r.level)!r}",
            )
        if getattr(b, "seq", r.seq) != r.seq:
            raise InvariantViolation("credits", f"{b.seq} takes counted, the reference {r.seq}")
        if not _close(b.used, r.used):
            raise InvariantViolation("credits", f"used {b.used!r}, the reference {float(r.used)!r}")
        self._check_envelope()

    def _check_envelope(self) -> None:
        live = sorted((g for g in self.grants if not g.refunded), key=lambda g: g.start)
        if not live:
            return
        rate, burst = self.ref.rate, self.ref.burst
        debt = max(g.cost for g in live)
        # The tightest windows start and end at grant starts: over i <= j, the excess
        # (P[j+1] - P[i]) - rate * (s[j] - s[i]) is P[j+1] - rate*s[j] minus the least
        # P[i] - rate*s[i] so far (P: prefix sums of cost in start order).
        prefix = Fraction(0)
        best: tuple[Fraction, Grant] | None = None
        for last in live:
            here = prefix - rate * last.start
            if best is None or here < best[0]:
                best = (here, last)
            prefix += last.cost
            excess = prefix - rate * last.start - best[0]
            if excess > burst + debt:
                first = best[1]
                raise InvariantViolation(
                    "credits",
                    f"{float(excess + rate * (last.start - first.start)):g} cost units granted "
                    f"to start within [{float(first.start):g}, {float(last.start):g}], over "
                    f"burst + rate x window + one grant's debt = "
                    f"{float(burst + rate * (last.start - first.start) + debt):g}",
                )

    def teardown(self) -> None:
        if self.bucket is not None:
            note("admission", "grants", len(self.grants))
