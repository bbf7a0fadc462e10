"""A crash of the runtime under test is a failure of the fuzz suites (fuzz/_crashes.py,
docs/fuzzing.md, "Crashes"): an actor that crashed where no fault the scenario planted
explains it fails the example (``crash``), with the first crash's traceback, though
its supervisor restarted it and every other invariant held; a crash the scenario
planted does not."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import attrs
import pytest
import trioserve.actors

import fuzz
import fuzz._runtime
from fuzz._crashes import watch_crashes
from fuzz._harness import SUITES, chunk_seed, run_chunk
from fuzz._runtime import play
from fuzz._runtime_checks import check


class _CrashesBetweenBatches(trioserve.actors.BatcherActor):
    """A batcher that crashes once, with nothing in flight, as it is about to pull
    its second batch: its supervisor restarts it and it serves on, so every caller
    is answered as without the crash."""

    _waits = 0

    async def _wait_breaker(self) -> None:
        self._waits += 1
        if self._waits == 2:
            raise KeyError("reply")
        await super()._wait_breaker()


_CRASHING = attrs.evolve(fuzz.PRODUCT, name="crashes", batcher_class=_CrashesBetweenBatches)

_TWO_CALLS = fuzz.Scenario(
    replicas=1, calls=(fuzz.Call(at_ms=0), fuzz.Call(at_ms=5), fuzz.Call(at_ms=10))
)


class _Blind:
    """A crash watch that sees nothing: the suite as it was before the rule."""

    def violation(self) -> None:
        return None


def test_an_unexpected_crash_fails_the_run_and_names_itself(monkeypatch):
    with pytest.raises(fuzz.InvariantViolation) as caught:
        fuzz.run_scenario(_TWO_CALLS, _CRASHING)
    error = caught.value
    assert error.invariant == "crash"
    first, *rest = str(error).splitlines()
    assert first.startswith(
        "crash: the runtime logged \"batcher[m#0@cpu] crashed (KeyError('reply')); "
        "restart 1\" at t="
    )
    assert "no fault the scenario planted explains it" in first
    traceback = "\n".join(rest)
    assert traceback.startswith("The first one's traceback:\nTraceback (most recent call last)")
    assert "in _wait_breaker" in traceback
    assert traceback.endswith("KeyError: 'reply'")
    # The invariants alone held: the batcher was restarted and served on.
    monkeypatch.setattr(fuzz._runtime, "watch_crashes", lambda: contextlib.nullcontext(_Blind()))
    fuzz.run_scenario(_TWO_CALLS, _CRASHING)


def test_the_fuzzer_shrinks_an_unexpected_crash_to_a_reproduction():
    failure = None
    for chunk in range(4):
        failure = run_chunk(
            SUITES["runtime"],
            product=_CRASHING,
            hypothesis_seed=chunk_seed(0, "crash", chunk),
            max_examples=25,
            database=None,
        )
        if failure is not None:
            break
    assert failure is not None
    assert failure.message.startswith("InvariantViolation: crash: the runtime logged ")
    assert "KeyError: 'reply'" in failure.message
    # shrunk: the fewest calls that make a replica pull twice
    scenario = failure.example
    assert isinstance(scenario, fuzz.Scenario)
    assert len(scenario.calls) <= 2
    code = failure.as_pytest()
    assert code.splitlines()[1].startswith("# InvariantViolation: crash: the runtime logged ")
    with pytest.raises(fuzz.InvariantViolation, match=r"^crash: "):
        fuzz.run_scenario(scenario, _CRASHING)
    fuzz.run_scenario(scenario)  # the product passes it


def test_a_crash_the_scenario_planted_does_not_fail_the_run():
    scenario = fuzz.Scenario(
        replicas=1,
        calls=(
            fuzz.Call(at_ms=0, items=(fuzz.Item(fault="crash"),)),
            fuzz.Call(at_ms=5),
        ),
    )
    with watch_crashes() as watch:
        run = play(scenario)
    check(run)
    assert run.executions[0].status == "crash"
    assert run.outcomes[0].kind == "error"
    assert isinstance(run.outcomes[0].value, trioserve.ActorBroken)
    assert run.outcomes[1].kind == "result"
    assert (watch.planted, watch.unexpected) == (1, 0)


def test_a_failure_the_run_raised_first_carries_the_crash_as_a_note(monkeypatch):
    async def _fails_after_a_crash(run: Any) -> None:
        try:
            raise KeyError("reply")
        except KeyError:
            logging.getLogger("trioserve").warning("x crashed", exc_info=True)
        raise fuzz.InvariantViolation("lost", "call #0 never got an answer")

    with pytest.raises(fuzz.InvariantViolation, match=r"^lost: ") as caught:
        fuzz._runtime.replay(_fails_after_a_crash, None)
    (note,) = caught.value.__notes__
    assert note.startswith("Before it, crash: the runtime logged \"x crashed (KeyError('reply'))\"")


def test_the_watch_sees_crashes_though_the_runtime_s_log_is_silenced():
    logger = logging.getLogger("trioserve")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with watch_crashes() as watch:
            try:
                raise RuntimeError("planted replica crash on item 0")
            except RuntimeError:
                logger.warning("a crashed", exc_info=True)
            try:
                raise ExceptionGroup("g", [ValueError("planted"), IndexError("pop")])
            except ExceptionGroup:
                logger.exception("b failed")
            logger.error("no traceback: not a crash")
        assert (watch.planted, watch.unexpected) == (1, 1)
        assert logger.level == logging.CRITICAL
        violation = watch.violation()
        assert violation is not None
        assert str(violation).startswith("crash: the runtime logged \"b failed (ExceptionGroup(")
        assert "IndexError: pop" in str(violation)
    finally:
        logger.setLevel(level)
