"""A failed batch's retry held for a replica to spare (its batch hung a worker thread
of a thread replica: docs/faults.md, "A hanging input and the last thread replica")
when the model is unloaded, and a retried part whose input was found poison alone
handed back by a model raise.

A request that ran is never refunded; one that never ran is refunded exactly once.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from test_held_apart import UNLOADING, served, stand_in
from test_hung_inputs import hung_in, request, with_metrics
from test_thread_hang import HANG, Replica, scheduler_of
from trioserve import ActorClosed, ModelError, Request, UnknownModel
from trioserve._model_copy import _Copy, _drain
from trioserve._outcomes import _never_ran, _refund_if_unrun
from trioserve.actors import _hung_inputs
from trioserve.actors._straggler import Hang, mark_hung

UNLOADED_RETRY = (
    "model 'm' was unloaded while this request waited to be run again after its "
    "batch hung the model's worker thread"
)
DEADLINE = 60.0


def ran_retry(scheduler, v: float, hang: Hang) -> Request:
    """A request of a batch that hung a thread (``hang``), handed back to run again:
    it ran (charged whatever comes), and may hang its replica too."""
    req = request(v)
    req = Request(model="m", item=req.item, reply=req.reply, deadline=DEADLINE)
    req.reply.dispatch()
    mark_hung([req], hang)
    req.reply.suspect = req.reply.ran = True
    scheduler.retry([[req]])
    return req


def sent_again(scheduler) -> Request:
    """The input that hung, sent again: queued (two replicas ready), held apart when
    pulled."""
    req = request(HANG)
    req = Request(model="m", item=req.item, reply=req.reply, deadline=DEADLINE)
    scheduler.submit_nowait(req)
    return req


class Refunds:
    """A caller's refunds, as its tenant's credits count them."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


async def test_an_unload_answers_a_ran_retry_waiting_for_a_spare_at_once_charged(
    autojump_clock,
):
    # The first replica hung; c runs a part that may hang, so b is the last replica
    # to spare: the retried part waits, and so does the input sent again (held
    # apart). The unload answered the one held apart at once, never run, but left
    # the retry, which had run, held: the drain waited for it to its deadline
    # (60 s; runtime.unload_timeout_s, 30 s, cut it short first). Now each is
    # answered at once: the retry with the unload's error, charged (it reached the
    # model), the input sent again with the refusal, refunded once.
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(hung_replica, b, c))
    hang = hung_in(scheduler, HANG, 1.0, 2.0)
    c.risking = True
    waiting = ran_retry(scheduler, 1.0, hang)
    left = ran_retry(scheduler, 2.0, hang)  # its caller leaves: it ran all the same
    again = sent_again(scheduler)
    again_left = sent_again(scheduler)  # its caller leaves once it is held apart
    got: list = []

    async def pull() -> None:
        got.append(await scheduler.pull(b))

    left_refunds, again_left_refunds = Refunds(), Refunds()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull)
        await trio.testing.wait_all_tasks_blocked()
        assert not got
        assert scheduler.queue_depth() == 4  # two retries, two held apart
        left.reply.withdraw()
        _refund_if_unrun([left.reply], left_refunds)
        again_left.reply.withdraw()
        _refund_if_unrun([again_left.reply], again_left_refunds)
        copy = _Copy(served=served(scheduler))
        copy.retire(served(stand_in()))
        began = trio.current_time()
        with trio.fail_after(1):
            await _drain(copy)
        assert trio.current_time() == began  # not at the retry's deadline
        with pytest.raises(ActorClosed, match=UNLOADED_RETRY) as ran:
            await waiting.reply.wait()
        assert not ran.value.in_queue  # it ran: charged
        assert not _never_ran(ran.value)  # its caller is not refunded
        with pytest.raises(UnknownModel, match=UNLOADING) as refused:
            await again.reply.wait()
        assert refused.value.in_queue  # never ran: refunded
        assert _never_ran(refused.value)
        assert left_refunds.n == 0  # it ran: never refunded
        assert again_left_refunds.n == 1  # never ran: refunded, once
        assert scheduler.queue_depth() == 0
        assert scheduler.load() == 0
        assert scheduler.metrics.statuses["poison"] == 0  # refused, not poison
        nursery.cancel_scope.cancel("test over")
    assert got == []
    assert again_left_refunds.n == 1


async def test_a_retry_that_may_hang_handed_back_after_an_unload_is_answered_at_once(
    autojump_clock,
):
    # A thread hangs while the unloaded copy drains: its batch's parts would wait
    # for a replica to spare (b, the last ready one, is not to be put at risk). They
    # are answered at once; a part that may not hang (its batch raised) is left to
    # the copy's replicas, as before.
    hung_replica, b = Replica(ready=False), Replica()
    scheduler = scheduler_of(hung_replica, b, Replica(ready=False))
    scheduler.hand_over(stand_in(), refuse_held=True)
    hang = hung_in(scheduler, 3.0)
    part = ran_retry(scheduler, 3.0, hang)
    assert not part.reply.answerable  # answered as it is handed back
    with pytest.raises(ActorClosed, match=UNLOADED_RETRY) as info:
        await part.reply.wait()
    assert not info.value.in_queue
    raised = request(4.0)
    raised.reply.dispatch()
    raised.reply.suspect = raised.reply.ran = True
    scheduler.retry([[raised]])
    assert await scheduler.pull(b) == [raised]
    assert scheduler.queue_depth() == 0


async def test_a_reload_keeps_a_ran_retry_held_for_its_own_replicas(autojump_clock):
    hung_replica, b, c = Replica(ready=False), Replica(), Replica()
    scheduler = scheduler_of(hung_replica, b, c)
    hang = hung_in(scheduler, 1.0)
    c.risking = True
    waiting = ran_retry(scheduler, 1.0, hang)
    scheduler.hand_over(scheduler_of(Replica(), Replica()))
    assert waiting.reply.answerable
    assert scheduler.queue_depth() == 1
    c.risking = False  # c is spared now: b runs it, here
    assert await scheduler.pull(b) == [waiting]


# ---------------------------------------------------------------- handed back by a raise
async def test_a_part_with_an_input_found_poison_handed_back_by_a_raise_is_poison_at_once(
    autojump_clock,
):
    # A hung batch held the same input twice (A1, A2), in two parts. A2's part
    # ([A2, x]) ran on c beside a spared d while A1, alone on b, hung b too and was
    # answered poison: A2's part was not held then. c's model then raised on the
    # part; split, [A2] was handed back and held for a replica to spare (d runs a
    # part that may hang) until its deadline, since only a hang looked for a part
    # with an input found poison. It is answered poison as it is handed back.
    a, b, c, d = Replica(ready=False), Replica(ready=False), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(a, b, c, d))
    hang = hung_in(scheduler, HANG, 1.0)
    a1 = request(HANG)
    a1.reply.dispatch()
    scheduler.poisoned_alone([a1])  # it hung b alone, answered poison
    d.risking = True
    a2, x = request(HANG), request(1.0)
    a2 = Request(model="m", item=a2.item, reply=a2.reply, deadline=DEADLINE)
    x = Request(model="m", item=x.item, reply=x.reply, deadline=DEADLINE)
    for r in (a2, x):
        r.reply.dispatch()
        mark_hung([r], hang)
        r.reply.suspect = r.reply.ran = True
    start = trio.current_time()
    scheduler.retry([[a2], [x]])  # the raised part, split (as _model_failed does)
    assert not a2.reply.answerable  # answered as it is handed back
    with pytest.raises(ModelError, match="the same input was found poison") as info:
        await a2.reply.wait()
    assert trio.current_time() == start
    assert not info.value.in_queue  # it ran in the hung batch: charged
    assert scheduler.metrics.statuses["poison"] == 1
    assert x.reply.answerable  # the innocent part still waits for a replica to spare
    assert scheduler.queue_depth() == 1


async def test_a_part_handed_back_is_looked_at_alone_for_an_input_found_poison(
    autojump_clock, monkeypatch,
):
    # While an input is marked poison, each retry used to digest the input of every
    # part held (40 parts held: 41 digests to hand back one more); it digests the
    # parts handed back now. One held already was looked at as it was handed back.
    a, b, c, d = Replica(ready=False), Replica(ready=False), Replica(), Replica()
    scheduler = with_metrics(scheduler_of(a, b, c, d))
    hang = hung_in(scheduler, HANG, *(float(v) for v in range(1, 42)))
    a1 = request(HANG)
    a1.reply.dispatch()
    scheduler.poisoned_alone([a1])
    d.risking = True  # no replica to spare: the parts stay held

    def part(v: float) -> list[Request]:
        r = request(v)
        r = Request(model="m", item=r.item, reply=r.reply, deadline=DEADLINE)
        r.reply.dispatch()
        mark_hung([r], hang)
        r.reply.suspect = r.reply.ran = True
        return [r]

    for v in range(1, 41):
        scheduler.retry([part(float(v))])
    assert scheduler.queue_depth() == 40
    digests: list = []
    real = _hung_inputs.digest
    monkeypatch.setattr(_hung_inputs, "digest", lambda it: digests.append(it) or real(it))
    poison = part(HANG)
    scheduler.retry([part(41.0), poison])
    assert len(digests) == 2  # the two parts handed back, not the 40 held
    assert not poison[0].reply.answerable  # still found poison
    assert scheduler.metrics.statuses["poison"] == 1
    assert scheduler.queue_depth() == 41
