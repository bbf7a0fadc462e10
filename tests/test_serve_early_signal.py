"""Ctrl-C (SIGINT) or SIGTERM while ``trioserve serve`` starts, before it listens for
signals itself, ends the command as a later one does: one line, status 0, no
traceback. So does one sent before the process could handle any signal at all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

#: Runs the command with one step of its start replaced by one that says "starting"
#: and then waits (for ever, but for a signal) before going on: SIGINT is sent then,
#: before the runtime's own signal handling is installed.
HELD = """
import sys, threading
import trioserve.transport._main as m
from trioserve.cli import entry

def hold():
    print("starting", flush=True)
    threading.Event().wait()

if sys.argv.pop(1) == "load_config":
    real = m.load_config
    def load_config(*a, **k):
        hold()
        return real(*a, **k)
    m.load_config = load_config
else:  # inside trio.run, before serve() opens its signal receiver
    real = m.serve
    async def serve(*a, **k):
        hold()
        return await real(*a, **k)
    m.serve = serve
entry()
"""


async def signal_once_said(argv: list[str], said: bytes, sig: signal.Signals) -> tuple[int, str]:
    """Run ``argv``, send it ``sig`` once its output holds ``said``, and return its
    exit status and all it wrote (stdout and stderr)."""
    proc = await trio.lowlevel.open_process(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = b""
    try:
        with trio.fail_after(60):
            while said not in output:
                chunk = await proc.stdout.receive_some()
                assert chunk, output.decode()
                output += chunk
            proc.send_signal(sig)
            rc = await proc.wait()
            while chunk := await proc.stdout.receive_some():
                output += chunk
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return rc, output.decode()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("step", ["load_config", "serve"])
async def test_a_stop_signal_before_the_runtime_handles_signals_stops_cleanly(
    step: str, sig: signal.Signals, tmp_path: Path
):
    """SIGTERM took its default action here: the process died (status -15) with no
    shutdown and no line said."""
    cfg = tmp_path / "t.toml"
    cfg.write_text('[models.echo]\nbackend = "echo"\n')
    rc, text = await signal_once_said(
        [sys.executable, "-c", HELD, step, "serve", "--config", str(cfg), "--port", "0"],
        b"starting\n", sig,
    )
    assert rc == 0, text
    assert "Traceback" not in text
    assert text.splitlines()[1:] == [f"trioserve: {sig.name} while starting: stopped"], text


#: Blocks the signal named by argv[1], says so, then runs the command (argv[2:]) in
#: its place: a signal sent once "held" is read stays pending across the exec, so the
#: command gets it at the first moment it can take one (before it has imported
#: anything), whenever the test sends it.
BLOCKED = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.Signals[sys.argv[1]]})
print("held", flush=True)
os.execv(sys.argv[2], sys.argv[2:])
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("how", ["-m", "script"])
async def test_a_stop_signal_at_the_very_start_of_serve_stops_cleanly(
    how: str, sig: signal.Signals, tmp_path: Path
):
    """A signal in the first fraction of a second of ``trioserve serve`` (Python's
    start, the package's imports): SIGTERM killed the process (status -15), SIGINT
    left a traceback. Both now end it as a signal during the start does, three runs
    each, through ``python -m trioserve`` and the console script."""
    cfg = tmp_path / "t.toml"
    cfg.write_text('[models.echo]\nbackend = "echo"\n')
    script = os.path.join(os.path.dirname(sys.executable), "trioserve")
    command = [sys.executable, "-m", "trioserve"] if how == "-m" else [script]
    for _ in range(3):
        rc, text = await signal_once_said(
            [sys.executable, "-c", BLOCKED, sig.name, *command,
             "serve", "--config", str(cfg), "--port", "0"],
            b"held\n", sig,
        )
        assert rc == 0, text
        assert "Traceback" not in text
        assert text.splitlines() == [
            "held", f"trioserve: {sig.name} while starting: stopped"
        ], text


async def test_the_package_notes_a_stop_signal_from_its_first_import_as_the_command():
    """As the command, the package takes stop signals before its own imports (half a
    second): a SIGTERM pending since the process began is noted by the import, not
    left to kill it. As a library, it leaves signals alone."""
    probe = (
        "import signal, sys\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
        "signal.raise_signal(signal.SIGTERM)\n"
        "sys.argv[0] = sys.argv[1]\n"
        "import trioserve\n"
        "from trioserve import _early_signals\n"
        "print(_early_signals.held, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})\n"
    )
    for argv0, expected in (("/usr/bin/trioserve", "[15] False"), ("app.py", "[] True")):
        result = await trio.run_process(
            [sys.executable, "-c", probe, argv0], capture_stdout=True, capture_stderr=True
        )
        assert result.stdout.decode().strip() == expected, result.stderr.decode()
