"""The runtime's shutdown: requests in flight answered within the grace, a stuck model
failing waiting callers after it, an error in the block cancelling at once, closing a
scheduler, and overlapping runtimes sharing the switch interval.

Under ``autojump_clock`` trio time jumps to the next deadline whenever every task
waits, including while a model runs in a worker thread; models run in threads there
set ``timeout_ms=None`` so no request's model timeout passes in that jump.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import Recorder, at, callable_model, config, item
from trioserve import ActorClosed, ModelConfig
from trioserve.actors import BatchLimits, FifoQueue, SchedulerActor


# ---------------------------------------------------------------- shutdown
async def test_a_cancelled_pull_takes_nothing_from_the_queue():
    # A batcher cancelled (shutdown) as it pulls must leave the batch queued for
    # close() to answer; a batch taken and then dropped would leave its callers hanging.
    scheduler = SchedulerActor("m", FifoQueue(BatchLimits(max_size=1), bound=10))
    request = trioserve.Request(model="m", item=None, arrival=trio.current_time())
    scheduler.policy.offer(request, request.arrival)
    with trio.CancelScope() as scope:
        scope.cancel("shutting down")
        await scheduler.pull()
    assert scope.cancelled_caught
    assert request.reply.state is trioserve.RequestState.QUEUED
    assert await scheduler.pull() == [request]
    assert request.reply.state is trioserve.RequestState.DISPATCHED


def test_closing_a_scheduler_answers_each_queued_request_with_its_own_error():
    # One error object raised in every caller gathered all their frames (and the
    # locals those hold) into one traceback, as long as any of them kept it.
    scheduler = SchedulerActor("m", FifoQueue(BatchLimits(max_size=1), bound=10))
    requests = [
        trioserve.Request(model="m", item=None, arrival=0.0, tenant=f"t{i}") for i in range(3)
    ]
    for r in requests:
        scheduler.policy.offer(r, r.arrival)
    assert scheduler.close(ActorClosed("model 'm' was shut down")) == 3
    errors = [r.reply.error for r in requests]
    assert len({id(e) for e in errors}) == 3
    assert {(type(e), str(e)) for e in errors} == {(ActorClosed, "model 'm' was shut down")}


async def test_shutdown_answers_requests_in_flight_within_grace(autojump_clock):
    rec = Recorder()
    cfg = config(callable_model("m", rec, max_batch_size=4, max_wait_ms=100), graceful_timeout_s=5)
    results: dict[int, object] = {}

    async def one(rt, i):
        try:
            with trio.fail_after(100):  # were an answer lost, this fails instead of hanging
                results[i] = await rt.infer("m", item(i))
        except ActorClosed as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        async with trioserve.open_runtime(cfg) as rt:
            t0 = trio.current_time()
            for i in range(10):
                nursery.start_soon(one, rt, i)
            await trio.testing.wait_all_tasks_blocked()
        # The block waited for the last batch (max_wait), not for the whole grace.
        assert at(trio.current_time(), t0 + 0.1)
    assert sorted(results) == list(range(10))
    for i, out in results.items():
        np.testing.assert_array_equal(out["y"], [2 * i + 1])
    assert rec.sizes == [4, 4, 2]
    with pytest.raises(ActorClosed, match="shut down"):
        await rt.infer("m", item(0))
    with pytest.raises(ActorClosed):
        await rt.infer_batch("m", [item(0), item(1)])
    assert rt.closed


async def test_shutdown_with_a_stuck_model_fails_waiting_callers_after_grace(autojump_clock, gates):
    gate = gates()
    cfg = config(
        callable_model(
            "m", gate, execution="thread", max_batch_size=2, max_wait_ms=0, timeout_ms=None
        ),
        graceful_timeout_s=0.5,
    )
    results: dict[int, object] = {}

    async def one(rt, i):
        try:
            with trio.fail_after(100):  # were an answer lost, this fails instead of hanging
                results[i] = await rt.infer("m", item(i))
        except ActorClosed as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        async with trioserve.open_runtime(cfg) as rt:
            t0 = trio.current_time()
            for i in range(5):
                nursery.start_soon(one, rt, i)
            await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() == t0 + 0.5  # exactly the grace, then cancelled
    assert sorted(results) == list(range(5))
    assert all(isinstance(r, ActorClosed) for r in results.values())
    # The two in the stuck batch were failed by their batcher, the three still queued
    # by the scheduler.
    messages = sorted(str(r) for r in results.values())
    assert (
        messages
        == [
            "batcher[m#0@cpu]: the runtime is shut down",
        ]
        * 2
        + ["the runtime shut down before this request was answered"] * 3
    )


async def test_shutdown_under_load_answers_every_caller():
    # Real clock and a sleeping model: how many finish within the grace varies, but
    # every caller gets exactly one answer, a correct result or ActorClosed.
    cfg = config(
        ModelConfig(
            name="sleep",
            backend="sleep",
            options={"delay_per_batch_ms": 1.0},
            max_batch_size=4,
            max_wait_ms=1,
        ),
        graceful_timeout_s=0.02,
    )
    n = 200
    results: dict[int, object] = {}

    async def one(rt, i):
        try:
            out = await rt.infer("sleep", {"x": np.array([0.0, i], dtype=np.float32)})
            results[i] = out
        except ActorClosed as exc:
            results[i] = exc

    with trio.fail_after(30):  # a hang fails the test, not the suite
        async with trio.open_nursery() as nursery:
            async with trioserve.open_runtime(cfg) as rt:
                for i in range(n):
                    nursery.start_soon(one, rt, i)
                await trio.testing.wait_all_tasks_blocked()
            for i in range(n, n + 5):  # after shutdown: refused at once
                nursery.start_soon(one, rt, i)
    assert sorted(results) == list(range(n + 5))
    for i, r in results.items():
        if isinstance(r, ActorClosed):
            continue
        assert i < n
        np.testing.assert_array_equal(r["y"], [0.0, i])
    assert all(isinstance(results[i], ActorClosed) for i in range(n, n + 5))


async def test_an_error_in_the_block_cancels_at_once_and_fails_waiting_callers(
    autojump_clock, gates
):
    gate = gates()
    cfg = config(
        callable_model(
            "m", gate, execution="thread", max_batch_size=1, max_wait_ms=0, timeout_ms=None
        ),
        graceful_timeout_s=1000,
    )
    results: dict[int, object] = {}

    async def one(rt, i):
        try:
            with trio.fail_after(100):  # were an answer lost, this fails instead of hanging
                results[i] = await rt.infer("m", item(i))
        except ActorClosed as exc:
            results[i] = exc

    async def serve_then_fail(nursery):
        async with trioserve.open_runtime(cfg) as rt:
            for i in range(3):
                nursery.start_soon(one, rt, i)
            await trio.testing.wait_all_tasks_blocked()
            raise KeyError("oops")

    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        with pytest.raises(KeyError, match="oops"):
            await serve_then_fail(nursery)
        assert trio.current_time() == t0  # no grace when the block fails
    assert all(isinstance(results[i], ActorClosed) for i in range(3))


async def test_overlapping_runtimes_share_the_switch_interval_and_restore_it():
    # Runtimes whose lifetimes overlap without nesting (two serve_in_thread clients
    # closed in the order they started): the smallest interval of those open applies,
    # and the process's own comes back once the last one closes.
    original = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    try:
        cfg_a = config(ModelConfig(name="e", backend="echo"), switch_interval_us=100)
        cfg_b = config(ModelConfig(name="e", backend="echo"), switch_interval_us=200)
        opened, close, closed = ({"a": trio.Event(), "b": trio.Event()} for _ in range(3))

        async def run(name, cfg):
            async with trioserve.open_runtime(cfg):
                opened[name].set()
                await close[name].wait()
            closed[name].set()

        def interval_us():
            # CPython keeps whole microseconds, truncated: 200e-6 s reads back as 199 us
            return pytest.approx(sys.getswitchinterval() * 1e6, abs=2)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", cfg_a)
            await opened["a"].wait()
            assert interval_us() == 100
            nursery.start_soon(run, "b", cfg_b)
            await opened["b"].wait()
            assert interval_us() == 100
            close["a"].set()
            await closed["a"].wait()
            assert interval_us() == 200  # b alone
            close["b"].set()
        assert interval_us() == 4000
    finally:
        sys.setswitchinterval(original)
