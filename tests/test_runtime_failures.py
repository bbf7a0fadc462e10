"""Model failures through the runtime: a model raising on one input fails only that
caller's request; an exception that cannot be shown, StopIteration or SystemExit, a
wrong number of outputs and misshapen outputs are model errors, inline, in a thread
or in a worker process, and the runtime keeps serving.

Under ``autojump_clock`` trio time jumps to the next deadline whenever every task
waits, including while a model runs in a worker thread; models run in threads there
set ``timeout_ms=None`` so no request's model timeout passes in that jump.
"""

from __future__ import annotations

import collections
import functools
import logging
import os

import numpy as np
import pytest
import trio
import trioserve
from runtime_helpers import (
    Recorder,
    call_all,
    callable_model,
    config,
    escapes_on_1,
    interrupts_on_1,
    item,
    misshapen,
    off_signature,
    pythonpath_with,
    unprintable_on_1,
)
from trioserve import ModelConfig, ModelError
from trioserve.actors import LogThrottle


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


def test_the_log_throttle_logs_the_first_at_once_then_one_an_interval_with_a_count():
    t = LogThrottle(interval=10.0)
    assert t.admit(0.0) == 0  # the first, at once
    assert t.admit(0.0) is None
    assert t.admit(9.999) is None
    assert t.admit(10.0) == 2  # the two not logged
    assert t.admit(15.0) is None
    assert t.admit(100.0) == 1  # a lone failure later is logged at once
    assert t.admit(110.0) == 0


def model_errors_logged(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name.startswith("trioserve") and r.levelno == logging.ERROR
    ]


@pytest.mark.parametrize("execution", ["inline", "thread"])
async def test_a_model_error_is_logged_throttled_with_how_many_were_not(
    autojump_clock, caplog, execution
):
    """A model that raised answered its callers with a 500 and left no line on the
    server: an operator saw only the client's errors."""
    caplog.set_level(logging.INFO, logger="trioserve")
    rec = Recorder(fail_on=5.0, timed=execution == "inline")
    cfg = config(callable_model("m", rec, execution=execution, max_wait_ms=0, timeout_ms=None))
    async with trioserve.open_runtime(cfg) as rt:
        await rt.infer("m", item(1))
        assert model_errors_logged(caplog) == []  # a result is no line
        for _ in range(3):
            with pytest.raises(ModelError):
                await rt.infer("m", item(5))
        first = model_errors_logged(caplog)
        await trio.sleep(LogThrottle().interval)
        with pytest.raises(ModelError):
            await rt.infer("m", item(5))
        later = model_errors_logged(caplog)[len(first):]
    assert first == [
        "batcher[m#0@cpu]: model 'm' failed on cpu: ValueError: poison item 5 "
        "(1 request answered with it)"
    ]
    assert later == [
        "batcher[m#0@cpu]: model 'm' failed on cpu: ValueError: poison item 5 "
        "(1 request answered with it; 2 more such failures since the last line)"
    ]


async def test_outputs_off_the_signature_are_logged_as_model_errors(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="trioserve")
    cfg = config(callable_model("m", off_signature, max_wait_ms=0))
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(ModelError) as info:
            await rt.infer("m", item(3.0))
    assert model_errors_logged(caplog) == [
        f"batcher[m#0@cpu]: {info.value} (1 request answered with it)"
    ]


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


@pytest.mark.parametrize("execution", ["thread", "process"])
async def test_a_model_raising_a_base_exception_off_the_event_loop_is_a_model_error(
    monkeypatch, execution
):
    # A KeyboardInterrupt (or any BaseException that is not an Exception) a model
    # raised in a worker thread ended the runtime, its request unanswered (over
    # HTTP `trioserve serve` stopped, saying "SIGINT while starting"); in a worker
    # process it ended the worker, and the request was answered as poison after two
    # more dead workers. No signal reaches a worker thread, and a worker process
    # ignores SIGINT: it is the model's raise, answered as any other.
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    cfg = config(
        callable_model(
            "m", interrupts_on_1, execution=execution, max_wait_ms=0, timeout_ms=None
        ),
        restart_intensity=0,
    )
    async with trioserve.open_runtime(cfg) as rt:
        errors = []
        for x in (1, 2, 3):
            with pytest.raises(ModelError) as info:
                await rt.infer("m", item(x))
            errors.append(str(info.value))
        after = await rt.infer("m", item(4))
        stats = rt.statistics()["m"]
    prefix = "WorkerError: " if execution == "process" else ""
    assert errors == [
        f"model 'm' failed on cpu: {prefix}KeyboardInterrupt: model interrupts",
        f"model 'm' failed on cpu: {prefix}GeneratorExit: model closes",
        f"model 'm' failed on cpu: {prefix}OwnBaseException: model's own",
    ]
    assert after["y"].tolist() == [4.0]
    replica = stats["replicas"][0]
    assert replica["restarts"] == 0
    # Each answered at once, not found as poison by killing workers
    assert stats["statuses"].get("worker_lost", 0) == 0
    assert stats["statuses"].get("poison", 0) == 0
    assert stats["statuses"]["model_error"] == 3


async def test_an_inline_model_raising_a_base_exception_of_its_own_is_a_model_error():
    # Inline, a KeyboardInterrupt is the process's Ctrl-C and is left alone; any other
    # BaseException is the model's, and used to end the runtime.
    cfg = config(
        callable_model("m", interrupts_on_1, execution="inline", max_wait_ms=0),
        restart_intensity=0,
    )
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(ModelError) as closed:
            await rt.infer("m", item(2))
        with pytest.raises(ModelError) as own:
            await rt.infer("m", item(3))
        after = await rt.infer("m", item(4))
    assert str(closed.value) == "model 'm' failed on cpu: GeneratorExit: model closes"
    assert str(own.value) == "model 'm' failed on cpu: OwnBaseException: model's own"
    assert after["y"].tolist() == [4.0]


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


def _raises_bare(items):
    raise ValueError()


async def test_an_error_without_words_is_named_without_a_dangling_colon(autojump_clock):
    # "ValueError: " read as a message cut off; an error with no words is its type
    cfg = config(callable_model("m", _raises_bare, execution="inline", max_wait_ms=0))
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(ModelError) as info:
            await rt.infer("m", item(1))
    assert str(info.value) == "model 'm' failed on cpu: ValueError"
    assert trioserve.exception_text(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert trioserve.exception_text(ValueError("no")) == "ValueError: no"
