"""The autoscaler's decision (``Autoscaler``, sans-IO), with explicit ``now``: the
replicas a load asks for, its mean over the look-back window, the delays before a
change, one look per interval, and, under hypothesis, bounds that hold, changes to
what the window's mean asks for, loads that swing faster than the delays moving
nothing, and a one-look spike never scaling up within a window no longer than the
upscale delay."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trioserve.actors import Autoscaler, ScaleDecision


def scaler(**kw) -> Autoscaler:
    args = dict(
        minimum=1, maximum=8, target=10.0, upscale_delay=5.0, downscale_delay=60.0,
        interval=1.0, look_back=0.0,
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
    with pytest.raises(ValueError, match="look_back must be >= 0, got -1"):
        scaler(look_back=-1.0)


def test_the_load_is_averaged_over_the_look_back_window():
    """A look sees the mean of the loads sampled less than ``look_back`` ago (three
    looks here), and the change goes to what that mean asks for, not the last look."""
    s = scaler(upscale_delay=2.0, look_back=3.0)
    assert s.decide(0.0, load=60, current=1) == 1  # mean 60: 6 wanted
    assert s.desired == 6
    assert s.decide(1.0, load=0, current=1) == 1  # mean 30: 3
    assert s.desired == 3
    assert s.decide(2.0, load=0, current=1) == 2  # mean 20: 2, above since 0
    assert s.last_decision == ScaleDecision(direction="up", before=1, after=2, at=2.0, load=20)
    assert s.decide(3.0, load=30, current=2) == 2  # the sample at 0 left: mean 10
    assert s.desired == 1


def test_a_window_of_zero_sees_the_last_look_only():
    s = scaler(upscale_delay=0.0)
    assert s.decide(0.0, load=1000, current=1) == 8
    assert s.decide(1.0, load=25, current=8) == 8  # downscale waits
    assert s.desired == 3


def test_a_one_look_spike_does_not_scale_up_within_a_window_as_long_as_the_delay():
    """The default look-back is the upscale delay: the last look of the wait is a
    whole delay after the spike, which has left the window by then."""
    s = scaler(upscale_delay=3.0, look_back=3.0)
    for t, load, desired in [(0, 60, 6), (1, 0, 3), (2, 0, 2), (3, 0, 1)]:
        assert s.decide(float(t), load=load, current=1) == 1
        assert s.desired == desired
    # a window longer than the delay keeps the spike for the whole wait
    longer = scaler(upscale_delay=3.0, look_back=4.0)
    for t, load in enumerate([60, 0, 0]):
        assert longer.decide(float(t), load=load, current=1) == 1
    assert longer.decide(3.0, load=0, current=1) == 2  # 60 / 4 samples


@settings(max_examples=300)
@given(
    bounds=st.tuples(st.integers(1, 6), st.integers(0, 6)).map(lambda b: (b[0], b[0] + b[1])),
    delays=st.tuples(st.floats(0, 20), st.floats(0, 20)),
    interval=st.floats(0.1, 5),
    look_back=st.floats(0, 20),
    steps=st.lists(
        st.tuples(st.floats(0.01, 10), st.floats(0, 1000)), min_size=1, max_size=80
    ),
)
def test_the_count_stays_in_its_bounds_and_moves_to_what_the_mean_asks_for(
    bounds, delays, interval, look_back, steps
):
    """Whatever the loads and their times: the count stays within the bounds, and a
    change goes to what the mean of the looks less than ``look_back`` ago asks for
    (up), or at least that and below the count (down: the most its wait asked for)."""
    lo, hi = bounds
    s = scaler(
        minimum=lo, maximum=hi, upscale_delay=delays[0], downscale_delay=delays[1],
        interval=interval, look_back=look_back,
    )
    now, current = 0.0, lo
    looks: list[tuple[float, float]] = []  # (time, load) of every look so far
    for dt, load in steps:
        now += dt
        looked = now >= s.next_look()
        new = s.decide(now, load=load, current=current)
        assert lo <= new <= hi
        if not looked:
            assert new == current
            continue
        window = [x for t, x in looks if now - t < look_back] + [load]
        looks.append((now, load))
        mean = min(max(sum(window) / len(window), min(window)), max(window))
        assert s.desired == s.wanted(mean)
        if new != current:
            d = s.last_decision
            assert (d.before, d.after, d.at, d.load) == (current, new, now, mean)
            assert d.direction == ("up" if new > current else "down")
            if new > current:  # up: to what the window's mean asks for
                assert new == s.wanted(mean)
            else:  # down: to the most its wait asked for, at least the last look's
                assert s.wanted(mean) <= new < current
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
    """With no look-back window (each look sees its own sample): high for less than
    the upscale delay, then low for less than the downscale delay, over and over:
    never a change, however many looks fall in each phase (at least one: a phase
    shorter than the interval may fall between two looks, and a load seen high at
    every look is a steady load). With a window, the mean of such a load may ask
    for more at every look: it is then scaled for as a steady load is."""
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
    delay=st.floats(0.05, 20),
    share=st.floats(0, 1),
    interval=st.floats(0.05, 3),
    spike=st.floats(0, 1e6),
    before=st.integers(0, 20),
    after=st.integers(1, 100),
)
def test_a_one_look_spike_never_scales_up_within_a_window_no_longer_than_the_delay(
    delay, share, interval, spike, before, after
):
    """No load but at one look, however large: with ``look_back`` at most the
    upscale delay (the default: equal), the spike has left the window by the look
    a whole delay after it, so no wait of looks asking for more lasts the delay."""
    s = scaler(
        minimum=1, maximum=8, upscale_delay=delay, look_back=share * delay, interval=interval,
    )
    now = 0.0
    for load in [0.0] * before + [spike] + [0.0] * after:
        assert s.decide(now, load=load, current=1) == 1
        now = s.next_look()
    assert s.decisions == {"up": 0, "down": 0}


@settings(max_examples=300)
@given(
    delay=st.floats(0, 20),
    interval=st.floats(0.05, 3),
    look_back=st.floats(0, 20),
    load=st.floats(0, 1000),
    current=st.integers(1, 8),
)
def test_a_steady_load_reaches_its_count_at_the_first_look_after_the_delay(
    delay, interval, look_back, load, current
):
    s = scaler(
        minimum=1, maximum=8, upscale_delay=delay, downscale_delay=delay, interval=interval,
        look_back=look_back,
    )
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
