"""The cuda:N path: runs where torch sees a GPU, skips cleanly where none is."""

import os
import signal

import numpy as np
import pytest
import torch
import trio
import trioserve
from trioserve._builtin import resolve_backend

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


@needs_cuda
@pytest.mark.parametrize("execution", ["thread", "process"])
async def test_mlp_on_cuda_matches_cpu(execution):
    x = np.random.default_rng(3).standard_normal(256).astype(np.float32)
    config = trioserve.Config(
        models=(
            trioserve.ModelConfig(name="gpu", backend="mlp", devices=("cuda:0",),
                                  execution=execution),
            trioserve.ModelConfig(name="cpu", backend="mlp", execution="thread"),
        )
    )
    async with trioserve.open_runtime(config) as rt:
        gpu = await rt.infer_batch("gpu", [x] * 8)
        cpu = await rt.infer("cpu", x)
    for out in gpu:
        np.testing.assert_allclose(out["y"], cpu["y"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("execution", ["thread", "process"])
async def test_unavailable_cuda_device_fails_at_start_with_a_clear_error(execution):
    n = torch.cuda.device_count()  # 0 without a GPU: cuda:0 is unavailable then
    config = trioserve.Config(
        models=(trioserve.ModelConfig(name="m", backend="mlp", devices=(f"cuda:{n}",),
                                      execution=execution),)
    )
    with pytest.raises(Exception, match=r"cuda"):
        async with trioserve.open_runtime(config):
            pass


@needs_cuda
async def test_unavailable_cuda_index_fails_at_start():
    n = torch.cuda.device_count()
    config = trioserve.Config(
        models=(trioserve.ModelConfig(name="m", backend="mlp", devices=(f"cuda:{n}",),
                                      execution="thread"),)
    )
    with pytest.raises(Exception, match="cuda"):
        async with trioserve.open_runtime(config):
            pass


def _reference(x: np.ndarray) -> np.ndarray:
    """The built-in mlp's answer for ``x``, computed on the CPU."""
    backend = resolve_backend(trioserve.ModelConfig(name="ref", backend="mlp"))
    return backend.load("cpu")([{"x": x}])[0]["y"]


@needs_cuda
@pytest.mark.parametrize("execution", ["thread", "process"])
async def test_two_replicas_on_one_gpu_answer_concurrent_callers(execution):
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(256).astype(np.float32) for _ in range(64)]
    config = trioserve.Config(
        models=(trioserve.ModelConfig(name="gpu", backend="mlp", devices=("cuda:0",),
                                      replicas=2, execution=execution, max_batch_size=8,
                                      max_wait_ms=1.0),)
    )
    got: dict[int, np.ndarray] = {}
    async with trioserve.open_runtime(config) as rt:
        assert [str(b.device) for b in rt.models["gpu"].batchers] == ["cuda:0", "cuda:0"]

        async def one(i: int) -> None:
            got[i] = (await rt.infer("gpu", xs[i]))["y"]

        async with trio.open_nursery() as nursery:
            for i in range(len(xs)):
                nursery.start_soon(one, i)
    assert sorted(got) == list(range(len(xs)))
    for i, x in enumerate(xs):
        np.testing.assert_allclose(got[i], _reference(x), rtol=1e-4, atol=1e-5)


@needs_cuda
async def test_a_model_on_a_gpu_and_a_cpu_answers_alike_on_both():
    x = np.random.default_rng(6).standard_normal(256).astype(np.float32)
    config = trioserve.Config(
        models=(trioserve.ModelConfig(name="m", backend="mlp", devices=("cuda:0", "cpu"),
                                      execution="thread", max_batch_size=4),)
    )
    async with trioserve.open_runtime(config) as rt:
        assert [str(b.device) for b in rt.models["m"].batchers] == ["cuda:0", "cpu"]
        outs = await rt.infer_batch("m", [x] * 32)
    for out in outs:
        np.testing.assert_allclose(out["y"], _reference(x), rtol=1e-4, atol=1e-5)


class _TwoHeads(torch.nn.Module):
    def forward(self, x):
        return {"double": x * 2, "total": x.sum(dim=1, keepdim=True)}


@needs_cuda
async def test_a_half_precision_module_with_two_outputs_on_a_gpu():
    backend = trioserve.TorchBackend(
        lambda: _TwoHeads().half(),
        inputs=[trioserve.TensorSpec(name="x", datatype="FP16", shape=[4])],
        outputs=[trioserve.TensorSpec(name="double", datatype="FP16", shape=[4]),
                 trioserve.TensorSpec(name="total", datatype="FP16", shape=[1])],
    )
    config = trioserve.Config(
        models=(trioserve.ModelConfig(name="h", backend=backend, devices=("cuda:0",),
                                      execution="thread"),)
    )
    x = np.array([1.0, 2.0, 3.0, 4.5], np.float16)
    async with trioserve.open_runtime(config) as rt:
        outs = await rt.infer_batch("h", [x, x + 1])
    assert outs[0]["double"].dtype == np.float16
    assert outs[0]["double"].tolist() == [2.0, 4.0, 6.0, 9.0]
    assert outs[1]["total"].tolist() == [14.5]


@needs_cuda
async def test_a_killed_gpu_worker_is_replaced_and_the_model_still_answers():
    x = np.random.default_rng(7).standard_normal(256).astype(np.float32)
    config = trioserve.Config(
        models=(trioserve.ModelConfig(name="gpu", backend="mlp", devices=("cuda:0",),
                                      execution="process"),)
    )
    async with trioserve.open_runtime(config) as rt:
        batcher = rt.models["gpu"].batchers[0]
        before = (await rt.infer("gpu", x))["y"]
        first_pid = batcher._worker.pid
        os.kill(first_pid, signal.SIGKILL)
        after = (await rt.infer("gpu", x))["y"]
        assert batcher._worker.pid != first_pid
        assert rt.model_ready("gpu")
    np.testing.assert_allclose(before, _reference(x), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-7)


@needs_cuda
async def test_over_http_a_gpu_model_answers_and_its_config_names_the_gpu():
    from http_helpers import config as http_config
    from http_helpers import serving
    from trioserve.transport import open_http

    x = np.random.default_rng(8).standard_normal((3, 256)).astype(np.float32)
    cfg = http_config(trioserve.ModelConfig(name="mlp", backend="mlp", devices=("cuda:0",),
                                            replicas=2, execution="thread"))
    async with serving(cfg) as gw, open_http(gw.url) as http:
        res = await http.infer("mlp", {"x": x})
        conf = await http.get("/v2/models/mlp/config")
    assert res.status == 200, res.body
    (out,) = res.json()["outputs"]
    want = np.stack([_reference(row) for row in x])
    np.testing.assert_allclose(np.reshape(out["data"], out["shape"]), want, rtol=1e-4, atol=1e-5)
    assert conf.status == 200, conf.body
    assert conf.json()["instance_group"] == [
        {"name": "mlp_0", "count": 2, "kind": "KIND_GPU", "gpus": [0]}
    ]


@needs_cuda
async def test_an_input_that_breaks_the_cuda_context_is_poison_and_nothing_else_fails(
    monkeypatch,
):
    """An index out of range trips a device-side assert, after which every CUDA call
    in that process fails (the model's later batches would all raise, whatever
    their inputs). The worker sees its device is lost after the raise and exits,
    so its batch is a lost worker's: bisected on fresh workers, the bad input is
    answered as poison, and every other request with its value. 32 callers, two
    worker-process replicas on one GPU."""
    from cuda_helpers import ROWS, WIDTH, Lookup
    from runtime_helpers import pythonpath_with

    monkeypatch.setenv("PYTHONPATH", pythonpath_with(os.path.dirname(__file__)))
    backend = trioserve.TorchBackend(
        Lookup,
        inputs=[trioserve.TensorSpec(name="x", datatype="INT64", shape=[1])],
        outputs=[trioserve.TensorSpec(name="y", datatype="FP32", shape=[WIDTH])],
    )
    config = trioserve.Config(
        models=(trioserve.ModelConfig(name="lookup", backend=backend, devices=("cuda:0",),
                                      replicas=2, execution="process", max_batch_size=8,
                                      max_wait_ms=1.0),)
    )
    bad = (3, 5)
    got: dict = {}

    async def client(rt, c: int) -> None:
        for j in range(20):
            index = 1000 if (c, j) == bad else (c * 20 + j) % ROWS
            try:
                out = await rt.infer("lookup", np.array([index], np.int64))
            except trioserve.ModelError as exc:
                got[c, j] = str(exc)
            else:
                got[c, j] = (index, out["y"])

    async with trioserve.open_runtime(config) as rt:
        batchers = rt.models["lookup"].batchers
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for c in range(32):
                    nursery.start_soon(client, rt, c)
            after = await rt.infer_batch("lookup", [np.array([i], np.int64) for i in range(64)])
        lost = [b.workers_lost for b in batchers]
        assert rt.model_ready("lookup")
    poison = got.pop(bad)
    assert isinstance(poison, str), poison
    assert "poison request" in poison, poison
    assert "device-side assert" in poison, poison
    assert len(got) == 32 * 20 - 1
    failed = {k: v for k, v in got.items() if isinstance(v, str)}
    assert not failed, list(failed.items())[:3]
    for index, y in got.values():
        np.testing.assert_array_equal(y, np.full(WIDTH, index, np.float32))
    for i, out in enumerate(after):
        np.testing.assert_array_equal(out["y"], np.full(WIDTH, i, np.float32))
    assert 1 <= sum(lost) <= 4  # the bad input's runs, each of which took a worker


_THREAD_REPLICA_LOSES_ITS_CONTEXT = """
import json, os, sys
import numpy as np, trio, trioserve
from cuda_helpers import WIDTH, Lookup

async def main():
    backend = trioserve.TorchBackend(
        Lookup,
        inputs=[trioserve.TensorSpec(name="x", datatype="INT64", shape=[1])],
        outputs=[trioserve.TensorSpec(name="y", datatype="FP32", shape=[WIDTH])],
    )
    config = trioserve.Config(models=(trioserve.ModelConfig(
        name="lookup", backend=backend, devices=("cuda:0",), execution="thread",
        timeout_ms=2000),))
    out = {}
    async with trioserve.open_runtime(config) as rt:
        out["good"] = (await rt.infer("lookup", np.array([7], np.int64)))["y"].tolist()
        try:
            await rt.infer("lookup", np.array([1000], np.int64))
        except trioserve.ModelError as exc:
            out["bad"] = str(exc)
        out["ready"] = rt.model_ready("lookup")
        out["health"] = rt.models["lookup"].batchers[0].health
        out["statuses"] = dict(rt.statistics()["lookup"]["statuses"])
    print(json.dumps(out), flush=True)
    os._exit(0)  # the process's CUDA context is gone: skip its teardown

trio.run(main)
"""


@needs_cuda
def test_a_thread_replica_whose_cuda_context_is_lost_serves_no_more():
    """In a worker thread the lost context is the process's own: nothing can replace
    it. The replica answers the batch with the error and serves no more, and the
    model is not ready (its only replica), so a readiness probe sees it. In a
    subprocess: the context of the process that runs this is lost for good."""
    import json
    import subprocess
    import sys

    from runtime_helpers import pythonpath_with

    env = dict(os.environ, PYTHONPATH=pythonpath_with(os.path.dirname(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _THREAD_REPLICA_LOSES_ITS_CONTEXT],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["good"] == [7.0] * 8
    assert "left it unusable" in out["bad"]
    assert "device-side assert" in out["bad"]
    assert out["ready"] is False
    assert out["health"] == "lost"
    assert out["statuses"]["device_lost"] == 1


@needs_cuda
@pytest.mark.parametrize("execution", ["thread", "process"])
async def test_a_batch_that_runs_out_of_gpu_memory_is_split_and_each_part_answered(
    monkeypatch, execution
):
    """Out of memory leaves the device usable (torch raises before the kernel runs):
    it is the model's error like any other, so the batch is retried in parts, which
    fit. The replica is not lost, nor its worker."""
    from cuda_helpers import Hungry
    from runtime_helpers import pythonpath_with

    monkeypatch.setenv("PYTHONPATH", pythonpath_with(os.path.dirname(__file__)))
    backend = trioserve.TorchBackend(
        Hungry,
        inputs=[trioserve.TensorSpec(name="x", datatype="FP32", shape=[4])],
        outputs=[trioserve.TensorSpec(name="y", datatype="FP32", shape=[4])],
    )
    config = trioserve.Config(
        models=(trioserve.ModelConfig(name="hungry", backend=backend, devices=("cuda:0",),
                                      execution=execution, max_batch_size=64),)
    )
    x = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    async with trioserve.open_runtime(config) as rt:
        with trio.fail_after(120):
            outs = await rt.infer_batch("hungry", list(x))
        batcher = rt.models["hungry"].batchers[0]
        assert batcher.health == "ready"
        assert batcher.workers_lost == 0
        statuses = rt.statistics()["hungry"]["statuses"]
    np.testing.assert_array_equal(np.stack([o["y"] for o in outs]), x * 2)
    assert statuses["retried"] >= 64  # the batch of 64 failed, and was split
    assert statuses.get("model_error", 0) == 0
    assert statuses.get("device_lost", 0) == 0


class _CpuBuffered(torch.nn.Module):
    """On a GPU, answering from a CPU buffer it keeps and writes on every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.out = torch.zeros(8, 2)  # not a registered buffer: stays on the CPU

    def forward(self, x):
        self.out[: len(x)] = x.cpu()
        return self.out[: len(x)]


@needs_cuda
def test_a_module_on_a_gpu_answering_from_a_cpu_buffer_keeps_earlier_answers():
    # The output's device decides the copy, not the model's.
    backend = trioserve.TorchBackend(
        _CpuBuffered,
        inputs=[trioserve.TensorSpec(name="x", datatype="FP32", shape=[2])],
        outputs=[trioserve.TensorSpec(name="y", datatype="FP32", shape=[2])],
    )
    run = backend.load("cuda:0")
    first = run.stacked({"x": np.array([[1.0, 2.0]], np.float32)})
    run.stacked({"x": np.array([[3.0, 4.0]], np.float32)})
    assert first["y"].tolist() == [[1.0, 2.0]]
