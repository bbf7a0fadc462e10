"""A connection's socket reads and writes, straight on its descriptor: a read that
yields to the scheduler once per request (:func:`_receive`), writes that wait only
when the socket buffer is full and cut a client that takes nothing for too long
(:func:`_send_all`), and the :class:`Outbox` that writes the data plane's keep-alive
answers of many connections together, once per pass of the scheduler."""

from __future__ import annotations

import math
import os
import select
from typing import Any

import outcome
import trio

KIB = 1024
RECEIVE_SIZE = 64 * KIB
_read = os.read
_write = os.write
_wait_readable = trio.lowlevel.wait_readable
_checkpoint = trio.lowlevel.checkpoint
_wait_writable = trio.lowlevel.wait_writable


def _readable(fd: int) -> bool:
    """Whether ``fd`` has input waiting (a request that its task has not read yet, or
    a connection a listener has not accepted yet) or has hung up or failed. Not a
    checkpoint."""
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(0))


class Outbox:
    """Writes the data plane's keep-alive answers of many connections together, once
    per pass of the scheduler.

    Under load an answer used to leave as soon as it was ready, one write every
    ~90 µs, and the client, idle in between, had to be woken by each: on this machine
    that wake-up is ~10% of the server's CPU (spent inside the write), and the client
    too sleeps and wakes once per answer. Now the first answer of a round is written at
    once and wakes the flusher task; answers ready before the flusher runs (on the
    scheduler's next pass) wait for it and leave together, so the client wakes about
    once a round. With one connection every answer is the first of its round: no wait.

    A connection whose answer waits is parked until the flusher wrote what the socket
    took; it waits for the rest itself, at most ``stall_after`` at a time (_WriteStalled).
    Cancelled while parked, its answer is not written.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[int, bytes, Any]] = []
        self._flusher: Any = None  # the task of ``run``, once started
        self._parked = False  # the flusher waits for a round to open
        self._round = False  # a round is open: an answer was written, the flusher woken

    async def run(self) -> None:
        """The flusher. Runs until cancelled (after the connections it serves); once it
        has ended, every answer is written at once. (Nothing waits for it while it is
        parked: an answer waits only in a round, and a round wakes it.)"""
        self._flusher = trio.lowlevel.current_task()
        reschedule = trio.lowlevel.reschedule
        try:
            while True:
                self._parked = True
                await trio.lowlevel.wait_task_rescheduled(_abort_parked)
                pending, self._pending = self._pending, []
                self._round = False
                for fd, data, task in pending:
                    try:
                        n = _write_some(fd, data)
                    except trio.BrokenResourceError as exc:
                        reschedule(task, outcome.Error(exc))
                        continue
                    reschedule(task, outcome.Value(n))
        finally:
            self._parked = False
            self._flusher = None

    async def send(self, fd: int, data: bytes, stall_after: float = math.inf) -> bool:
        """Write ``data`` to the connection's socket, now or with the round's other
        answers. Returns whether the task went through the scheduler (it waited).
        Raises _WriteStalled when the socket takes no byte of it for ``stall_after``."""
        if not self._round:
            if self._parked:
                self._round = True
                self._parked = False
                trio.lowlevel.reschedule(self._flusher)
            await _send_all(fd, data, stall_after)
            return False
        entry = (fd, data, trio.lowlevel.current_task())
        pending = self._pending
        pending.append(entry)

        def abort(_: Any) -> trio.lowlevel.Abort:
            for i, e in enumerate(pending):
                if e is entry:
                    del pending[i]
                    break
            return trio.lowlevel.Abort.SUCCEEDED

        n = await trio.lowlevel.wait_task_rescheduled(abort)
        if n < len(data):
            await _send_rest(fd, data, n, stall_after)
        return True


def _abort_parked(_: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.SUCCEEDED


class _ReadTimeout(Exception):
    """No request within the keep-alive timeout (``idle``), or a request begun and not
    received whole within the request timeout."""

    def __init__(self, idle: bool) -> None:
        self.idle = idle


class _WriteStalled(Exception):
    """The client took no byte of an answer for ``server.write_timeout_s``: it does not
    read. Nothing more can be written on the connection (the answer is cut)."""


async def _receive(
    fd: int,
    fresh: bool,
    patience: float = math.inf,
    *,
    deadline: float = math.inf,
    checkpoint: bool = True,
) -> bytes:
    """Up to ``RECEIVE_SIZE`` bytes from the connection's socket (b"" at EOF), read with
    ``os.read`` on its descriptor; only when nothing is there does it wait for
    readiness.

    ``fresh`` (the first read of a request head) yields to the scheduler once first:
    the client is still reading our last answer, and after the other connections' turns
    its next request has often arrived, so the read succeeds without an epoll
    registration. (Waiting for readiness first instead costs a registration every
    request: more system time per request than trio's own order, measured.) This is
    the checkpoint the connection loop has once per request; other reads are bounded
    by the head and body limits. Against trio's ``receive_some`` + ``send_all``
    (a checkpoint in each), one scheduler trip and its wrappers less per request.

    Without ``checkpoint`` the task has just been through the scheduler (its answer
    waited for the :class:`Outbox`), which serves the same purpose.

    A wait ends at ``deadline``, or ``patience`` seconds after it began, whichever is
    first, with _ReadTimeout (idle when ``fresh``); only a wait reads the clock.
    """
    if fresh and checkpoint:
        await _checkpoint()
    while True:
        try:
            return _read(fd, RECEIVE_SIZE)
        except BlockingIOError:
            until = min(deadline, trio.current_time() + patience)
            with trio.move_on_at(until):
                await _wait_readable(fd)
                continue
            raise _ReadTimeout(idle=fresh) from None
        except OSError as exc:
            raise trio.BrokenResourceError(f"connection lost: {exc}") from exc


async def _send_all(fd: int, data: bytes, stall_after: float = math.inf) -> None:
    """Write all of ``data`` to the connection's socket, waiting only when the socket
    buffer is full. An answer that fits leaves in one ``write`` and no scheduler trip
    (trio's ``send_all`` adds a checkpoint after every send). A socket that takes no
    byte of it for ``stall_after`` raises _WriteStalled."""
    n = _write_some(fd, data)
    if n < len(data):
        await _send_rest(fd, data, n, stall_after)


async def _send_rest(fd: int, data: bytes, n: int, stall_after: float = math.inf) -> None:
    """Write ``data[n:]``, waiting for the socket to take it: at most ``stall_after`` for
    each byte (every write the socket takes starts the wait afresh, so a slow reader
    is never cut); past that, _WriteStalled. Only a wait reads the clock."""
    with memoryview(data) as view:
        while n < len(view):
            with trio.move_on_after(stall_after):
                await _wait_writable(fd)
                n += _write_some(fd, view[n:])
                continue
            raise _WriteStalled(f"the client took no byte for {stall_after:g} s")


def _write_some(fd: int, data: bytes | memoryview) -> int:
    """One ``write`` of ``data``: the bytes the socket took (0 when its buffer is full).
    Raises BrokenResourceError when the connection is gone."""
    try:
        return _write(fd, data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise trio.BrokenResourceError(f"connection lost: {exc}") from exc


__all__ = [
    "KIB",
    "RECEIVE_SIZE",
    "Outbox",
]
