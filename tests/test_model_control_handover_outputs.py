"""A request handed over at a reload's swap (it looked the model up before the swap,
then waited for its tenant's credits) to a copy whose model declares other outputs
(a load's options changed an output's width, name or datatype) is answered as that
copy returned it: its outputs, each with the datatype and shape of what it holds, as
the model's metadata now says, JSON or binary. An output asked for by a name the new
copy no longer has is a 400, as the gateway answers an unknown output. A request the
old copy ran, answered after the swap, is answered as the old copy returned it. So
across several reloads in a row: a request handed over to a copy that a later reload
replaced while it ran the request is answered as that copy returned it, and a copy
replaced is dropped once no request it may have run waits for its answer."""

from __future__ import annotations

import functools
import gc
import threading
import weakref

import attrs
import numpy as np
import orjson
import pytest
import trio
import trio.testing
import trioserve
from http_helpers import GATE_LIMIT_S, serving, v2_input
from test_http_model_control import LOAD, call
from test_model_control_handover import held
from trioserve import ModelConfig, TensorSpec
from trioserve.transport import open_http, open_stream

X = TensorSpec(name="x", datatype="FP32", shape=(2,))
DTYPES = {"FP32": np.float32, "INT64": np.int64}


def shaped(width: int = 1, name: str = "y", datatype: str = "FP32",
           gate: threading.Event | None = None) -> trioserve.CallableBackend:
    """A backend factory: its output ``name`` holds ``width`` copies of ``sum(x)``,
    of ``datatype``. ``gate``: the model waits for it (in its worker thread)."""

    def run(items):
        if gate is not None:
            gate.wait(10)
        return [{name: np.full(width, it["x"].sum(), DTYPES[datatype])} for it in items]

    return trioserve.CallableBackend(
        run, inputs=(X,),
        outputs=(TensorSpec(name=name, datatype=datatype, shape=(width,)),),
        execution="inline" if gate is None else "thread",
    )


def held_config(**options) -> trioserve.Config:
    """The model ``m`` (``shaped``), and a tenant with one credit, refilled every
    2 s: a second request in the ``batch`` class waits for it."""
    m = ModelConfig(name="m", backend=shaped, options=options, max_wait_ms=0)
    return trioserve.Config(
        models=(m,),
        tenants=(trioserve.TenantConfig(name="t", default=True, credit_rate=0.5,
                                        credit_burst=1),),
        server=trioserve.ServerConfig(model_control="explicit", stream_ping_interval_s=0),
    )


def answered(res) -> tuple[int, dict]:
    """An answer's status and its outputs, name -> (datatype, shape, values), as the
    answer describes them (checked against the values it carries), or its error."""
    if res.status != 200:
        return res.status, res.json()
    hlen = res.headers.get("inference-header-content-length")
    doc = res.json() if hlen is None else orjson.loads(res.body[: int(hlen)])
    arrays = res.outputs()
    out = {}
    for o in doc["outputs"]:
        arr = arrays[o["name"]]
        assert list(arr.shape) == o["shape"]
        assert arr.dtype == DTYPES[o["datatype"]]
        out[o["name"]] = (o["datatype"], o["shape"], arr.reshape(-1).tolist())
    return 200, out


async def reload_under_a_held_request(gw, clock, options: dict, **kw) -> dict:
    """Two requests of ``x = [1, 2]`` (``kw``: the second's parameters, outputs):
    the first takes the one credit, the second waits for the next while ``m`` is
    reloaded with ``options``; returns each one's :func:`answered`."""
    answers: dict = {}

    async def infer(key: str, **kw) -> None:
        async with open_http(gw.url) as http:
            res = await http.infer("m", [v2_input(np.asarray([[1, 2]], np.float32))], **kw)
            answers[key] = answered(res)

    async with trio.open_nursery() as callers:
        with held(clock):
            callers.start_soon(infer, "first")
            await trio.testing.wait_all_tasks_blocked()
            callers.start_soon(functools.partial(infer, "held", **kw))  # waits for credits
            await trio.testing.wait_all_tasks_blocked()
            assert gw.runtime.credit_waits["t"] == 1
            body = orjson.dumps({"parameters": {"config": {"options": options}}})
            res = await call(gw, "POST", LOAD, body)
            assert res.status == 200, res.body
            await trio.testing.wait_all_tasks_blocked()
            assert list(answers) == ["first"]  # still waits, holding the old copy
        # time runs again: the credits come, the request held goes on
    return answers


PARAMS = [
    pytest.param({}, id="json"),
    pytest.param({"binary_data_output": True}, id="binary"),
]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("asked", [None, ["y"]], ids=["all", "asked"])
@pytest.mark.parametrize(
    ("options", "expected"),
    [
        pytest.param({"width": 3}, ("FP32", [1, 3], [3.0, 3.0, 3.0]), id="width"),
        pytest.param({"datatype": "INT64"}, ("INT64", [1, 1], [3]), id="datatype"),
    ],
)
async def test_an_output_changed_by_the_reload_is_answered_as_the_new_copy_returned_it(
    autojump_clock, params, asked, options, expected
):
    async with serving(held_config()) as gw:
        kw = {"parameters": {"priority": "batch", **params}}
        if asked is not None:
            kw["outputs"] = asked
        answers = await reload_under_a_held_request(gw, autojump_clock, options, **kw)
        assert answers["first"] == (200, {"y": ("FP32", [1, 1], [3.0])})
        assert answers["held"] == (200, {"y": expected})
        # as the model's metadata now says, and as a request sent now is answered
        async with open_http(gw.url) as http:
            meta = (await http.get("/v2/models/m")).json()
            assert meta["outputs"] == [{"name": "y", "datatype": expected[0],
                                        "shape": [-1, expected[1][1]]}]
        assert gw.runtime.statistics()["m"]["statuses"] == {}


@pytest.mark.parametrize("params", PARAMS)
async def test_an_output_renamed_by_the_reload_is_answered_by_its_new_name(
    autojump_clock, params
):
    async with serving(held_config()) as gw:
        answers = await reload_under_a_held_request(
            gw, autojump_clock, {"name": "z"}, parameters={"priority": "batch", **params}
        )
        assert answers["held"] == (200, {"z": ("FP32", [1, 1], [3.0])})


@pytest.mark.parametrize("params", PARAMS)
async def test_an_output_asked_for_that_the_reload_removed_is_a_400(autojump_clock, params):
    async with serving(held_config()) as gw:
        answers = await reload_under_a_held_request(
            gw, autojump_clock, {"name": "z"}, parameters={"priority": "batch", **params},
            outputs=["y"],
        )
        assert answers["held"] == (400, {"error": (
            "model 'm': unknown output 'y'; expected z (the model was reloaded while "
            "this request waited: it now gives z FP32 [1])"
        )})


async def test_a_request_the_old_copy_ran_is_answered_as_it_returned_it(autojump_clock):
    """Dispatched to the old copy before the swap, answered after it: the old
    copy's outputs, though the model's metadata says the new copy's by then."""
    gate = threading.Event()
    async with serving(held_config(gate=gate)) as gw:
        answers: dict = {}
        done = trio.Event()

        async def infer() -> None:
            async with open_http(gw.url) as http:
                res = await http.infer("m", [v2_input(np.asarray([[1, 2]], np.float32))])
                answers["ran"] = answered(res)
                done.set()

        async with trio.open_nursery() as callers:
            with held(autojump_clock):
                callers.start_soon(infer)
                await trio.testing.wait_all_tasks_blocked()  # in the model, at the gate
                body = orjson.dumps({"parameters": {"config": {"options": {"width": 3}}}})
                res = await call(gw, "POST", LOAD, body)
                assert res.status == 200, res.body
                assert gw.signatures["m"].outputs[0].shape == (3,)
                assert answers == {}
                gate.set()
                await done.wait()  # (held: the drain's bound does not pass meanwhile)
        assert answers["ran"] == (200, {"y": ("FP32", [1, 1], [3.0])})


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        pytest.param(None, {"z": [[3.0]]}, id="all"),
        pytest.param(["y"], (400, "model 'm': unknown output 'y'; expected z (the model "
                             "was reloaded while this request waited: it now gives z "
                             "FP32 [1])"), id="asked"),
    ],
)
async def test_on_a_stream_a_request_handed_over_is_answered_as_the_new_copy_returned_it(
    autojump_clock, asked, expected
):
    async with serving(held_config()) as gw, open_stream(gw.url) as stream:
        kw = {"parameters": {"priority": "batch"}}
        if asked is not None:
            kw["outputs"] = asked
        with held(autojump_clock):
            await stream.send(1, "m", [v2_input(np.asarray([[1, 2]], np.float32))])
            await trio.testing.wait_all_tasks_blocked()
            await stream.send(2, "m", [v2_input(np.asarray([[1, 2]], np.float32))], **kw)
            await trio.testing.wait_all_tasks_blocked()
            assert gw.runtime.credit_waits["t"] == 1
            body = orjson.dumps({"parameters": {"config": {"options": {"name": "z"}}}})
            res = await call(gw, "POST", LOAD, body)
            assert res.status == 200, res.body
            first = await stream.receive()
            assert first.id == 1
            assert first.outputs["y"].tolist() == [[3.0]]
        held_reply = await stream.receive()
        assert held_reply.id == 2
        if asked is None:
            assert held_reply.status == 200
            assert {k: v.tolist() for k, v in held_reply.outputs.items()} == expected
            assert held_reply.outputs["z"].dtype == np.float32
        else:
            assert (held_reply.status, held_reply.error) == expected


class Turnstile:
    """Where the copies loaded with ``gated`` wait (in their worker thread) until
    :meth:`open`; ``entered`` is set once one waits there."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def open(self) -> None:
        self.opened.set()


def staged(width: int = 1, datatype: str = "FP32", name: str = "y", gated: bool = False,
           turnstile: Turnstile | None = None) -> trioserve.CallableBackend:
    """A backend factory: its output ``name`` holds ``width`` copies of ``sum(x)``,
    of ``datatype``; a copy loaded ``gated`` runs in a worker thread and waits at
    ``turnstile``."""

    def run(items):
        if gated:
            assert turnstile is not None
            turnstile.entered.set()
            turnstile.opened.wait(GATE_LIMIT_S)
        return [{name: np.full(width, it["x"].sum(), DTYPES[datatype])} for it in items]

    return trioserve.CallableBackend(
        run, inputs=(X,), outputs=(TensorSpec(name=name, datatype=datatype, shape=(width,)),),
        execution="thread" if gated else "inline",
    )


def staged_config(turnstile: Turnstile) -> trioserve.Config:
    """As :func:`held_config`, of :func:`staged` (the table: one FP32, not gated)."""
    m = ModelConfig(name="m", backend=staged, options={"turnstile": turnstile}, max_wait_ms=0)
    return attrs.evolve(held_config(), models=(m,))


async def reload(gw, options: dict | None) -> None:
    """Reload ``m`` over HTTP with ``options`` (None: the table, as configured)."""
    body = b""
    if options is not None:
        body = orjson.dumps({"parameters": {"config": {"options": options}}})
    res = await call(gw, "POST", LOAD, body)
    assert res.status == 200, res.body


GATED = {"width": 3, "gated": True}


async def ran_between_reloads(
    gw, clock, turnstile: Turnstile, before: list, after: list, copies: list | None = None,
    **kw,
) -> dict:
    """A request (``kw``: its parameters) checked against the copy serving now waits
    for its credits while ``m`` is reloaded with each of ``before`` (the last one
    gated), is then handed over to the copy serving, which runs it, and while that
    copy runs it ``m`` is reloaded with each of ``after``. Returns each request's
    :func:`answered` (``first``: the one that took the credit; ``held``).
    ``copies``: each copy's ``ServedModel`` is appended to it, in turn."""
    answers: dict = {}
    done = trio.Event()
    copies = [] if copies is None else copies
    copies.append(gw.runtime.models["m"])

    async def infer(key: str, **kw) -> None:
        async with open_http(gw.url) as http:
            res = await http.infer("m", [v2_input(np.asarray([[1, 2]], np.float32))], **kw)
            answers[key] = answered(res)
        if key == "held":
            done.set()

    async def reloaded(options: dict | None) -> None:
        await reload(gw, options)
        copies.append(gw.runtime.models["m"])

    async with trio.open_nursery() as callers:
        with held(clock):
            callers.start_soon(infer, "first")
            await trio.testing.wait_all_tasks_blocked()
            callers.start_soon(functools.partial(infer, "held", **kw))
            await trio.testing.wait_all_tasks_blocked()
            assert gw.runtime.credit_waits["t"] == 1
            for options in before:
                await reloaded(options)
            clock.jump(2)  # the credit comes: the request is handed over
            await trio.to_thread.run_sync(turnstile.entered.wait, GATE_LIMIT_S)
            for options in after:
                await reloaded(options)
            assert answers == {"first": (200, {"y": ("FP32", [1, 1], [3.0])})}
            turnstile.open()
            await done.wait()  # (held: the drain's bound does not pass meanwhile)
    return answers


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param([GATED], [{"width": 5}], id="two"),
        # the last copy is the table's again: the first copy's backend serves again
        pytest.param([GATED], [None], id="two-back-to-the-table"),
        pytest.param([{"width": 2}, GATED], [{"datatype": "INT64"}], id="three-handed-twice"),
        pytest.param([GATED], [{"width": 5}, {"datatype": "INT64"}], id="three-replaced-twice"),
        pytest.param([GATED], [{"width": 5}, None], id="three-back-to-the-table"),
    ],
)
async def test_a_request_a_copy_between_two_reloads_ran_is_answered_as_it_returned_it(
    autojump_clock, params, before, after
):
    """The request is answered with the outputs of the copy that ran it, though
    neither the copy it looked up nor the one serving when it is answered declares
    them (:func:`ran_between_reloads`)."""
    turnstile = Turnstile()
    async with serving(staged_config(turnstile)) as gw:
        answers = await ran_between_reloads(
            gw, autojump_clock, turnstile, before, after,
            parameters={"priority": "batch", **params},
        )
        assert answers["held"] == (200, {"y": ("FP32", [1, 3], [3.0, 3.0, 3.0])})
        assert gw.runtime.statistics()["m"]["statuses"] == {}
        # a request sent now is answered by the copy serving, as its metadata says
        last = after[-1] or {}
        async with open_http(gw.url) as http:
            res = await http.infer("m", [v2_input(np.asarray([[1, 2]], np.float32))],
                                   parameters={"priority": "batch"})  # (waits for credits)
            datatype, width = last.get("datatype", "FP32"), last.get("width", 1)
            assert answered(res) == (200, {"y": (datatype, [1, width], [3] * width)})
            meta = (await http.get("/v2/models/m")).json()
            assert meta["outputs"] == [{"name": "y", "datatype": datatype,
                                        "shape": [-1, width]}]


async def test_an_output_asked_for_that_the_copy_between_two_reloads_lacks_is_a_400(
    autojump_clock
):
    """The copy that ran it has no ``y`` (it names its output ``z``), though the
    copies before and after it have: a 400 naming what that copy gives."""
    turnstile = Turnstile()
    async with serving(staged_config(turnstile)) as gw:
        answers = await ran_between_reloads(
            gw, autojump_clock, turnstile, [{**GATED, "name": "z"}], [None],
            parameters={"priority": "batch"}, outputs=["y"],
        )
        assert answers["held"] == (400, {"error": (
            "model 'm': unknown output 'y'; expected z (the model was reloaded while "
            "this request waited: it now gives z FP32 [3])"
        )})


async def test_a_replaced_copy_is_dropped_once_no_request_it_may_have_run_waits(
    autojump_clock
):
    """A replaced copy (its ``ServedModel``, and the signature an answer made of
    it) is kept for as long as a request that may have run on it waits for its
    answer, and no longer: once the requests are answered, and the model reloaded
    again, nothing holds them (the control forgets each copy once it has drained)."""
    turnstile = Turnstile()
    async with serving(staged_config(turnstile)) as gw:
        copies: list = []
        answers = await ran_between_reloads(
            gw, autojump_clock, turnstile, [GATED], [{"width": 5}, None], copies,
            parameters={"priority": "batch"},
        )
        assert answers["held"][0] == 200
        await reload(gw, {"width": 2})
        async with open_http(gw.url) as http:  # the signature of the copy serving
            res = await http.infer("m", [v2_input(np.asarray([[1, 2]], np.float32))],
                                   parameters={"priority": "batch"})
            assert answered(res) == (200, {"y": ("FP32", [1, 2], [3.0, 3.0])})
        assert len(copies) == 4
        gone = [weakref.ref(c) for c in copies]
        del copies
        await trio.testing.wait_all_tasks_blocked()  # the copy replaced last drains
        gc.collect()
        assert [ref() for ref in gone] == [None] * 4


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        pytest.param(None, (200, {"z": [[3.0, 3.0, 3.0]]}), id="all"),
        pytest.param(["y"], (400, "model 'm': unknown output 'y'; expected z (the model "
                             "was reloaded while this request waited: it now gives z "
                             "FP32 [3])"), id="asked"),
    ],
)
async def test_on_a_stream_a_request_a_copy_between_two_reloads_ran_is_answered_as_it_returned_it(
    autojump_clock, asked, expected
):
    """As over HTTP (:func:`ran_between_reloads`): the copy that ran it names its
    output ``z``; the one the request looked up and the one serving when it is
    answered name it ``y``."""
    turnstile = Turnstile()
    x = [v2_input(np.asarray([[1, 2]], np.float32))]
    async with serving(staged_config(turnstile)) as gw, open_stream(gw.url) as stream:
        kw = {"parameters": {"priority": "batch"}}
        if asked is not None:
            kw["outputs"] = asked
        with held(autojump_clock):
            await stream.send(1, "m", x)
            await trio.testing.wait_all_tasks_blocked()
            await stream.send(2, "m", x, **kw)
            await trio.testing.wait_all_tasks_blocked()
            assert gw.runtime.credit_waits["t"] == 1
            await reload(gw, {**GATED, "name": "z"})
            autojump_clock.jump(2)  # the credit comes: the request is handed over
            await trio.to_thread.run_sync(turnstile.entered.wait, GATE_LIMIT_S)
            await reload(gw, {"width": 5})
            await reload(gw, None)
            first = await stream.receive()
            assert (first.id, first.outputs["y"].tolist()) == (1, [[3.0]])
            turnstile.open()
            reply = await stream.receive()
        assert reply.id == 2
        if reply.status == 200:
            assert (200, {k: v.tolist() for k, v in reply.outputs.items()}) == expected
            assert reply.outputs["z"].dtype == np.float32
        else:
            assert (reply.status, reply.error) == expected
