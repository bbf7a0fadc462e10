"""The Retry-After of a request for a model whose first load is under way: what the
model's last load in this process took, less what this load has run, rounded up to
whole seconds and within [1, 30]; 1 when the model has not loaded before. Made when
each request is refused, from trio time, so every figure is exact under the
MockClock: the model's worker starts take ``workers.load_s`` trio seconds."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing
import trioserve
from http_helpers import config, echo_model, serving
from runtime_helpers import item
from test_model_control import control_config, workers  # noqa: F401  (fixture)
from test_model_control_answers import LOADING, answers_of, m_model
from trioserve import Overloaded, Request
from trioserve._not_loaded import LOADING_RETRY_MAX_S, LOADING_RETRY_MIN_S, loading_retry_after
from trioserve.actors import BatchLimits, FairQueue, SchedulerActor


async def retry_after(rt) -> float:
    """The ``retry_after`` a request for model 'm' is refused with now (it must be
    refused as loading)."""
    with pytest.raises(Overloaded, match="'m' is loading") as caught:
        await rt.infer("m", item(1.0))
    return caught.value.retry_after


def request() -> Request:
    return Request(model="m", item=None, cost=1, tenant="t", priority="default",
                   arrival=0.0, deadline=math.inf, answer_expiry=False)


async def timed_load(rt, load_s: float, workers) -> float:  # noqa: F811
    """Load model 'm' with worker starts of ``load_s``; return how long it took."""
    workers.load_s = load_s
    t0 = trio.current_time()
    await rt.load_model("m")
    return trio.current_time() - t0


def test_the_estimate_is_what_the_last_load_has_left_rounded_up_within_bounds():
    assert (LOADING_RETRY_MIN_S, LOADING_RETRY_MAX_S) == (1, 30)
    assert loading_retry_after(None, 0.0) == 1.0  # no history: the least
    assert loading_retry_after(None, 100.0) == 1.0
    assert loading_retry_after(12.0, 0.0) == 12.0
    assert loading_retry_after(12.0, 5.0) == 7.0
    assert loading_retry_after(12.0, 4.5) == 8.0  # 7.5 s left: rounded up
    assert loading_retry_after(12.0, 11.9) == 1.0
    assert loading_retry_after(12.0, 12.0) == 1.0  # due: never 0
    assert loading_retry_after(12.0, 40.0) == 1.0  # overdue
    assert loading_retry_after(100.0, 0.0) == 30.0
    assert loading_retry_after(100.0, 75.0) == 25.0
    assert loading_retry_after(0.0, 0.0) == 1.0  # a load that took no time


async def test_a_model_never_loaded_is_told_to_retry_after_1_s(autojump_clock, workers):  # noqa: F811
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        workers.load_s = 20.0
        async with trio.open_nursery() as ops:
            ops.start_soon(rt.load_model, "m")
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            assert rt.model_state("m") == ("LOADING", "loading")
            assert await retry_after(rt) == 1.0
            await trio.sleep(5.0)
            assert await retry_after(rt) == 1.0
            await trio.sleep_until(t0 + 19.5)
            assert await retry_after(rt) == 1.0
        assert rt.model_state("m") == ("READY", "")


async def test_a_load_after_a_12_s_load_is_told_what_is_left_of_12_s(autojump_clock, workers):  # noqa: F811
    """The second load of a model whose first took 12 s: 12 at its start, 7 after
    5 s, 8 after 4.5 s (rounded up), 1 once it has run 12 s and more (overdue)."""
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        assert await timed_load(rt, 12.0, workers) == 12.0
        await rt.unload_model("m")
        workers.load_s = 20.0  # this one runs late
        async with trio.open_nursery() as ops:
            ops.start_soon(rt.load_model, "m")
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            assert rt.model_state("m") == ("LOADING", "loading")
            assert await retry_after(rt) == 12.0
            await trio.sleep_until(t0 + 4.5)
            assert await retry_after(rt) == 8.0
            await trio.sleep_until(t0 + 5.0)
            assert await retry_after(rt) == 7.0
            await trio.sleep_until(t0 + 11.0)
            assert await retry_after(rt) == 1.0
            await trio.sleep_until(t0 + 12.5)
            assert await retry_after(rt) == 1.0
            await trio.sleep_until(t0 + 19.0)
            assert await retry_after(rt) == 1.0
            assert rt.model_state("m") == ("LOADING", "loading")
        assert trio.current_time() == t0 + 20.0
        # and the next load expects 20 s: the last load's, not the first's
        await rt.unload_model("m")
        async with trio.open_nursery() as ops:
            ops.start_soon(rt.load_model, "m")
            await trio.testing.wait_all_tasks_blocked()
            assert await retry_after(rt) == 20.0
            ops.cancel_scope.cancel("enough")
        await rt.unload_model("m")


async def test_a_reload_is_a_load_of_the_model_too(autojump_clock, workers):  # noqa: F811
    """A reload (while the loaded copy serves: never refused) counts as the model's
    last load: after a 12 s load and a 3 s reload, the next first load expects 3 s."""
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        assert await timed_load(rt, 12.0, workers) == 12.0
        assert await timed_load(rt, 3.0, workers) == 3.0  # a reload
        await rt.unload_model("m")
        workers.load_s = 10.0
        async with trio.open_nursery() as ops:
            ops.start_soon(rt.load_model, "m")
            await trio.testing.wait_all_tasks_blocked()
            assert await retry_after(rt) == 3.0
            await trio.sleep(1.0)
            assert await retry_after(rt) == 2.0


async def test_a_load_that_failed_or_was_abandoned_is_no_history(autojump_clock, workers):  # noqa: F811
    """Only a load that installed a copy tells what a load takes: one that failed
    (after 12 s) or one an unload abandoned (after 6 s) leaves the model with no
    history."""
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        workers.load_s, workers.fail = 12.0, True
        with pytest.raises(trioserve.ModelLoadError):
            await rt.load_model("m")
        workers.fail = False
        abandoned: list[str] = []

        async def load() -> None:
            try:
                await rt.load_model("m")
            except trioserve.ModelLoadError as exc:
                abandoned.append(str(exc))

        async with trio.open_nursery() as ops:
            ops.start_soon(load)
            await trio.sleep(6.0)
            assert await retry_after(rt) == 1.0
            await rt.unload_model("m")
        assert len(abandoned) == 1
        assert "its load was abandoned" in abandoned[0]
        async with trio.open_nursery() as ops:
            ops.start_soon(rt.load_model, "m")
            await trio.testing.wait_all_tasks_blocked()
            assert await retry_after(rt) == 1.0
            await trio.sleep(5.0)
            assert await retry_after(rt) == 1.0


async def test_a_load_time_of_minutes_is_told_to_retry_after_30_s_at_most(
    autojump_clock, workers  # noqa: F811
):
    """The clamp: after a 100 s load the next is told 30 s until 70 s have passed,
    then what is left (25 s after 75 s)."""
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        assert await timed_load(rt, 100.0, workers) == 100.0
        await rt.unload_model("m")
        async with trio.open_nursery() as ops:
            ops.start_soon(rt.load_model, "m")
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            assert await retry_after(rt) == 30.0
            await trio.sleep_until(t0 + 69.0)
            assert await retry_after(rt) == 30.0
            await trio.sleep_until(t0 + 75.0)
            assert await retry_after(rt) == 25.0


async def test_a_request_handed_to_the_stand_in_is_told_what_is_left_then(
    autojump_clock, workers  # noqa: F811
):
    """The stand-in of a model loading (which a request that looked up a copy since
    unloaded is handed over to) makes its refusal when the request comes, not when
    the load began."""
    async with trioserve.open_runtime(control_config(load_at_start=False)) as rt:
        await timed_load(rt, 12.0, workers)
        await rt.unload_model("m")
        async with trio.open_nursery() as ops:
            ops.start_soon(rt.load_model, "m")
            await trio.testing.wait_all_tasks_blocked()
            stand_in = rt.models["m"]
            assert not stand_in.loaded
            with pytest.raises(Overloaded, match="'m' is loading") as caught:
                stand_in.scheduler.submit_nowait(request())
            assert caught.value.retry_after == 12.0
            await trio.sleep(5.0)
            with pytest.raises(Overloaded, match="'m' is loading") as caught:
                stand_in.scheduler.submit_all_nowait([request()])
            assert caught.value.retry_after == 7.0


def test_a_queue_retired_with_a_refusal_makes_each_request_s_error_anew():
    queue = FairQueue(BatchLimits(max_size=4), bound=16, model="m", adaptive=False)
    scheduler = SchedulerActor("m", queue)
    made: list[Overloaded] = []

    def refusal() -> Overloaded:
        made.append(Overloaded(f"refusal {len(made)}", retry_after=len(made) + 1))
        return made[-1]

    scheduler.retire(Overloaded("at the retire"), refusal=refusal)
    for n in range(2):
        with pytest.raises(Overloaded, match=f"refusal {n}") as caught:
            scheduler.submit_nowait(request())
        assert caught.value.retry_after == n + 1
    scheduler.retire(Overloaded("fixed"))  # retired again, with an error of its own
    with pytest.raises(Overloaded, match="fixed"):
        scheduler.submit_nowait(request())
    assert len(made) == 2


async def test_every_entry_point_gives_the_estimate(autojump_clock, workers):  # noqa: F811
    """HTTP infer and metadata (the Retry-After header), the stream (the 503 frame's
    ``retry_after``) and the embedding API give the same figure."""
    async with serving(config(m_model(), echo_model(),
                              server={"model_control": "explicit"})) as gw:
        rt = gw.runtime
        assert await timed_load(rt, 100.0, workers) == 100.0
        await rt.unload_model("m")
        workers.load_s = 200.0
        async with trio.open_nursery() as ops:
            ops.start_soon(rt.load_model, "m")
            await trio.testing.wait_all_tasks_blocked()
            # (well within the clamp: the HTTP round trips may move the clock a little)
            assert await answers_of(gw) == {
                "rt": ("Overloaded", LOADING, 30.0),
                "infer": (503, LOADING, "30"),
                "metadata": (503, LOADING, "30"),
                "stream": (503, LOADING, 30),
            }
            ops.cancel_scope.cancel("enough")  # (the load goes on; the shutdown ends it)
