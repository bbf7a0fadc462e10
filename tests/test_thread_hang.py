"""An input that hangs its model call in a worker thread, with several thread replicas.

A thread cannot be stopped: a replica whose batch ran past its deadline is degraded
until its thread returns. The retried part holding the hanging input used to be
pulled by the next thread replica, to hang there too, until every replica of the
model was degraded and innocent traffic waited for the hung calls (possibly for
ever). Now such a part runs on a thread replica only while another replica is
ready to serve meanwhile, and an input that hung a thread alone is poison at once
when running it again could take the model's last ready replica (docs/faults.md,
"A hanging input and the last thread replica").

The batch deadline is kept on wall time, the watchdog's: the runtime tests keep it on
the :class:`ManualWatchdog` (the ``manual_watchdog`` fixture) and a hanging call moves
that clock past its deadline of 100 ms from its thread (``Hangs``), so its batch is cut
off while it hangs and no innocent batch is: a real deadline kept by the watchdog
thread can cut off a trivial call on a loaded machine. They release every hanging
call at their end.
"""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import GATE_LIMIT_S, ManualWatchdog, callable_model, config, item, key
from trioserve import DeadlineExceeded, ModelError, Reply, Request
from trioserve.actors import BatchLimits, FifoQueue, SchedulerActor
from trioserve.actors._straggler import Hang

HANG = 99.0
HANG2 = 98.0  # a second input that hangs
DEADLINE_MS = 100.0
#: what innocent traffic may take, a few batch deadlines on a loaded machine; it
#: waited for the hung calls before (here: for ever, until the test released them)
SERVED_WITHIN = 5.0


class Hangs:
    """A thread model doubling ``x``; a batch holding ``HANG`` (or another of
    ``hanging``) blocks until the test lets one such call return
    (``let_one_return``), as a model stuck on an input would. With ``cut`` (n), a
    call that hangs while n or more do (itself included) first moves the runtime's
    :class:`ManualWatchdog` (the ``manual_watchdog`` fixture) by ``DEADLINE_MS``,
    from its thread: every batch running then is cut off, before it blocks, and no
    other batch takes any of that clock; with ``cut_after`` too, it first sleeps
    that long on trio's clock (a trio timer due sooner has fired by then). Records
    each batch's keys."""

    def __init__(
        self, hanging: tuple[float, ...] = (HANG,), *, cut: int = 0, cut_after: float = 0.0
    ) -> None:
        self.hanging = frozenset(hanging)
        self.cut = cut  # 0: the clock is not moved (a real watchdog cuts them)
        self.cut_after = cut_after
        self.batches: list[list[float]] = []
        self.hung = 0  # calls blocked now
        self._lock = threading.Lock()
        self._returns = threading.Semaphore(0)

    def __call__(self, items):
        keys = [key(it) for it in items]
        with self._lock:
            self.batches.append(keys)
        if self.hanging.intersection(keys):
            with self._lock:
                self.hung += 1
                hung = self.hung
            if self.cut and hung >= self.cut:
                if self.cut_after:
                    trio.from_thread.run(trio.sleep, self.cut_after)
                # the cut is delivered in the event loop before this blocks
                trio.from_thread.run_sync(ManualWatchdog.made[-1].advance, DEADLINE_MS / 1000)
            try:
                if not self._returns.acquire(timeout=GATE_LIMIT_S):
                    raise RuntimeError("the test never let the call return")
            finally:
                with self._lock:
                    self.hung -= 1
        return [{"y": it["x"] * 2} for it in items]

    def let_one_return(self) -> None:
        self._returns.release()

    def let_all_return(self) -> None:
        self._returns.release(64)

    def runs_of(self, v: float) -> list[int]:
        """The sizes of the batches that held ``v``."""
        return [len(b) for b in self.batches if v in b]


def hanging_model(model: Hangs, **cfg) -> trioserve.ModelConfig:
    """Two thread replicas of ``model`` (unless ``cfg`` says), batches of up to 8
    closing after 5 ms, a batch deadline of ``DEADLINE_MS``."""
    cfg.setdefault("replicas", 2)
    cfg.setdefault("max_batch_size", 8)
    cfg.setdefault("max_wait_ms", 5)
    return callable_model(
        "m", model, execution="thread", batch_timeout_floor_ms=DEADLINE_MS,
        batch_timeout_cap_ms=DEADLINE_MS, **cfg,
    )


async def values(rt, vs: list[float]) -> dict[float, object]:
    """Send a request of each value at once; what each got (a value, or the
    ModelError), by value."""
    got: dict[float, object] = {}

    async def one(v: float) -> None:
        try:
            out = await rt.infer("m", item(v))
        except ModelError as exc:
            got[v] = exc
        else:
            got[v] = float(out["y"][0])

    async with trio.open_nursery() as nursery:
        for v in vs:
            nursery.start_soon(one, v)
    return got


def handed_back(monkeypatch, rt) -> trio.Event:
    """An event set when a replica of ``m`` first hands a batch back (a cut-off)."""
    scheduler = rt.models["m"].scheduler
    event = trio.Event()
    retry = scheduler.retry

    def note_retry(batches) -> None:
        retry(batches)
        event.set()

    monkeypatch.setattr(scheduler, "retry", note_retry)
    return event


def healths(rt) -> list[str]:
    return sorted(b.health for b in rt.models["m"].batchers)


class Answers:
    """What each of several requests sent one by one got (a value, or the error),
    by value, as each answer comes."""

    def __init__(self, rt) -> None:
        self.rt = rt
        self.got: dict[float, object] = {}
        self._came = trio.Event()

    async def send(self, nursery: trio.Nursery, v: float) -> None:
        """Send ``v`` and wait until it is queued (every task blocked): the requests
        sent so reach the queue, and their batch, in the order sent."""
        nursery.start_soon(self._one, v)
        await trio.testing.wait_all_tasks_blocked()

    async def _one(self, v: float) -> None:
        try:
            out = await self.rt.infer("m", item(v))
        except (ModelError, DeadlineExceeded) as exc:
            value: object = exc
        else:
            value = float(out["y"][0])
        assert v not in self.got  # one answer per request
        self.got[v] = value
        self._came.set()

    async def wait_for(self, *vs: float) -> None:
        while not all(v in self.got for v in vs):
            self._came = trio.Event()
            await self._came.wait()


async def test_an_input_that_hangs_alone_is_poison_at_once_and_the_other_replica_serves(
    manual_watchdog,
):
    """Two thread replicas; one request hangs its call for ever. It was retried on
    the other replica, hung it too, and the innocent requests sent after it waited
    for the hung calls (until the test let them return). Now it is poison after its
    first run, alone, and the other replica serves what comes."""
    model = Hangs(cut=1)
    try:
        async with trioserve.open_runtime(config(hanging_model(model))) as rt:
            with trio.fail_after(SERVED_WITHIN):
                with pytest.raises(ModelError) as info:
                    await rt.infer("m", item(HANG))
            assert "poison request, not retried" in str(info.value)
            assert "no other replica can be spared" in str(info.value)
            assert model.runs_of(HANG) == [1]  # run once, not on the second replica
            assert healths(rt) == ["degraded", "ready"]
            assert rt.model_ready("m")
            with trio.fail_after(SERVED_WITHIN):
                got = await values(rt, [float(v) for v in range(1, 17)])
            assert got == {float(v): 2.0 * v for v in range(1, 17)}
            assert model.hung == 1  # answered while the call still hangs
            stats = rt.statistics()["m"]["statuses"]
            assert stats["straggler"] == 1
            assert stats["poison"] == 1
            model.let_all_return()
    finally:
        model.let_all_return()


async def test_a_hung_batchs_parts_wait_for_a_replica_to_spare_and_the_innocents_are_answered(
    monkeypatch, manual_watchdog,
):
    """Two thread replicas; a batch of four holding the hanging input is cut off on
    one. Its parts (any may hang) are not run on the last ready replica, which
    serves the traffic sent after the hang meanwhile. Once the hung call returns
    (here: the test lets it), the parts run one at a time with a replica to spare:
    the input that hangs again, alone, is poison, and the other replica goes on
    serving; the three innocents, held while no replica can be spared (any of them
    may hang too: a batch may hold two such inputs), get their values once that
    second call returns."""
    model = Hangs(cut=1)
    cfg = config(hanging_model(model, max_batch_size=4, max_wait_ms=10_000))
    try:
        async with trioserve.open_runtime(cfg) as rt:
            scheduler = rt.models["m"].scheduler
            cut_off = handed_back(monkeypatch, rt)
            first = Answers(rt)
            async with trio.open_nursery() as nursery:
                for v in (HANG, 1.0, 2.0, 3.0):  # HANG's part is the first to run
                    await first.send(nursery, v)
                with trio.fail_after(SERVED_WITHIN):
                    await cut_off.wait()  # the batch is cut off, its parts held
                assert healths(rt) == ["degraded", "ready"]
                assert scheduler.queue_depth() == 4  # four parts, none run again
                with trio.fail_after(SERVED_WITHIN):
                    got = await values(rt, [float(v) for v in range(11, 19)])  # 2 batches
                assert got == {float(v): 2.0 * v for v in range(11, 19)}
                assert not first.got  # still held: no replica could be spared
                assert model.runs_of(HANG) == [4]
                assert scheduler.queue_depth() == 4
                model.let_one_return()  # the hung call returns: both replicas ready
                with trio.fail_after(SERVED_WITHIN):
                    await first.wait_for(HANG)
                poison = first.got[HANG]
                assert isinstance(poison, ModelError)
                assert "poison request, not retried" in str(poison)
                assert model.runs_of(HANG) == [4, 1]  # its batch, then alone once
                assert healths(rt) == ["degraded", "ready"]
                assert scheduler.queue_depth() == 3
                with trio.fail_after(SERVED_WITHIN):
                    got = await values(rt, [float(v) for v in range(21, 25)])
                assert got == {float(v): 2.0 * v for v in range(21, 25)}
                assert model.hung == 1
                model.let_one_return()  # its second call returns: the innocents run
            assert {v: first.got[v] for v in (1.0, 2.0, 3.0)} == {1.0: 2.0, 2.0: 4.0, 3.0: 6.0}
            assert healths(rt) == ["ready", "ready"]
            stats = rt.statistics()["m"]["statuses"]
            assert stats["straggler"] == 2
            assert stats["poison"] == 1
            assert stats["retried"] == 4
    finally:
        model.let_all_return()


async def test_a_hung_batchs_parts_are_answered_at_their_deadline_if_no_replica_can_be_spared(
    monkeypatch, manual_watchdog,
):
    """As above, but the hung call never returns (within the test): the parts held
    for a replica to spare are answered DeadlineExceeded at the model's timeout
    (charged: they ran), as any retry is, while the other replica serves; nothing
    is lost, and no part ran on the last ready replica."""
    timeout = 0.5
    model = Hangs(cut=1)
    cfg = config(
        hanging_model(model, max_batch_size=2, max_wait_ms=10_000, timeout_ms=timeout * 1000)
    )
    got: dict[float, object] = {}
    try:
        async with trioserve.open_runtime(cfg) as rt:
            cut_off = handed_back(monkeypatch, rt)

            async def one(v: float) -> None:
                with pytest.raises(DeadlineExceeded) as info:
                    await rt.infer("m", item(v))
                got[v] = info.value

            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, HANG)
                nursery.start_soon(one, 1.0)
                with trio.fail_after(SERVED_WITHIN):
                    await cut_off.wait()
                    served = await values(rt, [11.0, 12.0])  # one batch, after the hang
                assert served == {11.0: 22.0, 12.0: 24.0}
            assert trio.current_time() - start < SERVED_WITHIN
            assert model.runs_of(HANG) == [2]
            assert model.runs_of(1.0) == [2]
            assert model.hung == 1
            assert healths(rt) == ["degraded", "ready"]
            assert rt.models["m"].scheduler.queue_depth() == 0
            model.let_all_return()
    finally:
        model.let_all_return()
    assert sorted(got) == [1.0, HANG]
    for error in got.values():
        assert "deadline passed while its batch was being retried" in str(error)
        assert not error.in_queue


async def test_with_three_replicas_a_hanging_input_is_run_alone_twice_and_one_replica_serves(
    manual_watchdog,
):
    """Three thread replicas: where a replica can be spared, an input that hung
    alone is retried as any poison candidate is (``poison_attempts``, 2), then
    poison; the third replica serves the traffic sent after it."""
    model = Hangs(cut=1)
    try:
        async with trioserve.open_runtime(config(hanging_model(model, replicas=3))) as rt:
            with trio.fail_after(SERVED_WITHIN):
                with pytest.raises(ModelError) as info:
                    await rt.infer("m", item(HANG))
            assert "each of the 2 times it ran alone" in str(info.value)
            assert model.runs_of(HANG) == [1, 1]
            assert healths(rt) == ["degraded", "degraded", "ready"]
            with trio.fail_after(SERVED_WITHIN):
                got = await values(rt, [float(v) for v in range(1, 9)])
            assert got == {float(v): 2.0 * v for v in range(1, 9)}
            assert model.hung == 2
            model.let_all_return()
    finally:
        model.let_all_return()


async def test_two_hanging_inputs_in_one_batch_put_one_replica_at_risk_at_a_time(
    monkeypatch, manual_watchdog,
):
    """Two thread replicas; a batch holds two inputs that hang, and two innocents.
    Once the batch's hung call returned, its four parts used to be ordinary retries:
    each replica took one, both hanging inputs ran at once, and both replicas hung
    (the model served nobody). Now a part of a batch that hung runs only where
    another replica can be spared, whether or not that call returned: one replica at
    a time is put at risk, the other serves the traffic sent meanwhile, and each of
    the four is answered once (the innocents once both hanging inputs are found,
    each hung call let return here; else at their deadline)."""
    model = Hangs(hanging=(HANG, HANG2), cut=1)
    cfg = config(hanging_model(model, max_batch_size=4, max_wait_ms=10_000))
    try:
        async with trioserve.open_runtime(cfg) as rt:
            scheduler = rt.models["m"].scheduler
            cut_off = handed_back(monkeypatch, rt)
            answers = Answers(rt)
            async with trio.open_nursery() as nursery:
                for v in (HANG, HANG2, 1.0, 2.0):
                    await answers.send(nursery, v)
                with trio.fail_after(SERVED_WITHIN):
                    await cut_off.wait()  # the batch of four is cut off
                assert healths(rt) == ["degraded", "ready"]
                assert model.runs_of(HANG) == model.runs_of(HANG2) == [4]
                model.let_one_return()  # both replicas ready, four parts to run
                with trio.fail_after(SERVED_WITHIN):
                    await answers.wait_for(HANG)  # run alone on one replica: hangs it
                assert "poison request, not retried" in str(answers.got[HANG])
                assert model.runs_of(HANG) == [4, 1]
                assert model.runs_of(HANG2) == [4]  # not run beside it on the other
                assert model.hung == 1
                assert healths(rt) == ["degraded", "ready"]
                assert scheduler.queue_depth() == 3
                with trio.fail_after(SERVED_WITHIN):
                    got = await values(rt, [float(v) for v in range(11, 19)])
                assert got == {float(v): 2.0 * v for v in range(11, 19)}
                model.let_one_return()  # HANG's call returns: the next part runs
                with trio.fail_after(SERVED_WITHIN):
                    await answers.wait_for(HANG2)
                assert "poison request, not retried" in str(answers.got[HANG2])
                assert model.runs_of(HANG2) == [4, 1]
                assert model.hung == 1
                assert healths(rt) == ["degraded", "ready"]
                assert 1.0 not in answers.got
                assert 2.0 not in answers.got
                with trio.fail_after(SERVED_WITHIN):
                    got = await values(rt, [float(v) for v in range(21, 29)])
                assert got == {float(v): 2.0 * v for v in range(21, 29)}
                model.let_one_return()  # HANG2's call returns: the innocents run
                with trio.fail_after(SERVED_WITHIN):
                    await answers.wait_for(1.0, 2.0)
            assert {v: answers.got[v] for v in (1.0, 2.0)} == {1.0: 2.0, 2.0: 4.0}
            assert model.runs_of(1.0) == model.runs_of(2.0) == [4, 1]
            assert model.hung == 0
            assert scheduler.queue_depth() == 0
            stats = rt.statistics()["m"]["statuses"]
            assert stats["straggler"] == 3
            assert stats["poison"] == 2
            assert stats["retried"] == 4
    finally:
        model.let_all_return()


# ---------------------------------------------------------------- the scheduler's rule
class Replica:
    """What the scheduler reads of a replica pulling from it."""

    def __init__(self, *, ready: bool = True) -> None:
        self.ready = ready
        self.risking = False

    def holds(self, reply) -> bool:
        return False


def scheduler_of(*replicas: Replica) -> SchedulerActor:
    scheduler = SchedulerActor("m", FifoQueue(BatchLimits(max_size=4), bound=16))
    scheduler.batchers = list(replicas)
    scheduler.replicas = len(replicas)
    return scheduler


def hung_part(hang: Hang, v: float) -> list[Request]:
    """A part of a batch cut off in a worker thread (``hang``), handed back."""
    req = Request(model="m", item=v, reply=Reply())
    req.reply.dispatch()
    req.reply.suspect = req.reply.ran = True
    req.reply.hung = (hang,)
    return [req]


def fresh(scheduler: SchedulerActor, v: float) -> None:
    scheduler.submit_nowait(Request(model="m", item=v, reply=Reply()))


async def test_a_part_that_may_hang_goes_to_a_replica_only_while_another_can_be_spared(
    autojump_clock,
):
    hung_replica, last, third = Replica(ready=False), Replica(), Replica(ready=False)
    scheduler = scheduler_of(hung_replica, last, third)
    hang = Hang()
    scheduler.retry([hung_part(hang, 99.0)])
    fresh(scheduler, 1.0)
    # the last ready replica takes the new work, not the part (retries come first
    # otherwise); the part stays held
    assert [r.item for r in await scheduler.pull(last)] == [1.0]
    assert scheduler.queue_depth() == 1
    got: list = []

    async def pull() -> None:
        got.append(await scheduler.pull(last))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull)
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # nothing else to do: it still waits, for a replica to spare
        third.ready = third.risking = True  # ready, but running such a part itself
        scheduler.thread_returned()  # (a look: nothing changed for it)
        await trio.testing.wait_all_tasks_blocked()
        assert not got
        third.risking = False  # a replica to spare: the last one may run the part
        scheduler.thread_returned()
    assert [[r.item for r in b] for b in got] == [[99.0]]


async def test_a_part_waits_for_a_replica_to_spare_even_once_the_thread_it_hung_returns(
    autojump_clock,
):
    # The call that hung returned, but its replica's breaker keeps it from pulling:
    # the part (which may hang too) is not run on the last ready replica. It used to
    # be an ordinary retry then: two hanging inputs of one batch hung two replicas.
    hung_replica, last = Replica(ready=False), Replica()
    scheduler = scheduler_of(hung_replica, last)
    hang = Hang()
    scheduler.retry([hung_part(hang, 99.0)])
    got: list = []

    async def pull() -> None:
        got.append(await scheduler.pull(last))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull)
        await trio.testing.wait_all_tasks_blocked()
        assert not got
        hang.returned = True
        scheduler.thread_returned()
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # still the last ready replica
        hung_replica.ready = True  # a replica to spare
        scheduler.thread_returned()
    assert [[r.item for r in b] for b in got] == [[99.0]]
    assert last.risking
    # and a puller that is no replica (None) is never held back
    scheduler.retry([hung_part(Hang(), 98.0)])
    assert [r.item for r in await scheduler.pull()] == [98.0]


async def test_a_lone_replica_runs_a_part_once_the_thread_it_hung_returns(autojump_clock):
    # A lone replica has no other to spare: its part waits for its thread, and is
    # then an ordinary retry (the model is down until it returns anyway).
    only = Replica()
    scheduler = scheduler_of(only)
    hang = Hang()
    scheduler.retry([hung_part(hang, 99.0)])
    got: list = []

    async def pull() -> None:
        got.append(await scheduler.pull(only))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull)
        await trio.testing.wait_all_tasks_blocked()
        assert not got
        hang.returned = True
        scheduler.thread_returned()
    assert [[r.item for r in b] for b in got] == [[99.0]]


async def test_the_parts_of_a_hung_batch_run_one_at_a_time_once_its_thread_returned(
    autojump_clock,
):
    # Both replicas ready again, two parts: one replica takes a part, the other is
    # spared (it takes new work, not the second part) until the first is done.
    a, b = Replica(), Replica()
    scheduler = scheduler_of(a, b)
    hang = Hang()
    hang.returned = True
    scheduler.retry([hung_part(hang, 98.0), hung_part(hang, 99.0)])
    first = await scheduler.pull(a)
    assert [r.item for r in first] == [98.0]
    assert a.risking
    fresh(scheduler, 1.0)
    assert [r.item for r in await scheduler.pull(b)] == [1.0]  # not the part
    assert scheduler.queue_depth() == 1
    a.risking = False  # its part ran in time (the batcher clears it)
    assert [r.item for r in await scheduler.pull(b)] == [99.0]
    assert b.risking


async def test_two_idle_replicas_woken_together_do_not_both_take_a_part_that_may_hang(
    autojump_clock,
):
    # Both wake at the retry; the first to look takes a part, and is running such a
    # part from then on (before its pull returns), so the second is not spared by it.
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = scheduler_of(hung_replica, b, c)
    hang = Hang()
    got: dict[Replica, list] = {}

    async def pull(replica: Replica) -> None:
        got[replica] = await scheduler.pull(replica)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull, b)
        nursery.start_soon(pull, c)
        await trio.testing.wait_all_tasks_blocked()
        scheduler.retry([hung_part(hang, 98.0), hung_part(hang, 99.0)])
        await trio.testing.wait_all_tasks_blocked()
        assert len(got) == 1  # one replica is spared: the other part waits for it
        (taker,) = got
        assert taker.risking
        assert scheduler.queue_depth() == 1
        nursery.cancel_scope.cancel("the test is over")
