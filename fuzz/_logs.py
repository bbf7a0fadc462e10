"""What ``python -m fuzz`` shows of the runtime's log (docs/fuzzing.md, "The runtime's
log").

The scenarios plant faults on purpose: models that raise, replicas that crash, workers
that die, replicas that cannot load. The runtime logs each as it would in production
(a model's error answered to callers, a crashed actor's restart with its traceback), so
a run logged hundreds of such lines, which buried the harness's own output. Every fault
the suites plant says so: its text begins with ``planted`` (``PLANTED``). The rule, for
the records of the ``trioserve`` loggers at WARNING and above:

- a record with a traceback is shown unless its exception was planted (its text, or
  that of every exception of a group, begins with ``planted``): a traceback of any
  other exception is the runtime's own, or a bug of the harness, at any level;
- a record without one, at ERROR or above, is shown unless its message names a
  planted fault (``planted`` at its start, after ``": "`` or after ``"("``: how the
  runtime quotes an exception's text or a worker's death);
- a warning without a traceback is not shown: the runtime's report of what the
  scenarios make happen (a batch cut off, a worker replaced, a canary rolled back),
  as before the rule (the fuzzer showed ERROR and above only).

What is not shown is counted, and the count printed after the run. In the self-test
a record shown is shown without its traceback: the product is broken there on
purpose, and its planted bug's crashes (a reply answered twice) are its doing.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import re
from collections.abc import Iterator
from typing import IO

#: the word every fault a suite plants begins its text with
PLANTED = "planted"
_NAMES_PLANTED = re.compile(rf"(?:^|: |\(){PLANTED}\b")


class Seen(enum.Enum):
    """What becomes of a record of the runtime's log."""

    SHOWN = "shown"
    #: a fault a scenario planted, counted
    PLANTED = "planted"
    #: a warning without a traceback, counted
    WARNING = "warning"


def planted(exc: BaseException) -> bool:
    """Whether ``exc`` is a fault a suite planted: its text begins with ``planted``,
    or, a group, each of its exceptions is one."""
    if isinstance(exc, BaseExceptionGroup):
        return all(planted(e) for e in exc.exceptions)
    return str(exc).startswith(PLANTED)


def seen(record: logging.LogRecord) -> Seen:
    """The rule (the module's docstring): whether ``record`` is shown, or counted as
    a planted fault's or as a warning."""
    exc = record.exc_info[1] if record.exc_info else None
    if exc is not None:
        return Seen.PLANTED if planted(exc) else Seen.SHOWN
    if record.levelno < logging.ERROR:
        return Seen.WARNING
    if _NAMES_PLANTED.search(record.getMessage()):
        return Seen.PLANTED
    return Seen.SHOWN


class RuntimeLog(logging.Filter):
    """The filter of the handler :func:`runtime_log` installs: it applies
    :func:`seen` and counts what it holds back."""

    def __init__(self) -> None:
        super().__init__()
        self.planted = 0
        self.warnings = 0
        self.shown = 0

    def filter(self, record: logging.LogRecord) -> bool:
        what = seen(record)
        if what is Seen.PLANTED:
            self.planted += 1
        elif what is Seen.WARNING:
            self.warnings += 1
        else:
            self.shown += 1
        return what is Seen.SHOWN

    def summary(self) -> str:
        """One line: what the runtime logged and what of it was not shown."""
        return (
            f"fuzz: the runtime logged {self.planted:,} line(s) of faults the scenarios "
            f"planted and {self.warnings:,} warning(s), not shown; {self.shown:,} other "
            "line(s) shown (docs/fuzzing.md, \"The runtime's log\")"
        )


class _OneLine(logging.Formatter):
    """The message alone, without its traceback."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        return self.formatMessage(record)


@contextlib.contextmanager
def runtime_log(
    stream: IO[str] | None = None, *, tracebacks: bool = True
) -> Iterator[RuntimeLog]:
    """While it is entered, the ``trioserve`` logger's records at WARNING and above
    go to ``stream`` (default: standard error, as ``trioserve: LEVEL: message``,
    with their tracebacks unless ``tracebacks`` is False) as the rule says; its
    level and handlers are as they were afterwards (``python -m fuzz``'s ``main``
    may run inside another program)."""
    logger = logging.getLogger("trioserve")
    level = logger.level
    log = RuntimeLog()
    handler = logging.StreamHandler(stream)
    fmt = "trioserve: %(levelname)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt) if tracebacks else _OneLine(fmt))
    handler.addFilter(log)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield log
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
