"""The rollout's sans-IO decisions (actors/_rollout.py): the split, the steps, the
checks and the final states, with exact examples and properties."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trioserve.actors import Rollout, RolloutRules, RolloutState


def rollout(**rules) -> Rollout:
    return Rollout(RolloutRules(**rules), stable="1", canary="2", now=0.0)


@pytest.mark.parametrize("share", [0.05, 0.25, 0.5, 1 / 3, 0.7, 1.0])
def test_the_split_follows_the_share_exactly(share):
    r = rollout(steps=(share,))
    routed = [r.route() for _ in range(1000)]
    for n in (1, 7, 20, 100, 999, 1000):
        # the share as written (its shortest decimal), times n, rounded down
        assert routed[:n].count("2") == math.floor(n * _exact(share))


def test_a_good_canary_steps_through_every_share_and_is_promoted():
    r = rollout(steps=(0.1, 0.5), step_s=10, min_requests=3)
    assert (r.state, r.share, r.step) == (RolloutState.CANARY, 0.1, 0)
    for _ in range(3):
        assert r.record("2", True, 0.01, 1.0) == []  # enough requests, not long enough
    assert r.tick(9.99) == []
    (event,) = r.tick(10.0)
    assert (event.kind, event.step, event.share) == ("step", 1, 0.5)
    assert r.counts["2"].answers == 0  # a new step counts anew
    for _ in range(2):
        r.record("2", True, 0.01, 15.0)
    assert r.tick(25.0) == []  # long enough, too few requests
    (event,) = r.record("2", True, 0.01, 25.0)
    assert event.kind == "promoted"
    assert (r.state, r.share, r.target()) == (RolloutState.PROMOTED, 1.0, "2")
    assert {r.route() for _ in range(10)} == {"2"}


def test_errors_past_the_rate_roll_back_before_min_requests_are_reached():
    r = rollout(min_requests=100, max_error_rate=0.01)
    r.record("2", False, 0.01, 1.0)
    assert r.state is RolloutState.CANARY  # 1 error in 100 would be within 1%
    (event,) = r.record("2", False, 0.01, 2.0)  # 2 errors: over 1% at 100 answers
    assert event.kind == "rolled_back"
    assert r.reason == (
        "error rate: 2 errors in 2 answers of the canary (100.00%), more than "
        "max_error_rate 0.01 × min_requests 100 = 1 already"
    )
    assert (r.share, r.target()) == (0.0, "1")
    assert {r.route() for _ in range(10)} == {"1"}
    assert r.tick(1e9) == []
    assert r.record("2", True, 0.01, 3.0) == []


def test_a_slower_canary_is_rolled_back_once_both_have_min_requests():
    r = rollout(min_requests=5, max_latency_ratio=1.5)
    for _ in range(5):
        r.record("2", True, 0.2, 1.0)
    assert r.state is RolloutState.CANARY  # the stable has no answers yet
    for _ in range(4):
        r.record("1", True, 0.1, 1.0)
    assert r.state is RolloutState.CANARY
    (event,) = r.record("1", True, 0.1, 1.0)
    assert event.kind == "rolled_back"
    assert r.reason.startswith("latency: the canary's p99 201 ms over the stable's 100 ms")


def test_a_canary_turning_slow_later_in_a_step_is_caught_within_latency_every():
    """The p99s are compared when both versions first have min_requests answers,
    then after each LATENCY_EVERY answers (a p99 is too dear for every answer): a
    canary that turns slow afterwards is rolled back within LATENCY_EVERY answers."""
    r = rollout(min_requests=5, max_latency_ratio=1.5, step_s=1e9)
    for _ in range(5):
        r.record("1", True, 0.1, 1.0)
        r.record("2", True, 0.1, 1.0)
    assert r.state is RolloutState.CANARY  # compared here: alike
    answers = 10
    while r.state is RolloutState.CANARY:
        r.record("2", True, 1.0, 1.0)
        answers += 1
        assert answers <= 10 + Rollout.LATENCY_EVERY
    assert answers == 10 + Rollout.LATENCY_EVERY
    assert r.reason.startswith("latency: ")


def test_a_step_never_ends_without_comparing_the_latencies():
    """However few answers came since the last comparison, a step's end compares
    the p99s first: a slow canary is rolled back, not advanced."""
    r = rollout(steps=(0.1, 0.5), min_requests=5, max_latency_ratio=1.5, step_s=10)
    for _ in range(5):
        r.record("1", True, 0.1, 1.0)
        r.record("2", True, 0.1, 1.0)
    r.record("2", True, 5.0, 2.0)  # the canary's p99 now 5 s: not compared yet
    assert r.state is RolloutState.CANARY
    (event,) = r.tick(10.0)
    assert event.kind == "rolled_back"
    assert r.step == 0


def test_a_hung_canary_is_rolled_back_on_its_late_share():
    """A canary that answers nothing: its requests' deadlines pass in its queue.
    Late is no error, but once both versions have min_requests outcomes its late
    share (all of them) is past the stable's by more than max_error_rate."""
    r = rollout(min_requests=10, max_error_rate=0.05)
    for _ in range(9):
        assert r.record_late("2", 1.0) == []  # the stable has no outcomes yet
    for _ in range(9):
        r.record("1", True, 0.01, 1.0)
    assert r.state is RolloutState.CANARY  # 9 of the stable's: its share is not known
    (event,) = r.record("1", True, 0.01, 2.0)
    assert event.kind == "rolled_back"
    assert r.reason == (
        "late: 9 of the canary's 9 requests (100.00%) passed their deadline in its "
        "queue, 0 of the stable's 10 (0.00%): more by over max_error_rate 0.05 (at "
        "least 10 of each, sure to be over at 10 whatever its next ones)"
    )
    assert (r.share, r.counts["2"].late, r.counts["2"].answers) == (0.0, 9, 0)


def test_a_hung_canary_is_caught_in_a_few_late_requests_once_the_stable_is_known():
    """As the error rule does: once the canary's late requests are so many that its
    late share at min_requests, whatever its next outcomes, is past the stable's by
    over max_error_rate, it is rolled back, not min_requests late requests later."""
    r = rollout(min_requests=100, max_error_rate=0.05)
    for i in range(200):
        r.record_late("1", 1.0) if i % 10 == 0 else r.record("1", True, 0.01, 1.0)
    # the stable's late share is 0.1: the canary's must pass 0.15 at 100 outcomes
    for _ in range(15):
        assert r.record_late("2", 2.0) == []  # 15 of 100 would not be past
    (event,) = r.record_late("2", 2.0)  # 16 of 100 would
    assert event.kind == "rolled_back"
    assert r.reason.startswith("late: 16 of the canary's 16 requests (100.00%) passed "
                               "their deadline in its queue, 20 of the stable's 200")
    # answers in between move the canary's share, not the bound at min_requests
    r = rollout(min_requests=100, max_error_rate=0.05)
    for _ in range(100):
        r.record("1", True, 0.01, 1.0)
    for _ in range(90):
        r.record("2", True, 0.01, 1.0)
    for _ in range(5):
        assert r.record_late("2", 2.0) == []  # 5 of 95: 5 of 100 at most, 0.05
    (event,) = r.record_late("2", 2.0)  # 6 of 96: at least 6 of 100
    assert event.kind == "rolled_back"


def test_late_requests_alike_on_both_versions_are_no_breach():
    """Clients' own too-short timeouts hit both versions: the same late share on
    each (or the canary's more by at most max_error_rate) keeps the canary."""
    r = rollout(min_requests=10, max_error_rate=0.1, step_s=1e9)
    for _ in range(10):
        r.record_late("1", 1.0)
        r.record_late("2", 1.0)
        for _ in range(10):
            r.record("1", True, 0.01, 1.0)
            r.record("2", True, 0.01, 1.0)
    assert r.state is RolloutState.CANARY  # both 10 late of 110
    # the canary's share past the stable's by exactly 0.1: 20/100 vs 10/100
    r2 = rollout(min_requests=100, max_error_rate=0.1)
    for i in range(100):
        r2.record_late("2", 1.0) if i < 20 else r2.record("2", True, 0.01, 1.0)
        r2.record_late("1", 1.0) if i < 10 else r2.record("1", True, 0.01, 1.0)
    assert r2.state is RolloutState.CANARY
    (event,) = r2.record_late("2", 1.0)  # 21/101 - 10/100 > 0.1
    assert event.reason.startswith("late: 21 of the canary's 101 requests")


def test_errors_past_the_rate_after_min_requests_say_the_rate_they_exceed():
    r = rollout(min_requests=4, max_error_rate=0.2)
    for t in range(4):
        assert r.record("2", True, 0.01, 1.0 + t) == []
    assert r.record("2", False, 0.01, 5.0) == []  # 1 error in 5 answers: 20%, not over
    assert r.state is RolloutState.CANARY
    (event,) = r.record("2", False, 0.01, 6.0)  # 2 in 6: over 20%
    assert event.kind == "rolled_back"
    assert r.reason == (
        "error rate: 2 errors in 6 answers of the canary (33.33%), over max_error_rate 0.2"
    )


def test_late_requests_neither_end_a_step_nor_are_errors():
    r = rollout(steps=(0.1, 0.5), min_requests=3, max_error_rate=0.0, step_s=10)
    for _ in range(2):
        r.record("2", True, 0.01, 1.0)
    for _ in range(5):
        r.record_late("2", 1.0)  # the stable has no outcomes: nothing to compare
    assert r.tick(20.0) == []  # 2 answers: a step advances on answers only
    assert r.state is RolloutState.CANARY
    assert (r.counts["2"].errors, r.counts["2"].late) == (0, 5)
    (event,) = r.record("2", True, 0.01, 21.0)
    assert (event.kind, r.counts["2"].late) == ("step", 0)  # counted anew


def test_the_p99_found_with_numpy_is_hdrhs_own():
    import random

    from trioserve.actors._metrics import Latency

    rng = random.Random(7)
    for n in (1, 2, 99, 100, 101, 3000):
        lat = Latency()
        for _ in range(n):
            lat.record(rng.expovariate(1 / rng.choice([1e-5, 1e-3, 0.05, 2.0])))
        lat.fold()
        for q in (50, 90, 99, 99.9, 100):
            assert lat.percentile_s(q) == lat.hist.get_value_at_percentile(q) / 1e6
    assert Latency().percentile_s(99) == 0.0


def test_no_canary_routes_everything_to_stable():
    r = Rollout(RolloutRules(), stable="1", canary=None, now=0.0)
    assert r.state is RolloutState.STABLE
    assert {r.route() for _ in range(5)} == {"1"}
    assert r.record("1", False, 1.0, 1.0) == []
    assert r.next_deadline() == math.inf


_late = st.tuples(st.just("late"), st.sampled_from(["1", "2", "2"]))
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("route")),
        # answers mostly ok, so that a step lasts long enough for late requests
        st.tuples(st.just("record"), st.sampled_from(["1", "2"]),
                  st.sampled_from([True, True, True, False]),
                  st.sampled_from([0.01, 0.02, 0.05])),
        _late,
        _late,
        st.tuples(st.just("wait"), st.floats(0.0, 20.0)),
    ),
    max_size=300,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=_ops,
    steps=st.sampled_from([(0.05, 0.25, 0.5), (0.5,), (0.2, 1.0), (1 / 3, 0.9)]),
    min_requests=st.integers(1, 8),
    max_error_rate=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
)
def test_rollout_properties(ops, steps, min_requests, max_error_rate):
    rules = RolloutRules(steps=steps, step_s=10.0, min_requests=min_requests,
                         max_error_rate=max_error_rate, max_latency_ratio=2.0)
    r = Rollout(rules, stable="1", canary="2", now=0.0)
    now = 0.0
    routed = to_canary = 0
    seen_steps = [0]
    # the step's late requests and outcomes (answers and late) of each version
    late = {"1": 0, "2": 0}
    outcomes = {"1": 0, "2": 0}
    rate = _exact(max_error_rate)

    def late_breach() -> bool:
        # with the stable's min_requests outcomes, the canary's share over at least
        # min_requests outcomes (the least it can have at min_requests)
        if outcomes["1"] < min_requests or late["2"] == 0:
            return False
        return (Fraction(late["2"], max(outcomes["2"], min_requests))
                - Fraction(late["1"], outcomes["1"]) > rate)

    for op in ops:
        before = (r.state, r.step, r.step_started)
        if before[0] is RolloutState.CANARY:
            canary = r.counts["2"]
            enough = canary.answers
            n, errors = canary.answers, canary.errors
        if op[0] == "route":
            v = r.route()
            events = []
            if r.state is RolloutState.CANARY:
                routed += 1
                to_canary += v == "2"
                # the split is exact: floor(n * share) of the step's first n
                assert to_canary == math.floor(routed * _exact(r.share))
        elif op[0] == "record":
            _, v, ok, latency = op
            events = r.record(v, ok, latency, now)
            if before[0] is RolloutState.CANARY:
                outcomes[v] += 1
        elif op[0] == "late":
            events = r.record_late(op[1], now)
            if before[0] is RolloutState.CANARY:
                late[op[1]] += 1
                outcomes[op[1]] += 1
        else:
            now += op[1]
            events = r.tick(now)
        if before[0] is not RolloutState.CANARY:
            # terminal states stay terminal and change nothing
            assert events == []
            assert r.state is before[0]
            continue
        for e in events:
            if e.kind in ("step", "promoted"):
                # never advances with fewer than min_requests, nor before step_s
                assert enough + (op[0] == "record" and op[1] == "2") >= min_requests
                assert now - before[2] >= rules.step_s
            if e.kind == "step":
                # the shares follow the steps in order
                assert e.step == seen_steps[-1] + 1
                assert e.share == steps[e.step]
                seen_steps.append(e.step)
                routed = to_canary = 0
                late = {"1": 0, "2": 0}
                outcomes = {"1": 0, "2": 0}
            if e.kind == "rolled_back" and e.reason.startswith("late:"):
                # only when the late shares differ by more than max_error_rate
                assert late_breach()
        if r.state is RolloutState.CANARY:
            # late requests are counted per version, apart from answers
            assert {v: r.counts[v].late for v in late} == late
            assert {v: r.counts[v].outcomes for v in outcomes} == outcomes
            # a canary late more often than the stable by over max_error_rate, both
            # with min_requests outcomes (a hung one with no answers too), or sure to
            # be at min_requests, is rolled back at once
            assert not late_breach()
        if op[0] == "record" and op[1] == "2" and not op[2]:
            errors += 1
            n += 1
            # an error share over the limit (with min_requests, or certain to be at
            # min_requests) always rolls back
            if errors > max_error_rate * max(n, min_requests):
                assert r.state is RolloutState.ROLLED_BACK
        if r.state is RolloutState.ROLLED_BACK:
            assert r.share == 0.0
            assert r.reason
        if r.state is RolloutState.PROMOTED:
            assert r.share == 1.0
            assert r.step == len(steps) - 1


@settings(max_examples=300, deadline=None)
@given(
    outcomes=st.lists(st.tuples(st.sampled_from(["1", "2"]), st.booleans()), max_size=120),
    min_requests=st.integers(1, 30),
    max_error_rate=st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.3, 0.99, 1.0]),
)
def test_the_late_rule_rolls_back_early_exactly_when_sure(
    outcomes, min_requests, max_error_rate
):
    """Outcomes (a version's request late, or answered) in any order. The late rule
    proper: both versions have min_requests outcomes and the canary's late share is
    past the stable's by over max_error_rate. Early, with fewer than min_requests of
    the canary's: it is rolled back exactly when the rule proper would hold at its
    min_requests outcomes whatever they are (every completion, late or answered),
    against the stable's share as it is, which needs min_requests of the stable's."""
    m, rate = min_requests, _exact(max_error_rate)
    r = rollout(min_requests=m, max_error_rate=max_error_rate, step_s=1e9)
    late = {"1": 0, "2": 0}
    total = {"1": 0, "2": 0}

    def rule(cl: int, cn: int, sl: int, sn: int) -> bool:
        return min(cn, sn) >= m and Fraction(cl, cn) - Fraction(sl, sn) > rate

    def sure() -> bool:
        cl, cn, sl, sn = late["2"], total["2"], late["1"], total["1"]
        if cn >= m:
            return rule(cl, cn, sl, sn)
        # every way its next m - cn outcomes can go: j of them late
        return all(rule(cl + j, m, sl, sn) for j in range(m - cn + 1))

    for version, is_late in outcomes:
        events = r.record_late(version, 1.0) if is_late else r.record(version, True, 0.01, 1.0)
        late[version] += is_late
        total[version] += 1
        assert (r.state is RolloutState.ROLLED_BACK) == sure(), (late, total)
        if events:
            (event,) = events
            assert event.reason.startswith("late:")
            if total["2"] < m:
                assert total["1"] >= m  # the stable's share is known
            break
    if max_error_rate == 1.0:
        assert r.state is RolloutState.CANARY  # no share is past another by over 1


def _exact(share: float) -> Fraction:
    return Fraction(repr(share))


# ---------------------------------------------------------------- the operator's
def test_a_pause_holds_the_step_and_resuming_does_not_count_the_pause():
    r = rollout(steps=(0.1, 0.5), step_s=10, min_requests=3)
    for _ in range(3):
        r.record("2", True, 0.01, 1.0)
    (event,) = r.pause(4.0)
    assert (event.kind, event.operator, event.share) == ("paused", True, 0.1)
    assert (r.state, r.share, r.next_deadline()) == (RolloutState.PAUSED, 0.1, math.inf)
    assert [r.route() for _ in range(10)].count("2") == 1  # the share holds
    assert r.tick(100.0) == []  # long past step_s, enough answers: held
    assert r.record("2", True, 0.01, 100.0) == []
    (event,) = r.resume(104.0)
    assert (event.kind, r.state) == ("resumed", RolloutState.CANARY)
    # 4 s of the step before the pause, none of the 100 s paused: 6 s to go
    assert r.next_deadline() == 110.0
    assert r.tick(109.99) == []
    (event,) = r.tick(110.0)
    assert (event.kind, event.step, event.share) == ("step", 1, 0.5)


def test_a_paused_canary_is_still_checked_and_rolled_back():
    r = rollout(min_requests=100, max_error_rate=0.01)
    r.pause(1.0)
    r.record("2", False, 0.01, 2.0)
    (event,) = r.record("2", False, 0.01, 3.0)
    assert (event.kind, event.operator, r.state) == ("rolled_back", False,
                                                     RolloutState.ROLLED_BACK)
    assert r.reason.startswith("error rate: 2 errors")
    assert r.refusal("resume") == "the canary is already rolled_back (final)"


@pytest.mark.parametrize("paused", [False, True])
def test_the_operator_promotes_or_rolls_back_at_any_step(paused):
    for action in ("promote", "rollback"):
        r = rollout(steps=(0.05, 0.25, 0.5))
        if paused:
            r.pause(1.0)
        (event,) = r.promote(2.0) if action == "promote" else r.rollback(2.0, "bad dashboards")
        assert event.operator
        if action == "promote":
            assert (r.state, r.share, r.reason, event.kind) == (
                RolloutState.PROMOTED, 1.0, None, "promoted")
            assert {r.route() for _ in range(5)} == {"2"}
        else:
            assert (r.state, r.share, r.reason, event.kind) == (
                RolloutState.ROLLED_BACK, 0.0, "bad dashboards", "rolled_back")
            assert {r.route() for _ in range(5)} == {"1"}
        assert r.step == 0
        assert r.paused_at is None
        for other in ("promote", "rollback", "pause", "resume"):
            assert r.refusal(other) == f"the canary is already {r.state.value} (final)"
            with pytest.raises(ValueError, match=f"^cannot {other} the rollout: the canary"):
                getattr(r, other)(3.0, "x") if other == "rollback" else getattr(r, other)(3.0)
        assert len(r.events) == 1 + paused


def test_actions_the_state_does_not_allow_are_refused_and_change_nothing():
    r = rollout()
    assert r.refusal("resume") == "it is not paused"
    r.pause(1.0)
    assert r.refusal("pause") == "it is already paused"
    with pytest.raises(ValueError, match=r"^cannot pause the rollout: it is already paused$"):
        r.pause(2.0)
    assert (r.state, r.paused_at, len(r.events)) == (RolloutState.PAUSED, 1.0, 1)
    stable_only = Rollout(RolloutRules(), stable="1", canary=None, now=0.0)
    for action in ("promote", "rollback", "pause", "resume"):
        assert stable_only.refusal(action) == "it has no canary"
    assert stable_only.state is RolloutState.STABLE


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("wait"), st.floats(0.0, 7.0)),
    st.tuples(st.just("answer")),
    st.tuples(st.just("pause")),
    st.tuples(st.just("resume")),
), max_size=80))
def test_a_step_lasts_step_s_of_time_not_paused(ops):
    """However pauses and resumes fall, a step ends only unpaused, once it lasted
    step_s not counting its pauses and the canary has min_requests answers."""
    r = rollout(steps=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9), step_s=10.0,
                min_requests=2)
    now = unpaused = 0.0  # the step's time not paused
    answers = 0
    for op in ops:
        paused = r.state is RolloutState.PAUSED
        if op[0] == "wait":
            now += op[1]
            unpaused += 0.0 if paused else op[1]
            events = r.tick(now)
        elif op[0] == "answer":
            answers += 1
            events = r.record("2", True, 0.01, now)
        elif r.refusal(op[0]) is None:
            events = getattr(r, op[0])(now)
            assert [e.kind for e in events] == [op[0] + "d"]
        else:
            with pytest.raises(ValueError, match=f"^cannot {op[0]} the rollout: "):
                getattr(r, op[0])(now)
            continue
        if op[0] == "resume":
            events += r.tick(now)  # as the actor does on any change
        if any(e.kind in ("step", "promoted") for e in events):
            assert r.state is not RolloutState.PAUSED
            assert unpaused >= 10.0 - 1e-9
            assert answers >= 2
            unpaused, answers = 0.0, 0
        if r.state is RolloutState.CANARY:
            # nothing due is left undone
            assert not (unpaused >= 10.0 + 1e-9 and answers >= 2)
        if r.terminal:
            break


def test_a_rollout_just_made_starts_from_a_recorded_decision():
    promoted, rolled = rollout(), rollout()
    paused = rollout(steps=(0.1, 0.5), step_s=10, min_requests=3)
    promoted.restore(RolloutState.PROMOTED, step=0, reason=None, now=5.0)
    rolled.restore(RolloutState.ROLLED_BACK, step=0, reason="error rate: ...", now=5.0)
    paused.restore(RolloutState.PAUSED, step=1, reason=None, now=5.0)
    assert (promoted.state, promoted.share, promoted.target()) == (
        RolloutState.PROMOTED, 1.0, "2")
    assert (rolled.state, rolled.share, rolled.reason) == (
        RolloutState.ROLLED_BACK, 0.0, "error rate: ...")
    assert {rolled.route() for _ in range(10)} == {"1"}
    assert (paused.state, paused.step, paused.share) == (RolloutState.PAUSED, 1, 0.5)
    assert [paused.route() for _ in range(4)] == ["1", "2", "1", "2"]
    assert all(r.events == [] for r in (promoted, rolled, paused))  # nothing happened
    assert {r.restored for r in (promoted, rolled, paused)} == {
        RolloutState.PROMOTED, RolloutState.ROLLED_BACK, RolloutState.PAUSED}
    # paused: nothing ends the step; resumed, its step_s counts from the resumption
    for _ in range(3):
        paused.record("2", True, 0.01, 6.0)
    assert paused.tick(100.0) == []
    paused.resume(100.0)
    assert paused.tick(109.9) == []
    (event,) = paused.tick(110.0)
    assert event.kind == "promoted"
    assert promoted.refusal("rollback") == "the canary is already promoted (final)"


@pytest.mark.parametrize(
    ("state", "step", "elapsed", "why"),
    [
        (RolloutState.STABLE, 0, 0.0, "cannot restore a rollout to stable"),
        (RolloutState.PAUSED, 3, 0.0, "step 3 is not one of the 3 steps"),
        (RolloutState.CANARY, 0, -1.0, "a step's time served must be a finite number >= 0"),
        (RolloutState.CANARY, 0, math.inf, "a step's time served must be a finite number"),
    ],
)
def test_only_a_recorded_state_is_restored_and_only_once(state, step, elapsed, why):
    with pytest.raises(ValueError, match=why):
        rollout().restore(state, step=step, reason=None, now=0.0, elapsed=elapsed)
    once = rollout()
    once.restore(RolloutState.PAUSED, step=0, reason=None, now=0.0)
    begun = rollout()
    begun.pause(1.0)
    begun.resume(2.0)
    for r in (once, begun):
        with pytest.raises(ValueError, match="only a canary's rollout just begun"):
            r.restore(RolloutState.PROMOTED, step=0, reason=None, now=3.0)


def test_a_trial_restored_at_a_step_ends_it_after_the_time_left():
    # recorded at step 2 with 7 s of its 10 served: 3 s more, and its answers
    r = rollout(steps=(0.1, 0.5, 0.75), step_s=10, min_requests=2)
    r.restore(RolloutState.CANARY, step=1, reason=None, now=100.0, elapsed=7.0)
    assert (r.state, r.restored, r.step, r.share) == (RolloutState.CANARY,
                                                       RolloutState.CANARY, 1, 0.5)
    assert r.step_elapsed(100.0) == 7.0
    assert r.next_deadline() == 103.0
    assert r.counts["2"].answers == 0  # the counts were the earlier run's
    for _ in range(2):
        assert r.record("2", True, 0.01, 101.0) == []
    assert r.tick(102.9) == []
    (event,) = r.tick(103.0)
    assert (event.kind, event.step, event.share) == ("step", 2, 0.75)
    # paused, restored: the time served holds until the resume
    p = rollout(steps=(0.1, 0.5), step_s=10, min_requests=1)
    p.restore(RolloutState.PAUSED, step=0, reason=None, now=50.0, elapsed=4.0)
    assert p.step_elapsed(80.0) == 4.0
    p.resume(80.0)
    assert p.next_deadline() == 86.0


def test_a_new_trial_starts_once_the_last_ended():
    r = rollout(steps=(0.5,), step_s=10, min_requests=1)
    assert r.refusal("start") == "canary '2' is on trial; roll it back or promote it first"
    r.pause(1.0)
    assert r.refusal("start") == (
        "canary '2' is on trial (paused); roll it back or promote it first")
    with pytest.raises(ValueError, match=r"^cannot start the rollout: canary '2' is on trial"):
        r.start("3", RolloutRules(), 2.0)
    r.rollback(2.0, "bad")
    # rolled back: the stable stays; the new trial's rules are its own
    (event,) = r.start("3", RolloutRules(steps=(0.25, 1.0), step_s=5, min_requests=1), 3.0)
    assert (event.kind, event.step, event.share, event.operator) == ("started", 0, 0.25, True)
    assert (r.state, r.stable, r.canary, r.step, r.reason) == (
        RolloutState.CANARY, "1", "3", 0, None)
    assert (r.origin, r.stable_from) == ("operator", "previous")
    assert [r.route() for _ in range(4)] == ["1", "1", "1", "3"]
    assert set(r.counts) == {"1", "3"}
    r.record("3", True, 0.01, 4.0)
    assert r.tick(7.9) == []
    assert [e.kind for e in r.tick(8.0)] == ["step"]
    r.record("3", True, 0.01, 9.0)
    assert [e.kind for e in r.tick(13.0)] == ["promoted"]
    # promoted: the promoted canary is the next trial's stable
    with pytest.raises(ValueError, match="the canary '3' is the stable version"):
        r.start("3", RolloutRules(), 14.0)
    r.start("2", RolloutRules(steps=(0.5,)), 14.0)
    assert (r.stable, r.canary, r.stable_from, r.share) == ("3", "2", "promoted", 0.5)
    assert [r.route() for _ in range(2)] == ["3", "2"]


def test_a_rollout_without_a_canary_may_start_one():
    r = Rollout(RolloutRules(), stable="1", canary=None, now=0.0)
    assert r.refusal("promote") == "it has no canary"
    assert r.refusal("start") is None
    r.start("2", RolloutRules(steps=(0.5,)), 1.0)
    assert (r.state, r.stable, r.canary, r.stable_from) == (
        RolloutState.CANARY, "1", "2", "configuration")
