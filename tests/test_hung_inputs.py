"""The inputs that hung a thread replica, remembered (docs/faults.md, "An input that
hung a thread, sent again").

A request's record of the hang (``Reply.hung``) used to be all: the same input sent
again by its client (a new request), or a hedge copy of it, was fresh work, and could
take the model's last ready thread replica. Now each queue of a model that has thread
replicas remembers, once one of its calls hung, the inputs of the batch that hung,
while that call runs: a request with one of them runs only where a replica can be
spared, or is answered poison at once.
"""

from __future__ import annotations

import collections
import sys

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import config, item
from test_thread_hang import (
    HANG,
    SERVED_WITHIN,
    Hangs,
    Replica,
    hanging_model,
    healths,
    scheduler_of,
    values,
)
from trioserve import ModelError, Reply, Request
from trioserve.actors import BatchLimits, FairQueue, _hung_inputs
from trioserve.actors._hung_inputs import HungInputs, digest
from trioserve.actors._straggler import Hang, mark_hung, split_failed, to_retry


# ---------------------------------------------------------------- the memory
def test_equal_inputs_match_whatever_their_arrays_and_others_do_not():
    memory = HungInputs()
    hang = Hang()
    memory.note(item(1.0), hang)
    assert memory.match(item(1.0)) is hang  # another array, the same values
    assert memory.match({"x": np.array([1.0], dtype=np.float64)}) is None  # another dtype
    assert memory.match(item(2.0)) is None
    assert len(memory) == 1


def test_it_holds_at_most_its_size_and_forgets_the_least_recently_seen():
    memory = HungInputs(size=3)
    hang = Hang()
    for v in (1.0, 2.0, 3.0):
        memory.note(item(v), hang)
    assert memory.match(item(1.0)) is hang  # seen again: the most recent now
    memory.note(item(4.0), hang)
    assert len(memory) == 3
    assert memory.match(item(2.0)) is None  # the least recently seen went
    assert all(memory.match(item(v)) is hang for v in (1.0, 3.0, 4.0))


def test_an_input_is_forgotten_once_it_ran_in_time_or_its_call_returned():
    memory = HungInputs()
    first, second = Hang(), Hang()
    memory.note(item(1.0), first)
    memory.note(item(2.0), second)
    memory.forget(item(1.0))
    assert memory.match(item(1.0)) is None
    second.returned = True
    assert memory.match(item(2.0)) is None  # its call returned: forgotten
    assert len(memory) == 0
    memory.note(item(3.0), first)
    memory.note(item(4.0), second)
    memory.drop_returned()
    assert len(memory) == 1


def test_an_input_answered_poison_alone_is_marked_while_it_is_remembered():
    memory = HungInputs()
    hang = Hang()
    assert not memory.poisoned(item(1.0))  # not remembered: nothing to mark
    memory.note(item(1.0), hang)
    memory.note(item(2.0), hang)
    assert not memory.any_poisoned()
    assert memory.poisoned(item(1.0))
    assert memory.any_poisoned()
    assert memory.was_poisoned(item(1.0))
    assert not memory.was_poisoned(item(2.0))
    memory.forget(item(1.0))  # forgotten: so is the mark
    assert not memory.was_poisoned(item(1.0))
    assert memory.poisoned(item(2.0))
    hang.returned = True
    memory.drop_returned()
    assert not memory.any_poisoned()


def test_an_input_it_cannot_digest_is_not_remembered():
    memory = HungInputs()
    odd = {"x": object()}
    assert digest(odd) is None
    memory.note(odd, Hang())
    assert len(memory) == 0
    assert memory.match(odd) is None


def test_an_input_nested_past_the_recursion_limit_is_not_remembered():
    # A backend's own prepare may give an item nested deeper than the v2 readers'
    # 99 levels; digesting it must not raise out of the queue's submit.
    deep: list = []
    for _ in range(sys.getrecursionlimit() + 10):
        deep = [deep]
    memory = HungInputs()
    assert digest({"x": deep}) is None
    memory.note({"x": deep}, Hang())
    assert len(memory) == 0


# ---------------------------------------------------------------- the queue's rule
def request(v: float) -> Request:
    return Request(model="m", item=item(v), reply=Reply())


class Metrics:
    """What the queue counts in its model's metrics."""

    def __init__(self) -> None:
        self.statuses: collections.Counter = collections.Counter()


def with_metrics(scheduler):
    scheduler.metrics = Metrics()
    return scheduler


def hung_in(scheduler, *vs: float) -> Hang:
    """A batch of ``vs`` hung a thread of ``scheduler``'s replicas: its call runs."""
    hang = Hang()
    batch = [request(v) for v in vs]
    for r in batch:
        r.reply.dispatch()
    scheduler.note_hang(batch, hang)
    return hang


async def test_a_queue_whose_replicas_never_hung_digests_nothing(autojump_clock, monkeypatch):
    calls = []
    monkeypatch.setattr(_hung_inputs, "digest", lambda it: calls.append(it))
    scheduler = scheduler_of(Replica(), Replica())
    scheduler.submit_nowait(request(1.0))
    assert len(await scheduler.pull(scheduler.batchers[0])) == 1
    assert scheduler.hung_inputs is None
    assert not calls


async def test_a_lone_replica_remembers_nothing(autojump_clock):
    scheduler = scheduler_of(Replica())
    hung_in(scheduler, HANG)
    assert scheduler.hung_inputs is None


async def test_the_input_sent_again_with_no_replica_to_spare_is_poison_at_once(autojump_clock):
    hung_replica, last = Replica(ready=False), Replica()
    scheduler = with_metrics(scheduler_of(hung_replica, last))
    hung_in(scheduler, HANG, 1.0)
    again = request(HANG)
    with pytest.raises(ModelError) as info:
        scheduler.submit_nowait(again)
    assert "poison request" in str(info.value)
    assert "this input hung the model's worker thread earlier" in str(info.value)
    assert info.value.in_queue  # never ran: not charged
    assert scheduler.queue_depth() == 0
    assert scheduler.metrics.statuses["poison"] == 1
    scheduler.submit_nowait(request(2.0))  # another input is fresh work
    assert [r.item["x"][0] for r in await scheduler.pull(last)] == [2.0]


async def test_the_input_sent_again_runs_alone_where_a_replica_can_be_spared(autojump_clock):
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = scheduler_of(hung_replica, b, c)
    hang = hung_in(scheduler, HANG)
    again = request(HANG)
    scheduler.submit_nowait(request(1.0))
    scheduler.submit_nowait(again)
    scheduler.submit_nowait(request(2.0))
    assert again.reply.hung == (hang,)
    # the fresh batch goes without it; it waits apart, for a replica to spare
    assert [r.item["x"][0] for r in await scheduler.pull(b)] == [1.0, 2.0]
    assert scheduler.queue_depth() == 1
    assert await scheduler.pull(c) == [again]  # alone, b to spare
    assert c.risking
    assert again.reply.suspect  # a failure of its run is its input's doing
    # it ran to completion in time: not a hanging input after all
    again.reply.set_result({"y": 0})
    scheduler.completed([again])
    assert scheduler.hung_inputs.match(item(HANG)) is None
    fresh = request(HANG)
    scheduler.submit_nowait(fresh)
    assert fresh.reply.hung is None


async def test_the_input_sent_again_waits_apart_while_the_spare_runs_such_a_part(
    autojump_clock,
):
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = scheduler_of(hung_replica, b, c)
    hung_in(scheduler, HANG)
    again = request(HANG)
    scheduler.submit_nowait(again)
    c.risking = True  # c runs a part that may hang: b is not to be put at risk too
    got: list = []

    async def pull() -> None:
        got.append(await scheduler.pull(b))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull)
        await trio.testing.wait_all_tasks_blocked()
        assert not got
        assert scheduler.queue_depth() == 1
        c.risking = False
        scheduler.thread_returned()  # (a look)
    assert got == [[again]]


async def test_the_input_is_forgotten_once_the_call_it_hung_returns(autojump_clock):
    hung_replica, last = Replica(ready=False), Replica()
    scheduler = scheduler_of(hung_replica, last)
    hang = hung_in(scheduler, HANG)
    hang.returned = True
    hung_replica.ready = True
    scheduler.thread_returned()
    assert len(scheduler.hung_inputs) == 0
    again = request(HANG)
    scheduler.submit_nowait(again)  # no longer remembered: ordinary fresh work
    assert again.reply.hung is None
    assert await scheduler.pull(last) == [again]


async def test_a_hedge_copy_of_the_input_is_not_queued(autojump_clock):
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = scheduler_of(hung_replica, b, c)
    hung_in(scheduler, HANG)
    original = request(HANG)
    original.reply.dispatch()
    copy = request(HANG)
    assert not scheduler.submit_copy_nowait(original, copy)
    assert scheduler.queue_depth() == 0
    assert not scheduler.twins


async def test_a_queued_hedge_copy_is_held_apart_once_its_original_hangs(autojump_clock):
    hung_replica, b, c = Replica(), Replica(), Replica()
    scheduler = scheduler_of(hung_replica, b, c)
    original = request(HANG)
    original.reply.dispatch()  # running on hung_replica
    copy = request(HANG)
    assert scheduler.submit_copy_nowait(original, copy)
    hang = Hang()
    scheduler.note_hang([original], hang)  # its batch hangs there
    hung_replica.ready = False
    assert copy.reply.hung == (hang,)
    scheduler.submit_nowait(request(1.0))
    assert [r.item["x"][0] for r in await scheduler.pull(b)] == [1.0]
    assert await scheduler.pull(c) == [copy]  # alone, b to spare
    assert c.risking


async def test_a_calls_item_with_the_input_is_poison_when_it_is_pulled_with_none_to_spare(
    autojump_clock,
):
    hung_replica, last = Replica(ready=False), Replica()
    scheduler = with_metrics(scheduler_of(hung_replica, last))
    scheduler.policy = FairQueue(BatchLimits(max_size=4), bound=16, adaptive=False)
    hung_in(scheduler, HANG)
    call = [request(1.0), request(HANG), request(2.0)]
    scheduler.submit_all_nowait(call)  # a call's items are queued all or none
    batch = await scheduler.pull(last)
    assert [r.item["x"][0] for r in batch] == [1.0, 2.0]
    with pytest.raises(ModelError, match="hung the model's worker thread earlier"):
        await call[1].reply.wait()
    assert scheduler.queue_depth() == 0
    assert scheduler.metrics.statuses["poison"] == 1
    assert scheduler.policy.in_service == 2  # its cost left the devices
    for r in batch:
        r.reply.set_result({"y": 0})
    scheduler.completed(batch)
    assert scheduler.policy.in_service == 0


# ---------------------------------------------------------------- through the runtime
async def test_the_input_sent_again_is_poison_at_once_and_the_other_replica_serves(
    monkeypatch, manual_watchdog,
):
    """Two thread replicas; one request hangs its call, and is poison after its run
    alone. Its client sends it again: the new request used to run on the last ready
    replica, hang it too, and the model served nobody until a hung call returned.
    Now it is answered poison at once, without running, and the other replica
    serves what comes."""
    model = Hangs(cut=1)
    try:
        async with trioserve.open_runtime(config(hanging_model(model))) as rt:
            scheduler = rt.models["m"].scheduler
            returned = trio.Event()
            thread_returned = scheduler.thread_returned

            def note_return() -> None:
                thread_returned()
                returned.set()

            monkeypatch.setattr(scheduler, "thread_returned", note_return)
            with trio.fail_after(SERVED_WITHIN):
                with pytest.raises(ModelError, match="poison request, not retried"):
                    await rt.infer("m", item(HANG))
            assert healths(rt) == ["degraded", "ready"]
            for _ in range(3):
                with trio.fail_after(SERVED_WITHIN):
                    with pytest.raises(ModelError) as info:
                        await rt.infer("m", item(HANG))
                assert "this input hung the model's worker thread earlier" in str(info.value)
            assert model.runs_of(HANG) == [1]  # never run again
            assert healths(rt) == ["degraded", "ready"]
            with trio.fail_after(SERVED_WITHIN):
                got = await values(rt, [float(v) for v in range(1, 17)])
            assert got == {float(v): 2.0 * v for v in range(1, 17)}
            stats = rt.statistics()["m"]["statuses"]
            assert stats["straggler"] == 1
            assert stats["poison"] == 4
            model.let_one_return()  # the hung call returns: the input is forgotten
            with trio.fail_after(SERVED_WITHIN):
                await returned.wait()
            assert len(scheduler.hung_inputs) == 0
    finally:
        model.let_all_return()


async def test_the_input_held_apart_is_poison_once_the_replica_running_it_alone_hangs(
    autojump_clock,
):
    # Three replicas, one hung on the input. Sent again twice: the first runs alone
    # on b, c spared; the second waits apart. b hangs on it too: c is the last
    # ready replica, so the second is answered poison then, not at its deadline.
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(hung_replica, b, c))
    hung_in(scheduler, HANG)
    first, second = request(HANG), request(HANG)
    scheduler.submit_nowait(first)
    scheduler.submit_nowait(second)
    assert await scheduler.pull(b) == [first]  # alone, c to spare
    assert scheduler.queue_depth() == 1
    hang = Hang()
    mark_hung([first], hang)
    scheduler.note_hang([first], hang, b, "its batch ran past its deadline of 0.100s")
    scheduler.after_hang(hang, b)
    with pytest.raises(ModelError, match="this input hung the model's worker thread") as info:
        await second.reply.wait()
    assert info.value.in_queue  # never ran: not charged
    assert scheduler.queue_depth() == 0
    assert scheduler.metrics.statuses["poison"] == 1


async def test_a_retried_part_with_the_input_found_poison_alone_is_answered_poison_at_once(
    autojump_clock,
):
    # A hung batch held the same input twice (A1, A2). Once the hung call returned,
    # A1 ran alone on a (b spared), hung it and was answered poison. A2's part used
    # to wait for a replica to spare until its deadline (504, charged); now it is
    # answered poison at once, and the innocent x still waits for a spare replica.
    a, b = Replica(), Replica()
    scheduler = with_metrics(scheduler_of(a, b))
    a1, a2, x = (
        Request(model="m", item=item(v), reply=Reply(), deadline=10.0) for v in (HANG, HANG, 1.0)
    )
    for r in (a1, a2, x):
        scheduler.submit_nowait(r)
    batch = await scheduler.pull(a)
    assert batch == [a1, a2, x]
    why = "its batch ran past its deadline of 0.100s"

    def hangs(batch: list[Request], *, last: bool) -> Hang:
        """``batch`` hangs ``a``'s thread, handed back as its batcher does."""
        hang = Hang()
        a.ready = False  # degraded while its thread runs
        mark_hung(batch, hang)
        scheduler.note_hang(batch, hang, a, why)
        scheduler.completed(batch, failed=True)
        retry, poison = split_failed(
            to_retry(batch), poison_attempts=1 if last else 2, parts=8
        )
        for r in poison:
            r.reply.set_error(ModelError(f"poison request, not retried: {why}"))
        if poison:
            scheduler.poisoned_alone(poison)
        scheduler.retry(retry)
        scheduler.after_hang(hang, a)
        return hang

    first = hangs(batch, last=False)
    assert scheduler.queue_depth() == 3  # three parts, waiting for a to return
    first.returned, a.ready = True, True
    scheduler.thread_returned()
    assert await scheduler.pull(a) == [a1]  # alone, b spared
    got: list = []
    done = trio.Event()

    async def pull_b() -> None:
        got.append(await scheduler.pull(b))
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull_b)
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # b is the spared one: it takes no part
        start = trio.current_time()
        hangs([a1], last=True)  # b is the last ready replica: a1 is poison
        with pytest.raises(ModelError, match="poison request, not retried"):
            await a1.reply.wait()
        assert not a2.reply.answerable  # answered then, not held to its deadline
        with pytest.raises(ModelError) as info:
            await a2.reply.wait()
        assert trio.current_time() == start  # at once, not at its deadline
        assert "the same input was found poison when run alone" in str(info.value)
        assert not info.value.in_queue  # it ran in the hung batch: charged
        assert scheduler.metrics.statuses["poison"] == 1
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # x's part still waits for a replica to spare
        assert scheduler.queue_depth() == 1
        scheduler.submit_nowait(request(2.0))  # b serves new work meanwhile
        await done.wait()
    assert [[r.item["x"][0] for r in b] for b in got] == [[2.0]]
    assert x.reply.answerable


# ---------------------------------------------------------------- replicas that change otherwise
async def held_apart(scheduler, puller, got: list, nursery) -> Request:
    """The input sent again, pulled by ``puller`` and held apart (no replica to
    spare): ``puller`` waits in its pull, which appends what it gets to ``got``."""
    again = request(HANG)
    scheduler.submit_nowait(again)

    async def pull() -> None:
        got.append(await scheduler.pull(puller))

    nursery.start_soon(pull)
    await trio.testing.wait_all_tasks_blocked()
    assert not got
    assert scheduler.queue_depth() == 1  # held apart
    return again


async def test_a_held_input_runs_once_a_replica_is_added_to_spare(autojump_clock):
    # c runs a part that may hang, so b is not to be put at risk: the input waits.
    # A replica added (the autoscaler's) is one to spare: b runs it now, not at
    # the input's deadline.
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = scheduler_of(hung_replica, b, c)
    hung_in(scheduler, HANG)
    c.risking = True
    got: list = []
    async with trio.open_nursery() as nursery:
        again = await held_apart(scheduler, b, got, nursery)
        began = trio.current_time()
        scheduler.batchers.append(Replica())
        scheduler.replicas += 1
        scheduler.replicas_changed()
        await trio.testing.wait_all_tasks_blocked()
        assert got == [[again]]
        assert trio.current_time() == began
    assert b.risking


@pytest.mark.parametrize("why", ["breaker opened", "retired", "device lost"])
async def test_a_held_input_is_poison_at_once_when_too_few_replicas_are_left(
    autojump_clock, why,
):
    # The other replica stops being ready (whatever the reason): one ready replica
    # is left, so the held input is what a new request with it is, poison, never
    # run, now rather than at its deadline.
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(hung_replica, b, c))
    hung_in(scheduler, HANG)
    c.risking = True
    got: list = []
    async with trio.open_nursery() as nursery:
        again = await held_apart(scheduler, b, got, nursery)
        began = trio.current_time()
        c.ready = False
        scheduler.replicas_changed()
        with pytest.raises(ModelError, match="this input hung the model's worker") as info:
            await again.reply.wait()
        assert trio.current_time() == began
        assert info.value.in_queue  # never ran: not charged
        assert scheduler.queue_depth() == 0
        assert scheduler.metrics.statuses["poison"] == 1
        scheduler.submit_nowait(request(1.0))  # b serves on
        await trio.testing.wait_all_tasks_blocked()
        assert [[r.item["x"][0] for r in batch] for batch in got] == [[1.0]]


async def test_a_held_input_whose_call_returned_is_not_poison_when_replicas_change(
    autojump_clock,
):
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(hung_replica, b, c))
    hang = hung_in(scheduler, HANG)
    c.risking = True
    got: list = []
    async with trio.open_nursery() as nursery:
        again = await held_apart(scheduler, b, got, nursery)
        hang.returned = True  # its input is known to end: no longer poison
        c.ready = False
        scheduler.replicas_changed()
        await trio.testing.wait_all_tasks_blocked()
        assert again.reply.answerable
        assert scheduler.queue_depth() == 1  # still waits for a replica to spare
        c.ready, c.risking = True, False
        scheduler.replicas_changed()
        await trio.testing.wait_all_tasks_blocked()
        assert got == [[again]]
    assert scheduler.metrics.statuses["poison"] == 0


@pytest.mark.parametrize("change", ["replicas changed", "another thread hung"])
async def test_a_drain_returns_once_what_was_held_apart_is_answered_poison(
    autojump_clock, change,
):
    # A drain (an unload or a reload waiting for the queue to empty) waits for the
    # input held apart. The change of replicas (or a hang) that answers it poison
    # used to leave the drain parked until something else woke it (a batch taken
    # or completed); it wakes the drain itself now.
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(hung_replica, b, c))
    hung_in(scheduler, HANG)
    c.risking = True
    got: list = []
    drained = trio.Event()

    async def drain() -> None:
        await scheduler.wait_empty()
        drained.set()

    async with trio.open_nursery() as nursery:
        again = await held_apart(scheduler, b, got, nursery)
        nursery.start_soon(drain)
        await trio.testing.wait_all_tasks_blocked()
        assert not drained.is_set()  # it waits for the input held apart
        began = trio.current_time()
        if change == "replicas changed":
            c.ready = False
            scheduler.replicas_changed()
        else:
            scheduler.after_hang(Hang(), c)  # c hung (on another input)
        await trio.testing.wait_all_tasks_blocked()
        assert not again.reply.answerable  # answered poison
        assert scheduler.queue_depth() == 0
        assert drained.is_set()
        assert trio.current_time() == began
        assert got == []  # b still waits for work
        nursery.cancel_scope.cancel("the test is over")


class Counted(Replica):
    """A replica that counts the looks at its readiness."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    @property
    def ready(self) -> bool:
        self.looks += 1
        return True

    @ready.setter
    def ready(self, value: bool) -> None:
        pass


async def test_a_change_of_replicas_costs_nothing_when_nothing_is_held(autojump_clock):
    a, b = Counted(), Counted()
    scheduler = scheduler_of(a, b)
    hung_in(scheduler, HANG)
    scheduler.replicas_changed()
    assert a.looks == b.looks == 0
