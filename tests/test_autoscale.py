"""The autoscaler's decision (``Autoscaler``, sans-IO), with explicit ``now``: the
replicas a load asks for, the delays before a change, one look per interval, and,
under hypothesis, bounds that hold and loads that swing faster than the delays
moving nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trioserve.actors import Autoscaler, ScaleDecision


def scaler(**kw) -> Autoscaler:
    args = dict(
        minimum=1, maximum=8, target=10.0, upscale_delay=5.0, downscale_delay=60.0,
        interval=1.0,
    )
    args.update(kw)
    return Autoscaler(**args)


def test_the_load_asks_for_ceil_of_load_over_target_within_the_bounds():
    s = scaler(minimum=2, maximum=5)
    assert [s.wanted(load) for load in (0, 1, 20, 21, 40, 41, 1e9)] == [2, 2, 2, 3, 4, 5, 5]


def test_it_scales_up_once_the_load_held_for_the_upscale_delay():
    s = scaler()
    current = 1
    for t in range(5):  # looks at 0..4: above for less than 5 s
        assert s.decide(float(t), load=35, current=current) == 1
        assert s.desired == 4
    assert s.decide(5.0, load=35, current=current) == 4  # straight to what it asks for
    assert s.last_decision == ScaleDecision(direction="up", before=1, after=4, at=5.0, load=35)
    assert s.decisions == {"up": 1, "down": 0}


def test_it_scales_down_once_the_load_stayed_low_for_the_downscale_delay():
    s = scaler()
    for t in range(60):
        assert s.decide(float(t), load=0, current=4) == 4
    assert s.decide(60.0, load=0, current=4) == 1
    assert s.last_decision.direction == "down"
    assert s.statistics().decisions == {"up": 0, "down": 1}


def test_it_scales_down_to_the_most_its_wait_asked_for():
    """A load sampled between its peaks asks for fewer replicas than it needs: going
    down to the last look's count (2 here) dropped replicas the next peak wanted
    back, and the count swung. It goes down to the most the wait's looks asked for."""
    s = scaler(downscale_delay=5.0)
    loads = [15, 25, 12, 28, 11, 14]  # ask for 2, 3, 2, 3, 2, 2: all below 4
    for t, load in enumerate(loads[:-1]):
        assert s.decide(float(t), load=load, current=4) == 4
    assert s.decide(5.0, load=loads[-1], current=4) == 3
    assert s.last_decision == ScaleDecision(direction="down", before=4, after=3, at=5.0, load=14)
    # the next wait starts afresh: its own looks only
    for t in range(6, 11):
        assert s.decide(float(t), load=5, current=3) == 3
    assert s.decide(11.0, load=5, current=3) == 1


def test_a_blip_starts_the_wait_again():
    s = scaler()
    for t in range(4):
        assert s.decide(float(t), load=35, current=1) == 1
    assert s.decide(4.0, load=5, current=1) == 1  # asks for no change: the wait resets
    for t in range(5, 10):
        assert s.decide(float(t), load=35, current=1) == 1
    assert s.decide(10.0, load=35, current=1) == 4


def test_it_looks_once_per_interval():
    s = scaler(interval=2.0)
    assert s.decide(0.0, load=35, current=1) == 1
    assert s.next_look() == 2.0
    # calls between looks change nothing: not even a blip is seen
    assert s.decide(1.0, load=0, current=1) == 1
    for t in (2.0, 4.0):
        assert s.decide(t, load=35, current=1) == 1
    assert s.decide(5.0, load=35, current=1) == 1  # before the look at 6
    assert s.decide(6.0, load=35, current=1) == 4


def test_a_replica_lost_below_the_minimum_is_replaced_after_the_delay():
    s = scaler(minimum=3)
    for t in range(5):
        assert s.decide(float(t), load=0, current=2) == 2
    assert s.decide(5.0, load=0, current=2) == 3


def test_a_failed_change_waits_its_full_delay_again():
    s = scaler(upscale_delay=2.0)
    for t in range(2):
        s.decide(float(t), load=35, current=1)
    assert s.decide(2.0, load=35, current=1) == 4
    s.failed()
    assert s.decide(3.0, load=35, current=1) == 1
    assert s.decide(4.0, load=35, current=1) == 1
    assert s.decide(5.0, load=35, current=1) == 4


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="minimum <= maximum"):
        scaler(minimum=3, maximum=2)
    with pytest.raises(ValueError, match="must be > 0"):
        scaler(target=0)


@settings(max_examples=300)
@given(
    bounds=st.tuples(st.integers(1, 6), st.integers(0, 6)).map(lambda b: (b[0], b[0] + b[1])),
    delays=st.tuples(st.floats(0, 20), st.floats(0, 20)),
    interval=st.floats(0.1, 5),
    steps=st.lists(
        st.tuples(st.floats(0.01, 10), st.floats(0, 1000)), min_size=1, max_size=80
    ),
)
def test_the_count_never_leaves_its_bounds(bounds, delays, interval, steps):
    lo, hi = bounds
    s = scaler(
        minimum=lo, maximum=hi, upscale_delay=delays[0], downscale_delay=delays[1],
        interval=interval,
    )
    now, current = 0.0, lo
    for dt, load in steps:
        now += dt
        new = s.decide(now, load=load, current=current)
        assert lo <= new <= hi
        if new != current:
            d = s.last_decision
            assert (d.before, d.after, d.at) == (current, new, now)
            assert d.direction == ("up" if new > current else "down")
            if new > current:  # up: to what the last look asks for
                assert new == s.wanted(load)
            else:  # down: to the most its wait asked for, at least the last look's
                assert s.wanted(load) <= new < current
        current = new


@settings(max_examples=300)
@given(
    delays=st.tuples(st.floats(1, 30), st.floats(1, 30)),
    every=st.floats(0.05, 0.99),  # a look in every phase (at 1, float rounding can skip one)
    share=st.floats(0.05, 0.99),
    high=st.floats(31, 1000),
    start=st.integers(1, 3),
    swings=st.integers(1, 40),
)
def test_a_load_swinging_faster_than_the_delays_moves_nothing(
    delays, every, share, high, start, swings
):
    """High for less than the upscale delay, then low for less than the downscale
    delay, over and over: never a change, however many looks fall in each phase
    (at least one: a phase shorter than the interval may fall between two looks,
    and a load seen high at every look is a steady load)."""
    phase = share * min(delays)
    s = scaler(
        minimum=1, maximum=8, upscale_delay=delays[0], downscale_delay=delays[1],
        interval=every * phase,
    )
    now = 0.0
    for _ in range(swings):
        for load in (high, 0.0):
            end = now + phase
            while now < end:
                assert s.decide(now, load=load, current=start) == start
                now = s.next_look()
            now = end
    assert s.decisions == {"up": 0, "down": 0}


@settings(max_examples=300)
@given(
    delay=st.floats(0, 20),
    interval=st.floats(0.05, 3),
    load=st.floats(0, 1000),
    current=st.integers(1, 8),
)
def test_a_steady_load_reaches_its_count_at_the_first_look_after_the_delay(
    delay, interval, load, current
):
    s = scaler(minimum=1, maximum=8, upscale_delay=delay, downscale_delay=delay, interval=interval)
    wanted = s.wanted(load)
    first = None
    now = 0.0
    while True:
        new = s.decide(now, load=load, current=current)
        if new != current or wanted == current:
            break
        first = now if first is None else first
        now = s.next_look()
    assert new == wanted
    if wanted != current:
        assert now - (first or 0.0) >= delay
        assert now - (first or 0.0) < delay + interval + 1e-9
