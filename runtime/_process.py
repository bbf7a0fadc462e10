"""A model replica in a worker process, fed over a pipe with inputs in shared memory.

The event loop never shares a GIL with the model: the forward pass runs at its solo
speed on another core, and a hung or crashed model can be killed and restarted
without touching the runtime.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import signal
import struct
import sys
import tempfile
import termios
from typing import Any

import numpy as np
import trio

from ._config import ModelConfig
from ._model import ModelBackend
from ._units import MIB

_LEN = struct.Struct("<I")


class WorkerDied(RuntimeError):
    """The worker process exited or its pipe broke (or, with ``details``, the traceback
    of its failure, its model failed to load). ``stderr``: the last lines the process
    wrote to its stderr, when known (it ended, and its zygote said so)."""

    details: str | None = None
    stderr: str | None = None


class WorkerError(RuntimeError):
    """The model raised inside the worker process."""


class FrameTooLarge(WorkerError):
    """A batch's inputs or outputs are more than one message to or from a worker
    process can carry (:attr:`WorkerProcess.MAX_FRAME_BYTES`): the batch was not run,
    or its outputs could not be sent back; the worker goes on."""


def _shared_memory(size: int) -> int:
    """A file descriptor of ``size`` bytes of shared memory that has no name, so that
    no end of either process (SIGKILL included) leaves a file behind: it is freed
    when the last descriptor and mapping of it go."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("trioserve-batches")
    else:  # no memfd: a file, unlinked before anyone could be killed holding its name
        fd, path = tempfile.mkstemp(
            prefix="trioserve-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pipe_broke(exc: BaseException) -> str:
    """Why the worker's pipe failed, in words: trio's BrokenResourceError often says
    nothing itself (its cause may), and ``pipe broke: `` with nothing after it read
    as a message cut short."""
    why = str(exc) or str(exc.__cause__ or "")
    return f"pipe broke: {why}" if why else "pipe broke"


class WorkerProcess:
    """One worker process running one replica. Use :meth:`start`, :meth:`run`, :meth:`kill`."""

    Died = WorkerDied
    Failed = WorkerError
    TooLarge = FrameTooLarge
    #: What the log calls it.
    KIND = "worker process"
    #: Batches in flight per worker (one running, the rest staged in shared memory).
    SLOTS = 3
    #: The most shared memory a slot takes: a batch whose inputs do not fit is sent
    #: through the pipe instead (as one whose inputs cannot be stacked is).
    MAX_SLOT_BYTES = 64 * MIB
    #: The most one message over the pipe carries, either way: its length is 4 bytes.
    #: Read at each batch sent, and told to the worker at its start, so both ends
    #: hold to the same limit (a test lowers it, on the class, to a few KB).
    MAX_FRAME_BYTES = (1 << 32) - 1

    def __init__(
        self,
        cfg: ModelConfig,
        backend: ModelBackend,
        device: str,
        torch_threads: int,
        *,
        zygote: Any = None,
    ) -> None:
        self._cfg = cfg
        self._zygote = zygote
        self._pidfd: int | None = None
        self._exit_lock = trio.Lock()  # one task at a time waits on the pidfd
        self._backend = backend
        self._device = device
        self._torch_threads = torch_threads
        per_item = sum(
            int(np.prod(s.shape)) * s.dtype.itemsize
            for s in backend.inputs
            if s.dtype.kind != "O" and all(d > 0 for d in s.shape)
        )
        # SLOTS slots, so the next batches are staged while the worker runs this one.
        want = min(max(1 << 20, per_item * cfg.max_batch_size * 2), self.MAX_SLOT_BYTES)
        self._slot_size = (want + 63) & ~63
        self._shm_size = self.SLOTS * self._slot_size
        self._next_slot = 0
        #: the length of the message of each slot's batch, as sent (its frame)
        self._frames = [0] * self.SLOTS
        self._writing = False  # a batch's message is being written into the pipe
        self.in_flight = 0
        #: Once killed: how many of the batches left in flight (the newest) it never
        #: read whole, so never ran: their messages, or the end of one, were still in
        #: its request pipe when the kill was sent (0 when not known).
        self.never_read = 0
        #: Once closed: how many of the batches left in flight (their results unread)
        #: it never started. It runs them in order, each once it has written the
        #: result of the one before, so all but the first of those whose result it
        #: never wrote; 0 when that is not known (the end of its pipe not read).
        self.never_started = 0
        self._left_in_flight = 0  # batches in flight when it was killed
        #: Seconds the worker spent running batches (measured in the worker).
        self.busy_seconds = 0.0
        #: Seconds the worker spent on the last batch whose result was read.
        self.last_run_seconds = 0.0
        self._proc: trio.Process | None = None
        self._send: trio.lowlevel.FdStream | None = None
        self._recv: trio.lowlevel.FdStream | None = None
        self._buf = bytearray()
        #: After kill: a copy of the reply pipe's descriptor and what was read of it,
        #: for the zygote's word on how the worker ended (read by aclose).
        self._tail: tuple[int, bytes] | None = None
        self._shm: Any = None
        self.pid: int | None = None
        #: How the process ended (a wait status, as ``os.waitpid`` gives it), once known.
        self.exit_status: int | None = None
        #: The last lines its stderr had, once it has ended (a forked worker's, from its
        #: zygote, which passes them on to the server's stderr as they come too); ""
        #: when it wrote nothing, None when not known.
        self.stderr_tail: str | None = None
        #: What it said it died of (its device context was lost), when it said so.
        self.cause: str | None = None

    async def start(self) -> None:
        """Spawn the process and wait until its model is loaded. Raises WorkerDied."""
        import mmap

        shm_fd = _shared_memory(self._shm_size)
        try:
            self._shm = mmap.mmap(shm_fd, self._shm_size)
        except BaseException:
            os.close(shm_fd)
            raise
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        try:
            if self._zygote is not None:
                # Forked from the zygote, which has torch imported already: ~50 ms.
                self.pid = await self._zygote.spawn(p2c_r, c2p_w, shm_fd)
                try:
                    self._pidfd = os.pidfd_open(self.pid)
                except (AttributeError, OSError):
                    self._pidfd = None  # kill() falls back to the pid
            else:
                self._proc = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "trioserve._worker",
                     str(p2c_r), str(c2p_w), str(shm_fd)],
                    pass_fds=(p2c_r, c2p_w, shm_fd),
                )
        except BaseException:
            os.close(p2c_w)
            os.close(c2p_r)
            raise
        finally:
            os.close(p2c_r)
            os.close(c2p_w)
            os.close(shm_fd)
        self._send = trio.lowlevel.FdStream(p2c_w)
        self._recv = trio.lowlevel.FdStream(c2p_r)
        cfg = self._cfg
        backend = cfg.backend if isinstance(cfg.backend, str) else self._backend
        try:
            init = pickle.dumps(
                ("init", _portable(cfg, backend), self._device, self._torch_threads,
                 self._shm_size, self.MAX_FRAME_BYTES),
                protocol=5,
            )
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            self.kill()
            raise WorkerDied(f"model {cfg.name!r}: backend cannot be sent to a worker "
                             f"process ({exc}); use execution = \"thread\"") from None
        await self._write(init)
        reply = await self._read()
        if reply[0] != "ready":
            self.kill()
            died = WorkerDied(f"worker for model {cfg.name!r} failed to load:\n{reply[1]}")
            died.details = reply[1]  # the traceback in the worker
            raise died
        self.pid = reply[1]

    @staticmethod
    def stderr_note(tail: str | None) -> str:
        """The tail of a worker's stderr, to append to a message: "" when it wrote
        nothing (or it is not known), else a clause saying so and its lines, indented."""
        if not tail:
            return ""
        lines = "\n".join(f"    {line}" for line in tail.splitlines())
        return f"; its stderr ended with:\n{lines}"

    @property
    def alive(self) -> bool:
        """Started and not killed (it may still have died on its own)."""
        return self._send is not None

    async def run(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run one batch in the worker: :meth:`submit` then :meth:`result`."""
        await self.submit(items)
        return await self.result()

    async def submit(self, items: list[dict[str, Any]]) -> None:
        """Send a batch. At most SLOTS may be in flight (one shared-memory slot each);
        the worker runs them in order. Raises WorkerDied, or FrameTooLarge (the batch
        is not sent: its inputs do not fit in one message; the worker goes on).
        Cancelling it leaves the pipe mid-message: kill the worker after a cancelled
        call."""
        if self.in_flight >= self.SLOTS:
            raise RuntimeError(f"at most {self.SLOTS} batches may be in flight per worker")
        if self._shm is None:
            raise self._death("the worker was killed")
        n = len(items)
        layout = self._stack(items, self._next_slot * self._slot_size)
        if layout is not None:
            data = pickle.dumps(("stacked", n, layout), protocol=5)
        else:
            data = pickle.dumps(("items", n, items), protocol=5)
            if len(data) > self.MAX_FRAME_BYTES:
                # Before anything is counted: the worker never sees this batch.
                # (a request alone is no batch to its caller)
                what = "its inputs" if n == 1 else "its batch's inputs"
                raise FrameTooLarge(
                    f"{what} are {len(data)} bytes in one message to its "
                    f"worker process, more than the {self.MAX_FRAME_BYTES} bytes a "
                    "message carries"
                )
        self._frames[self._next_slot] = _LEN.size + len(data)
        self._next_slot = (self._next_slot + 1) % self.SLOTS
        self.in_flight += 1
        self._writing = True
        await self._write(data)
        self._writing = False

    async def result(self) -> list[dict[str, Any]]:
        """The outputs of the oldest batch in flight. Raises WorkerError (the model
        raised: the worker goes on) or WorkerDied (the process is gone, or going: its
        model raised and left its device unusable; or it was killed, before or during
        the call)."""
        reply = await self._read()
        self.in_flight -= 1
        if reply[0] == "error":
            raise WorkerError(reply[1])
        if reply[0] == "too_large":
            raise FrameTooLarge(reply[1])
        if reply[0] == "lost":  # its device context was lost: it exits
            self.cause = f"its device context was lost: {reply[1]}"
            raise self._death(self.cause)
        n, out = reply[1], reply[2]
        self.busy_seconds += reply[3]
        self.last_run_seconds = reply[3]
        return unstack_outputs(n, out)

    def _stack(self, items: list[dict[str, Any]], base: int) -> list[tuple] | None:
        # Stack fixed-shape numeric inputs straight into a shared-memory slot, by the
        # first item's layout: only when every item has its inputs (an item with
        # another input lost it, the worker rebuilding items from the layout). As
        # many as the first, each of the first's found below (KeyError): the same.
        first = items[0]
        n_inputs = len(first)
        if any(len(it) != n_inputs for it in items):
            return None
        offset = base
        limit = base + self._slot_size
        layout = []
        for name, arr in first.items():
            if arr.dtype.kind == "O":
                return None
            shape = arr.shape
            nbytes = arr.nbytes * len(items)
            if offset + nbytes > limit:
                return None
            view = np.frombuffer(self._shm, dtype=arr.dtype, count=arr.size * len(items),
                                 offset=offset)
            try:
                _stack_into(view, [it[name] for it in items], shape)
            except (ValueError, KeyError, TypeError, AttributeError):
                return None
            layout.append((name, arr.dtype.str, shape, offset))
            offset += (nbytes + 63) & ~63
        return layout

    async def _write(self, data: bytes) -> None:
        if self._send is None:
            raise self._death("the worker was killed")
        try:
            await self._send.send_all(_LEN.pack(len(data)) + data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise self._death(_pipe_broke(exc)) from None

    async def _read(self) -> Any:
        # Killed by another task (the batcher's watch on the exit) between our caller
        # taking its batch and this call: a cancel-shielded checkpoint (a memory
        # channel's receive) lets that happen with no checkpoint after it.
        if self._recv is None:
            raise self._death("the worker was killed")
        buf = self._buf
        need = _LEN.size
        while True:
            if len(buf) >= need:
                if need == _LEN.size:
                    need = _LEN.size + _LEN.unpack_from(buf)[0]
                    continue
                frame = bytes(buf[_LEN.size:need])
                del buf[:need]
                reply = pickle.loads(frame)
                if reply[0] == "exited":  # the zygote's word on how it ended: its last
                    self.exit_status = reply[1]
                    if len(reply) > 2:
                        self.stderr_tail = reply[2].decode(errors="replace").rstrip()
                    raise self._death("worker process exited")
                return reply
            try:
                chunk = await self._recv.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise self._death(_pipe_broke(exc)) from None
            if not chunk:
                raise self._death("worker process exited")
            buf += chunk

    def _death(self, what: str) -> WorkerDied:
        how = self.ended_how
        died = WorkerDied(
            f"{what} (pid {self.pid})" if how is None else f"{what} (pid {self.pid}; {how})"
        )
        died.stderr = self.stderr_tail or None
        return died

    def died_of(self) -> str:
        """The worker's death in one wording, whichever call found it (a batch's
        sending or result, or :meth:`wait_exited`): what it said it died of, its pid
        and how it ended, those known (``pid 4242, killed by SIGKILL: …``; ``its
        device context was lost: …; pid 4242``, where the signal is the kill that
        followed its word, not news). Not a checkpoint."""
        how = None if self.cause is not None else self.ended_how
        pid = f"pid {self.pid}" if self.pid is not None else ""
        facts = ", ".join(k for k in (pid, how or "") if k)
        return "; ".join(k for k in (self.cause or "", facts) if k) or "how is not known"

    @property
    def ended_how(self) -> str | None:
        """How the process ended, in words ("killed by SIGKILL: an out-of-memory kill,
        or kill -9", "exit status 3"), once known: a forked worker's status comes from
        its zygote after the exit, and is read at the latest by :meth:`aclose`."""
        if self._proc is not None and self.exit_status is None:
            code = self._proc.poll()
            if code is not None:
                self.exit_status = _wait_status(code)
        return None if self.exit_status is None else describe_exit(self.exit_status)

    async def wait_exited(self) -> None:
        """Wait until the process has exited, killed or on its own: it is gone (a
        forked worker is reaped by its zygote at once). A checkpoint. A forked worker
        without a pidfd (Linux before 5.3) cannot be watched: it waits forever."""
        if self._proc is not None:
            await self._proc.wait()
            return
        async with self._exit_lock:
            if self._pidfd is None:
                await trio.sleep_forever()
            try:
                await trio.lowlevel.wait_readable(self._pidfd)
            except trio.ClosedResourceError:
                pass  # closed by aclose: it waited for the exit itself

    def kill(self) -> None:
        """Kill the process and free its pipe and shared memory. Synchronous; the
        process may still be exiting when it returns: :meth:`aclose` waits for it."""
        if self._proc is not None and self._proc.returncode is None:
            try:
                self._proc.kill()
            except ProcessLookupError:
                pass
        elif self._pidfd is not None:
            # A pidfd names this process even after its pid is reused by another.
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except (ProcessLookupError, OSError):
                pass
        elif self._zygote is not None and self.pid is not None and self._send is not None:
            try:  # no pidfd (an old kernel): the pid, while our pipe says it is ours
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._recv is not None and self.exit_status is None and self._tail is None:
            # read by aclose: the zygote's word on how it ended, and the results it
            # wrote that were not read (which tell what it never started)
            self._tail = (os.dup(self._recv.fileno()), bytes(self._buf))
            self._left_in_flight = self.in_flight
        if self._send is not None:
            self.never_read = self._never_read()
        for stream in (self._send, self._recv):
            if stream is not None:
                stream.close()
        self._send = self._recv = None
        self._buf.clear()
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with it
            self._shm = None

    def _never_read(self) -> int:
        """How many of the batches in flight, the newest, the worker has not read
        whole: what is left unread in its request pipe (``FIONREAD``) is more than
        the messages of the batches sent after each. Called as it is killed (after
        the signal): a read it was in then may still end, but it runs nothing more.
        0 when not known (a message being written: its part in the pipe is not
        known; a pipe that cannot say). Not a checkpoint."""
        if self._send is None or self._writing or not self.in_flight:
            return 0
        try:
            raw = fcntl.ioctl(self._send.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return 0
        unread = struct.unpack("i", raw)[0]
        never, after = 0, 0
        for i in range(1, self.in_flight + 1):  # the newest first
            if unread <= after:
                break  # it read this one whole (and those before it)
            never += 1
            after += self._frames[(self._next_slot - i) % self.SLOTS]
        return never

    def unread_results(self) -> list[tuple[Any, float]]:
        """Once killed: what it wrote for the batches left in flight that it finished,
        their results not read (waiting in its pipe, read now without waiting: what
        :meth:`aclose` reads on keeps them), oldest first: each (its outputs as
        :meth:`result` returns them, or the WorkerError or FrameTooLarge it would
        raise; the seconds it ran). It runs its batches in order, each once it has
        written the result of the one before, so the batch after those is the one it
        was running, if any: also the one whose device context it lost (its "lost"
        reply ends them). A result half written is not one. Exact for a worker that
        has exited (a death found by :meth:`wait_exited` before the results were
        read); one killed alive may write one more before the signal lands. Empty
        when not killed. Not a checkpoint."""
        if self._tail is None:
            return []
        fd, data = self._tail
        chunks = [data]
        try:
            os.set_blocking(fd, False)
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        except OSError:
            pass  # nothing more now (BlockingIOError), or a pipe that broke
        data = b"".join(chunks)
        self._tail = (fd, data)
        results: list[tuple[Any, float]] = []
        at = 0
        while at + _LEN.size <= len(data) and len(results) < self._left_in_flight:
            end = at + _LEN.size + _LEN.unpack_from(data, at)[0]
            if end > len(data):
                break  # half written: the batch it was running
            try:
                reply = pickle.loads(data[at + _LEN.size:end])
            except Exception:
                break  # misread: count no further
            kind = reply[0]
            if kind == "ok":
                results.append((unstack_outputs(reply[1], reply[2]), reply[3]))
            elif kind == "error":
                results.append((WorkerError(reply[1]), 0.0))
            elif kind == "too_large":
                results.append((FrameTooLarge(reply[1]), 0.0))
            else:
                break  # "lost" (the batch it failed on), or the zygote's word: the last
            at = end
        return results

    async def aclose(self) -> None:
        """Kill the process and wait until it has exited (shielded, bounded), then
        free its pidfd. After it the worker is gone: its zygote may go too, without
        leaving it to init as an orphan."""
        self.kill()
        if self._proc is not None or self._pidfd is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self.wait_exited()
        if self._pidfd is not None:
            trio.lowlevel.notify_closing(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._tail is not None:
            fd, self._buf[:] = self._tail
            self._tail = None
            self._recv = trio.lowlevel.FdStream(fd)
            written = 0  # results it wrote that were not read before
            try:
                # The zygote writes it as soon as it reaps the worker (exited above);
                # a worker started alone ends its pipe as it exits.
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    while True:
                        reply = await self._read()
                        if reply[0] in ("ok", "error", "too_large", "lost"):
                            written += 1
            except WorkerDied:
                # the end of its pipe (the zygote's word comes after all it wrote;
                # a result it left half written was its last): the batch after the
                # last result written never started, nor did those after it
                self.never_started = max(0, self._left_in_flight - written - 1)
            except Exception:
                pass  # what the killed worker left half written, misread
            finally:
                self._recv.close()
                self._recv = None
                self._buf.clear()


#: What a signal that ends a worker most often means.
_SIGNAL_HINTS = {
    signal.SIGKILL: "an out-of-memory kill, or kill -9",
    signal.SIGSEGV: "a crash in native code, in an extension or the model's library",
    signal.SIGBUS: "a crash in native code, in an extension or the model's library",
    signal.SIGABRT: "an abort in native code, in an extension or the model's library",
}


def _wait_status(returncode: int) -> int:
    """The wait status of a subprocess' ``returncode`` (negative: the signal)."""
    return -returncode if returncode < 0 else returncode << 8


def describe_exit(status: int) -> str:
    """A wait status in words: "exit status 3", or "killed by SIGKILL (an
    out-of-memory kill, or kill -9)"."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        hint = _SIGNAL_HINTS.get(sig)
        return f"killed by {name}" + (f": {hint}" if hint else "")
    if os.WIFEXITED(status):
        return f"exit status {os.WEXITSTATUS(status)}"
    return f"wait status {status}"


def _stack_into(flat: np.ndarray, arrays: list[np.ndarray], shape: tuple[int, ...]) -> None:
    """Stack ``arrays`` (each of ``shape``) into ``flat``, a 1-D buffer of their total
    size. What ``np.stack(arrays, out=...)`` does, in one ``concatenate`` of flattened
    views: np.stack makes an expanded view of every array first, which is most of its
    cost on a batch of small items (64 rows of 256 floats: ~28 → ~12 µs). Raises
    ValueError when an array is not of ``shape``, or not of ``flat``'s dtype (it would
    be cast to it: an item's int64 input came back float32)."""
    dtype = flat.dtype
    for a in arrays:
        if a.shape != shape:
            raise ValueError(f"an item of shape {a.shape} among items of shape {shape}")
        if a.dtype != dtype:
            raise ValueError(f"an item of dtype {a.dtype} among items of dtype {dtype}")
    if not shape:
        np.stack(arrays, out=flat)
        return
    np.concatenate(arrays, out=flat.reshape((len(arrays) * shape[0], *shape[1:])))


def unstack_outputs(n: int, out: Any) -> list[Any]:
    """A worker's outputs of ``n`` items as one per item: {name: stacked array} as
    rows, a list (items of different outputs, or an item's error) as it is."""
    if isinstance(out, dict):
        names = list(out)
        if len(names) == 1:
            name, arr = names[0], out[names[0]]
            return [{name: row} for row in arr[:n]]
        return [{k: out[k][i] for k in names} for i in range(n)]
    return out


def _portable(cfg: ModelConfig, backend: Any) -> ModelConfig:
    import attrs

    return attrs.evolve(cfg, backend=backend)
