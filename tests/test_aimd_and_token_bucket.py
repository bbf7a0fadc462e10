"""The AimdLimit and TokenBucket cores, driven directly (time is an argument): the
adaptive limit's multiplicative cuts and additive growth, and the token bucket against
a reference model in exact arithmetic."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from trioserve.actors import AimdLimit, TokenBucket


# ---------------------------------------------------------------- AimdLimit
def test_aimd_cuts_multiplicatively_at_most_once_per_interval_down_to_the_minimum():
    lim = AimdLimit(minimum=10, maximum=100, backoff=0.5, interval=1.0)
    assert (lim.limit, lim.value) == (100.0, 100)
    lim.on_congestion(0.0)
    assert lim.limit == 50.0
    lim.on_congestion(0.999)  # within the interval: ignored
    assert lim.limit == 50.0
    lim.on_dispatch(5, True, 0.5)  # a congested dispatch is a congestion signal too
    assert lim.limit == 50.0
    lim.on_congestion(1.0)
    assert lim.limit == 25.0
    lim.on_dispatch(5, True, 2.0)
    assert lim.limit == 12.5
    lim.on_congestion(3.0)
    assert lim.limit == 10.0  # 6.25 is below the minimum
    lim.on_congestion(4.0)
    assert lim.limit == 10.0


def test_aimd_grows_additively_to_the_maximum():
    lim = AimdLimit(minimum=4, maximum=6, backoff=0.5, interval=1.0)
    lim.on_congestion(0.0)
    lim.on_congestion(1.0)
    assert lim.limit == 4.0
    lim.on_dispatch(4, False, 2.0)  # +4/4
    assert lim.limit == 5.0
    lim.on_dispatch(5, False, 2.0)  # +5/5
    assert lim.limit == 6.0
    lim.on_dispatch(100, False, 2.0)
    assert (lim.limit, lim.value) == (6.0, 6)


def test_aimd_minimum_is_at_least_one_and_at_most_the_maximum():
    assert AimdLimit(minimum=0, maximum=8).minimum == 1.0
    assert AimdLimit(minimum=50, maximum=8).minimum == 8.0


@settings(max_examples=80, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.integers(0, 30), st.booleans(), st.integers(1, 20)),  # dt ms, congested, n
        max_size=80,
    ),
    minimum=st.integers(1, 20),
    maximum=st.integers(1, 200),
    backoff=st.sampled_from([0.5, 0.75, 0.9]),
)
def test_aimd_limit_stays_in_bounds_cuts_once_per_interval_and_grows_additively(
    events, minimum, maximum, backoff
):
    lim = AimdLimit(minimum=minimum, maximum=maximum, backoff=backoff, interval=0.05)
    lo, hi = max(1, min(minimum, maximum)), maximum
    now, last_cut = 0.0, -math.inf
    for dt_ms, congested, n in events:
        now += dt_ms / 1000
        before = lim.limit
        lim.on_dispatch(n, congested, now)
        after = lim.limit
        assert lo <= after <= hi
        if not congested:
            assert after == min(hi, before + n / before)
        elif now - last_cut >= 0.05:  # the same float expression the limit evaluates
            assert after == max(lo, before * backoff)
            last_cut = now
        else:
            assert after == before  # at most one cut per interval


# ---------------------------------------------------------------- TokenBucket
class RefBucket:
    """The token-bucket rules in exact arithmetic: the level refills at ``rate`` up to
    ``burst``; a take needs min(cost, burst) and may leave a debt; a reservation starts
    when its need is there but never before one made earlier; a refund goes back to the
    level less what would have filled the bucket past the burst before a waiter after
    the earliest starts (the waiters' peaks: the level each meets at its start; past 16
    waiting entries, a new one is merged into the latest)."""

    def __init__(self, rate, burst, now):
        self.rate, self.burst = Fraction(rate), Fraction(burst)
        self.level, self.stamp, self.used = Fraction(burst), Fraction(now), Fraction(0)
        self.tail = None
        self.waiting: list[list] = []  # [start, peak, n], after ``stamp``

    def at(self, now):
        now = Fraction(now)
        if now > self.stamp:
            self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
            self.stamp = now
            self.waiting = [e for e in self.waiting if e[0] > now]
        return self.level

    def reserve(self, cost, now, latest):
        level = self.at(now)
        need = min(cost, self.burst)
        go = now if level >= need else now + (need - level) / self.rate
        if self.tail is not None and go < self.tail:
            go = self.tail
        if go > latest:
            return None
        if go > now:
            ahead = (go - now) * self.rate
            peak = min(self.burst, level + ahead)
            level = min(level, self.burst - ahead)
            if len(self.waiting) >= 16:
                last = self.waiting[-1]
                last[:] = [go, max(last[1], peak), last[2] + 1]
            else:
                self.waiting.append([go, peak, 1])
            self.tail = go
        self.level = level - cost
        self.used += cost
        return go

    def refund(self, cost):
        self.used -= cost
        give = Fraction(cost)
        peaks = [e[1] for e in self.waiting[1:]]
        if self.waiting and self.waiting[0][2] > 1:
            peaks.append(self.waiting[0][1])
        if peaks:
            give = max(Fraction(0), min(give, self.burst - max(peaks)))
        for e in self.waiting:
            e[1] += give
        self.level = min(self.burst, self.level + give)


@settings(max_examples=100, deadline=None)
@given(
    rate=st.sampled_from([1, 2, 4, 8]),
    burst=st.integers(1, 16),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["take", "take", "reserve", "refund"]),
            st.integers(0, 24),  # time step in 1/8 s
            st.integers(1, 24),  # cost
            st.integers(0, 32),  # reserve: latest, in 1/8 s after now
        ),
        max_size=60,
    ),
)
def test_token_bucket_matches_the_reference_model(rate, burst, ops):
    # Rates are powers of two and times multiples of 1/8 s: every float here is exact.
    b = TokenBucket(float(rate), float(burst), 0.0)
    ref = RefBucket(rate, burst, 0)
    now = Fraction(0)
    taken: list[int] = []
    for op, step, cost, latest in ops:
        now += Fraction(step, 8)
        if op == "take":
            level = ref.at(now)
            need = min(cost, ref.burst)
            got = b.try_take(cost, float(now))
            if level >= need:
                assert got == 0.0
                ref.level -= cost
                ref.used += cost
                taken.append(cost)
            else:
                assert got == (need - level) / ref.rate > 0
        elif op == "reserve":
            latest_t = now + Fraction(latest, 8)
            go = ref.reserve(cost, now, latest_t)
            got = b.reserve(cost, float(now), float(latest_t))
            assert got == go  # None when too late, and nothing taken (checked below)
            if go is not None:
                taken.append(cost)
        elif taken:
            c = taken.pop()
            b.refund(c)
            ref.refund(c)
        assert b.level <= burst
        assert b.level == ref.level
        assert b.used == ref.used


def test_token_bucket_reserve_returns_the_exact_refill_time_in_reservation_order():
    b = TokenBucket(10.0, 5.0, 100.0)
    assert b.reserve(5, 100.0, 100.0) == 100.0  # the full burst, now
    assert b.reserve(2, 100.0, 200.0) == pytest.approx(100.2)
    assert b.reserve(3, 100.0, 200.0) == pytest.approx(100.5)  # after the first waiter
    assert b.reserve(1, 100.0, 100.55) is None  # would be 100.6
    assert b.level == pytest.approx(-5.0)  # the refused one took nothing
    assert b.used == 10.0


def test_token_bucket_cost_above_burst_is_served_from_a_full_bucket_as_a_debt():
    b = TokenBucket(2.0, 4.0, 0.0)
    assert b.try_take(10, 0.0) == 0.0
    assert b.level == -6.0
    assert b.try_take(1, 0.0) == 3.5  # the debt is paid back first
    assert b.try_take(10, 5.0) == 0.0  # full again (4) after 5 s


def test_token_bucket_refund_restores_level_and_used():
    b = TokenBucket(1.0, 3.0, 0.0)
    assert b.try_take(2, 0.0) == 0.0
    assert b.reserve(3, 0.0, 10.0) == 2.0
    assert (b.level, b.used) == (-2.0, 5.0)
    b.refund(3)
    assert (b.level, b.used) == (1.0, 2.0)
    b.refund(2)
    assert (b.level, b.used) == (3.0, 0.0)
    b.refund(1)  # never above the burst
    assert b.level == 3.0


def test_token_bucket_wait_time_counts_the_reservations_ahead():
    b = TokenBucket(1.0, 4.0, 0.0)
    assert b.wait_time(3, 0.0) == 0.0
    assert b.reserve(4, 0.0, 0.0) == 0.0
    assert b.reserve(2, 0.0, 10.0) == 2.0
    assert b.reserve(2, 0.0, 10.0) == 4.0
    b.refund(2)  # the first waiter left: the level rises, the later start stays
    assert b.level == -2.0
    # From the level alone the next start would be 4.0 - 0.0 = 4 s away; it also waits
    # for the reservation starting at 4.0, so 4 s either way, and never less.
    assert b.wait_time(2, 0.0) == 4.0
    assert b.wait_time(1, 0.0) == 4.0  # the level says 3 s; the waiter ahead says 4
    assert b.reserve(1, 0.0, 3.5) is None
    assert b.level == -2.0  # wait_time and the refusal took nothing


def test_token_bucket_refund_of_a_started_grant_leaves_the_waiters_their_room():
    b = TokenBucket(1.0, 10.0, 0.0)
    assert b.reserve(10, 0.0, 0.0) == 0.0  # A starts now ...
    a = b.seq
    assert b.reserve(10, 0.0, 20.0) == 10.0  # ... B waits for the refill
    b.refund(10, since=a)  # A is pushed out of the queue: B's start cannot move
    assert b.level == -10.0  # so nothing comes back: B meets a full bucket at 10
    assert b.try_take(10, 10.0) > 0.0  # no second burst at B's start
    assert b.used == 10.0


def test_token_bucket_refund_of_a_started_grant_counts_the_levels_since():
    b = TokenBucket(100.0, 0.5, 0.0)
    assert b.reserve(1, 0.0, 0.0) == 0.0
    a = b.seq
    assert b.reserve(1, 0.01, 0.01) == 0.01  # full again (0.5) just before this take
    b.refund(1, since=a)  # the bucket was full since A: A's credits were lost to it
    assert b.level == -0.5
    assert b.try_take(1, 0.01) > 0.0
    # with no take since and nothing waiting, a started grant's credits all come back
    c = TokenBucket(1.0, 4.0, 0.0)
    assert c.try_take(3, 0.0) == 0.0
    c.refund(3, since=c.seq)
    assert (c.level, c.used) == (4.0, 0.0)


def test_token_bucket_refund_after_forgotten_takes_gives_nothing_back():
    b = TokenBucket(1000.0, 1000.0, 0.0)
    assert b.try_take(5, 0.0) == 0.0
    a = b.seq
    for _ in range(64):
        assert b.try_take(1, 0.0) == 0.0
    b.refund(5, since=a)  # 64 takes later: their levels are known (all below 995)
    assert b.level == 1000.0 - 64
    assert b.try_take(5, 0.0) == 0.0
    a = b.seq
    for _ in range(65):
        assert b.try_take(1, 0.0) == 0.0
    b.refund(5, since=a)  # 65 takes later: the history since is gone
    assert b.level == 1000.0 - 64 - 5 - 65


def test_a_waiting_reservation_refunded_by_its_number_leaves_the_waiting_ones():
    b = TokenBucket(rate=1.0, burst=2.0, now=0.0)
    assert b.try_take(2.0, 0.0) == 0.0
    assert b.reserve(1.0, 0.0, math.inf) == 1.0
    first = b.seq
    assert b.reserve(1.0, 0.0, math.inf) == 2.0
    second = b.seq
    b.refund(1.0, reservation=first)  # a later waiter meets 1 at its start: 1 fits
    b.refund(1.0, reservation=second)  # the last waiter now: all of it
    assert (b.level, b.used) == (0.0, 2.0)
    # the starts handed out never move: a new reservation still goes after them
    assert b.reserve(1.0, 0.5, math.inf) == 2.0


def test_a_reservation_refunded_after_its_start_is_refunded_as_a_grant():
    b = TokenBucket(rate=1.0, burst=2.0, now=0.0)
    b.try_take(2.0, 0.0)
    assert b.reserve(1.0, 0.0, math.inf) == 1.0
    taken = b.seq
    assert b.wait_time(0.0, 1.5) == 0.0  # refilled to 1.5: it started at 1
    b.refund(1.0, reservation=taken)  # the bucket held at most 0.5 since: all of it back
    assert b.level == 1.5
    assert b.used == 2.0


def test_a_reservation_refused_at_its_start_before_any_refill_gets_its_credits_back():
    # A waiter wakes at its start and the queue refuses it at once: no call has
    # refilled the bucket since, so its reservation is still on the books as waiting.
    # It was refunded as a grant that also counted the level it met at its own start
    # (a full bucket) as a later waiter's, and got nothing back.
    b = TokenBucket(rate=1.0, burst=4.0, now=0.0)
    assert b.try_take(4.0, 0.0) == 0.0
    assert b.reserve(4.0, 0.0, math.inf) == 4.0  # meets a full bucket at 4
    taken = b.seq
    b.refund(4.0, since=taken)  # at t=4, the bucket untouched since t=0
    assert b.wait_time(4.0, 4.0) == 0.0  # the credits stayed: full again at 4
    assert (b.level, b.used) == (4.0, 4.0)
    # the same refund after a call that refilled the bucket (an observation) agrees
    c = TokenBucket(rate=1.0, burst=4.0, now=0.0)
    assert c.try_take(4.0, 0.0) == 0.0
    assert c.reserve(4.0, 0.0, math.inf) == 4.0
    assert c.wait_time(0.0, 4.0) == 0.0
    c.refund(4.0, since=c.seq)
    assert (c.level, c.used) == (b.level, b.used)


def _envelope_excess(grants, rate, burst):
    """The most by which the grants that stand (start, seq, cost) exceed, over a window
    [a, b] of their starts, burst + rate x (b - a) + the debt of a grant starting at b
    (a cost above the burst takes a full bucket below 0); <= 0 when within it."""
    live = sorted(grants)
    worst = Fraction(-(10**9))
    prefix, least = Fraction(0), None
    for j, (start, _, cost) in enumerate(live):
        here = prefix - rate * start
        least = here if least is None else min(least, here)
        prefix += cost
        if j + 1 < len(live) and live[j + 1][0] == start:
            continue  # the window ends after every grant starting then
        debt = max(max(0, c - burst) for s, _, c in live if s == start)
        worst = max(worst, prefix - rate * start - least - burst - debt)
    return worst


@settings(max_examples=200, deadline=None)
@given(
    rate=st.sampled_from([1, 2, 4]),
    burst=st.integers(1, 8),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["advance", "take", "reserve", "reserve", "refund", "refund"]),
            st.integers(0, 16),  # advance: in 1/8 s; take, reserve: cost
            st.integers(0, 1 << 16),  # refund: which of the grants that stand
            st.booleans(),  # refund of a started reservation: by reservation= or since=
        ),
        max_size=80,
    ),
)
# A waiter withdrawn (refunded as waiting) left its record's level in the log, so a
# later grant's refund counted the level that waiter would have met at its start as
# one the bucket held, and gave back nothing where the waiter's way gave all of it.
@example(
    rate=2, burst=1,
    ops=[("take", 1, 0, False), ("reserve", 1, 0, False), ("reserve", 1, 0, False),
         ("refund", 0, 2, False), ("advance", 4, 0, False), ("refund", 0, 1, False)],
)
# ... but one that started (refunded by since=, still listed as waiting) met that level,
# and a refund of an earlier grant must still count it, as after a refill.
@example(
    rate=2, burst=1,
    ops=[("take", 2, 0, False), ("reserve", 1, 0, False), ("reserve", 1, 0, False),
         ("advance", 8, 0, False), ("refund", 0, 1, False), ("refund", 0, 1, False),
         ("refund", 0, 0, False)],
)
def test_token_bucket_refunds_keep_the_envelope_whenever_the_bucket_is_looked_at(
    rate, burst, ops
):
    # Two buckets take the same calls; one is also looked at (wait_time, which takes
    # nothing and refills it) after every step of time, the other only when called. A
    # refund gives back the same whichever: a reservation whose start has passed with
    # no call since is still on the books as waiting in one and has started in the
    # other; and a started reservation is refunded alike by reservation= and since=.
    # Whatever the refunds, the grants that stand keep to burst + rate x window (+ one
    # grant's debt). Rates are powers of two, times multiples of 1/8 s: floats exact.
    lazy = TokenBucket(float(rate), float(burst), 0.0)
    eager = TokenBucket(float(rate), float(burst), 0.0)
    now = Fraction(0)
    grants: list[tuple[Fraction, int, int]] = []  # (start, seq, cost), not refunded
    waited: set[int] = set()  # the grants that were reservations made to wait
    for op, n, k, by_reservation in ops:
        t = float(now)
        if op == "advance":
            now += Fraction(n, 8)
            eager.wait_time(0.0, float(now))
            continue
        if op == "take" and n:
            got = lazy.try_take(n, t)
            assert eager.try_take(n, t) == got
            if got == 0.0:
                grants.append((now, lazy.seq, n))
        elif op == "reserve" and n:
            at = lazy.reserve(n, t, math.inf)
            assert eager.reserve(n, t, math.inf) == at
            grants.append((Fraction(at), lazy.seq, n))
            if at > t:
                waited.add(lazy.seq)
        elif op == "refund" and grants:
            start, seq, cost = grants.pop(k % len(grants))
            if start > now:  # its caller left while it waited
                lazy.refund(cost, reservation=seq, now=t)
                eager.refund(cost, reservation=seq, now=t)
            elif seq in waited:  # it waited, and started: either way it is a grant
                by = {"reservation": seq, "now": t}
                lazy.refund(cost, **(by if by_reservation else {"since": seq}))
                eager.refund(cost, **({"since": seq} if by_reservation else by))
            else:
                lazy.refund(cost, since=seq)
                eager.refund(cost, since=seq)
        assert lazy.seq == eager.seq
        assert lazy.used == eager.used == sum(c for _, _, c in grants)
        # the levels agree once brought to the same moment
        assert lazy.wait_time(0.0, t) == eager.wait_time(0.0, t)
        assert (lazy.level, lazy.stamp) == (eager.level, eager.stamp)
        assert lazy.level <= burst
        assert _envelope_excess(grants, rate, burst) <= 0
