"""Deadlines, withdrawals and refusals through the runtime: a caller's deadline or
leaving, a cancelled batch call withdrawing its queued items, the model timeout in
the queue, a full queue, reply groups, and a refused batch that leaves nothing
queued and runs nothing.

Under ``autojump_clock`` trio time jumps to the next deadline whenever every task
waits, including while a model runs in a worker thread; models run in threads there
set ``timeout_ms=None`` so no request's model timeout passes in that jump.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import Recorder, at, callable_model, config, item
from trioserve import DeadlineExceeded, Overloaded


# ---------------------------------------------------------------- deadlines
async def test_caller_deadline_returns_on_time_and_the_request_is_never_run(autojump_clock, gates):
    gate = gates()
    cfg = config(
        callable_model(
            "m", gate, execution="thread", max_batch_size=1, max_wait_ms=0, timeout_ms=None
        )
    )
    async with trioserve.open_runtime(cfg) as rt:
        async with trio.open_nursery() as nursery:
            first = trio.Event()

            async def occupy():
                await rt.infer("m", item(1))
                first.set()

            nursery.start_soon(occupy)
            await trio.testing.wait_all_tasks_blocked()  # item 1 holds the only replica
            t0 = trio.current_time()
            with trio.move_on_after(0.2) as scope:
                await rt.infer("m", item(2))
            assert scope.cancelled_caught
            assert trio.current_time() == t0 + 0.2
            gate.release()
            await first.wait()
        out = await rt.infer("m", item(3))
    np.testing.assert_array_equal(out["y"], [7.0])
    assert gate.seen == [1.0, 3.0]  # item 2 was withdrawn before dispatch


async def test_caller_leaving_a_running_request_drops_its_answer(autojump_clock, gates):
    gate = gates()
    cfg = config(
        callable_model(
            "m", gate, execution="thread", max_batch_size=1, max_wait_ms=0, timeout_ms=None
        )
    )
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        with trio.move_on_after(0.2):
            await rt.infer("m", item(1))  # dispatched, then abandoned
        assert trio.current_time() == t0 + 0.2
        gate.release()
        out = await rt.infer("m", item(2))
        stats = rt.statistics()["m"]
    np.testing.assert_array_equal(out["y"], [5.0])
    assert gate.seen == [1.0, 2.0]
    assert stats["replicas"][0]["restarts"] == 0
    assert stats["statuses"].get("model_error", 0) == 0


async def test_cancelled_infer_batch_withdraws_every_queued_item(autojump_clock, gates):
    gate = gates()
    cfg = config(
        callable_model(
            "m", gate, execution="thread", max_batch_size=2, max_wait_ms=0, timeout_ms=None
        )
    )
    async with trioserve.open_runtime(cfg) as rt:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rt.infer, "m", item(1))
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.2):
                await rt.infer_batch("m", [item(2), item(3), item(4)])
            gate.release()
        await rt.infer("m", item(5))
    assert gate.seen == [1.0, 5.0]


async def test_model_timeout_in_queue_is_deadline_exceeded(autojump_clock, gates, manual_watchdog):
    # item 1's batch runs past the model timeout too, in trio time; its running deadline
    # is kept on the watchdog's wall clock, which this test holds still (on a slow machine
    # the real one could cut item 1 off before the gate opens)
    gate = gates()
    cfg = config(
        callable_model(
            "m", gate, execution="thread", max_batch_size=1, max_wait_ms=0, timeout_ms=100
        )
    )
    async with trioserve.open_runtime(cfg) as rt:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rt.infer, "m", item(1))
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            with trio.fail_after(5):  # the caller would wait longer than the model
                with pytest.raises(
                    DeadlineExceeded, match=r"model 'm': deadline passed after 0\.100s"
                ):
                    await rt.infer("m", item(2))
            assert at(trio.current_time(), t0 + 0.1)
            gate.release()
    assert gate.seen == [1.0]


# ---------------------------------------------------------------- backpressure
async def test_a_refused_batch_leaves_nothing_queued(autojump_clock, gates):
    gate = gates()
    cfg = config(
        callable_model("m", gate, execution="thread", max_batch_size=1, max_wait_ms=0,
                       adaptive_limit=False, timeout_ms=None),
        queue_bound=3,
    )
    async with trioserve.open_runtime(cfg) as rt:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rt.infer, "m", item(1))  # runs, held by the gate
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(rt.infer, "m", item(2))  # queued: two places left
            await trio.testing.wait_all_tasks_blocked()
            # Two are admitted, the third is refused: the call fails and withdraws both.
            with pytest.raises(
                Overloaded, match=r"model 'm': queue full \(3 requests waiting\)"
            ):
                await rt.infer_batch("m", [item(10), item(11), item(12)])
            gate.release()
        out = await rt.infer("m", item(9))
    assert gate.seen == [1.0, 2.0, 9.0]  # the two submitted before the failure: withdrawn
    np.testing.assert_array_equal(out["y"], [19.0])


async def test_full_queue_is_overloaded(autojump_clock, gates):
    gate = gates()
    cfg = config(
        callable_model(
            "m", gate, execution="thread", max_batch_size=1, max_wait_ms=0, timeout_ms=None
        ),
        queue_bound=2,
    )
    async with trioserve.open_runtime(cfg) as rt:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rt.infer, "m", item(1))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(rt.infer, "m", item(2))
            nursery.start_soon(rt.infer, "m", item(3))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(Overloaded, match=r"queue full \(2 requests waiting\)"):
                await rt.infer("m", item(4))
            gate.release()
    assert sorted(gate.seen) == [1.0, 2.0, 3.0]


# ---------------------------------------------------------------- reply groups
async def test_a_reply_group_wakes_its_waiter_once_the_last_reply_is_answered():
    from trioserve._messages import DONE, ReplyGroup

    group = ReplyGroup(3)
    got: list = []

    async def waiter():
        got.append(await group.wait())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        r0, r1, r2 = group.replies
        assert r2.dispatch()
        assert r2.set_result("c")
        assert r0.set_error(ValueError("a"))
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # one reply still unanswered
        assert r1.set_result("b")
    [outcomes] = got
    with pytest.raises(ValueError, match="a"):
        outcomes[0].unwrap()
    assert [o.unwrap() for o in outcomes[1:]] == ["b", "c"]
    assert [r.state for r in group.replies] == [DONE, DONE, DONE]


async def test_a_cancelled_reply_group_withdraws_queued_replies_and_drops_running_ones():
    from trioserve._messages import ABANDONED, CANCELLED, DONE, ReplyGroup

    group = ReplyGroup(3)
    r0, r1, r2 = group.replies
    withdrawn: list[int] = []
    r2.on_cancel = lambda: withdrawn.append(2)
    assert r0.set_result("a")
    assert r1.dispatch()
    with trio.move_on_after(0) as scope:
        await group.wait()
    assert scope.cancelled_caught
    assert [r.state for r in group.replies] == [DONE, ABANDONED, CANCELLED]
    assert withdrawn == [2]
    assert not r1.set_result("late")  # dropped: its caller left
    assert not r2.set_result("late")


async def test_a_reply_group_already_answered_returns_at_once_but_is_a_checkpoint():
    from trioserve._messages import ReplyGroup

    group = ReplyGroup(2)
    for i, r in enumerate(group.replies):
        assert r.set_result(i)
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await group.wait()
    group = ReplyGroup(1)
    group.replies[0].set_result("x")
    assert [o.unwrap() for o in await group.wait()] == ["x"]


@pytest.mark.parametrize("attempt", range(4))
async def test_a_refused_batch_never_runs_the_items_it_queued(autojump_clock, attempt):
    """The items queued before the refusal are withdrawn before the refusal yields:
    a batcher woken by them (the batch is full) once took them at that checkpoint,
    so an Overloaded call had run in part (and was refunded in full)."""
    rec = Recorder()
    cfg = config(
        callable_model("m", rec, max_batch_size=3, max_wait_ms=10, adaptive_limit=False),
        queue_bound=3,
    )
    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(rt.infer, "m", item(100))  # queued: its batch waits max_wait
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(Overloaded, match="queue full"):
            await rt.infer_batch("m", [item(1), item(2), item(3)])
        await trio.sleep(1.0)
    assert rec.seen == [100.0]
