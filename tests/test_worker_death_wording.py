"""A worker process's death is worded one way whichever of its batcher's paths found
it: the watch on its exit, a batch's sending that failed on its pipe, or a batch's
result. The words are the worker's own (:meth:`WorkerProcess.died_of`); a stand-in
worker in trio time, whose calls fail as a real one's do, sets the death off."""

from __future__ import annotations

import logging
import pickle
import struct

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import NoZygote, _StandIn, callable_model, config, item
from trioserve import ModelConfig, WorkerProcess
from trioserve._builtin import resolve_backend


class _Dies(_StandIn):
    """Echoes each batch (``y = x``), but for the first one made, which holds its
    first batch until it dies (:meth:`die`), ``exit status 3``; the batcher finds
    that by ``found_by``: the watch on its exit, the next batch's sending (its pipe
    broke), or the held batch's result (the end of its pipe)."""

    made: list[_Dies] = []
    found_by = "watch"  # (the first one's: the test sets it)
    died_of = WorkerProcess.died_of  # the real wording
    _death = WorkerProcess._death  # the errors its calls raise, as a real one's

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = 4200 + len(_Dies.made)
        self.cause = None
        self.ended_how: str | None = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self.first = not _Dies.made
        if not self.first:
            self.found_by = "watch"
        self.sent: list[list] = []
        self._gone = trio.Event()  # exited on its own
        self._exited = trio.Event()  # killed
        _Dies.made.append(self)

    def die(self) -> None:
        self.ended_how = "exit status 3"
        self._gone.set()

    async def wait_exited(self) -> None:
        await (self._gone if self.found_by == "watch" else self._exited).wait()

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        if self._gone.is_set():
            raise self._death("pipe broke: [Errno 32] Broken pipe")
        self.sent.append(items)

    async def result(self):
        if self.first:
            if self.found_by == "result":
                await self._gone.wait()
                raise self._death("worker process exited")
            await self._exited.wait()
            raise self._death("the worker was killed")
        await trio.lowlevel.checkpoint()
        return [{"y": it["x"]} for it in self.sent.pop(0)]


@pytest.fixture
def dying(monkeypatch):
    import trioserve._runtime
    import trioserve.actors._batcher

    _Dies.made = []
    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _Dies)
    return _Dies


@pytest.mark.parametrize("found_by", ["watch", "send", "result"])
async def test_a_worker_s_death_is_worded_the_same_whichever_path_found_it(
    autojump_clock, manual_watchdog, dying, caplog, found_by
):
    """It used to read ``its worker process exited (pid N), exit status 3`` (the
    watch), ``its worker process died (pipe broke: … (pid N; exit status 3))`` (a
    sending) and ``its worker process died (worker process exited (pid N; exit
    status 3))`` (a result): one death, three wordings, the how said twice in two.
    The batch it held runs again on its successor."""
    caplog.set_level(logging.WARNING, logger="trioserve")
    cfg = config(callable_model(
        "m", lambda items: items, execution="process", max_batch_size=1, max_wait_ms=0,
        timeout_ms=None,
    ))
    answers: dict[float, list] = {}

    async def caller(rt, value: float) -> None:
        answers[value] = (await rt.infer("m", item(value)))["y"].tolist()

    dying.found_by = found_by
    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        (first,) = dying.made
        nursery.start_soon(caller, rt, 1.0)
        await trio.testing.wait_all_tasks_blocked()
        first.die()
        await trio.testing.wait_all_tasks_blocked()
        if found_by == "send":  # nothing found it yet: the next batch's sending does
            nursery.start_soon(caller, rt, 2.0)
            await trio.testing.wait_all_tasks_blocked()
        batcher = rt.models["m"].batchers[0]
        assert batcher.workers_lost == 1
        assert batcher._worker is not first
    assert answers[1.0] == [1.0]
    lost = [r.getMessage() for r in caplog.records if " lost: " in r.getMessage()]
    assert lost == [
        "batcher[m#0@cpu]: worker process lost: its worker process died (pid 4200, "
        "exit status 3); a new one is started"
    ]


class _Frames:
    """A worker's reply pipe that holds these frames, then its end."""

    def __init__(self, *replies) -> None:
        data = [pickle.dumps(r, protocol=5) for r in replies]
        self._data = b"".join(struct.pack("<I", len(d)) + d for d in data)

    async def receive_some(self, n):
        await trio.lowlevel.checkpoint()
        chunk, self._data = self._data[:n], self._data[n:]
        return chunk


def _worker() -> WorkerProcess:
    cfg = ModelConfig(name="m", backend="echo")
    worker = WorkerProcess(cfg, resolve_backend(cfg), "cpu", 1)
    worker.pid = 4242
    worker.in_flight = 1
    return worker


async def test_a_worker_process_s_death_names_its_pid_how_it_ended_and_its_word():
    """What is known of its death, and only that: its pid; how it ended, once its
    zygote said so; what it said it died of (its device context lost), with no
    signal then: the SIGKILL that follows its word is the runtime's."""
    worker = _worker()
    assert worker.died_of() == "pid 4242"
    worker._recv = _Frames(("exited", 9, b""))  # the zygote's word: SIGKILL
    with pytest.raises(WorkerProcess.Died):
        await worker.result()
    assert worker.died_of() == (
        "pid 4242, killed by SIGKILL: an out-of-memory kill, or kill -9"
    )
    worker.pid = None
    assert worker.died_of() == "killed by SIGKILL: an out-of-memory kill, or kill -9"
    worker.exit_status = None
    assert worker.died_of() == "how is not known"

    worker = _worker()
    worker._recv = _Frames(("lost", "CUDA error: an illegal memory access"), ("exited", 9))
    with pytest.raises(WorkerProcess.Died):
        await worker.result()
    with pytest.raises(WorkerProcess.Died):
        await worker.result()  # its exit, after its word
    assert worker.ended_how is not None
    assert worker.died_of() == (
        "its device context was lost: CUDA error: an illegal memory access; pid 4242"
    )
