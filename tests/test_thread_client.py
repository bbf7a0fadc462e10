"""The blocking client: ``serve_in_thread`` runs the runtime on its own trio thread and
plain threads call it. These tests are synchronous and use the real clock."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import trioserve
from runtime_helpers import Gate, Recorder, callable_model, config, item
from trioserve import ActorClosed, ConfigError, DeadlineExceeded, InvalidInput, ModelConfig


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.release()


@pytest.fixture
def served(gate):
    """A runtime in a thread serving ``double`` (y = 2x + 1, in a worker thread),
    ``echo``, ``gated`` (held by ``gate``) and ``sleep`` (x[0] ms per item, 4
    replicas)."""
    cfg = config(
        callable_model("double", Recorder(timed=False), execution="thread", max_wait_ms=1),
        ModelConfig(name="echo", backend="echo", max_wait_ms=1),
        callable_model("gated", gate, execution="thread", max_batch_size=1, max_wait_ms=0),
        ModelConfig(
            name="sleep",
            backend="sleep",
            max_batch_size=1,
            max_wait_ms=0,
            devices=["cpu"],
            replicas=4,
        ),
    )
    with trioserve.serve_in_thread(cfg) as client:
        yield client


def test_eight_threads_each_get_their_own_results(served):
    def work(t: int) -> list[str]:
        wrong = []
        for i in range(25):
            v = t * 1000 + i
            out = served.infer("double", item(v))
            if float(out["y"][0]) != 2 * v + 1:
                wrong.append(f"thread {t} item {i}: {out['y']}")
            echoed = served.infer("echo", {"a": [t, i]})
            if echoed["a"].tolist() != [t, i]:
                wrong.append(f"thread {t} echo {i}: {echoed['a']}")
        many = served.infer_many("double", [item(t * 1000 + 500 + i) for i in range(20)])
        want = [2 * (t * 1000 + 500 + i) + 1 for i in range(20)]
        if [float(o["y"][0]) for o in many] != want:
            wrong.append(f"thread {t} infer_many out of order")
        return wrong

    with ThreadPoolExecutor(8) as pool:
        problems = [p for ps in pool.map(work, range(8)) for p in ps]
    assert problems == []
    stats = served.statistics()
    assert stats["double"]["items"] == 8 * (25 + 20)
    assert stats["echo"]["items"] == 8 * 25


def test_infer_many_returns_results_in_input_order(served):
    # Four replicas sleep x[0] ms each: the items finish in a different order than
    # they were given, and come back in the order given.
    delays = [30.0, 0.0, 20.0, 5.0, 10.0, 0.0, 25.0, 1.0]
    inputs = [{"x": np.array([d, i], dtype=np.float32)} for i, d in enumerate(delays)]
    results = served.infer_many("sleep", inputs)
    assert [r["y"].tolist() for r in results] == [[d, i] for i, d in enumerate(delays)]


def test_timeout_raises_deadline_exceeded(served, gate):
    with pytest.raises(DeadlineExceeded, match=r"model 'gated': no answer within 0\.05s"):
        served.infer("gated", item(1), timeout=0.05)
    results = served.infer_many("gated", [item(2), item(3)], timeout=0.05, return_exceptions=True)
    assert [type(r) for r in results] == [DeadlineExceeded, DeadlineExceeded]
    gate.release()
    out = served.infer("gated", item(4), timeout=30)
    assert float(out["y"][0]) == 9.0


def test_infer_many_reports_failures_in_place_or_raises_the_first(served):
    inputs = [item(1), {"x": ["not", "numbers"]}, item(3), {"nope": [1.0]}]
    results = served.infer_many("double", inputs, return_exceptions=True)
    assert float(results[0]["y"][0]) == 3.0
    assert isinstance(results[1], InvalidInput)
    assert "expected FP32" in str(results[1])
    assert float(results[2]["y"][0]) == 7.0
    assert isinstance(results[3], InvalidInput)
    assert "missing input 'x'" in str(results[3])
    with pytest.raises(InvalidInput, match="expected FP32"):
        served.infer_many("double", inputs)


def test_client_errors_are_the_runtime_errors(served):
    with pytest.raises(trioserve.UnknownModel, match="unknown model 'nope'"):
        served.infer("nope", item(1))
    with pytest.raises(InvalidInput, match=r"expected shape \[-1\]"):
        served.infer("double", {"x": [[1.0, 2.0]]})


def test_calls_after_the_block_raise_actor_closed():
    cfg = config(ModelConfig(name="echo", backend="echo"))
    with trioserve.serve_in_thread(cfg) as client:
        assert client.infer("echo", {"x": [1.0]})["x"].tolist() == [1.0]
    with pytest.raises(ActorClosed, match="shut down"):
        client.infer("echo", {"x": [1.0]})
    with pytest.raises(ActorClosed):
        client.infer_many("echo", [{"x": [1.0]}])


def test_a_runtime_that_cannot_start_raises_in_the_caller():
    cfg = config(ModelConfig(name="m", backend="no_such_module_here:thing"))
    with pytest.raises(ConfigError, match=r"models\.m\.backend: cannot import"):
        with trioserve.serve_in_thread(cfg):
            pytest.fail("started without its model")


def test_a_version_and_a_bad_timeout(served):
    out = served.infer("double", item(2), version="1")
    assert float(out["y"][0]) == 5.0
    assert [float(o["y"][0]) for o in served.infer_many("double", [item(1)], version="1")] == [3.0]
    with pytest.raises(trioserve.UnknownModel, match="has no version '9'"):
        served.infer("double", item(2), version="9")
    for bad in (0, -1, float("nan"), float("inf"), "1"):
        with pytest.raises(InvalidInput, match="timeout must be a positive number"):
            served.infer("double", item(2), timeout=bad)


def test_ragged_inputs_to_an_open_model_are_invalid_input(served):
    with pytest.raises(InvalidInput, match="inputs are not arrays"):
        served.infer("echo", {"a": [[1, 2], [3]]})


def test_a_numpy_integer_is_a_priority_level(served):
    assert float(served.infer("double", item(2), priority=np.int64(2))["y"][0]) == 5.0
    with pytest.raises(InvalidInput, match="unknown request class"):
        served.infer("double", item(2), priority=np.float64(2))
