"""The runtime core through ``open_runtime`` / ``Runtime.infer``: batch closing under
MockClock, oversize policies and routing of answers. Models are small callables (no
torch). Model failures are in test_runtime_failures.py; deadlines, withdrawals and
refusals in test_runtime_deadlines.py; shutdown in test_runtime_shutdown.py.

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_helpers import CostModel, Recorder, at, call_all, callable_model, config, item
from trioserve import InvalidInput, ModelConfig, ModelError, Overloaded


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
    assert before["replicas"] == [
        {"name": "batcher[m#0@cpu]", "state": "running", "health": "ready", "restarts": 0}
    ]
    assert (after["batches"], after["items"], after["fill_ratio"]) == (1, 1, 1 / 8)
    # Latencies come from trio time: exactly max_wait, to hdrhistogram's 2 digits.
    assert after["queue_wait"].count == 1
    assert after["queue_wait"].max_ms == pytest.approx(250, rel=0.01)
    assert after["end_to_end"].max_ms == pytest.approx(250, rel=0.01)


# Regression: model_ready of a model not served raised a bare KeyError('nope').
async def test_model_ready_of_a_model_not_served_is_unknown_model(autojump_clock):
    cfg = config(callable_model("m", Recorder()))
    async with trioserve.open_runtime(cfg) as rt:
        assert rt.model_ready("m")
        with pytest.raises(trioserve.UnknownModel, match=r"^unknown model 'nope'; serving: m$"):
            rt.model_ready("nope")
        with pytest.raises(trioserve.UnknownModel, match=r"^unknown model \['m'\]"):
            rt.model_ready(["m"])  # unhashable: was TypeError
    assert not rt.model_ready("m")


# Regression: a call from another trio run (trio.run in a thread of the program's)
# reached the scheduler's queue, then failed on waking it with trio's bare
# AssertionError; the request stayed queued in a runtime it did not belong to.
@pytest.mark.parametrize("many", [False, True], ids=["infer", "infer_batch"])
async def test_a_call_from_another_trio_run_is_refused_before_anything_is_queued(many):
    rec = Recorder()
    async with trioserve.open_runtime(config(callable_model("m", rec))) as rt:

        async def call():
            if many:
                return await rt.infer_batch("m", [item(1.0), item(2.0)])
            return await rt.infer("m", item(1.0))

        with pytest.raises(RuntimeError, match=r"^this runtime belongs to another trio run: "
                                               r".*trio\.from_thread\.run.*serve_in_thread"):
            await trio.to_thread.run_sync(trio.run, call)
        assert rt.statistics()["m"]["queue_depth"] == 0
        assert (await rt.infer("m", item(3.0)))["y"].tolist() == [7.0]
    assert rec.seen == [3.0]
    assert rt.statistics()["m"]["flows"]["t/realtime"]["admitted"] == 1


# Regression: entering an ``open_runtime(...)`` object a second time raised Python's
# own AttributeError ('_AsyncGeneratorContextManager' object has no attribute 'args').
async def test_an_open_runtime_object_is_entered_once(autojump_clock):
    rec = Recorder()
    opened = trioserve.open_runtime(config(callable_model("m", rec)))
    once = r"^this open_runtime\(\.\.\.\) was entered already: it is entered once"
    async with opened as rt:
        with pytest.raises(RuntimeError, match=once):  # while it runs
            async with opened:
                pass
        assert (await rt.infer("m", item(1.0)))["y"].tolist() == [3.0]  # unharmed
    with pytest.raises(RuntimeError, match=once):  # after it closed
        async with opened:
            pass
    # a new call opens a new runtime
    async with trioserve.open_runtime(config(callable_model("m", rec))) as again:
        assert (await again.infer("m", item(2.0)))["y"].tolist() == [5.0]
    assert rec.seen == [1.0, 2.0]


async def test_an_open_runtime_object_whose_entry_failed_says_so_when_entered_again():
    # It said "entered already", as if it ran, instead of its first entry's error.
    opened = trioserve.open_runtime("trioserve.toml")  # a path: refused at entry
    with pytest.raises(trioserve.ConfigError, match="load_config"):
        async with opened:
            pytest.fail("started")  # pragma: no cover
    failed = (
        r"^this open_runtime\(\.\.\.\) was entered already, and that entry failed "
        r"\(ConfigError: see its error\): it is entered once; call open_runtime\(config\) "
        r"again for another runtime$"
    )
    for _ in range(2):  # each time
        with pytest.raises(RuntimeError, match=failed):
            async with opened:
                pytest.fail("started")  # pragma: no cover
