"""A copy of a model replaced by a reload (its ``ServedModel``: its queues, replicas
and loaded model) lives as long as a request that looked it up, or that it may have
run, waits for its answer, and no longer: however it was reloaded (``load_model``
here, with no request through the gateway since), and whether or not the gateway
looked the model up since."""

from __future__ import annotations

import functools
import gc
import weakref

import numpy as np
import trio
import trio.testing
from http_helpers import serving, v2_input
from test_model_control_handover import held
from test_model_control_handover_outputs import Turnstile, answered, staged_config
from trioserve.transport import open_http


def alive(refs: list[weakref.ref]) -> list[bool]:
    gc.collect()
    return [ref() is not None for ref in refs]


async def test_copies_reloaded_with_no_request_since_are_dropped(autojump_clock):
    async with serving(staged_config(Turnstile())) as gw:
        rt = gw.runtime
        replaced = []
        for width in range(2, 7):
            replaced.append(weakref.ref(rt.models["m"]))
            await rt.load_model("m", {"options": {"width": width}})
        await trio.testing.wait_all_tasks_blocked()  # the copies replaced drain
        assert alive(replaced) == [False] * 5
        # the gateway's signature is the serving copy's
        async with open_http(gw.url) as http:
            res = await http.infer("m", [v2_input(np.asarray([[1, 2]], np.float32))])
            assert answered(res) == (200, {"y": ("FP32", [1, 6], [3.0] * 6)})
            meta = (await http.get("/v2/models/m")).json()
            assert meta["outputs"][0]["shape"] == [-1, 6]


async def test_copies_reloaded_while_a_request_waits_are_dropped_once_it_is_answered(
    autojump_clock
):
    """The request looked up the first copy (it waits for its tenant's credits):
    any of the copies loaded since may run it, so all are kept until it is
    answered (by the last, with its outputs), then dropped."""
    async with serving(staged_config(Turnstile())) as gw:
        rt = gw.runtime
        answers: dict = {}

        async def infer(key: str, **kw) -> None:
            async with open_http(gw.url) as http:
                res = await http.infer("m", [v2_input(np.asarray([[1, 2]], np.float32))], **kw)
                answers[key] = answered(res)

        replaced = []
        async with trio.open_nursery() as callers:
            with held(autojump_clock):
                callers.start_soon(infer, "first")
                await trio.testing.wait_all_tasks_blocked()
                callers.start_soon(functools.partial(
                    infer, "held", parameters={"priority": "batch"}
                ))
                await trio.testing.wait_all_tasks_blocked()
                assert rt.credit_waits["t"] == 1
                for width in range(2, 7):
                    replaced.append(weakref.ref(rt.models["m"]))
                    await rt.load_model("m", {"options": {"width": width}})
                await trio.testing.wait_all_tasks_blocked()
                assert list(answers) == ["first"]
                assert alive(replaced) == [True] * 5  # it may run on any of them
            # time runs again: the credit comes, the request goes on
        assert answers["held"] == (200, {"y": ("FP32", [1, 6], [3.0] * 6)})
        assert alive(replaced) == [False] * 5
