"""The zygote: a process that imports torch and the worker code once, then forks a
worker process on request, so that a killed or crashed worker is replaced in tens of
milliseconds instead of the seconds a fresh interpreter takes to import torch.

Parent side: :class:`Zygote`. Child side: ``python -m trioserve._worker --zygote FD``
(:func:`trioserve._worker.zygote_main`). The parent sends a new worker's pipe ends and
shared memory over a Unix socket (SCM_RIGHTS); the zygote forks, the child serves
batches on them (:func:`trioserve._worker.serve`), and the zygote answers with the
child's pid.
The zygote ignores SIGCHLD, so its children are reaped by the kernel; it exits when
the parent's end of the socket closes.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import sys
from typing import Any

import trio

_PID = struct.Struct("<q")


class ZygoteError(RuntimeError):
    """The zygote could not start, or died."""


class Zygote:
    """The parent's handle on a zygote process. :meth:`start`, :meth:`spawn`, :meth:`aclose`."""

    def __init__(self) -> None:
        self._proc: trio.Process | None = None
        self._sock: Any = None
        self._lock = trio.Lock()

    async def start(self) -> None:
        """Start the zygote and wait until it has imported the worker code."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # numpy's BLAS pool would otherwise start threads in the zygote before it forks.
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        try:
            self._proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "trioserve._worker", "--zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=env,
            )
        finally:
            theirs.close()
        self._sock = trio.socket.from_stdlib_socket(ours)
        if await self._sock.recv(1) != b"R":
            await self.aclose()
            raise ZygoteError("the worker zygote failed to start")

    async def spawn(self, *fds: int) -> int:
        """Fork a worker serving on these file descriptors (the zygote gets copies;
        the caller still closes its own); return its pid. Raises ZygoteError."""
        if self._sock is None:
            raise ZygoteError("the worker zygote is not running")
        async with self._lock:
            try:
                await self._sock.sendmsg(
                    [b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                )
                data = b""
                while len(data) < _PID.size:
                    chunk = await self._sock.recv(_PID.size - len(data))
                    if not chunk:
                        raise ZygoteError("the worker zygote died")
                    data += chunk
            except OSError as exc:
                raise ZygoteError(f"the worker zygote died: {exc}") from None
        return _PID.unpack(data)[0]

    async def aclose(self) -> None:
        """Stop the zygote. Its workers are not its to stop: each WorkerProcess.aclose
        kills and waits for its own, and should come first (a worker that outlives its
        zygote is left to init, a zombie until init reaps it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await proc.wait()
