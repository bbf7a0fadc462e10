"""Ctrl-C (SIGINT) while ``trioserve serve`` starts, before it listens for signals
itself, ends the command as a later one does: one line, status 0, no traceback."""

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


@pytest.mark.parametrize("step", ["load_config", "serve"])
async def test_sigint_before_the_runtime_handles_signals_stops_cleanly(
    step: str, tmp_path: Path
):
    cfg = tmp_path / "t.toml"
    cfg.write_text('[models.echo]\nbackend = "echo"\n')
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", HELD, step, "serve", "--config", str(cfg), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = b""
    try:
        with trio.fail_after(60):
            while b"starting\n" not in output:
                chunk = await proc.stdout.receive_some()
                assert chunk, output.decode()
                output += chunk
            proc.send_signal(signal.SIGINT)
            rc = await proc.wait()
            while chunk := await proc.stdout.receive_some():
                output += chunk
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = output.decode()
    assert rc == 0, text
    assert "Traceback" not in text
    assert text.splitlines()[1:] == ["trioserve: SIGINT while starting: stopped"], text
