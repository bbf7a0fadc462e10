"""What ``python -m fuzz`` shows of the runtime's log (fuzz/_logs.py, docs/fuzzing.md):
the lines of faults the scenarios planted are counted, not shown; a traceback of any
other exception, and any other error, is shown."""

from __future__ import annotations

import io
import logging
import sys

import pytest
from trioserve import ActorBroken

import fuzz
from fuzz._logs import Seen, planted, runtime_log, seen


def _record(
    msg: str, *args: object, level: int = logging.ERROR, exc: BaseException | None = None
) -> logging.LogRecord:
    exc_info = None
    if exc is not None:
        try:
            raise exc
        except BaseException:
            exc_info = sys.exc_info()
    return logging.LogRecord("trioserve", level, __file__, 1, msg, args, exc_info)


MODEL_ERROR = "%s: %s (%d %s answered with it%s)"


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        # a model's error answered to callers, as the batcher logs it
        (_record(MODEL_ERROR, "batcher[m#0@cpu]",
                 "model 'm' failed on cpu: ValueError: planted model error on item 12", 1,
                 "request", ""), Seen.PLANTED),
        (_record(MODEL_ERROR, "batcher[m#1@cpu]",
                 "model 'm' failed on cpu: WorkerError: ValueError: planted model error on "
                 "key 3 (run 4)", 2, "requests", ""), Seen.PLANTED),
        (_record("model 'm': a new replica on cpu:0 failed to start (model 'm': replica 4 "
                 "on cpu:0 failed to load: RuntimeError: planted: replica 4 cannot load)"),
         Seen.PLANTED),
        (_record("batcher[m#0@cpu]: worker process lost: its worker process died (planted "
                 "worker death on item 8)"), Seen.PLANTED),
        # an error the scenarios did not plant
        (_record(MODEL_ERROR, "batcher[m#0@cpu]",
                 "model 'm' failed on cpu: ValueError: operands could not be broadcast", 1,
                 "request", ""), Seen.SHOWN),
        (_record("rollout state file %s: cannot write the rollouts' decisions", "x.json"),
         Seen.SHOWN),
        # the word elsewhere than at a fault's text's start names no planted fault
        (_record("model 'm' failed on cpu: KeyError: 'unplanted' (implanted planted)"),
         Seen.SHOWN),
        # a crash's restart warning, with its traceback: judged by its exception
        (_record("%s crashed (%r); restart %d", "batcher[m#1@cpu]",
                 RuntimeError("planted replica crash on item 1"), 1, level=logging.WARNING,
                 exc=RuntimeError("planted replica crash on item 1")), Seen.PLANTED),
        (_record("%s crashed (%r); restart %d", "batcher[m#1@cpu]",
                 ActorBroken("request state cannot go from done to done"), 1,
                 level=logging.WARNING,
                 exc=ActorBroken("request state cannot go from done to done")),
         Seen.SHOWN),
        # a traceback of the runtime's own, whatever its message names
        (_record("model 'm': answering the requests whose deadline passed failed "
                 "(ValueError: planted model error on item 3)",
                 exc=AttributeError("'NoneType' object has no attribute 'late'")),
         Seen.SHOWN),
        (_record("crashed", level=logging.WARNING, exc=ExceptionGroup("nursery", [
            RuntimeError("planted replica crash on item 2"),
            KeyError("reply"),
        ])), Seen.SHOWN),
        (_record("crashed", level=logging.WARNING, exc=ExceptionGroup("nursery", [
            RuntimeError("planted replica crash on item 2"),
            ExceptionGroup("inner", [ValueError("planted model error on item 2")]),
        ])), Seen.PLANTED),
        # a warning without a traceback: the runtime's report of what a scenario did
        (_record("%s: %s lost: %s; a new one is started", "batcher[m#0@cpu]",
                 "worker process", "it ran past its batch deadline of 0.100s",
                 level=logging.WARNING), Seen.WARNING),
        (_record("a warning naming nothing planted", level=logging.WARNING), Seen.WARNING),
    ],
)
def test_the_rule_shows_what_no_scenario_planted(record, expected):
    assert seen(record) is expected


def test_a_planted_fault_is_one_whose_text_begins_so():
    assert planted(ValueError("planted model error on item 1"))
    assert not planted(ValueError("model error on item 1 (planted)"))
    assert not planted(ExceptionGroup("g", [ValueError("planted"), ValueError("real")]))


def test_a_scenario_s_planted_faults_are_counted_and_a_real_traceback_shows():
    out = io.StringIO()
    logger = logging.getLogger("trioserve")
    level, handlers = logger.level, list(logger.handlers)
    scenario = fuzz.Scenario(
        replicas=1,
        calls=(
            fuzz.Call(at_ms=0, items=(fuzz.Item(fault="error"),)),
            fuzz.Call(at_ms=5, items=(fuzz.Item(fault="crash"),)),
            fuzz.Call(at_ms=10, items=(fuzz.Item(),)),
        ),
    )
    with runtime_log(out) as log:
        fuzz.run_scenario(scenario)
        # the model's error (ERROR) and the crash's restart (a planted traceback)
        assert log.planted >= 2
        assert log.shown == 0
        assert out.getvalue() == ""
        try:
            raise KeyError("reply")
        except KeyError:
            logger.exception("model %r: the batch's delivery failed", "m")
        logger.error("model %r: a real error", "m")
        logger.warning("model %r: a plain warning", "m")
    shown = out.getvalue()
    assert "trioserve: ERROR: model 'm': the batch's delivery failed\nTraceback" in shown
    assert "KeyError: 'reply'" in shown
    assert "trioserve: ERROR: model 'm': a real error" in shown
    assert "plain warning" not in shown
    assert (log.shown, log.warnings) == (2, 1)
    assert f"{log.planted:,} line(s) of faults the scenarios planted" in log.summary()
    # as it was once left
    assert (logger.level, logger.handlers) == (level, handlers)


def test_the_command_shows_no_planted_fault_and_counts_them(capsys):
    from fuzz._cli import main

    assert main(["--profile", "ci", "--suite", "runtime"]) == 0
    captured = capsys.readouterr()
    assert "planted" not in captured.err
    line = next(x for x in captured.out.splitlines() if x.startswith("fuzz: the runtime logged"))
    planted_lines = int(line.split()[4].replace(",", ""))
    assert planted_lines > 0
    assert "0 other line(s) shown" in line


def test_without_tracebacks_a_record_shown_is_one_line():
    out = io.StringIO()
    logger = logging.getLogger("trioserve")
    with runtime_log(out, tracebacks=False) as log:
        try:
            raise ActorBroken("request state cannot go from done to done")
        except ActorBroken as exc:
            logger.warning("%s crashed (%r); restart %d", "batcher[m#0@cpu]", exc, 1,
                           exc_info=True)
    assert out.getvalue() == (
        "trioserve: WARNING: batcher[m#0@cpu] crashed (ActorBroken('request state cannot "
        "go from done to done')); restart 1\n"
    )
    assert log.shown == 1
