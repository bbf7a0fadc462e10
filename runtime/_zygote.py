"""The zygote: a process that imports torch and the worker code once, then forks a
worker process on request, so that a killed or crashed worker is replaced in tens of
milliseconds instead of the seconds a fresh interpreter takes to import torch.

Parent side: :class:`Zygote`. Child side: ``python -m trioserve._worker --zygote FD``
(:func:`trioserve._worker.zygote_main`). The parent sends a new worker's pipe ends and
shared memory over a Unix socket (SCM_RIGHTS); the zygote forks, the child serves
batches on them (:func:`trioserve._worker.serve`), and the zygote answers with the
child's pid. The zygote reaps its children and writes each one's wait status on the
child's reply pipe (its last frame: the runtime learns how a worker ended, an exit
status or a signal); it exits when the parent's end of the socket closes.

A zygote that died (killed, crashed) or stopped answering is restarted by the next
:meth:`Zygote.spawn`: the workers already forked keep running, and a worker loss never
needs the zygote it was forked from.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import struct
import sys
from typing import Any

import trio

from ._units import SECONDS

_PID = struct.Struct("<q")

log = logging.getLogger("trioserve")


class ZygoteError(RuntimeError):
    """The zygote could not start, or died."""


class Zygote:
    """The parent's handle on a zygote process. :meth:`start`, :meth:`spawn`, :meth:`aclose`."""

    #: A fork takes milliseconds; a zygote that has not answered one in this long is
    #: taken for hung (stopped, stuck), killed and restarted.
    FORK_TIMEOUT = 10 * SECONDS
    #: A start imports torch (~3 s); one that has not answered in this long is stuck
    #: (an import waiting on a lock, a hung file system) and is stopped.
    START_TIMEOUT = 120 * SECONDS

    def __init__(self) -> None:
        self._proc: trio.Process | None = None
        self._sock: Any = None
        self._lock = trio.Lock()
        self._closed = False
        #: How many times a dead or hung zygote was replaced.
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        """The running zygote's pid (None when it is not running)."""
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        """Start the zygote and wait until it has imported the worker code (seconds:
        it imports torch). Raises ZygoteError."""
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
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = trio.socket.from_stdlib_socket(ours)
        ok = False
        try:
            with trio.move_on_after(self.START_TIMEOUT) as waited:
                ok = await self._sock.recv(1) == b"R"
        except OSError:
            pass
        except BaseException:
            await self._stop()
            raise
        if not ok:
            await self._stop()
            if waited.cancelled_caught:
                raise ZygoteError(
                    f"the worker zygote did not start within {self.START_TIMEOUT:g}s"
                )
            raise ZygoteError("the worker zygote failed to start")

    async def spawn(self, *fds: int) -> int:
        """Fork a worker serving on these file descriptors (the zygote gets copies; the
        caller still closes its own) and return its pid. A zygote that is dead or does
        not answer within FORK_TIMEOUT is replaced first (seconds: a fresh one imports
        torch). A checkpoint; cancelling it mid-fork stops the zygote (the next call
        starts a new one). Raises ZygoteError when no zygote can fork."""
        async with self._lock:
            if self._closed:
                raise ZygoteError("the worker zygote was closed")
            if self._running():
                try:
                    return await self._fork(fds)
                except ZygoteError as exc:
                    log.warning("%s; starting a new one", exc)
            else:
                log.warning("the worker zygote is not running; starting a new one")
            # Dead, hung, or stopped by an earlier cancelled fork.
            await self._stop()
            await self.start()
            self.restarts += 1
            return await self._fork(fds)

    def _running(self) -> bool:
        return self._sock is not None and self._proc is not None and self._proc.poll() is None

    async def _fork(self, fds: tuple[int, ...]) -> int:
        # One fork. The zygote is stopped unless it answered: after a failure, or a
        # cancellation between the request and the answer, it may still write a pid
        # that the next fork would take for its own.
        sock = self._sock
        try:
            with trio.move_on_after(self.FORK_TIMEOUT):
                await sock.sendmsg(
                    [b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                )
                data = b""
                while len(data) < _PID.size:
                    chunk = await sock.recv(_PID.size - len(data))
                    if not chunk:
                        raise ZygoteError("the worker zygote died")
                    data += chunk
                return _PID.unpack(data)[0]
            raise ZygoteError(
                f"the worker zygote did not fork within {self.FORK_TIMEOUT:g}s"
            )
        except OSError as exc:
            await self._stop()
            raise ZygoteError(f"the worker zygote died: {exc}") from None
        except BaseException:
            await self._stop()
            raise

    async def _stop(self) -> None:
        """Kill the zygote and reap it (shielded, bounded)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
            with trio.CancelScope(shield=True), trio.move_on_after(5 * SECONDS):
                await proc.wait()

    async def aclose(self) -> None:
        """Stop the zygote for good. Its workers are not its to stop: each
        WorkerProcess.aclose kills and waits for its own, and should come first (a
        worker that outlives its zygote is left to init, a zombie until init reaps
        it)."""
        self._closed = True
        await self._stop()
