"""A worker process that dies at an awkward moment for its batcher: after writing
results nobody read yet (they are delivered, not run again), or while a batch is
still being written into its pipe (that batch never reached it: it goes back as
never run, no suspect). Stand-in workers in trio time, whose death the test sets
off; the batcher's two ways of finding it (the watch on its exit, and the call
that failed on its pipe) both taken; and a real worker process whose parent reads
nothing of it until it is dead."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import (
    NoZygote,
    _StandIn,
    callable_model,
    config,
    crash_on_666,
    item,
    key,
    pythonpath_with,
)
from trioserve import ModelError, TenantConfig, WorkerProcess
from trioserve.actors import Breaker

TESTS = os.path.dirname(os.path.abspath(__file__))


def _config(**cfg) -> trioserve.Config:
    """Tenant a with 10 credits (1/s) and a one-replica worker-process model of
    batches of one."""
    return trioserve.Config(
        models=(callable_model(
            "m", lambda items: items, execution="process", adaptive_limit=False,
            max_batch_size=1, max_wait_ms=0, timeout_ms=None, **cfg,
        ),),
        tenants=(TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=10.0),),
    )


def _credits(rt) -> tuple[int, int]:
    tenant = rt.tenant_statistics()["a"]
    return tenant["credits_used"], tenant["credits_refunded"]


class _Worker(_StandIn):
    """A worker process in trio time. Every one but the first echoes each batch
    (``y = x``) as soon as it is asked for its result. The first answers nothing:
    its results are read only once the runtime kills it; the test makes it die
    (:meth:`die`), having written the results ``written`` of its first batches,
    or holds the sending of a batch (``hold_send``) until it dies."""

    made: list[_Worker] = []

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = len(_Worker.made)
        self.busy_seconds = self.last_run_seconds = 0.0
        self.first = not _Worker.made
        self.sent: list[list] = []  # every batch whose sending began
        self.sent_at: list[float] = []  # when (trio time)
        self.ran_for = 0.0  # the seconds it says it ran each batch whose result it wrote
        self.hold_send = False
        self.seen_by = "watch"  # which of the batcher's calls finds the death
        self._read = 0  # results read
        self._written: list = []
        self._killed = trio.Event()
        self._gone = trio.Event()  # exited on its own
        self._exited = self._killed  # (the base's, for aclose)
        _Worker.made.append(self)

    @property
    def alive(self) -> bool:
        return not self._killed.is_set()

    def kill(self) -> None:
        self._killed.set()

    def die(self, written: list | None = None) -> None:
        self._written = written or []
        self._gone.set()

    async def wait_exited(self) -> None:
        await (self._gone if self.seen_by == "watch" else self._killed).wait()

    def unread_results(self) -> list:
        if not self._killed.is_set():
            return []
        return [(outputs, self.ran_for) for outputs in self._written]

    async def submit(self, items) -> None:
        self.sent.append(items)
        self.sent_at.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        if self.hold_send:
            await self._gone.wait()  # the worker reads a part of it, and dies
            await trio.lowlevel.checkpoint()
            raise self.Died("pipe broke")

    async def result(self):
        if self.first:
            await self._killed.wait()
            raise self.Died("killed")
        await trio.lowlevel.checkpoint()
        self._read += 1
        return [{"y": it["x"]} for it in self.sent[self._read - 1]]


class _RecordingBreaker(Breaker):
    """A Breaker that records what it was told, in order (of every replica)."""

    told: list[str] = []

    def failure(self, now: float) -> None:
        _RecordingBreaker.told.append("failure")
        super().failure(now)

    def success(self) -> None:
        _RecordingBreaker.told.append("success")
        super().success()


@pytest.fixture
def worker_class(monkeypatch):
    import trioserve._runtime
    import trioserve.actors._batcher

    _Worker.made = []
    _RecordingBreaker.told = []
    monkeypatch.setattr(trioserve.actors, "Breaker", _RecordingBreaker)
    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _Worker)
    return _Worker


@pytest.mark.parametrize("seen_by", ["watch", "the next send"])
async def test_results_a_dead_worker_wrote_are_delivered_not_run_again(
    autojump_clock, manual_watchdog, worker_class, seen_by
):
    """Its worker wrote a's result (nothing read it yet), died running b, never
    started c; the batcher finds the death before it reads a's result (the watch on
    its exit, or a send that fails on its pipe). a's caller gets that result, the
    one it ran (charged once, not run again); b is the suspect; c goes back. a used
    to be handed back to run again on the next worker, charged, its result dropped
    (and its caller, had it left meanwhile, charged for both runs' work)."""
    cfg = _config()
    answers: dict[float, object] = {}

    async def caller(rt, value: float) -> None:
        answers[value] = (await rt.infer("m", item(value)))["y"].tolist()

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        (first,) = worker_class.made
        first.seen_by = "watch" if seen_by == "watch" else "nobody"
        for value in (1.0, 2.0, 3.0):
            # (the third, in the second case, held as it is sent, as the worker dies)
            first.hold_send = value == 3.0 and seen_by == "the next send"
            nursery.start_soon(caller, rt, value)
            await trio.testing.wait_all_tasks_blocked()
        batcher = rt.models["m"].batchers[0]
        ((a,), (b,), (c,)) = batcher._in_flight
        # what the dead worker computed for a: not what a second run gives
        first.die(written=[[{"y": np.array([10.0], dtype=np.float32)}]])
        await trio.testing.wait_all_tasks_blocked()
        assert batcher.workers_lost == 1
    assert answers[1.0] == [10.0]  # the result it wrote, read from its pipe
    assert answers[2.0] == [2.0]
    assert answers[3.0] == [3.0]
    assert a.reply.run is not None  # answered from its run
    assert not a.reply.suspect
    assert b.reply.suspect  # it crashed the worker
    assert b.reply.attempts == 1
    assert not c.reply.suspect
    ran_again = [it["x"][0] for w in worker_class.made[1:] for batch in w.sent for it in batch]
    assert 1.0 not in ran_again  # a ran once
    assert sorted(ran_again) == [2.0, 3.0]
    assert _credits(rt) == (3, 0)
    # a's success came before the death, which the breaker counts (b's retry's
    # success on the next worker after it)
    assert _RecordingBreaker.told[:3] == ["success", "failure", "success"]


@pytest.mark.parametrize("seen_by", ["watch", "the send"])
@pytest.mark.parametrize("its_caller", ["stays", "left"])
async def test_a_batch_whose_sending_its_worker_died_in_never_ran(
    autojump_clock, manual_watchdog, worker_class, seen_by, its_caller
):
    """The worker answered a; b was being written into its pipe (longer than the
    pipe holds: the worker reading it) when it died. b never reached the model:
    it goes back as it was, no suspect (no poison attempt counted), not charged
    when its caller left. It used to be taken for the batch the worker died
    running: split as a suspect, an attempt counted towards poison (two such
    deaths made a sound request "poison"), marked as having run, and charged."""
    cfg = _config()
    answers: dict[float, object] = {}
    scope = trio.CancelScope()

    async def caller(rt, value: float) -> None:
        with scope if value == 2.0 else trio.CancelScope():
            answers[value] = (await rt.infer("m", item(value)))["y"].tolist()

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        batcher = rt.models["m"].batchers[0]
        (first,) = worker_class.made
        first.first = False  # it answers a
        nursery.start_soon(caller, rt, 1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert answers[1.0] == [1.0]
        first.hold_send = True
        first.seen_by = "watch" if seen_by == "watch" else "nobody"
        nursery.start_soon(caller, rt, 2.0)
        await trio.testing.wait_all_tasks_blocked()
        ((b,),) = batcher._in_flight
        assert batcher._sending is not None
        if its_caller == "left":
            scope.cancel("the caller left")
            await trio.testing.wait_all_tasks_blocked()
        first.die()
        await trio.testing.wait_all_tasks_blocked()
        assert batcher.workers_lost == 1
        assert batcher._worker is not first
    assert not b.reply.suspect
    assert b.reply.attempts == 0
    assert not b.reply.ran
    if its_caller == "stays":
        assert answers[2.0] == [2.0]  # run on the next worker
        assert _credits(rt) == (2, 0)
    else:
        assert 2.0 not in answers
        assert _credits(rt) == (1, 1)  # b never ran: refunded


async def test_a_replaced_worker_s_unread_results_are_delivered(
    autojump_clock, manual_watchdog, worker_class
):
    """The worker's breaker opened on another replica's evidence: it is replaced as
    its first batch a is answered. It had finished b too (its result written, not
    read yet) and was running c. b's caller gets what it wrote (b runs nowhere
    else); c reached the model: handed back as it was, charged (``Reply.ran``), no
    suspect. b used to be handed back to run again, charged, its result dropped."""
    cfg = _config()
    answers: dict[float, object] = {}

    async def caller(rt, value: float) -> None:
        answers[value] = (await rt.infer("m", item(value)))["y"].tolist()

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        (first,) = worker_class.made
        first.seen_by = "nobody"
        finish = trio.Event()
        result = first.result

        async def first_answered_on_finish():
            if not finish.is_set():
                await finish.wait()
                return [{"y": it["x"]} for it in first.sent[0]]
            return await result()

        first.result = first_answered_on_finish
        for value in (1.0, 2.0, 3.0):
            nursery.start_soon(caller, rt, value)
            await trio.testing.wait_all_tasks_blocked()
        batcher = rt.models["m"].batchers[0]
        ((_,), (b,), (c,)) = batcher._in_flight
        first._written = [[{"y": np.array([20.0], dtype=np.float32)}]]
        batcher._replace_due = True  # (as another replica's evidence sets it)
        finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert batcher.workers_broken == 1
    assert answers == {1.0: [1.0], 2.0: [20.0], 3.0: [3.0]}
    assert not b.reply.suspect
    assert c.reply.ran
    assert not c.reply.suspect
    ran_again = [it["x"][0] for w in worker_class.made[1:] for batch in w.sent for it in batch]
    assert ran_again == [3.0]
    assert _credits(rt) == (3, 0)


async def test_a_straggler_s_result_written_as_it_was_cut_off_is_delivered(
    autojump_clock, manual_watchdog, worker_class
):
    """a ran past the batch deadline and its worker was killed; it had written a's
    result as the deadline passed (in its pipe, unread), and then started b; c was
    staged behind. a's caller gets that result (a ran once, and is no straggler's
    suspect); b, killed as it began, goes back as it was (no suspect, no poison
    attempt) and is charged (it reached the model); c never started: refunded.
    b's and c's callers left meanwhile. a used to go back as the suspect, to run
    again, its result dropped, and b as never started: refunded, though it had
    reached the model. No batch failed: the breaker is told a's success, and no
    failure."""
    cfg = _config()
    answers: dict[float, object] = {}
    scopes = {2.0: trio.CancelScope(), 3.0: trio.CancelScope()}

    async def caller(rt, value: float) -> None:
        with scopes.get(value, trio.CancelScope()):
            answers[value] = (await rt.infer("m", item(value)))["y"].tolist()

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        (first,) = worker_class.made
        first.seen_by = "nobody"  # its end is found by the deadline
        for value in (1.0, 2.0, 3.0):
            nursery.start_soon(caller, rt, value)
            await trio.testing.wait_all_tasks_blocked()
        batcher = rt.models["m"].batchers[0]
        ((a,), (b,), (c,)) = batcher._in_flight
        for scope in scopes.values():
            scope.cancel("the caller left")
        await trio.testing.wait_all_tasks_blocked()
        assert _credits(rt) == (3, 0)  # they may still run: kept
        first._written = [[{"y": np.array([10.0], dtype=np.float32)}]]
        (watchdog,) = manual_watchdog.made
        watchdog.advance(3600.0)  # past a's batch deadline
        await trio.testing.wait_all_tasks_blocked()
        assert (batcher.stragglers, batcher.workers_lost) == (0, 1)  # no straggler
    assert answers == {1.0: [10.0]}  # what it wrote, read from its pipe
    assert a.reply.run is not None
    assert not a.reply.suspect
    assert (b.reply.ran, b.reply.suspect, b.reply.attempts) == (True, False, 0)
    assert not c.reply.ran
    ran_again = [it["x"][0] for w in worker_class.made[1:] for batch in w.sent for it in batch]
    assert ran_again == []  # a ran once; b's and c's callers are gone
    assert _credits(rt) == (2, 1)  # a and b ran; c never did: refunded
    assert _RecordingBreaker.told == ["success"]


@pytest.mark.parametrize("written", [True, False])
async def test_a_straggler_is_counted_and_logged_only_when_its_result_did_not_come(
    autojump_clock, manual_watchdog, worker_class, caplog, written
):
    """Its batch's deadline passed and its worker was killed. Had the worker written
    that batch's result as the deadline passed (in its pipe, unread), the batch was
    answered: no straggler is counted (the batcher's ``stragglers``, the model's
    ``straggler`` outcome), and the log says it was killed as it wrote that result;
    it used to count a straggler and log that it "ran past its batch deadline".
    Without the result, it is a straggler, as before. The worker's loss is counted
    either way."""
    cfg = _config()

    async def caller(rt) -> None:
        with trio.move_on_after(7200.0):
            await rt.infer("m", item(1.0))

    with caplog.at_level("WARNING", logger="trioserve"):
        async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
            (first,) = worker_class.made
            first.seen_by = "nobody"  # its end is found by the deadline
            nursery.start_soon(caller, rt)
            await trio.testing.wait_all_tasks_blocked()
            if written:
                first._written = [[{"y": np.array([10.0], dtype=np.float32)}]]
            (watchdog,) = manual_watchdog.made
            watchdog.advance(3600.0)  # past the batch deadline
            await trio.testing.wait_all_tasks_blocked()
            batcher = rt.models["m"].batchers[0]
            stats = rt.statistics()["m"]["statuses"]
            nursery.cancel_scope.cancel()
    assert (batcher.stragglers, stats.get("straggler", 0)) == ((0, 0) if written else (1, 1))
    assert (batcher.workers_lost, stats["worker_lost"]) == (1, 1)
    (line,) = [r.getMessage() for r in caplog.records if "worker process" in r.getMessage()]
    if written:
        assert line == (
            "batcher[m#0@cpu]: worker process killed as its batch deadline passed, just "
            "as it wrote that batch's result (answered, not run again); a new one is "
            "started"
        )
    else:
        assert re.fullmatch(
            r"batcher\[m#0@cpu\]: worker process lost: it ran past its batch deadline "
            r"of \d+\.\d{3}s; a new one is started", line,
        )


async def test_an_unread_result_s_run_is_measured_from_its_sending(
    autojump_clock, manual_watchdog, worker_class
):
    """A dead worker's result read from its pipe is measured as one read in time:
    from the batch's sending to its answer, on trio's clock (its reply's ``run``,
    the batch execution histogram, the replica's busy time). It used to be taken to
    have started ``now`` less the seconds the worker measured on its own clock: a
    start the batch never had (here 0.25 s before the death, where it was sent 2 s
    before)."""
    cfg = _config()
    answers: dict[float, object] = {}

    async def caller(rt, value: float) -> None:
        answers[value] = (await rt.infer("m", item(value)))["y"].tolist()

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        (first,) = worker_class.made
        first.ran_for = 0.25
        nursery.start_soon(caller, rt, 1.0)
        await trio.testing.wait_all_tasks_blocked()
        batcher = rt.models["m"].batchers[0]
        ((a,),) = batcher._in_flight
        (sent,) = first.sent_at
        execs = batcher._metrics.batch_exec
        execs.fold()
        before = (execs.total_us, batcher.busy_time)
        await trio.sleep(2.0)
        died = trio.current_time()
        first.die(written=[[{"y": np.array([10.0], dtype=np.float32)}]])
        await trio.testing.wait_all_tasks_blocked()
        assert batcher.workers_lost == 1
        execs.fold()
        assert execs.total_us - before[0] == int((died - sent) * 1e6)
        assert batcher.busy_time - before[1] == pytest.approx(died - sent)
    assert answers == {1.0: [10.0]}
    assert died - sent >= 2.0
    assert a.reply.run == (sent, pytest.approx(died - sent))


class _UnreadProcess(WorkerProcess):
    """A worker process that records the batches sent to it; the first one made is
    never asked for a result (its parent is slow to read): its death is found by the
    watch on its exit, with what it wrote still in its pipe."""

    made: list[_UnreadProcess] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[list[float]] = []
        _UnreadProcess.made.append(self)

    async def submit(self, items) -> None:
        self.sent.append([key(it) for it in items])
        await super().submit(items)

    async def result(self):
        if self is _UnreadProcess.made[0]:
            await trio.sleep_forever()
        return await super().result()


async def test_a_dead_worker_process_s_unread_result_is_read_from_its_pipe(monkeypatch):
    """A real worker process runs a, writes its result, and exits in b
    (``crash_on_666``) before its parent read a's result. a's caller gets it, read
    from the dead worker's pipe, and a runs nowhere else; b, the suspect, crashes
    the next workers until it is poison. a used to run again on the next worker."""
    import trioserve.actors._batcher

    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))  # crash_on_666's
    _UnreadProcess.made = []
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _UnreadProcess)
    cfg = config(callable_model(
        "m", crash_on_666, execution="process", max_batch_size=1, max_wait_ms=0,
        timeout_ms=None,
    ))
    answers: dict[float, object] = {}

    async def caller(rt, value: float) -> None:
        try:
            answers[value] = (await rt.infer("m", item(value)))["y"].tolist()
        except ModelError as exc:
            answers[value] = exc

    async with trioserve.open_runtime(cfg) as rt:
        batcher = rt.models["m"].batchers[0]
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller, rt, 1.0)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(caller, rt, 666.0)
    assert answers[1.0] == [1.0]
    assert isinstance(answers[666.0], ModelError)
    assert "poison request" in str(answers[666.0])
    first, *later = _UnreadProcess.made
    assert first.sent == [[1.0], [666.0]]
    assert all(batch == [666.0] for w in later for batch in w.sent)  # a ran once
    assert batcher.workers_lost >= 2


@pytest.mark.parametrize("its_caller", ["stays", "left"])
async def test_a_batch_a_cut_off_straggler_never_read_is_not_charged(
    autojump_clock, manual_watchdog, worker_class, its_caller
):
    """As above, a's worker wrote its result as a's deadline passed and was killed;
    but its pipe says it never read b (nor c) whole (``never_read``: their
    messages were still in it as the kill was sent). b never ran: it goes back as
    it was, not charged, not a suspect, and runs on the next worker; refunded when
    its caller left. It used to be charged as the batch the worker had just begun."""
    cfg = _config()
    answers: dict[float, object] = {}
    scope = trio.CancelScope()

    async def caller(rt, value: float) -> None:
        with scope if value == 2.0 else trio.CancelScope():
            answers[value] = (await rt.infer("m", item(value)))["y"].tolist()

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        (first,) = worker_class.made
        first.seen_by = "nobody"  # its end is found by the deadline
        for value in (1.0, 2.0, 3.0):
            nursery.start_soon(caller, rt, value)
            await trio.testing.wait_all_tasks_blocked()
        batcher = rt.models["m"].batchers[0]
        ((a,), (b,), _) = batcher._in_flight
        if its_caller == "left":
            scope.cancel("the caller left")
            await trio.testing.wait_all_tasks_blocked()
        first._written = [[{"y": np.array([10.0], dtype=np.float32)}]]
        first.never_read = 2  # b and c, as its pipe says
        (watchdog,) = manual_watchdog.made
        watchdog.advance(3600.0)  # past a's batch deadline
        await trio.testing.wait_all_tasks_blocked()
        assert (batcher.stragglers, batcher.workers_lost) == (0, 1)
    assert a.reply.run is not None
    assert (b.reply.suspect, b.reply.attempts) == (False, 0)
    ran_again = [it["x"][0] for w in worker_class.made[1:] for batch in w.sent for it in batch]
    if its_caller == "stays":
        assert answers == {1.0: [10.0], 2.0: [2.0], 3.0: [3.0]}
        assert ran_again == [2.0, 3.0]
        assert _credits(rt) == (3, 0)
    else:
        assert not b.reply.ran
        assert answers == {1.0: [10.0], 3.0: [3.0]}
        assert ran_again == [3.0]
        assert _credits(rt) == (2, 1)  # b never ran: refunded
    assert _RecordingBreaker.told[0] == "success"
    assert "failure" not in _RecordingBreaker.told
