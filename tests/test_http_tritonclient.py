"""A standard v2 client, unchanged: NVIDIA's tritonclient.http (blocking, gevent-based,
so it runs in a worker thread) against a real server."""

from __future__ import annotations

import numpy as np
import pytest
import trio
from http_helpers import config, echo_model, mlp_model, serving

tritonclient_http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture
async def server():
    async with serving(config(mlp_model(), echo_model())) as gw:
        yield gw


def _client(gw):
    host, port = gw.addresses[0]
    return tritonclient_http.InferenceServerClient(url=f"{host}:{port}")


async def test_health_ready_and_metadata(server):
    def calls():
        client = _client(server)
        try:
            return (
                client.is_server_live(),
                client.is_server_ready(),
                client.is_model_ready("mlp"),
                client.is_model_ready("mlp", model_version="1"),
                client.get_server_metadata(),
                client.get_model_metadata("mlp"),
            )
        finally:
            client.close()

    live, ready, model_ready, version_ready, server_meta, meta = await trio.to_thread.run_sync(
        calls
    )
    assert live
    assert ready
    assert model_ready
    assert version_ready
    assert server_meta["name"] == "trioserve"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 16]}]


@pytest.mark.parametrize("binary", [True, False])
async def test_infer_with_binary_or_json_tensors(server, binary):
    x = np.random.default_rng(5).standard_normal((4, 256)).astype(np.float32)
    want = np.stack([r["y"] for r in await server.runtime.infer_batch("mlp", list(x))])

    def call():
        client = _client(server)
        try:
            inp = tritonclient_http.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            out = tritonclient_http.InferRequestedOutput("y", binary_data=binary)
            result = client.infer("mlp", [inp], outputs=[out], request_id="r1")
            return result.as_numpy("y"), result.get_response()
        finally:
            client.close()

    y, response = await trio.to_thread.run_sync(call)
    assert response["id"] == "r1"
    assert response["model_name"] == "mlp"
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


async def test_infer_with_default_outputs_and_a_version(server):
    x = np.arange(6, dtype=np.int64).reshape(2, 3)

    def call():
        client = _client(server)
        try:
            inp = tritonclient_http.InferInput("x", [2, 3], "INT64")
            inp.set_data_from_numpy(x)
            return client.infer("echo", [inp], model_version="1").as_numpy("x")
        finally:
            client.close()

    np.testing.assert_array_equal(await trio.to_thread.run_sync(call), x)


async def test_errors_reach_the_client_as_inference_server_exceptions(server):
    def call():
        client = _client(server)
        try:
            inp = tritonclient_http.InferInput("x", [1, 3], "FP32")
            inp.set_data_from_numpy(np.zeros((1, 3), np.float32))
            with pytest.raises(InferenceServerException) as bad:
                client.infer("mlp", [inp])
            with pytest.raises(InferenceServerException) as missing:
                client.get_model_metadata("nope")
            return bad.value, missing.value
        finally:
            client.close()

    bad, missing = await trio.to_thread.run_sync(call)
    assert bad.status() == "400"
    assert "expected shape [256] or [N, 256]" in bad.message()
    assert missing.status() == "404"
    assert "unknown model 'nope'" in missing.message()
