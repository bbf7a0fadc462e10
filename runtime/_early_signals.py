"""SIGINT and SIGTERM while the ``trioserve`` command starts, before ``serve`` listens
for them itself (trio's signal receiver): Python's start, the package's imports (about
half a second), the config, the bind.

:func:`hold` (the first thing the package does when it is the command, and the first
thing :func:`trioserve.cli.main` does) makes either one only noted, so that an import is
never cut in the middle; :func:`release` (once ``main`` can stop cleanly) turns a noted
one, and any later one, into the KeyboardInterrupt that ``main`` reports as "<SIGNAL>
while starting: stopped", status 0, as a signal while the models load is. SIGTERM's
default action killed the command instead (status -15, no shutdown, no line said).
Imports nothing of the package: it runs before the package's imports.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
from typing import Any

_STOP = (signal.SIGINT, signal.SIGTERM)
#: The signals noted while held, in order of arrival.
held: list[int] = []
#: The last stop signal taken, by name, for the line that says so.
last = "SIGINT"


def _note(signum: int, frame: Any) -> None:
    held.append(signum)


def is_the_command() -> bool:
    """Whether this process is the ``trioserve`` command: its console script, or
    ``python -m trioserve`` (or ``-m trioserve.cli``)."""
    if os.path.basename(sys.argv[0]) == "trioserve":
        return True
    argv = getattr(sys, "orig_argv", [])
    return any(
        a == "-m" and b in ("trioserve", "trioserve.cli") for a, b in itertools.pairwise(argv)
    )


def hold() -> None:
    """Note SIGINT and SIGTERM from now on, and take those that were blocked already
    (pending since before this process could handle them). Outside the main thread
    (``main`` called by an embedding program), nothing: signals are not ours there."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _STOP:
        signal.signal(sig, _note)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP)


def _terminate(signum: int, frame: Any) -> None:
    # SIGTERM stops a start as SIGINT does: by the handler SIGINT has now (Python's,
    # raising KeyboardInterrupt; trio's inside trio.run, which defers it where trio
    # must not be interrupted).
    global last
    last = "SIGTERM"
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not _interrupt:
        handler(signal.SIGINT, frame)
    else:
        signal.default_int_handler(signal.SIGINT, frame)


def _interrupt(signum: int, frame: Any) -> None:
    global last
    last = "SIGINT"
    signal.default_int_handler(signum, frame)


def release(*, serving: bool) -> None:
    """From now on a stop signal raises KeyboardInterrupt (for ``serving``: SIGTERM
    too; otherwise SIGTERM takes its default action again, as before), and one noted
    while held is raised now. Outside the main thread, nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _terminate if serving else signal.SIG_DFL)
    noted, held[:] = list(held), []
    if signal.SIGTERM in noted and not serving:
        os.kill(os.getpid(), signal.SIGTERM)  # its default action, as if never held
    if noted:
        global last
        last = signal.Signals(noted[0]).name
        raise KeyboardInterrupt
