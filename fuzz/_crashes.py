"""Crashes of the runtime under test: a failure of every suite that drives one
(docs/fuzzing.md, "Crashes").

When an actor of the runtime (a batcher, a scheduler, the cache actor, a controller)
crashes, its supervisor restarts it and logs the crash with its traceback
(``trioserve.supervise``); where raising would end the event loop (a running batch's
expiry), the runtime logs the exception with its traceback instead. The invariants may
still hold afterwards: the restarted actor keeps its queue and picks up where it was,
so the example passed and only the log told. A crash is expected only when the
scenario planted it: a replica that crashes on a "crash" item, a model that raises, a
worker that dies; every such fault's text begins with ``planted`` (``fuzz._logs``).
Any other is a bug of the runtime, or of the harness's fakes, and fails the example
with the invariant ``crash``, the first one's traceback in the message, so hypothesis
shrinks to it like any other failure.

:func:`watch_crashes` watches the ``trioserve`` logger while a scenario plays;
``fuzz._runtime.replay``, through which every suite that drives a runtime plays, raises
what it saw.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator

import trio

from ._checker import InvariantViolation
from ._logs import planted


class CrashWatch(logging.Handler):
    """A handler of the ``trioserve`` logger that keeps what the runtime logged with
    a traceback: the planted ones counted, the first unexpected one with its
    traceback and trio time, the others counted."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        #: crashes (records with a traceback) that a scenario planted
        self.planted = 0
        #: those no planted fault explains
        self.unexpected = 0
        #: the first of those, in words (its first line), and its traceback
        self.first = ""
        self.first_traceback = ""

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return
        if planted(exc):
            self.planted += 1
            return
        self.unexpected += 1
        if self.unexpected > 1:
            return
        message = record.getMessage()
        if repr(exc) not in message:
            message += f" ({exc!r})"
        try:
            at = f" at t={trio.current_time():.6g}"
        except RuntimeError:  # (logged by a thread of the runtime's, outside trio)
            at = ""
        self.first = f"the runtime logged {message!r}{at}"
        self.first_traceback = "".join(traceback.format_exception(exc)).rstrip()

    def violation(self) -> InvariantViolation | None:
        """The failure of the unexpected crashes seen, or None when there were none."""
        if not self.unexpected:
            return None
        more = f"; {self.unexpected} in all" if self.unexpected > 1 else ""
        return InvariantViolation(
            "crash",
            f"{self.first}: no fault the scenario planted explains it (a planted fault's "
            f"text begins with 'planted'){more}\nThe first one's traceback:\n"
            f"{self.first_traceback}",
        )


@contextlib.contextmanager
def watch_crashes() -> Iterator[CrashWatch]:
    """While it is entered, the ``trioserve`` logger's records with a traceback are
    watched (:class:`CrashWatch`); its handlers and level are as they were afterwards.
    Its level is lowered to WARNING if it was set above (a crash is logged as a
    warning), so a run that silences the runtime's log still sees its crashes."""
    logger = logging.getLogger("trioserve")
    level = logger.level
    watch = CrashWatch()
    logger.addHandler(watch)
    if not logger.isEnabledFor(logging.WARNING):
        logger.setLevel(logging.WARNING)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)
