"""A request handed over at a reload's swap (it looked the model up before the swap,
then waited: for its tenant's credits here) is checked against the inputs of the
copy it is handed to, when a load's options changed them: one of the old shape is
refused as bad input (InvalidInput, 400 over HTTP), naming the input, what the
model now takes and that it was reloaded meanwhile; nothing runs it, so it fails
no batch, counts as no model error and leaves the replicas' breakers alone. One
that fits the new copy's inputs is answered by it. The model runs inline
(``sized``: its input's width is an option)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from http_helpers import serving, v2_input
from test_http_model_control import LOAD, call
from trioserve import InvalidInput, ModelConfig, TensorSpec
from trioserve.transport import open_http

Y1 = TensorSpec(name="y", datatype="FP32", shape=(1,))


class OwnPrepare(trioserve.CallableBackend):
    """A backend that prepares its items its own way (here: as the plain one does,
    but the runtime cannot know that)."""

    def prepare(self, name, inputs):
        return super().prepare(name, inputs)


def sized(width: int = 4, own_prepare: bool = False) -> trioserve.CallableBackend:
    """A backend factory: ``y = sum(x)`` over an input ``x`` of ``width`` values
    (-1: any number), as a product with a ``width`` × 1 matrix, so that an item of
    another width fails in the model. ``own_prepare``: an :class:`OwnPrepare`."""

    def run(items):
        x = np.stack([it["x"] for it in items])
        w = np.ones((x.shape[1] if width == -1 else width, 1), np.float32)
        return [{"y": row} for row in x @ w]

    backend = OwnPrepare if own_prepare else trioserve.CallableBackend
    return backend(
        run, inputs=(TensorSpec(name="x", datatype="FP32", shape=(width,)),),
        outputs=(Y1,), execution="inline",
    )


def held_config(width: int) -> trioserve.Config:
    """The model ``m`` (``sized``, of ``width``), and a tenant with one credit,
    refilled every 2 s: a second request in the ``batch`` class waits for it.

    The tests hold the clock while they reload (:func:`held`): a reload's load waits
    for worker threads (its replica's, and the backend its options make), and an
    autojumping clock would take that wait for idleness and jump to the credits'
    refill, letting the request held in before the swap."""
    m = ModelConfig(name="m", backend=sized, options={"width": width}, max_wait_ms=0)
    return trioserve.Config(
        models=(m,),
        tenants=(trioserve.TenantConfig(name="t", default=True, credit_rate=0.5,
                                        credit_burst=1),),
        server=trioserve.ServerConfig(model_control="explicit", stream_ping_interval_s=0),
    )


@contextmanager
def held(clock: trio.testing.MockClock) -> Iterator[None]:
    """The clock moves only when told meanwhile, then autojumps again (also when a
    test fails inside: its runtime's shutdown then waits for nothing)."""
    clock.autojump_threshold = math.inf
    try:
        yield
    finally:
        clock.autojump_threshold = 0


def untouched(rt) -> None:
    """Nothing failed in the model: no model error, no poison search, no breaker."""
    stats = rt.statistics()["m"]
    assert stats["statuses"] == {}
    for b in rt.models["m"].batchers:
        assert not b._breaker.is_open(trio.current_time())
        assert b.ready


async def infer_into(outcomes: dict, rt, x: float, n: int) -> None:
    """``rt.infer`` of ``n`` values ``x`` (of the batch class); ``outcomes[x]``: the
    error it raised, or its ``y``."""
    try:
        out = await rt.infer("m", {"x": np.full(n, x, np.float32)}, priority="batch")
    except trioserve.TrioserveError as exc:
        outcomes[x] = exc
    else:
        outcomes[x] = float(out["y"][0])


async def test_a_request_of_the_old_shape_handed_over_is_refused_as_bad_input(autojump_clock):
    outcomes: dict = {}

    async def infer(x: float, n: int) -> None:
        await infer_into(outcomes, rt, x, n)

    async with trioserve.open_runtime(held_config(4)) as rt:
        async with trio.open_nursery() as callers:
            with held(autojump_clock):
                callers.start_soon(infer, 1.0, 4)  # takes the one credit
                await trio.testing.wait_all_tasks_blocked()
                callers.start_soon(infer, 2.0, 4)  # of the old width, waits 2 s for credits
                await trio.testing.wait_all_tasks_blocked()
                assert rt.credit_waits["t"] == 1
                await rt.load_model("m", config={"options": {"width": 3}})
                await trio.testing.wait_all_tasks_blocked()
                assert list(outcomes) == [1.0]  # 2.0 still waits, holding the old copy
            # time runs again: the credits come, the requests held go on
        assert outcomes[1.0] == 4.0
        refused = outcomes[2.0]
        assert type(refused) is InvalidInput
        assert str(refused) == (
            "input 'x' of model 'm': expected shape [3], got [4] (the model was "
            "reloaded while this request waited: it now takes x FP32 [3])"
        )
        untouched(rt)
        assert rt.credits_refunded["t"] == 1  # it never ran: not charged
        # the new copy serves items of its width
        out = await rt.infer("m", {"x": np.ones(3, np.float32)}, priority="batch")
        assert out["y"][0] == 3.0


async def test_a_request_that_fits_the_new_inputs_is_answered_by_the_new_copy(autojump_clock):
    """The old copy took any width; the new one takes 3: of the requests held, those
    of width 3 are answered by it, the others refused (``infer_batch``'s items all
    together)."""
    outcomes: dict = {}

    async def infer(x: float, n: int) -> None:
        await infer_into(outcomes, rt, x, n)

    async def infer_batch(x: float, n: int) -> None:
        items = [{"x": np.full(n, x, np.float32)}, {"x": np.full(n, x + 1, np.float32)}]
        try:
            out = await rt.infer_batch("m", items, priority="batch")
        except trioserve.TrioserveError as exc:
            outcomes[x] = exc
        else:
            outcomes[x] = [float(o["y"][0]) for o in out]

    async with trioserve.open_runtime(held_config(-1)) as rt:
        async with trio.open_nursery() as callers:
            with held(autojump_clock):
                callers.start_soon(infer, 1.0, 2)  # takes the one credit
                await trio.testing.wait_all_tasks_blocked()
                for x, n, call_ in ((2.0, 3, infer), (3.0, 5, infer), (10.0, 3, infer_batch),
                                    (20.0, 2, infer_batch)):
                    callers.start_soon(call_, x, n)  # each waits for its credits
                    await trio.testing.wait_all_tasks_blocked()
                await rt.load_model("m", config={"options": {"width": 3}})
                await trio.testing.wait_all_tasks_blocked()
                assert list(outcomes) == [1.0]  # the others still wait, holding the old copy
            # time runs again: the credits come, the requests held go on
        assert outcomes[1.0] == 2.0
        assert outcomes[2.0] == 6.0  # three values: the new copy's width
        assert outcomes[10.0] == [30.0, 33.0]
        for x, n in ((3.0, 5), (20.0, 2)):
            assert type(outcomes[x]) is InvalidInput
            assert str(outcomes[x]) == (
                f"input 'x' of model 'm': expected shape [3], got [{n}] (the model was "
                "reloaded while this request waited: it now takes x FP32 [3])"
            )
        untouched(rt)


async def test_over_http_a_request_of_the_old_shape_handed_over_is_a_400(autojump_clock):
    async with serving(held_config(4)) as gw:
        answers: dict = {}

        async def infer(x: float) -> None:
            async with open_http(gw.url) as http:
                res = await http.infer("m", [v2_input(np.full((1, 4), x, np.float32))],
                                       parameters={"priority": "batch"})
                answers[x] = (res.status, res.json() if res.status != 200 else
                              res.outputs()["y"].tolist())

        async with trio.open_nursery() as callers:
            with held(autojump_clock):
                callers.start_soon(infer, 1.0)
                await trio.testing.wait_all_tasks_blocked()
                callers.start_soon(infer, 2.0)  # waits for credits, validated as width 4
                await trio.testing.wait_all_tasks_blocked()
                assert gw.runtime.credit_waits["t"] == 1
                res = await call(gw, "POST", LOAD, b'{"parameters": {"config": '
                                 b'{"options": {"width": 3}}}}')
                assert res.status == 200
                await trio.testing.wait_all_tasks_blocked()
                assert list(answers) == [1.0]  # 2.0 still waits, holding the old copy
            # time runs again: the credits come, the requests held go on
        assert answers[1.0] == (200, [[4.0]])
        assert answers[2.0] == (400, {"error": (
            "input 'x' of model 'm': expected shape [3], got [4] (the model was "
            "reloaded while this request waited: it now takes x FP32 [3])"
        )})
        untouched(gw.runtime)


@pytest.mark.parametrize("width", [4, -1])
async def test_a_reload_that_keeps_the_inputs_hands_requests_over_unchecked(
    autojump_clock, width
):
    """Options that leave the inputs as they were: no check at the hand-over."""
    outcomes: dict = {}

    async def infer(x: float) -> None:
        out = await rt.infer("m", {"x": np.full(4, x, np.float32)}, priority="batch")
        outcomes[x] = float(out["y"][0])

    async with trioserve.open_runtime(held_config(width)) as rt:
        old = rt.models["m"].scheduler
        async with trio.open_nursery() as callers:
            with held(autojump_clock):
                callers.start_soon(infer, 1.0)
                await trio.testing.wait_all_tasks_blocked()
                callers.start_soon(infer, 2.0)
                await trio.testing.wait_all_tasks_blocked()
                await rt.load_model("m", config={"options": {"width": width}, "max_batch_size": 8})
                await trio.testing.wait_all_tasks_blocked()
                assert list(outcomes) == [1.0]  # 2.0 still waits, holding the old copy
            # time runs again: the credits come, the requests held go on
            assert old.successor is rt.models["m"].scheduler
            assert old.handed_check is None
        assert outcomes == {1.0: 4.0, 2.0: 8.0}


@pytest.mark.parametrize(
    ("reloads", "expected"),
    [
        # the copy between takes other inputs; the one serving takes the old again
        pytest.param([{"width": 3}, None], 8.0, id="back-to-the-table"),
        # ... and prepares its items its own way: a request handed over to it would
        # be refused ("send the request again"); it goes past it, to the copy serving
        pytest.param([{"width": 3, "own_prepare": True}, None], 8.0,
                     id="back-to-the-table-past-its-own-prepare"),
        pytest.param([{"width": 3}, {"width": -1}], 8.0, id="then-any"),
        # the copy between takes the old inputs; the one serving other ones
        pytest.param([{"width": -1}, {"width": 3}], (
            "input 'x' of model 'm': expected shape [3], got [4] (the model was "
            "reloaded while this request waited: it now takes x FP32 [3])"
        ), id="then-other"),
    ],
)
async def test_a_request_handed_over_across_two_reloads_is_checked_against_the_copy_serving(
    autojump_clock, reloads, expected
):
    """Two reloads while the request waits: it is checked against the inputs of the
    copy serving when it goes on (the one it is handed to), whatever the copy between
    them took."""
    outcomes: dict = {}
    async with trioserve.open_runtime(held_config(4)) as rt:
        async with trio.open_nursery() as callers:
            with held(autojump_clock):
                callers.start_soon(infer_into, outcomes, rt, 1.0, 4)  # takes the credit
                await trio.testing.wait_all_tasks_blocked()
                callers.start_soon(infer_into, outcomes, rt, 2.0, 4)  # waits for credits
                await trio.testing.wait_all_tasks_blocked()
                assert rt.credit_waits["t"] == 1
                for options in reloads:
                    await rt.load_model(
                        "m", config=None if options is None else {"options": options}
                    )
                await trio.testing.wait_all_tasks_blocked()
                assert list(outcomes) == [1.0]
        assert outcomes[1.0] == 4.0
        outcome = outcomes[2.0]
        if isinstance(expected, str):
            assert (type(outcome), str(outcome)) == (InvalidInput, expected)
        else:
            assert outcome == expected
        untouched(rt)
