"""Requests held apart for their input (it hung a thread replica earlier, and waits to
run alone beside a spared replica) when the model is unloaded, when a replica crashes
and is restarted, and when another thread hangs (docs/faults.md, "An input that hung
a thread, sent again").
"""

from __future__ import annotations

import types

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import config, item
from test_hung_inputs import Counted, held_apart, hung_in, request, with_metrics
from test_thread_hang import (
    HANG,
    SERVED_WITHIN,
    Hangs,
    Replica,
    hanging_model,
    healths,
    scheduler_of,
)
from trioserve import ModelError, UnknownModel
from trioserve._model_copy import _Copy, _drain
from trioserve._model_state import ModelState
from trioserve._not_loaded import not_loaded
from trioserve._served import ServedModel
from trioserve.actors import BatcherActor, BatchLimits, FifoQueue, SchedulerActor
from trioserve.actors._straggler import Hang, mark_hung

UNLOADING = "model 'm' is unloading: it takes no new requests"


def stand_in() -> SchedulerActor:
    """The queue of an unloaded model's stand-in: it refuses every request as the
    model control's does while the model unloads."""
    queue = SchedulerActor("m", FifoQueue(BatchLimits(max_size=4), bound=16))
    queue.retire(not_loaded("m", ModelState.UNLOADING))
    return queue


def served(scheduler: SchedulerActor) -> ServedModel:
    return ServedModel(
        config=types.SimpleNamespace(name="m"), backend=None, scheduler=scheduler,
        batchers=[], metrics=None, limits=None, timeout=60.0,
    )


# ---------------------------------------------------------------- an unload
async def test_an_unload_answers_a_held_input_at_once_and_its_drain_does_not_wait(
    autojump_clock,
):
    # c runs a part that may hang, so b cannot run the input beside a spared replica:
    # it waits apart. The unload's drain used to wait for it to its deadline (or
    # runtime.unload_timeout_s); it is answered what a new request gets now, the
    # unload's refusal, never run (not charged), and the drain ends at once.
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(hung_replica, b, c))
    hung_in(scheduler, HANG)
    c.risking = True
    got: list = []
    async with trio.open_nursery() as nursery:
        again = await held_apart(scheduler, b, got, nursery)
        copy = _Copy(served=served(scheduler))
        copy.retire(served(stand_in()))
        began = trio.current_time()
        with trio.fail_after(1):
            await _drain(copy)
        assert trio.current_time() == began
        with pytest.raises(UnknownModel, match=UNLOADING) as info:
            await again.reply.wait()
        assert info.value.in_queue  # never ran: not charged
        assert scheduler.queue_depth() == 0
        assert scheduler.metrics.statuses["poison"] == 0  # refused, not poison
        nursery.cancel_scope.cancel("test over")
    assert got == []


async def test_an_unloaded_queue_refuses_a_queued_input_it_would_hold(autojump_clock):
    # A request queued before the unload is answered by the copy's replicas; one
    # with a remembered input would be held apart when pulled: it is refused then.
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = scheduler_of(hung_replica, b, c)
    hung_in(scheduler, HANG)
    c.risking = True
    again, other = request(HANG), request(1.0)
    scheduler.submit_nowait(again)
    scheduler.submit_nowait(other)
    scheduler.hand_over(stand_in(), refuse_held=True)
    assert await scheduler.pull(b) == [other]  # served, as any queued request
    with pytest.raises(UnknownModel, match=UNLOADING) as info:
        await again.reply.wait()
    assert info.value.in_queue
    assert scheduler.queue_depth() == 0


async def test_an_unload_answers_a_twin_held_for_its_hung_twin_as_never_run(autojump_clock):
    # A hedge copy still queued when its original's batch hangs is held apart while
    # the original's retry runs; unloaded, it is refused (never run: its caller
    # takes the retry's answer), and the retry is left to the copy's replicas.
    a, b, c = Replica(), Replica(), Replica()
    scheduler = scheduler_of(a, b, c)
    original, copy = request(HANG), request(HANG)
    original.reply.dispatch()
    assert scheduler.submit_copy_nowait(original, copy)
    hang = Hang()
    mark_hung([original], hang)
    scheduler.note_hang([original], hang, a)
    a.ready = False
    scheduler.retry([[original]])
    assert await scheduler.pull(b) == [original]  # the retry, alone, c to spare
    assert b.risking
    got: list = []

    async def pull() -> None:
        got.append(await scheduler.pull(c))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull)
        await trio.testing.wait_all_tasks_blocked()
        assert scheduler.queue_depth() == 1  # the copy, held apart
        scheduler.hand_over(stand_in(), refuse_held=True)
        with pytest.raises(UnknownModel, match=UNLOADING) as info:
            await copy.reply.wait()
        assert info.value.in_queue
        assert original.reply.answerable  # its run goes on
        assert scheduler.queue_depth() == 0
        nursery.cancel_scope.cancel("test over")


async def test_a_reload_hands_nothing_held_to_the_new_copy(autojump_clock):
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = scheduler_of(hung_replica, b, c)
    hung_in(scheduler, HANG)
    c.risking = True
    new_copy = scheduler_of(Replica(), Replica())
    got: list = []
    async with trio.open_nursery() as nursery:
        again = await held_apart(scheduler, b, got, nursery)
        scheduler.hand_over(new_copy)
        await trio.testing.wait_all_tasks_blocked()
        assert again.reply.answerable
        assert scheduler.queue_depth() == 1  # still held here, for this copy's replicas
        assert new_copy.queue_depth() == 0
        c.risking = False
        scheduler.replicas_changed()  # c is spared now: b runs it, here
        await trio.testing.wait_all_tasks_blocked()
    assert got == [[again]]


# ---------------------------------------------------------------- a crashed replica
class Down(trioserve.Actor):
    """An actor that crashes once, and records how it reads in ``on_crash``."""

    def __init__(self, runs: int) -> None:
        super().__init__()
        self.runs = runs
        self.seen: list = []

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        self.runs -= 1
        await trio.lowlevel.checkpoint()
        if self.runs >= 0:
            raise RuntimeError("crash")

    def on_crash(self, exc: BaseException) -> None:
        self.seen.append(self.state)


@pytest.mark.parametrize(
    ("runs", "intensity", "state"),
    [(1, 1, trioserve.ActorState.RESTARTING), (5, 0, trioserve.ActorState.BROKEN)],
)
async def test_an_actor_reads_as_down_when_its_crash_is_handled(
    autojump_clock, runs, intensity, state,
):
    actor = Down(runs)
    try:
        await trioserve.supervise(actor, trioserve.RestartPolicy(intensity=intensity))
    except trioserve.ActorBroken:
        pass
    assert actor.seen == [state]


async def test_a_crashed_thread_replica_re_decides_a_held_input(monkeypatch):
    """Three thread replicas. The input hangs the first; its retry runs alone on a
    second, the third spared; the same input sent again meanwhile waits apart. The
    second replica crashes (its task, not its model call) and is restarted: as it
    goes down one replica is left ready, so the held input is what a new request
    with it is, poison, answered then and never run. It used to be run by the
    restarted replica, whose thread it hung too."""
    model = Hangs()
    gate = trio.Event()
    retry_taken, held, crashed = trio.Event(), trio.Event(), trio.Event()
    original = BatcherActor._execute
    runs_of_hang = []

    async def execute(self, batch):
        if any(float(r.item["x"][0]) == HANG for r in batch):
            runs_of_hang.append(self.index)
            if len(runs_of_hang) == 2:  # the retry, on the second replica
                retry_taken.set()
                await gate.wait()
                crashed.set()
                raise RuntimeError("batcher bug")
        await original(self, batch)

    monkeypatch.setattr(BatcherActor, "_execute", execute)
    try:
        async with trioserve.open_runtime(config(hanging_model(model, replicas=3))) as rt:
            scheduler = rt.models["m"].scheduler
            hold = scheduler._hold

            def note_held(requests) -> None:
                hold(requests)
                if scheduler._apart:
                    held.set()

            monkeypatch.setattr(scheduler, "_hold", note_held)
            answers: dict = {}

            async def ask(name: str) -> None:
                try:
                    answers[name] = await rt.infer("m", item(HANG))
                except trioserve.TrioserveError as exc:
                    answers[name] = exc

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, "first")
                with trio.fail_after(SERVED_WITHIN):
                    await retry_taken.wait()  # it hung once, and its retry runs
                nursery.start_soon(ask, "again")
                with trio.fail_after(SERVED_WITHIN):
                    await held.wait()
                assert scheduler.queue_depth() == 1  # held apart
                gate.set()
                with trio.fail_after(SERVED_WITHIN):
                    await crashed.wait()
            assert isinstance(answers["first"], trioserve.ActorBroken)
            again = answers["again"]
            assert isinstance(again, ModelError)
            assert "this input hung the model's worker thread earlier" in str(again)
            assert again.in_queue  # never ran: not charged
            assert len(runs_of_hang) == 2  # not run again
            assert model.runs_of(HANG) == [1]
            assert sorted(healths(rt)) == ["degraded", "ready", "ready"]
            model.let_all_return()  # before the close, which waits for hung calls
    finally:
        model.let_all_return()


# ---------------------------------------------------------------- another hang
async def test_a_held_input_is_poison_when_another_input_hangs_the_spared_replica(
    autojump_clock,
):
    # The input hung a; it waits apart while c runs a part that may hang. c hangs
    # on another input: b is the last ready replica, so the held input (an earlier
    # hang's) is answered poison then, not at its deadline; b serves on.
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(hung_replica, b, c))
    hung_in(scheduler, HANG)
    c.risking = True
    got: list = []
    async with trio.open_nursery() as nursery:
        again = await held_apart(scheduler, b, got, nursery)
        began = trio.current_time()
        other = request(7.0)
        other.reply.dispatch()
        hang = Hang()
        mark_hung([other], hang)
        scheduler.note_hang([other], hang, c, "its batch ran past its deadline of 0.100s")
        scheduler.after_hang(hang, c)
        with pytest.raises(ModelError, match="this input hung the model's worker") as info:
            await again.reply.wait()
        assert trio.current_time() == began
        assert info.value.in_queue
        assert scheduler.metrics.statuses["poison"] == 1
        assert scheduler.queue_depth() == 0
        scheduler.submit_nowait(request(1.0))  # b serves on
        await trio.testing.wait_all_tasks_blocked()
        assert [[r.item["x"][0] for r in batch] for batch in got] == [[1.0]]


async def test_a_held_input_waits_on_when_another_hang_leaves_two_ready(autojump_clock):
    a, b, c, d = Replica(ready=False), Replica(), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(a, b, c, d))
    hung_in(scheduler, HANG)
    c.risking = d.risking = True
    got: list = []
    async with trio.open_nursery() as nursery:
        again = await held_apart(scheduler, b, got, nursery)
        hang = Hang()
        scheduler.note_hang([request(7.0)], hang, c)
        scheduler.after_hang(hang, c)  # b and d are left ready: it may still run
        await trio.testing.wait_all_tasks_blocked()
        assert again.reply.answerable
        assert scheduler.queue_depth() == 1
        nursery.cancel_scope.cancel("test over")
    assert scheduler.metrics.statuses["poison"] == 0


async def test_a_hang_costs_nothing_more_when_nothing_is_held(autojump_clock):
    a, b, c = Counted(), Counted(), Counted()
    scheduler = scheduler_of(a, b, c)
    hung_in(scheduler, HANG)
    scheduler.after_hang(Hang(), a)
    assert a.looks == b.looks == c.looks == 0
