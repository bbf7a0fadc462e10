"""The worker process side: ``python -m trioserve._worker READ_FD WRITE_FD SHM_FD``, or
the zygote that forks workers: ``python -m trioserve._worker --zygote SOCKET_FD``
(see trioserve._zygote).

Loads one model replica, then answers batches until its pipe closes. Inputs of
fixed shape arrive stacked in shared memory (an anonymous file the parent passed as
SHM_FD: no per-item pickling, and no name to leave behind); the rest travels as
pickles over the pipe. Frames are a 4-byte little-endian length + pickle.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import pickle
import signal
import struct
import sys
import time
import traceback
from typing import Any

import numpy as np

_LEN = struct.Struct("<I")
#: The most one frame carries; the parent sets it at the start (its 4-byte length).
max_frame = (1 << 32) - 1


class FrameTooLarge(ValueError):
    """A frame longer than ``max_frame``."""


def read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> Any:
    (n,) = _LEN.unpack(read_exact(fd, _LEN.size))
    return pickle.loads(read_exact(fd, n))


def write_frame(fd: int, obj: Any, what: str = "its batch's outputs") -> None:
    """Write ``obj`` as one frame. Raises FrameTooLarge, before writing anything, when
    it is longer than ``max_frame`` pickled, saying ``what`` it holds."""
    data = pickle.dumps(obj, protocol=5)
    if len(data) > max_frame:
        raise FrameTooLarge(
            f"{what} are {len(data)} bytes in one message from its worker "
            f"process, more than the {max_frame} bytes a message carries"
        )
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def stack_outputs(outputs: Any) -> Any:
    """{name: stacked array} when every item's outputs have the same names, shapes and
    dtypes; else the list (where an item's ModelError, from ``conform_outputs``, stays
    as it is). Stacked otherwise, an item's other output was lost, and its arrays were
    cast to a dtype they all fit (an int64 output came back float64)."""
    if not outputs:
        return {}
    if any(isinstance(o, Exception) for o in outputs):
        return list(outputs)
    listed = [{k: np.asarray(v) for k, v in o.items()} for o in outputs]
    first = listed[0]
    for o in listed:
        if o.keys() != first.keys() or any(
            a.dtype != first[k].dtype or a.shape != first[k].shape for k, a in o.items()
        ):
            return listed
    return {n: np.stack([o[n] for o in listed]) for n in first}


def exit_when_orphaned(rfd: int) -> None:
    """In a daemon thread: end the process once nobody can write to ``rfd``, the
    worker's end of its request pipe, whose only writer is the runtime. The main
    thread sees that only between model calls: a runtime killed while a long (or
    stuck) call ran left its worker running it, holding a CPU, memory and a GPU's,
    reparented out of reach. ``poll`` with no events asked for waits for POLLHUP alone
    and takes no data from the pipe."""
    import select

    poller = select.poll()
    poller.register(rfd, 0)
    while True:
        for _, events in poller.poll():
            if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                os._exit(1)


def serve(rfd: int, wfd: int, shm_fd: int) -> None:
    global max_frame
    import threading

    from trioserve._builtin import resolve_backend
    from trioserve._errors import exception_text
    from trioserve._model import check_outputs, load_runner

    threading.Thread(target=exit_when_orphaned, args=(rfd,), daemon=True).start()
    try:
        _, cfg, device, torch_threads, shm_size, limit = read_frame(rfd)
    except EOFError:
        return  # the parent is gone
    except Exception as exc:
        # The backend travels by reference (its module and name): a callable defined
        # in the parent's __main__, or in a module this process cannot import, cannot
        # be rebuilt here. Said, or the parent would see only that the worker exited.
        # (One line: the parent reports a failed load by its last line.)
        write_frame(wfd, ("error", (
            f"the worker process cannot rebuild the model's backend "
            f"({type(exc).__name__}: {exc}): define it (or its factory) in a module "
            "the worker can import (on its sys.path or PYTHONPATH, not the script run "
            'as __main__), or use execution = "thread"'
        ).replace("\n", " ")))
        return
    max_frame = limit
    try:
        shm = mmap.mmap(shm_fd, shm_size)
        os.close(shm_fd)
        backend = resolve_backend(cfg)
        runner = load_runner(backend, device, torch_threads)
    except (Exception, SystemExit) as exc:  # a load's sys.exit() is its failure too
        # The backend's own frames (this function's left out), the deepest last.
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        text = "".join(traceback.format_exception(type(exc), exc, tb, limit=-20))
        write_frame(wfd, ("error", text))
        return
    write_frame(wfd, ("ready", os.getpid()))
    stacked_run = getattr(runner, "stacked", None)
    while True:
        try:
            msg = read_frame(rfd)
        except EOFError:
            return
        kind, n, payload = msg
        started = time.perf_counter()  # busy time, reported back (not trio time: no loop here)
        try:
            if kind == "stacked":
                arrays = {
                    name: np.frombuffer(shm, dtype=dtype, count=n * int(np.prod(shape)),
                                        offset=offset).reshape((n, *shape))
                    for name, dtype, shape, offset in payload
                }
                if stacked_run is not None:
                    out: Any = backend.conform_rows(cfg.name, stacked_run(arrays), n)
                else:
                    items = [{k: a[i] for k, a in arrays.items()} for i in range(n)]
                    out = stack_outputs(
                        backend.conform_outputs(cfg.name, check_outputs(runner(items), n))
                    )
                del arrays
            else:
                out = stack_outputs(
                    backend.conform_outputs(cfg.name, check_outputs(runner(payload), n))
                )
            # (a request alone is no batch to its caller)
            write_frame(
                wfd, ("ok", n, out, time.perf_counter() - started),
                "its outputs" if n == 1 else "its batch's outputs",
            )
        except FrameTooLarge as exc:
            write_frame(wfd, ("too_large", str(exc)))
        # The model's sys.exit() ends no worker, nor does its KeyboardInterrupt (the
        # worker ignores SIGINT: it is the model's own raise) or any other
        # BaseException: each used to end the process, and its request was found
        # as poison after two more dead workers.
        except BaseException as exc:
            text = exception_text(exc)  # (its str() may raise: this loop must go on)
            if context_lost(device):
                # Every later call here would fail too: say why, and wait for the
                # parent to kill us (exiting now, our exit could be seen before
                # this frame is read, and the reason lost; orphaned, the watcher
                # thread ends us). The batch is then a lost worker's: bisected on
                # fresh workers, the input that breaks them found as poison.
                write_frame(wfd, ("lost", text))
                threading.Event().wait()
            write_frame(wfd, ("error", text))


def context_lost(device: str) -> bool:
    """The check after a model raise: ``trioserve.device_lost`` (a name of this module,
    so that a test model can stand in for a GPU's answer)."""
    from trioserve._model import device_lost

    return device_lost(device)


def zygote_main(sock_fd: int) -> None:  # pragma: no cover - runs in the zygote
    """Import what workers need once, then fork one per request on the socket. Each
    child it reaps is reported to the runtime on the child's own reply pipe, as its
    last frame: ``("exited", wait status)``; the runtime is not the child's parent and
    could not learn otherwise whether it exited with a status or was killed by a
    signal (SIGKILL: an out-of-memory kill; SIGSEGV: a crashing extension)."""
    import gc
    import importlib.util
    import select
    import socket

    sock = socket.socket(fileno=sock_fd)
    # SIGCHLD wakes the loop below (through the wakeup pipe), which reaps.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    import trioserve._builtin  # noqa: F401

    if importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401  (the seconds a fresh worker would spend)
    gc.collect()
    gc.freeze()  # fewer copy-on-write faults in the children
    sock.sendall(b"R")
    reply_fds: dict[int, int] = {}  # child pid -> our copy of its reply pipe
    # Each child's stderr is a pipe to us: what it writes is passed on to ours (the
    # server's) as it comes, and its last lines kept, to go with its exit status.
    errs: dict[int, StderrTail] = {}  # our end of a child's stderr pipe -> its tail
    tails: dict[int, StderrTail] = {}  # child pid -> its tail, until it is reaped
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        for fd in ready & errs.keys():
            if not errs[fd].pump():
                poller.unregister(fd)
                os.close(fd)
                del errs[fd]
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            report_exits(reply_fds, tails)
        if sock.fileno() not in ready:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1, 3)
        except OSError:
            os._exit(0)
        if not msg:
            os._exit(0)  # the parent is gone
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                sock.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                for fd in (*reply_fds.values(), *errs, err_r):
                    os.close(fd)
                os.dup2(err_w, 2)
                os.close(err_w)
                serve(*fds)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(err_w)
        os.set_blocking(err_r, False)
        errs[err_r] = tails[pid] = StderrTail(err_r)
        poller.register(err_r, select.POLLIN)
        rfd, wfd, shm_fd = fds
        os.close(rfd)
        os.close(shm_fd)
        reply_fds[pid] = wfd  # kept until the child is reaped
        sock.sendall(struct.pack("<q", pid))


class StderrTail:
    """What a worker wrote to its stderr, passed on to the zygote's own as it comes,
    and the last of it kept: at most TAIL_LINES lines and TAIL_BYTES bytes (so that
    its exit frame stays one atomic pipe write, under PIPE_BUF)."""

    TAIL_LINES = 30
    TAIL_BYTES = 3 * 1024

    def __init__(self, fd: int) -> None:
        self.fd = fd  # our end of its stderr pipe, non-blocking
        self.tail = b""
        #: At its end, what it wrote and was not reported yet: nothing more comes.
        self.ended = False

    def pump(self) -> bool:
        """Read what is there on its pipe, pass it on and keep its tail. False at its
        end (every writer gone: the caller closes it)."""
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return True
            except OSError:
                chunk = b""
            if not chunk:
                self.ended = True
                return False
            write_all(2, chunk)
            tail = (self.tail + chunk)[-self.TAIL_BYTES:]
            lines = tail.split(b"\n")
            if len(lines) > self.TAIL_LINES + 1:
                tail = b"\n".join(lines[-self.TAIL_LINES - 1:])
            self.tail = tail


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (skipped when it cannot be written)."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass


def report_exits(reply_fds: dict[int, int], tails: dict[int, StderrTail]) -> None:
    """Reap every child that has exited and write its wait status and the tail of its
    stderr on its reply pipe (one small frame: atomic, and skipped when the pipe is
    full or its reader gone)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        tail = b""
        err = tails.pop(pid, None)
        if err is not None:
            if not err.ended:  # what it wrote just before its end (no EOF yet: the
                err.pump()  # poll loop closes the pipe when it comes)
            tail, err.tail = err.tail, b""
        fd = reply_fds.pop(pid, None)
        if fd is None:
            continue
        data = pickle.dumps(("exited", status, tail), protocol=5)
        try:
            os.set_blocking(fd, False)  # its only other writer, the child, is gone
            os.write(fd, _LEN.pack(len(data)) + data)
        except OSError:
            pass
        finally:
            os.close(fd)


def main() -> None:
    # A crash in native code (a segfaulting extension, an abort in a model's library)
    # leaves every thread's Python stack on stderr before the process dies of its
    # signal (the parent still sees "killed by SIGSEGV"). Enabled in the zygote, its
    # handlers and their alternate stack pass on to each worker it forks.
    faulthandler.enable()
    # The parent decides when we stop: a signal to the whole process group (Ctrl-C
    # in a terminal, systemd's stop, `timeout`) is the runtime's, which drains and
    # then closes its workers; taken here too, it killed them in the middle of the
    # drain (and the zygote with them), and their batches were run again.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.argv[1] == "--zygote":
        zygote_main(int(sys.argv[2]))
    else:
        serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))


if __name__ == "__main__":
    main()
