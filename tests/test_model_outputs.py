"""A model's outputs against its declared signature, in-process: the caller of an item
whose output the signature does not allow gets a ModelError naming the model and the
output (over HTTP the same words, as a 500); an output numpy can convert (float64 or
a list for FP32) comes back as the declared datatype; a batch answered with another
number of outputs fails every caller, none getting another's row. Checked where the
model runs: inline, in a worker thread, in a worker process."""

from __future__ import annotations

import os

import numpy as np
import orjson
import pytest
import trio
import trioserve
from http_helpers import config as http_config
from http_helpers import serving
from runtime_helpers import (
    OFF_SIGNATURE,
    callable_model,
    config,
    item,
    key,
    off_signature,
    pythonpath_with,
)
from trioserve import ModelConfig, ModelError, TensorSpec
from trioserve.transport import open_http

TESTS = os.path.dirname(os.path.abspath(__file__))
DECLARES = "the model declares"
#: x[0] -> the error its caller gets (the others of OFF_SIGNATURE are converted)
REFUSED = {
    3.0: "model 'm' returned no output 'y', which it declares (it returned 'z')",
    4.0: f"model 'm': output 'y' holds strings, {DECLARES} FP32",
    5.0: f"model 'm': output 'y' has shape [1, 2] per item, {DECLARES} [-1]",
    6.0: f"model 'm': output 'y' has shape [] per item, {DECLARES} [-1]",
    7.0: f"model 'm': output 'y' holds Python objects, {DECLARES} FP32",
    8.0: f"model 'm': output 'y' is of numpy dtype complex64, {DECLARES} FP32",
}
CONVERTED = sorted(set(OFF_SIGNATURE) - set(REFUSED))


def off_signature_config(execution: str, **cfg) -> trioserve.Config:
    return config(
        callable_model(
            "m", off_signature, execution=execution, **{"max_wait_ms": 0, "timeout_ms": None, **cfg}
        ),
        ModelConfig(name="echo", backend="echo"),
        restart_intensity=0,
    )


async def answers_off_signature_outputs(cfg: trioserve.Config) -> None:
    async with trioserve.open_runtime(cfg) as rt:
        errors = {}
        for x in REFUSED:
            with pytest.raises(ModelError) as info:
                await rt.infer("m", item(x, 2))
            errors[x] = str(info.value)
        converted = {x: (await rt.infer("m", item(x, 2)))["y"] for x in CONVERTED}
        after = await rt.infer("m", item(9.0, 2))  # the replica keeps serving
        echoed = await rt.infer("echo", {"a": [1]})  # an open model's outputs: as they are
        stats = rt.statistics()["m"]
    assert errors == REFUSED
    for x, y in converted.items():
        assert (type(y), y.dtype, y.tolist()) == (np.ndarray, np.float32, [2 * x, 0.0])
    assert after["y"].tolist() == [18.0, 0.0]
    assert echoed["a"].tolist() == [1]
    assert stats["statuses"]["model_error"] == len(REFUSED)
    assert "retried" not in stats["statuses"]  # the model answered: nothing to retry
    assert stats["replicas"][0]["restarts"] == 0
    assert stats["replicas"][0]["state"] == "running"


@pytest.mark.parametrize("execution", ["inline", "thread"])
async def test_an_output_against_the_signature_is_a_model_error_naming_it(
    autojump_clock, execution
):
    # In-process the caller got whatever the callable returned: a dict without the
    # declared output, None, strings, a float64 array for FP32, a list, a scalar.
    await answers_off_signature_outputs(off_signature_config(execution))


async def test_outputs_of_a_worker_process_are_checked_there(monkeypatch):
    # Real time: the worker's replies come through a pipe.
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))  # where it finds the model
    await answers_off_signature_outputs(off_signature_config("process"))


@pytest.mark.parametrize("execution", ["inline", "thread", "process"])
def test_each_item_of_a_batch_gets_its_own_answer_or_error(monkeypatch, execution):
    # From the thread client, in one batch: an item with a bad output fails alone (it
    # is not the model raising: nothing is retried), the others get their own rows.
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    xs = [0.5, 3.0, 1.0, 7.0, 9.5]
    cfg = off_signature_config(execution, max_batch_size=len(xs), max_wait_ms=60_000)
    with trioserve.serve_in_thread(cfg) as client:
        got = client.infer_many("m", [item(x, 2) for x in xs], return_exceptions=True)
        stats = client.statistics()["m"]
    assert [str(g) for g in got if isinstance(g, ModelError)] == [REFUSED[3.0], REFUSED[7.0]]
    assert {x: g["y"].tolist() for x, g in zip(xs, got, strict=True) if isinstance(g, dict)} == {
        0.5: [1.0, 0.0], 1.0: [2.0, 0.0], 9.5: [19.0, 0.0]
    }
    assert (stats["batches"], stats["items"]) == (1, len(xs))
    assert "retried" not in stats["statuses"]
    assert stats["statuses"]["model_error"] == 2


@pytest.mark.parametrize(
    ("answer", "alone"),
    [
        (lambda outs: outs[1:], "returned 0 outputs for 1 item"),
        (lambda outs: [*outs, outs[0]], "returned 2 outputs for 1 item"),
        (lambda outs: outs[::-1][:-1], "returned 0 outputs for 1 item"),
    ],
    ids=["one-short", "one-more", "reversed-and-short"],
)
@pytest.mark.parametrize("execution", ["inline", "thread"])
async def test_a_batch_answered_with_another_number_of_outputs_fails_every_caller(
    autojump_clock, execution, answer, alone
):
    # Four callers, one batch: no caller may get another's row (the list is not
    # matched to the items by position), and none may wait forever for one.
    ran: list[list[float]] = []

    def model(items):
        ran.append([key(it) for it in items])
        return answer([{"y": it["x"] * 2} for it in items])

    cfg = config(callable_model(
        "m", model, execution=execution, max_batch_size=4, max_wait_ms=10, timeout_ms=None
    ))
    got: dict[float, object] = {}

    async def call(x: float) -> None:
        try:
            got[x] = await rt.infer("m", item(x))
        except ModelError as exc:
            got[x] = exc

    async with trioserve.open_runtime(cfg) as rt:
        async with trio.open_nursery() as nursery:
            for x in (1.0, 2.0, 3.0, 4.0):
                nursery.start_soon(call, x)
        stats = rt.statistics()["m"]
    # The batch failed as a whole, and was retried each item alone (as when a model
    # raises), where each answer is refused again.
    assert sorted(ran[0]) == [1.0, 2.0, 3.0, 4.0]
    assert sorted(ran[1:]) == [[1.0], [2.0], [3.0], [4.0]]
    assert {x: str(e) for x, e in got.items()} == {
        x: f"model 'm' failed on cpu: ValueError: {alone}; expected a list of 1 output "
        "mapping (name -> array), one per item"
        for x in (1.0, 2.0, 3.0, 4.0)
    }
    assert stats["statuses"]["model_error"] == 4
    assert stats["replicas"][0]["state"] == "running"


def backend_of(*outputs: TensorSpec) -> trioserve.CallableBackend:
    return trioserve.CallableBackend(
        off_signature, inputs=[TensorSpec(name="x", datatype="FP32", shape=[-1])],
        outputs=outputs,
    )


def test_outputs_as_declared_are_passed_on_as_they_are():
    # The usual case costs a few comparisons per item, and copies nothing.
    backend = backend_of(
        TensorSpec(name="y", datatype="FP32", shape=[16]),
        TensorSpec(name="z", datatype="INT64", shape=[-1, 4]),
    )
    outs = [{"y": np.zeros(16, np.float32), "z": np.zeros((i, 4), np.int64), "extra": i}
            for i in range(3)]
    assert backend.conform_outputs("m", outs) is outs
    outs[1]["z"] = np.zeros((2, 5), np.int64)
    checked = backend.conform_outputs("m", outs)
    assert checked[0] is outs[0]
    assert str(checked[1]) == f"model 'm': output 'z' has shape [2, 5] per item, {DECLARES} [-1, 4]"
    assert checked[2] == outs[2]
    assert checked[2]["extra"] == 2  # an undeclared output is kept as it is
    outs[1]["z"] = np.array([[300, 0, 0, 0]], np.int16)
    out8 = backend_of(TensorSpec(name="z", datatype="INT8", shape=[-1, 4]))
    assert str(out8.conform_outputs("m", outs)[1]) == (
        f"model 'm': output 'z' holds values out of the range of INT8, which {DECLARES}"
    )


def test_stacked_outputs_are_checked_once_for_the_batch():
    # A torch module run on stacked inputs (in a worker process) answers stacked.
    backend = backend_of(TensorSpec(name="y", datatype="FP32", shape=[2]))
    same = {"y": np.zeros((3, 2), np.float32)}
    assert backend.conform_rows("m", same, 3) is same
    y = backend.conform_rows("m", {"y": np.ones((3, 2))}, 3)["y"]
    assert (y.dtype, y.shape) == (np.float32, (3, 2))
    errors = backend.conform_rows("m", {"y": np.ones((3, 4), np.float32)}, 3)
    assert [str(e) for e in errors] == [
        f"model 'm': output 'y' has shape [4] per item, {DECLARES} [2]"
    ] * 3
    assert len({id(e) for e in errors}) == 3  # each caller raises its own
    errors = backend.conform_rows("m", {"y": np.ones((4, 2), np.float32)}, 3)
    assert [str(e) for e in errors] == [
        "model 'm' returned output 'y' with 4 rows for 3 items; expected one row per item"
    ] * 3


async def test_a_torch_module_answering_float64_is_answered_as_declared(autojump_clock):
    torch = pytest.importorskip("torch")
    backend = trioserve.TorchBackend(
        lambda: torch.nn.Identity(),
        inputs=[TensorSpec(name="x", datatype="FP64", shape=[2])],
        outputs=[TensorSpec(name="y", datatype="FP32", shape=[2])],
    )
    cfg = config(ModelConfig(name="m", backend=backend, max_wait_ms=0, timeout_ms=None))
    async with trioserve.open_runtime(cfg) as rt:
        out = await rt.infer("m", [1.5, 2.5])
    assert (out["y"].dtype, out["y"].tolist()) == (np.float32, [1.5, 2.5])


class _Preparing(trioserve.ModelBackend):
    """A backend whose own ``prepare`` raises an error of its own making."""

    inputs = (TensorSpec(name="x", datatype="FP32", shape=(-1,)),)
    outputs = (TensorSpec(name="y", datatype="FP32", shape=(-1,)),)

    def load(self, device, *, torch_threads=1):
        return lambda items: [{"y": it["x"]} for it in items]

    def prepare(self, name, inputs):
        raise KeyError("no such feature")

    def prepare_rows(self, name, inputs):
        raise KeyError("no such feature")


# Regression: a KeyError raised by a backend's own prepare reached the caller raw (an
# in-process caller got an error outside the documented ones). It is the model's error.
async def test_a_backend_prepare_raising_its_own_error_is_a_model_error():
    cfg = http_config(ModelConfig(name="m", backend=_Preparing(), execution="inline"))
    said = "model 'm': preparing the inputs raised KeyError: 'no such feature'"
    async with serving(cfg) as gw:
        rt = gw.runtime
        for call in (lambda: rt.infer("m", [1.0]), lambda: rt.infer_batch("m", [[1.0]]),
                     lambda: rt.infer_batch("m", {"x": np.ones((2, 1), np.float32)})):
            with pytest.raises(ModelError) as caught:
                await call()
            assert str(caught.value) == said
            assert isinstance(caught.value.__cause__, KeyError)
        for shape in ([1, 1], [2, 1]):
            body = {"inputs": [{"name": "x", "shape": shape, "datatype": "FP32",
                                "data": [1.0] * shape[0]}]}
            async with open_http(gw.url) as http:
                res = await http.request("POST", "/v2/models/m/infer", orjson.dumps(body))
            assert (res.status, res.json()) == (500, {"error": said})


def test_a_torch_module_answering_bfloat16_is_answered_as_declared():
    """numpy has no bfloat16: a module answering in it (a model run in bf16, its
    output not cast back) failed every batch with torch's ``TypeError: Got
    unsupported ScalarType BFloat16`` (a 500). Such an output is read as float32,
    which holds each of its values exactly, then conformed as declared (FP32 here),
    as an input in bfloat16 is taken."""
    torch = pytest.importorskip("torch")

    class Bf16(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.bfloat16)

    backend = trioserve.TorchBackend(
        Bf16,
        inputs=[TensorSpec(name="x", datatype="FP32", shape=[2])],
        outputs=[TensorSpec(name="y", datatype="FP32", shape=[2])],
    )
    run = backend.load("cpu")
    outs = run([{"x": np.array([1.5, -3.0], np.float32)}])
    assert outs[0]["y"].tolist() == [1.5, -3.0]
    stacked = run.stacked({"x": np.array([[0.25, 1.0]], np.float32)})
    assert (stacked["y"].dtype, stacked["y"].tolist()) == (np.float32, [[0.25, 1.0]])



def test_a_torch_module_writing_a_tensor_it_keeps_does_not_change_earlier_answers():
    """On the CPU a tensor's numpy array shares its memory: a module that answers
    from a buffer it keeps and writes again on the next batch (a preallocated
    output) rewrote the answers of the batch before, while they waited to be sent
    (served with threads, callers got another caller's values). Each batch's
    outputs are now its own."""
    torch = pytest.importorskip("torch")

    class Buffered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("out", torch.zeros(8, 2))

        def forward(self, x):
            self.out[: len(x)] = x
            return self.out[: len(x)]

    backend = trioserve.TorchBackend(
        Buffered,
        inputs=[TensorSpec(name="x", datatype="FP32", shape=[2])],
        outputs=[TensorSpec(name="y", datatype="FP32", shape=[2])],
    )
    run = backend.load("cpu")
    first = run([{"x": np.array([1.0, 2.0], np.float32)}])
    first_stacked = run.stacked({"x": np.array([[3.0, 4.0]], np.float32)})
    run([{"x": np.array([5.0, 6.0], np.float32)}])
    run.stacked({"x": np.array([[7.0, 8.0]], np.float32)})
    assert first[0]["y"].tolist() == [1.0, 2.0]
    assert first_stacked["y"].tolist() == [[3.0, 4.0]]


class _AsyncCall:
    async def __call__(self, items):
        return [{"y": it["x"]} for it in items]


async def _async_model(items):
    return [{"y": it["x"]} for it in items]


@pytest.mark.parametrize("fn", [_async_model, _AsyncCall()], ids=["function", "object"])
def test_an_async_model_is_refused_when_its_backend_is_made(fn):
    # A model is called off the loop, never awaited: every batch would have failed
    # with "returned a value of type coroutine" and a "never awaited" warning.
    with pytest.raises(ValueError, match="is an async function; a model is called, not awaited"):
        trioserve.CallableBackend(
            fn, inputs=[TensorSpec(name="x", datatype="FP32", shape=[-1])], outputs=[]
        )


@pytest.mark.filterwarnings("error::RuntimeWarning")  # "coroutine ... never awaited"
@pytest.mark.parametrize("execution", ["inline", "thread"])
async def test_a_model_returning_a_coroutine_fails_its_callers_and_closes_it(
    autojump_clock, execution
):
    # A sync callable that hands back a coroutine (a wrapper of an async function):
    # the model's error, saying why; the coroutine closed, never run.
    ran: list[bool] = []

    async def body(items):
        ran.append(True)
        return [{"y": it["x"]} for it in items]

    cfg = config(callable_model("m", lambda items: body(items), execution=execution))
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(ModelError, match="returned a coroutine; a model is called, not"):
            await rt.infer("m", item(1.0))
        assert rt.statistics()["m"]["replicas"][0]["state"] == "running"
    assert ran == []
