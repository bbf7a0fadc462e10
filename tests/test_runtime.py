"""The runtime core through ``open_runtime`` / ``Runtime.infer``: batch closing under
MockClock, oversize policies, routing of answers, model failures, deadlines,
backpressure and shutdown. Models are small callables (no torch).

Under ``autojump_clock`` trio time jumps to the next deadline whenever every task
waits, including while a model runs in a worker thread; models run in threads there
set ``timeout_ms=None`` so no request's model timeout passes in that jump.
"""

from __future__ import annotations

import collections
import functools
import os
import sys

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_helpers import (
    CostModel,
    Gate,
    Recorder,
    at,
    callable_model,
    config,
    escapes_on_1,
    item,
    misshapen,
    pythonpath_with,
    unprintable_on_1,
)
from trioserve import (
    ActorClosed,
    DeadlineExceeded,
    InvalidInput,
    ModelConfig,
    ModelError,
    Overloaded,
)
from trioserve.actors import BatchLimits, FifoQueue, SchedulerActor


@pytest.fixture
def gates():
    """Make Gates; every one is released at teardown so no worker thread outlives the
    test by more than its batch."""
    made: list[Gate] = []

    def make(**kw) -> Gate:
        g = Gate(**kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.release()


async def call_all(rt, model, inputs, *, stagger: float = 0.0):
    """Infer every input from its own task, the i-th arriving at start + i*stagger.
    Returns {i: (outputs or the exception, trio time answered)}."""
    results: dict[int, tuple[object, float]] = {}
    start = trio.current_time()

    async def one(i, x):
        await trio.sleep_until(start + i * stagger)
        try:
            out = await rt.infer(model, x)
        except Exception as exc:
            out = exc
        results[i] = (out, trio.current_time())

    async with trio.open_nursery() as nursery:
        for i, x in enumerate(inputs):
            nursery.start_soon(one, i, x)
    return results


# ---------------------------------------------------------------- batch closing
async def test_batch_closes_on_size_and_is_dispatched_at_once(autojump_clock):
    rec = Recorder()
    cfg = config(callable_model("m", rec, max_batch_size=4, max_wait_ms=1000))
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        results = await call_all(rt, "m", [item(i) for i in range(4)])
    assert rec.sizes == [4]
    assert rec.times == [t0]  # full: no waiting for max_wait
    assert sorted(rec.seen) == [0, 1, 2, 3]
    for i, (out, t) in results.items():
        np.testing.assert_array_equal(out["y"], [2 * i + 1])
        assert t == t0


async def test_remainder_after_a_full_batch_waits_max_wait(autojump_clock):
    rec = Recorder()
    cfg = config(callable_model("m", rec, max_batch_size=4, max_wait_ms=1000))
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        results = await call_all(rt, "m", [item(i) for i in range(6)])
    assert rec.sizes == [4, 2]
    assert rec.times[0] == t0
    assert at(rec.times[1], t0 + 1.0)
    assert sorted(rec.seen) == list(range(6))
    assert all(not isinstance(out, Exception) for out, _ in results.values())


async def test_batch_closes_when_the_oldest_waited_max_wait_exactly(autojump_clock):
    rec = Recorder()
    cfg = config(callable_model("m", rec, max_batch_size=8, max_wait_ms=250))
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        answered: dict[int, float] = {}

        async def one(i, arrive):
            await trio.sleep_until(arrive)
            await rt.infer("m", item(i))
            answered[i] = trio.current_time()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0, t0)
            nursery.start_soon(one, 1, t0 + 0.1)  # joins the batch of the oldest
            nursery.start_soon(one, 2, t0 + 0.3)  # after that batch closed
            # Not before: at t0 + 0.249 nothing has run yet.
            await trio.sleep_until(t0 + 0.249)
            await trio.testing.wait_all_tasks_blocked()
            assert rec.batches == []
    assert [keys for _, keys in rec.batches] == [[0, 1], [2]]
    assert at(rec.times[0], t0 + 0.25)
    assert at(rec.times[1], t0 + 0.3 + 0.25)
    assert at(answered[0], t0 + 0.25)
    assert at(answered[1], t0 + 0.25)
    assert at(answered[2], t0 + 0.55)


async def test_zero_max_wait_dispatches_each_arrival_at_once(autojump_clock):
    rec = Recorder()
    cfg = config(callable_model("m", rec, max_batch_size=8, max_wait_ms=0))
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        await call_all(rt, "m", [item(i) for i in range(3)], stagger=0.01)
    assert rec.sizes == [1, 1, 1]
    assert [at(t, t0 + 0.01 * i) for i, t in enumerate(rec.times)] == [True] * 3


async def test_dispatch_follows_arrival_order(autojump_clock):
    rec = Recorder()
    cfg = config(callable_model("m", rec, max_batch_size=3, max_wait_ms=1000))
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        await call_all(rt, "m", [item(i) for i in range(7)], stagger=0.001)
    assert [keys for _, keys in rec.batches] == [[0, 1, 2], [3, 4, 5], [6]]
    assert at(rec.times[0], t0 + 0.002)
    assert at(rec.times[1], t0 + 0.005)
    assert at(rec.times[2], t0 + 0.006 + 1.0)


async def test_batch_closes_on_token_budget(autojump_clock):
    backend = CostModel()
    cfg = config(
        ModelConfig(
            name="m", backend=backend, max_batch_size=100, max_batch_tokens=10, max_wait_ms=500
        )
    )
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        outs = await rt.infer_batch("m", [item(i, n=4) for i in range(3)])
    assert backend.costs == [[4, 4], [4]]  # a third 4 would make 12 > 10
    assert backend.times[0] == t0
    assert at(backend.times[1], t0 + 0.5)
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out["y"], item(i, n=4)["x"] * 2)


async def test_padded_token_budget_counts_items_times_longest(autojump_clock):
    backend = CostModel(padded=True)
    cfg = config(
        ModelConfig(
            name="m", backend=backend, max_batch_size=100, max_batch_tokens=10, max_wait_ms=500
        )
    )
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        outs = await rt.infer_batch("m", [item(i, n) for i, n in enumerate((2, 5, 1, 1))])
    # 2 x 5 = 10 fits; adding a third item would cost 3 x 5 = 15.
    assert backend.costs == [[2, 5], [1, 1]]
    assert backend.times[0] == t0
    assert at(backend.times[1], t0 + 0.5)
    assert [len(o["y"]) for o in outs] == [2, 5, 1, 1]


@settings(
    max_examples=40,
    deadline=None,
    # The clock is reused across examples: every assertion is relative to its start.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    gaps_ms=st.lists(st.integers(0, 30), min_size=1, max_size=12),
    max_size=st.integers(1, 4),
    max_wait_ms=st.sampled_from([0, 5, 10, 20]),
)
async def test_batches_close_on_size_or_exactly_at_max_wait(
    autojump_clock, gaps_ms, max_size, max_wait_ms
):
    rec = Recorder()
    cfg = config(callable_model("m", rec, max_batch_size=max_size, max_wait_ms=max_wait_ms))
    arrival: dict[int, float] = {}
    submitted: list[int] = []
    outs: dict[int, float] = {}
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()

        async def one(i, at_ms):
            await trio.sleep_until(t0 + at_ms / 1000)
            arrival[i] = trio.current_time()
            submitted.append(i)  # no checkpoint before infer submits it
            outs[i] = float((await rt.infer("m", item(i)))["y"][0])

        async with trio.open_nursery() as nursery:
            at_ms = 0
            for i, gap in enumerate(gaps_ms):
                at_ms += gap
                nursery.start_soon(one, i, at_ms)
    n = len(gaps_ms)
    assert outs == {i: 2 * i + 1 for i in range(n)}
    assert rec.seen == submitted  # FIFO across batches (ties in any order)
    for t, keys in rec.batches:
        first, last = int(keys[0]), int(keys[-1])
        assert len(keys) <= max_size
        deadline = arrival[first] + max_wait_ms / 1000
        if len(keys) == max_size and t == arrival[last]:
            assert t <= deadline + 1e-9  # closed full, no later than its max_wait
        else:
            assert at(t, deadline), f"batch {keys} at {t - t0}, oldest waited to {deadline - t0}"


# ---------------------------------------------------------------- oversize policies
def cost_config(backend, oversize, *, tokens=10, wait_ms=500):
    return config(
        ModelConfig(
            name="m",
            backend=backend,
            max_batch_size=100,
            max_batch_tokens=tokens,
            max_wait_ms=wait_ms,
            oversize=oversize,
        )
    )


async def test_oversize_reject_names_the_budget(autojump_clock):
    backend = CostModel()
    async with trioserve.open_runtime(cost_config(backend, "reject")) as rt:
        with pytest.raises(
            InvalidInput,
            match=r"model 'm': request cost 12 exceeds max_batch_tokens 10 "
            r"\(oversize policy 'reject'\)",
        ):
            await rt.infer("m", item(1, n=12))
        out = await rt.infer("m", item(1, n=10))  # exactly the budget is fine
    np.testing.assert_array_equal(out["y"], item(1, n=10)["x"] * 2)
    assert backend.costs == [[10]]


async def test_oversize_alone_runs_as_a_batch_of_one(autojump_clock):
    backend = CostModel()
    async with trioserve.open_runtime(cost_config(backend, "alone")) as rt:
        t0 = trio.current_time()
        results = await call_all(rt, "m", [item(1, n=3), item(2, n=12), item(3, n=3)], stagger=0.1)
    # The big one cannot join the first: that batch closes when it arrives, and the big
    # one runs alone at once; the last small one waits its own max_wait.
    assert backend.costs == [[3], [12], [3]]
    assert at(backend.times[0], t0 + 0.1)
    assert at(backend.times[1], t0 + 0.1)
    assert at(backend.times[2], t0 + 0.2 + 0.5)
    big, _ = results[1]
    np.testing.assert_array_equal(big["y"], item(2, n=12)["x"] * 2)


async def test_oversize_split_runs_parts_within_budget_and_merges(autojump_clock):
    backend = CostModel(splittable=True)
    async with trioserve.open_runtime(cost_config(backend, "split", tokens=4, wait_ms=0)) as rt:
        x = np.arange(10, dtype=np.float32)
        out = await rt.infer("m", {"x": x})
    np.testing.assert_array_equal(out["y"], x * 2)
    assert all(sum(costs) <= 4 for costs in backend.costs)
    assert sorted(c for costs in backend.costs for c in costs) == [2, 4, 4]


async def test_oversize_split_without_split_support_is_rejected(autojump_clock):
    backend = CostModel(splittable=False)
    async with trioserve.open_runtime(cost_config(backend, "split")) as rt:
        with pytest.raises(InvalidInput, match=r"exceeds max_batch_tokens 10 .*'split'"):
            await rt.infer("m", item(1, n=11))
    assert backend.costs == []


async def test_oversize_split_part_failure_is_a_model_error(autojump_clock):
    backend = CostModel(splittable=True, fail_on=4.0)
    async with trioserve.open_runtime(cost_config(backend, "split", tokens=4, wait_ms=0)) as rt:
        with pytest.raises(ModelError, match=r"ValueError: poison item 4"):
            await rt.infer("m", {"x": np.arange(10, dtype=np.float32)})


# Regression: a batch holding an oversize item ran every item one after another (a
# request each, each waiting max_wait), and under `reject` ran the items before the
# oversize one, then raised.
@pytest.mark.parametrize("oversize", ["alone", "split"])
async def test_a_batch_with_an_oversize_item_runs_the_rest_together(autojump_clock, oversize):
    backend = CostModel(splittable=oversize == "split")
    items = [item(i, n=2) for i in range(4)]
    items.insert(2, item(99, n=14))
    async with trioserve.open_runtime(cost_config(backend, oversize, wait_ms=50)) as rt:
        t0 = trio.current_time()
        outs = await rt.infer_batch("m", items)
        took = trio.current_time() - t0
    for out, it in zip(outs, items, strict=True):
        np.testing.assert_array_equal(out["y"], it["x"] * 2)
    # at most one max_wait, and a few batches (one by one, each of the small items
    # was a batch of its own, after its own max_wait)
    assert took <= 0.05
    assert len(backend.costs) <= 3
    assert sorted(c for costs in backend.costs for c in costs if c == 2) == [2] * 4


async def test_a_batch_with_an_oversize_item_under_reject_runs_nothing(autojump_clock):
    backend = CostModel()
    async with trioserve.open_runtime(cost_config(backend, "reject")) as rt:
        with pytest.raises(
            InvalidInput, match=r"^model 'm': item 2 costs 12, over max_batch_tokens 10 "
            r"\(oversize policy 'reject'\)$",
        ):
            await rt.infer_batch("m", [item(1), item(2), item(3, n=12), item(4)])
    assert backend.costs == []


async def test_a_batch_with_oversize_items_raises_the_first_failure_in_item_order(
    autojump_clock,
):
    backend = CostModel(fail_on=5.0)
    async with trioserve.open_runtime(cost_config(backend, "alone", wait_ms=0)) as rt:
        with pytest.raises(ModelError, match="poison item 5"):
            await rt.infer_batch("m", [item(1), item(5, n=12), item(7)])
        with pytest.raises(ModelError, match="poison item 5"):
            await rt.infer_batch("m", [item(1, n=12), item(5), item(7, n=12)])


# ---------------------------------------------------------------- routing
@pytest.mark.parametrize("model", ["echo", "double"])
async def test_each_of_1000_concurrent_callers_gets_its_own_answer(autojump_clock, model):
    rec = Recorder(timed=False)
    cfg = config(
        ModelConfig(name="echo", backend="echo", max_batch_size=32, max_wait_ms=2),
        callable_model(
            "double", rec, execution="thread", max_batch_size=32, max_wait_ms=2, timeout_ms=None
        ),
    )
    n = 1000
    wrong: list[int] = []
    async with trioserve.open_runtime(cfg) as rt:

        async def one(i):
            x = np.array([i, -i, i / 2], dtype=np.float32)
            out = await rt.infer(model, {"x": x})
            want = x if model == "echo" else x * 2 + 1
            got = out["x"] if model == "echo" else out["y"]
            if not np.array_equal(got, want):
                wrong.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        stats = rt.statistics()[model]
    assert wrong == []
    assert stats["items"] == n
    assert stats["batches"] >= n // 32
    if model == "double":
        assert sorted(rec.seen) == list(range(n))
        assert max(rec.sizes) <= 32


async def test_a_refusal_is_a_checkpoint_so_a_caller_retrying_at_once_cannot_hold_the_loop(
    autojump_clock, gates
):
    """Admission refuses in the caller's task, without waiting; the refusal still
    checkpoints. A caller that retries on Overloaded at once used to spin without
    yielding, so the replica never drained the full queue it waited to enter."""
    gate = gates()
    cfg = config(
        callable_model("m", gate, execution="thread", max_batch_size=1, max_wait_ms=0,
                       adaptive_limit=False, timeout_ms=None),  # mock time jumps while
        queue_bound=2,  # the worker thread runs: no deadline to pass meanwhile
    )
    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(rt.infer, "m", item(1))  # runs, held by the gate
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(rt.infer_batch, "m", [item(2), item(2)])  # the queue's places
        await trio.testing.wait_all_tasks_blocked()
        refusals = [
            (Overloaded, lambda: rt.infer("m", item(3))),
            (Overloaded, lambda: rt.infer_batch("m", [item(3), item(4)])),
            (InvalidInput, lambda: rt.infer_batch("m", [item(3)] * 3)),  # over the bound
            (trioserve.UnknownModel, lambda: rt.infer("nope", item(3))),
            (InvalidInput, lambda: rt.infer("m", {"z": item(3)["x"]})),
            (trioserve.Unauthorized, lambda: rt.infer("m", item(3), tenant="who")),
        ]
        for error, call in refusals:
            with trio.testing.assert_checkpoints(), pytest.raises(error):
                await call()

        tries = 0
        released = False

        async def retry_at_once() -> None:
            nonlocal tries
            while True:
                try:
                    return await rt.infer("m", item(5))
                except Overloaded:
                    tries += 1
                    assert released or tries < 1000, "the retries never let another task run"

        async def release() -> None:  # a task: it runs once the loop yields
            nonlocal released
            released = True
            gate.release()

        nursery.start_soon(release)
        out = await retry_at_once()
        assert float(out["y"][0]) == 11.0
        assert tries > 0


async def test_infer_batch_returns_outputs_in_input_order(autojump_clock):
    rec = Recorder()
    cfg = config(callable_model("m", rec, max_batch_size=4, max_wait_ms=1))
    async with trioserve.open_runtime(cfg) as rt:
        outs = await rt.infer_batch("m", [item(i) for i in range(10)])
        from_a_generator = await rt.infer_batch("m", (item(i) for i in range(3)))
    assert [float(o["y"][0]) for o in outs] == [2 * i + 1 for i in range(10)]
    assert rec.sizes == [4, 4, 2, 3]
    assert [float(o["y"][0]) for o in from_a_generator] == [1, 3, 5]


async def test_a_version_is_a_string_as_in_the_config_and_any_other_type_is_invalid_input(
    autojump_clock,
):
    """Versions are named by strings in the config (``versions = ["1", "2"]``; an
    integer there is a config error, and "02" or "v2" are names too). ``version=2``
    was UnknownModel "has no version 2" while version "2" is served; it is now
    InvalidInput saying a version is a string, checked only once the version is not
    found, so a string costs nothing more."""
    cfg = config(callable_model("m", Recorder(), max_batch_size=4, versions=("1", "2")))
    async with trioserve.open_runtime(cfg) as rt:
        assert float((await rt.infer("m", item(1), version="2"))["y"][0]) == 3.0
        outs = await rt.infer_batch("m", [item(1), item(2)], version="2")
        assert [float(o["y"][0]) for o in outs] == [3.0, 5.0]
        for bad, shown in ((2, "int 2"), (True, "bool True"), (2.0, "float 2.0")):
            for call, items in ((rt.infer, item(1)), (rt.infer_batch, [item(1)])):
                with trio.testing.assert_checkpoints(), pytest.raises(InvalidInput) as info:
                    await call("m", items, version=bad)
                assert str(info.value) == (
                    f"model 'm': version must be a string, one of '1', '2' (as the "
                    f"config names them), got {shown}"
                )
        with pytest.raises(trioserve.UnknownModel, match="model 'm' has no version '3'"):
            await rt.infer("m", item(1), version="3")


async def test_statistics_before_and_after_a_request(autojump_clock):
    cfg = config(callable_model("m", Recorder(), max_batch_size=8, max_wait_ms=250))
    async with trioserve.open_runtime(cfg) as rt:
        before = rt.statistics()["m"]
        await rt.infer("m", item(1))
        after = rt.statistics()["m"]
    assert before["batches"] == 0
    assert before["queue_depth"] == 0
    assert before["queue_wait"].count == 0
    assert before["end_to_end"].p99_ms == 0.0
    assert before["replicas"] == [{"name": "batcher[m#0@cpu]", "state": "running", "restarts": 0}]
    assert (after["batches"], after["items"], after["fill_ratio"]) == (1, 1, 1 / 8)
    # Latencies come from trio time: exactly max_wait, to hdrhistogram's 2 digits.
    assert after["queue_wait"].count == 1
    assert after["queue_wait"].max_ms == pytest.approx(250, rel=0.01)
    assert after["end_to_end"].max_ms == pytest.approx(250, rel=0.01)


# ---------------------------------------------------------------- model failures
@pytest.mark.parametrize("execution", ["inline", "thread"])
async def test_a_model_raising_on_one_input_fails_only_that_callers_request(
    autojump_clock, execution
):
    rec = Recorder(fail_on=5.0, timed=execution == "inline")
    cfg = config(
        callable_model(
            "m", rec, execution=execution, max_batch_size=4, max_wait_ms=1000, timeout_ms=None
        )
    )
    async with trioserve.open_runtime(cfg) as rt:
        results = await call_all(rt, "m", [item(i) for i in range(8)])
        after = await rt.infer("m", item(5.5))  # the replica keeps serving
        stats = rt.statistics()["m"]
    # The batch holding 5 (no more than retry_parts) is retried each request alone:
    # each of its batch-mates runs once more and succeeds.
    assert [len(keys) for _, keys in rec.batches if 5.0 in keys] == [4, 1]
    runs = collections.Counter(k for _, keys in rec.batches for k in keys)
    assert runs[5.0] == 2
    assert sum(runs.values()) == 8 + 4 + 1  # 8 firsts, then 4 retried alone, then 5.5
    for i, (out, _) in results.items():
        if i == 5:
            assert isinstance(out, ModelError)
            assert str(out) == "model 'm' failed on cpu: ValueError: poison item 5"
        else:
            np.testing.assert_array_equal(out["y"], [2 * i + 1])
    np.testing.assert_array_equal(after["y"], [12.0])
    assert stats["statuses"]["model_error"] == 1
    assert stats["statuses"]["retried"] == 4
    assert stats["replicas"][0]["restarts"] == 0
    assert stats["replicas"][0]["state"] == "running"


@pytest.mark.parametrize("execution", ["inline", "thread", "process"])
async def test_a_model_raising_an_exception_that_cannot_be_shown_is_a_model_error(
    monkeypatch, execution
):
    # Formatting its message raised in the replica answering with it: the batcher
    # crashed (ActorBroken for the caller, a restart spent; with none left the
    # runtime went down); in a worker process, its loop. Real time (the process).
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    cfg = config(
        callable_model(
            "m", unprintable_on_1, execution=execution, max_wait_ms=0, timeout_ms=None
        ),
        restart_intensity=0,
    )
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(ModelError) as info:
            await rt.infer("m", item(1))
        after = await rt.infer("m", item(2))
        stats = rt.statistics()["m"]
    prefix = "WorkerError: " if execution == "process" else ""
    assert str(info.value) == (
        f"model 'm' failed on cpu: {prefix}Unprintable (its message cannot be shown: "
        "str() raised RuntimeError)"
    )
    assert after["y"].tolist() == [2.0]
    assert stats["replicas"][0]["restarts"] == 0


@pytest.mark.parametrize("execution", ["inline", "thread", "process"])
async def test_a_model_raising_stop_iteration_or_system_exit_is_a_model_error(
    monkeypatch, execution
):
    # StopIteration left a thread's coroutine as "RuntimeError: coroutine raised
    # StopIteration" (PEP 479); SystemExit ended the batcher and the runtime with it
    # (inline, thread) or the worker process (a lost worker, retried as poison). The
    # caller gets the model's error as for any other; the replica serves on.
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    cfg = config(
        callable_model("m", escapes_on_1, execution=execution, max_wait_ms=0, timeout_ms=None),
        restart_intensity=0,
    )
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(ModelError) as stopped:
            await rt.infer("m", item(1))
        with pytest.raises(ModelError) as exited:
            await rt.infer("m", item(2))
        after = await rt.infer("m", item(3))
        stats = rt.statistics()["m"]
    prefix = "WorkerError: " if execution == "process" else ""
    assert str(stopped.value) == f"model 'm' failed on cpu: {prefix}StopIteration: ran out"
    assert str(exited.value) == f"model 'm' failed on cpu: {prefix}SystemExit: model says bye"
    assert after["y"].tolist() == [3.0]
    assert stats["replicas"][0]["restarts"] == 0


async def test_wrong_number_of_outputs_is_a_model_error(autojump_clock):
    cfg = config(
        callable_model("m", lambda items: [*items, *items], max_batch_size=2, max_wait_ms=0)
    )
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(ModelError, match=r"returned 2 outputs for 1 item"):
            await rt.infer_batch("m", [item(1), item(2)])


TESTS = os.path.dirname(os.path.abspath(__file__))
MISSHAPEN = {  # x[0] of a lone item -> the error its misshapen outputs are answered with
    1.0: "TypeError: returned None",
    2.0: "TypeError: returned a value of type generator",
    3.0: "TypeError: returned a value of type int",
    4.0: "ValueError: returned 2 outputs for 1 item",
    5.0: "TypeError: returned a value of type ndarray as the output of item 0",
}


async def answers_misshapen_outputs_with_model_errors(cfg, prefix: str = "") -> None:
    async with trioserve.open_runtime(cfg) as rt:
        errors = {}
        for x in MISSHAPEN:
            with pytest.raises(ModelError) as info:
                await rt.infer("m", item(x))
            errors[x] = str(info.value)
        outs = await rt.infer_batch("m", [item(6), item(7)])  # the replica keeps serving
        echoed = await rt.infer("echo", {"a": [1]})
        stats = rt.statistics()["m"]
    want = "; expected a list of 1 output mapping (name -> array), one per item"
    assert errors == {
        x: f"model 'm' failed on cpu: {prefix}{what}{want}" for x, what in MISSHAPEN.items()
    }
    assert [float(o["y"][0]) for o in outs] == [6.0, 7.0]
    assert echoed["a"].tolist() == [1]
    assert stats["statuses"]["model_error"] == len(MISSHAPEN)
    assert stats["replicas"][0]["restarts"] == 0
    assert stats["replicas"][0]["state"] == "running"


@pytest.mark.parametrize("execution", ["inline", "thread"])
async def test_misshapen_outputs_are_model_errors_and_the_runtime_keeps_serving(
    autojump_clock, execution
):
    # A model returning None (or a generator, an int, a list of the wrong length or of
    # non-mappings) crashed its batcher: ActorBroken for its callers, and with no
    # restart budget left the whole runtime went down, echo with it.
    cfg = config(
        callable_model(
            "m", misshapen, execution=execution, max_batch_size=4, max_wait_ms=0,
            timeout_ms=None,
        ),
        ModelConfig(name="echo", backend="echo"),
        restart_intensity=0,
    )
    await answers_misshapen_outputs_with_model_errors(cfg)


async def test_misshapen_outputs_of_a_worker_process_are_model_errors(monkeypatch):
    # In a worker process they were ModelErrors already, but saying only what list()
    # said of them ("'NoneType' object is not iterable"), a generator was taken, and
    # one output too many was dropped without a word. Real time: the worker's replies
    # come through a pipe.
    # where the worker finds ``misshapen``
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    cfg = config(
        callable_model(
            "m", misshapen, execution="process", max_batch_size=4, max_wait_ms=0,
            timeout_ms=None,
        ),
        ModelConfig(name="echo", backend="echo"),
        restart_intensity=0,
    )
    await answers_misshapen_outputs_with_model_errors(cfg, "WorkerError: ")


async def test_a_torch_module_answering_another_number_of_rows_is_a_model_error(
    autojump_clock,
):
    # Flatten(0) makes one row per input value, not per item: the first rows were
    # returned as the items' answers, the rest dropped without a word.
    torch = pytest.importorskip("torch")
    backend = trioserve.TorchBackend(
        functools.partial(torch.nn.Flatten, 0),
        inputs=[trioserve.TensorSpec(name="x", datatype="FP32", shape=[2])],
        outputs=[trioserve.TensorSpec(name="y", datatype="FP32", shape=[-1])],
    )
    cfg = config(ModelConfig(name="m", backend=backend, max_batch_size=4, max_wait_ms=0,
                             timeout_ms=None))
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(ModelError) as info:
            await rt.infer("m", {"x": [1.0, 2.0]})
    assert str(info.value) == (
        "model 'm' failed on cpu: RuntimeError: module returned output 'y' with 2 rows "
        "for 1 item; expected one row per item"
    )


class _Answering:
    """A torch module (built lazily: torch is optional) whose forward returns
    ``answer(x)``."""

    def __init__(self, answer):
        self.answer = answer

    def __call__(self):
        import torch

        answer = self.answer

        class Module(torch.nn.Module):
            def forward(self, x):
                return answer(x)

        return Module()


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (lambda x: {"z": x}, "a mapping without output 'y' (it returned 'z'); the signature has y"),
        (lambda x: {}, "a mapping without output 'y' (it returned none); the signature has y"),
        (
            lambda x: x.numpy(),
            "output 'y' as a value of type ndarray; expected a tensor with one row per item",
        ),
    ],
)
async def test_a_torch_module_answering_no_tensor_for_an_output_says_which(
    autojump_clock, answer, said
):
    # The caller was told "KeyError: 'y'" of a dict without the output, and
    # "AttributeError: 'numpy.ndarray' object has no attribute 'dim'" of an array.
    pytest.importorskip("torch")
    backend = trioserve.TorchBackend(
        _Answering(answer),
        inputs=[trioserve.TensorSpec(name="x", datatype="FP32", shape=[2])],
        outputs=[trioserve.TensorSpec(name="y", datatype="FP32", shape=[2])],
    )
    cfg = config(ModelConfig(name="m", backend=backend, max_batch_size=4, max_wait_ms=0,
                             timeout_ms=None, poison_attempts=1))
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(ModelError) as info:
            await rt.infer("m", {"x": [1.0, 2.0]})
    assert str(info.value) == f"model 'm' failed on cpu: RuntimeError: module returned {said}"


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


async def test_model_timeout_in_queue_is_deadline_exceeded(autojump_clock, gates):
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
