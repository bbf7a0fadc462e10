"""Worker processes and their zygote, with real processes: a worker that dies while
idle is replaced at once (and its replica is not ready meanwhile), a dead or hung
zygote is replaced, the shared memory has no name to leave behind, and a closed worker
has exited before its zygote goes.

These wait on the processes themselves (their pidfds), never on a sleep.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import (
    GATE_FILE_ENV,
    X,
    Y,
    callable_model,
    config,
    crash_on_666,
    held_until_file,
    item,
    pythonpath_with,
)
from trioserve import ModelConfig, ModelError, WorkerProcess
from trioserve._builtin import resolve_backend
from trioserve._model import CallableBackend
from trioserve._zygote import Zygote, ZygoteError

TESTS = os.path.dirname(os.path.abspath(__file__))
SLEEP = ModelConfig(name="s", backend="sleep", execution="process", max_batch_size=4,
                    max_wait_ms=1.0)


def x(v: float) -> dict[str, np.ndarray]:
    return {"x": np.array([v, 0.0], np.float32)}


@contextlib.contextmanager
def watching(pid: int) -> Iterator[int]:
    """A pidfd of ``pid``, closed on leaving."""
    fd = os.pidfd_open(pid)
    try:
        yield fd
    finally:
        os.close(fd)


def exited(pidfd: int) -> bool:
    """Whether the process has exited, now (no wait)."""
    return select.select([pidfd], [], [], 0)[0] == [pidfd]


async def kill_and_wait(pid: int) -> None:
    """SIGKILL ``pid`` and wait until it has exited."""
    with watching(pid) as fd:
        os.kill(pid, signal.SIGKILL)
        with trio.fail_after(10):
            await trio.lowlevel.wait_readable(fd)


async def test_a_worker_that_dies_idle_is_replaced_before_the_next_request():
    async with trioserve.open_runtime(config(SLEEP)) as rt:
        batcher = rt.models["s"].batchers[0]
        assert (await rt.infer("s", x(1.0)))["y"].tolist() == [1.0, 0.0]
        first = batcher._worker.pid
        await kill_and_wait(first)
        await trio.testing.wait_all_tasks_blocked()
        # Noticed with no request to find out by: not ready while its successor starts.
        assert batcher.workers_lost == 1
        assert batcher.health == "replacing"
        assert not rt.model_ready("s")
        assert rt.health()["s"]["ready"] is False
        with trio.fail_after(30):
            assert (await rt.infer("s", x(2.0)))["y"].tolist() == [2.0, 0.0]
        assert batcher._worker.pid != first
        assert batcher.workers_lost == 1
        assert batcher.restarts == 0
        assert rt.model_ready("s")


async def test_a_worker_killed_while_serving_is_logged_with_its_signal(caplog):
    """The loss of a worker that died on its own was logged as "its worker process
    exited (pid N)", with nothing of how: now its signal (or exit status) too, once
    its zygote has reaped it, worded as a death found by a batch's call is."""
    import logging

    caplog.set_level(logging.WARNING, logger="trioserve")
    async with trioserve.open_runtime(config(SLEEP)) as rt:
        batcher = rt.models["s"].batchers[0]
        first = batcher._worker.pid
        await kill_and_wait(first)
        with trio.fail_after(30):  # answered by its successor: the loss was logged
            assert (await rt.infer("s", x(2.0)))["y"].tolist() == [2.0, 0.0]
    lost = [r.getMessage() for r in caplog.records if "worker process lost: " in r.getMessage()]
    assert len(lost) == batcher.workers_lost == 1
    assert lost[0] == (
        f"{batcher.name}: worker process lost: its worker process died (pid {first}, "
        "killed by SIGKILL: an out-of-memory kill, or kill -9); a new one is started"
    )


async def test_a_worker_lost_while_its_batch_is_taken_for_collection_crashes_nothing(
    monkeypatch,
):
    """The worker writes a batch's result and exits on the next batch (as a segfault
    would). The batcher's collector reads the result and takes the next batch off its
    channel (a cancel-shielded checkpoint), and the watch on the exit hands the
    batches back and kills the worker before the collector asks for that batch's
    result. That call found the pipe gone, tripped an assertion and crashed the
    actor (a restart). Now it raises WorkerDied: the loss is already handled, and
    every request is answered once. The hooks below only order the two tasks that
    way; the processes are real."""
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))  # where crash_on_666 is
    cfg = config(callable_model("m", crash_on_666, execution="process",
                                max_batch_size=1, max_wait_ms=0, timeout_ms=None))
    result, wait_exited, kill = (
        WorkerProcess.result, WorkerProcess.wait_exited, WorkerProcess.kill
    )
    first_read, killed = trio.Event(), trio.Event()
    calls: list[str] = []

    async def ordered_result(self):
        if self is not first:
            return await result(self)
        calls.append("result")
        if len(calls) == 1:
            try:
                return await result(self)
            finally:
                first_read.set()
        with trio.CancelScope(shield=True):
            await killed.wait()  # the watch handled the exit first
        try:
            return await result(self)
        except WorkerProcess.Died:
            calls.append("died")
            raise

    async def ordered_wait_exited(self):
        await wait_exited(self)
        if self is first:
            await first_read.wait()  # not before the first result was read

    def recorded_kill(self):
        kill(self)
        if self is first:
            killed.set()

    async with trioserve.open_runtime(cfg) as rt:
        batcher = rt.models["m"].batchers[0]
        first = batcher._worker
        monkeypatch.setattr(WorkerProcess, "result", ordered_result)
        monkeypatch.setattr(WorkerProcess, "wait_exited", ordered_wait_exited)
        monkeypatch.setattr(WorkerProcess, "kill", recorded_kill)
        answers: dict[float, list[object]] = {1.0: [], 666.0: []}

        async def call(v: float) -> None:
            try:
                answers[v].append(float((await rt.infer("m", item(v)))["y"][0]))
            except ModelError as exc:
                answers[v].append(exc)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 1.0)
                await trio.testing.wait_all_tasks_blocked()  # 1.0 sent to the worker
                nursery.start_soon(call, 666.0)
        assert calls == ["result", "result", "died"]
        assert batcher.restarts == 0
        assert answers[1.0] == [1.0]
        [poison] = answers[666.0]
        assert "poison request" in str(poison)
        assert batcher.workers_lost >= 1
        with trio.fail_after(30):
            assert (await rt.infer("m", item(2.0)))["y"].tolist() == [2.0]


async def test_a_successor_that_cannot_start_is_tried_again_and_the_runtime_serves_on(
    monkeypatch,
):
    # Before, the batcher crashed; its supervisor's restarts were used up in
    # milliseconds and the escalation took the whole runtime, every model, down.
    start = WorkerProcess.start
    failures = [OSError("no room for a process"), OSError("still none")]

    async def flaky_start(self):
        if failures:
            raise failures.pop(0)
        await start(self)

    echo = ModelConfig(name="echo", backend="echo", max_wait_ms=0)
    async with trioserve.open_runtime(config(SLEEP, echo)) as rt:
        batcher = rt.models["s"].batchers[0]
        assert (await rt.infer("s", x(1.0)))["y"].tolist() == [1.0, 0.0]
        monkeypatch.setattr(WorkerProcess, "start", flaky_start)
        await kill_and_wait(batcher._worker.pid)
        await trio.testing.wait_all_tasks_blocked()
        assert not rt.model_ready("s")
        assert (await rt.infer("echo", {"a": [1]}))["a"].tolist() == [1]  # others serve
        with trio.fail_after(30):
            assert (await rt.infer("s", x(2.0)))["y"].tolist() == [2.0, 0.0]
        assert failures == []
        assert batcher.start_failures == 2
        assert batcher.restarts == 0
        assert rt.model_ready("s")


async def test_a_dead_zygote_is_restarted_when_a_worker_is_lost():
    # Before, the batcher could not replace its worker, crashed at once each time it
    # was restarted, and its escalation took the whole runtime down.
    async with trioserve.open_runtime(config(SLEEP)) as rt:
        batcher = rt.models["s"].batchers[0]
        zygote = batcher._zygote
        assert (await rt.infer("s", x(1.0)))["y"].tolist() == [1.0, 0.0]
        first_zygote = zygote.pid
        await kill_and_wait(first_zygote)
        await kill_and_wait(batcher._worker.pid)
        with trio.fail_after(60):
            assert (await rt.infer("s", x(2.0)))["y"].tolist() == [2.0, 0.0]
        assert zygote.restarts == 1
        assert zygote.pid != first_zygote
        assert batcher.restarts == 0
        assert rt.model_ready("s")


async def test_a_hung_zygote_is_replaced_and_a_closed_one_forks_nothing():
    backend = resolve_backend(SLEEP)
    zygote = Zygote()
    zygote.FORK_TIMEOUT = 0.5
    await zygote.start()
    try:
        first = zygote.pid
        os.kill(first, signal.SIGSTOP)  # alive, never answers
        worker = WorkerProcess(SLEEP, backend, "cpu", 1, zygote=zygote)
        try:
            with trio.fail_after(60):
                await worker.start()
            assert zygote.restarts == 1
            assert zygote.pid != first
            assert not on_disk([f"/proc/{first}"])  # killed and reaped
            (out,) = await worker.run([x(3.0)])
            assert out["y"].tolist() == [3.0, 0.0]
        finally:
            await worker.aclose()
    finally:
        await zygote.aclose()
    late = WorkerProcess(SLEEP, backend, "cpu", 1, zygote=zygote)
    try:
        with pytest.raises(ZygoteError, match="closed"):
            await late.start()
        assert zygote.pid is None  # not restarted once closed
    finally:
        await late.aclose()


async def test_a_closed_worker_has_exited_before_its_zygote_goes():
    # Killed and not waited for, a worker could still be exiting when the zygote was
    # killed next: orphaned to init, a zombie until init reaped it.
    zygote = Zygote()
    await zygote.start()
    try:
        worker = WorkerProcess(SLEEP, resolve_backend(SLEEP), "cpu", 1, zygote=zygote)
        await worker.start()
        with watching(worker.pid) as fd:
            await worker.aclose()
            assert exited(fd)
    finally:
        await zygote.aclose()


def faulthandler_state(items):
    """A model reporting whether faulthandler is enabled in its process: y = 1 or 0.
    Importable, so a worker process can run it."""
    import faulthandler

    return [{"y": np.full(2, float(faulthandler.is_enabled()), np.float32)} for _ in items]


def segfaults(items):
    """A model whose batch ends its process with SIGSEGV, as a crashing extension
    does (no core file). Importable, so a worker process can run it."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    os.kill(os.getpid(), signal.SIGSEGV)


async def test_faulthandler_is_enabled_in_a_worker_forked_or_started_alone(monkeypatch):
    """A worker forked from the zygote and one started without it (its own
    ``python -m trioserve._worker``) both have faulthandler enabled."""
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    cfg = callable_model("f", faulthandler_state, execution="process")
    backend = resolve_backend(cfg)
    zygote = Zygote()
    await zygote.start()
    try:
        for worker in (WorkerProcess(cfg, backend, "cpu", 1, zygote=zygote),
                       WorkerProcess(cfg, backend, "cpu", 1)):
            try:
                with trio.fail_after(60):
                    await worker.start()
                    (out,) = await worker.run([x(0.0)])
                assert out["y"].tolist() == [1.0, 1.0]
            finally:
                await worker.aclose()
    finally:
        await zygote.aclose()


async def test_a_worker_killed_by_sigsegv_leaves_its_python_stack_on_stderr(
    monkeypatch, capfd
):
    """A worker forked from the zygote dies of SIGSEGV in its model call: its stderr
    (the server's) has faulthandler's report with the model's frame, and it is still
    seen as killed by SIGSEGV. Its report is written before it dies, so before its
    zygote reaps it and the runtime learns it is gone."""
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    cfg = callable_model("f", segfaults, execution="process")
    zygote = Zygote()
    await zygote.start()
    try:
        worker = WorkerProcess(cfg, resolve_backend(cfg), "cpu", 1, zygote=zygote)
        try:
            with trio.fail_after(60):
                await worker.start()
                with pytest.raises(WorkerProcess.Died, match="; killed by SIGSEGV: ") as died:
                    await worker.run([x(0.0)])
        finally:
            await worker.aclose()
    finally:
        await zygote.aclose()
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err
    assert "in segfaults" in err  # the model's frame, in the stack it left
    # The same report's tail comes with the error too, from the worker's zygote.
    assert died.value.stderr is not None
    assert "in segfaults" in died.value.stderr
    assert died.value.stderr == worker.stderr_tail


class DiesLoading(CallableBackend):
    """A backend whose load writes 100 numbered lines to stderr, then ends its process
    with exit status 3 (as an import error in a model's module ends a worker that
    sys.exit()s from a native library). Importable, so a worker process can load it."""

    def load(self, device: str, *, torch_threads: int = 1):
        for i in range(100):
            print(f"loading, line {i}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(3)


async def test_a_worker_that_dies_loading_names_its_stderr_in_the_load_error(
    monkeypatch, capfd
):
    """What a worker wrote to its stderr went only to the server's stderr: the
    ModelLoadError said "exit status 3" and nothing of why. Its last lines (30 at
    most) now come in the error too, and every line still reaches the server's
    stderr."""
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    backend = DiesLoading(crash_on_666, inputs=(X,), outputs=(Y,), execution="process")
    cfg = ModelConfig(name="d", backend=backend, execution="process")
    with trio.fail_after(60), pytest.raises(trioserve.ModelLoadError) as failed:
        async with trioserve.open_runtime(config(cfg)):
            pass  # pragma: no cover - it does not open
    msg = str(failed.value)
    assert "(pid " in msg
    assert "exit status 3); its stderr ended with:\n    loading, line 70\n" in msg
    assert msg.endswith("\n    loading, line 99")
    assert "line 69\n" not in msg
    err = capfd.readouterr().err
    assert all(f"loading, line {i}\n" in err for i in range(100))


def noisy_crash_on_666(items):
    """``crash_on_666``, saying so on stderr first. Importable."""
    if any(float(it["x"][0]) == 666.0 for it in items):
        print("about to crash on 666", file=sys.stderr, flush=True)
    return crash_on_666(items)


async def test_a_lost_worker_is_logged_with_the_tail_of_its_stderr(monkeypatch, caplog):
    """The log line of a worker that died serving names how it ended and the last
    lines it wrote to its stderr."""
    import logging

    caplog.set_level(logging.WARNING, logger="trioserve")
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    cfg = callable_model("m", noisy_crash_on_666, execution="process", max_batch_size=1,
                         timeout_ms=None)
    async with trioserve.open_runtime(config(cfg)) as rt:
        with trio.fail_after(60):
            with pytest.raises(ModelError, match="poison request"):
                await rt.infer("m", item(666))
            assert (await rt.infer("m", item(2)))["y"][0] == 2.0
    lost = [r.getMessage() for r in caplog.records if "worker process lost: " in r.getMessage()]
    assert lost
    for line in lost:
        assert "exit status 3" in line
        assert line.endswith(
            "; a new one is started; its stderr ended with:\n    about to crash on 666"
        )


def on_disk(paths: list[str]) -> list[str]:
    """Those of ``paths`` that exist."""
    return [p for p in paths if os.path.exists(p)]


def mapped_files(pid: int | str) -> list[str]:
    """The paths of the trioserve mappings of a process (``/proc/PID/maps``)."""
    with open(f"/proc/{pid}/maps") as f:
        rows = [line.split(maxsplit=5) for line in f]
    return [row[5].rstrip("\n") for row in rows if len(row) == 6 and "trioserve" in row[5]]


async def test_the_shared_memory_has_no_name_that_a_killed_server_could_leave():
    async with trioserve.open_runtime(config(SLEEP)) as rt:
        worker = rt.models["s"].batchers[0]._worker
        ours, theirs = mapped_files("self"), mapped_files(worker.pid)
        assert ours
        assert theirs
        # Anonymous (a memfd) or already unlinked: nothing left in /dev/shm.
        assert on_disk(ours + theirs) == []


ORPHAN = """
import sys, numpy as np, trio, trioserve
from trioserve import ModelConfig

async def main():
    cfg = trioserve.Config(models=(ModelConfig(
        name="s", backend="sleep", execution="process", max_wait_ms=0.0,
        timeout_ms=600_000.0),))
    async with trioserve.open_runtime(cfg) as rt:
        batcher = rt.models["s"].batchers[0]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rt.infer, "s", {"x": np.array([600_000.0, 0.0], np.float32)})
            await trio.sleep(0.5)
            print(batcher._worker.pid, batcher._zygote.pid, flush=True)
            await trio.sleep_forever()

trio.run(main)
"""


async def test_a_worker_ends_with_its_runtime_even_in_the_middle_of_a_model_call():
    """The runtime SIGKILLed while its worker ran a 10-minute call: the worker saw its
    pipe close only after the call, and ran on meanwhile, reparented out of reach."""
    import subprocess
    import sys

    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE
    )
    try:
        out = b""
        with trio.fail_after(60):
            while not out.endswith(b"\n"):
                chunk = await proc.stdout.receive_some()
                assert chunk, out
                out += chunk
        worker, zygote = map(int, out.split())
        try:
            with watching(worker) as wfd, watching(zygote) as zfd:
                assert not exited(wfd)  # in its call
                proc.kill()
                with trio.fail_after(10):  # the call alone has minutes to go
                    await trio.lowlevel.wait_readable(wfd)
                    await trio.lowlevel.wait_readable(zfd)
        finally:  # nothing left behind if it failed
            for pid in (worker, zygote):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (trio.BrokenResourceError(), "pipe broke (pid 4242)"),
        (trio.ClosedResourceError("this stream was already closed"),
         "pipe broke: this stream was already closed (pid 4242)"),
        (BrokenPipeError(32, "Broken pipe"), "pipe broke: [Errno 32] Broken pipe (pid 4242)"),
    ],
)
async def test_a_broken_pipe_says_why_or_nothing_after_it(error, expected):
    """The faults bench's log read ``worker process died (pipe broke:  (pid N))``:
    trio's BrokenResourceError, raised bare, has no words of its own."""

    class Breaks:
        async def send_all(self, data):
            raise error

        async def receive_some(self, n):
            raise error

    cfg = ModelConfig(name="m", backend="echo")
    worker = WorkerProcess(cfg, resolve_backend(cfg), "cpu", 1)
    worker.pid = 4242
    worker._send = worker._recv = Breaks()
    for op in (worker._write(b"x"), worker._read()):
        with pytest.raises(WorkerProcess.Died) as died:
            await op
        assert str(died.value) == expected


async def test_a_worker_replica_reads_stopped_once_the_runtime_is_closed():
    # Its batcher serves from a nursery of tasks, so the close cancels it with a group
    # of Cancelled: it used to stay RUNNING, and health() said 'ready' after the close.
    async with trioserve.open_runtime(config(SLEEP)) as rt:
        assert (await rt.infer("s", x(1.0)))["y"].tolist() == [1.0, 0.0]
        batcher = rt.models["s"].batchers[0]
    assert batcher.state is trioserve.ActorState.STOPPED
    assert rt.health()["s"] == {"ready": False, "replicas": {batcher.name: "stopped"}}


@pytest.mark.parametrize("spawn", ["forked", "alone"])
async def test_a_closed_worker_says_which_batches_in_flight_it_never_started(
    monkeypatch, tmp_path, spawn
):
    """Three batches sent to a worker held in the first (its gate never opens): once
    closed, it says the two staged behind it never started (it wrote no result, and
    runs each only after writing the one before's). Its own pipe says so, forked from
    the zygote or started alone."""
    monkeypatch.setenv(GATE_FILE_ENV, str(tmp_path / "never"))
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    cfg = callable_model("h", held_until_file, execution="process")
    zygote = Zygote()
    await zygote.start()
    try:
        worker = WorkerProcess(
            cfg, resolve_backend(cfg), "cpu", 1, zygote=zygote if spawn == "forked" else None
        )
        try:
            with trio.fail_after(60):
                await worker.start()
                for v in (1.0, 2.0, 3.0):
                    await worker.submit([x(v)])
            assert worker.never_started == 0  # not known while it runs
        finally:
            await worker.aclose()
        assert worker.never_started == 2
    finally:
        await zygote.aclose()


@pytest.mark.parametrize("spawn", ["forked", "alone"])
async def test_a_killed_worker_gives_the_results_it_wrote_that_were_not_read(
    monkeypatch, tmp_path, spawn
):
    """A worker that wrote its first batch's result, nobody reading it, and then
    held the second: killed, its pipe holds the first's outputs (read without
    waiting), so the batch it was running is the second; the third never started."""
    gate = tmp_path / "open"
    monkeypatch.setenv(GATE_FILE_ENV, str(gate))
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    cfg = callable_model("h", held_until_file, execution="process")
    zygote = Zygote()
    await zygote.start()
    try:
        worker = WorkerProcess(
            cfg, resolve_backend(cfg), "cpu", 1, zygote=zygote if spawn == "forked" else None
        )
        try:
            with trio.fail_after(60):
                await worker.start()
                gate.touch()
                await worker.submit([x(1.0)])
                await trio.lowlevel.wait_readable(worker._recv.fileno())  # its result
                gate.unlink()
                for v in (2.0, 3.0):
                    await worker.submit([x(v)])
            assert worker.unread_results() == []  # not known while it runs
            worker.kill()
            ((outputs, seconds),) = worker.unread_results()
            assert [o["y"].tolist() for o in outputs] == [[1.0, 0.0]]
            assert seconds >= 0.0
            assert len(worker.unread_results()) == 1  # what it read is kept
        finally:
            await worker.aclose()
        assert worker.never_started == 1  # aclose reads on from what it kept
    finally:
        await zygote.aclose()
