"""A standard v2 client, unchanged: NVIDIA's tritonclient.http (blocking, gevent-based,
so it runs in a worker thread) against a real server."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import trio
from http_helpers import config, echo_model, mlp_model, serving
from trioserve import ModelConfig
from trioserve._config import minilm_available

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


@pytest.mark.parametrize("binary", [True, False])
async def test_the_classification_extension(server, binary):
    """``InferRequestedOutput(name, class_count=k)``: each item's k highest values of
    the output as "value:index" strings, as Triton answers (it was the raw tensor)."""
    x = np.random.default_rng(9).standard_normal((3, 256)).astype(np.float32)
    raw = np.stack([r["y"] for r in await server.runtime.infer_batch("mlp", list(x))])

    def call():
        client = _client(server)
        try:
            inp = tritonclient_http.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            out = tritonclient_http.InferRequestedOutput("y", binary_data=binary, class_count=3)
            return client.infer("mlp", [inp], outputs=[out]).as_numpy("y")
        finally:
            client.close()

    classes = await trio.to_thread.run_sync(call)
    assert classes.shape == (3, 3)
    for row, got in zip(raw, classes, strict=True):
        top = np.argsort(-row, kind="stable")[:3]
        assert [c.decode() if isinstance(c, bytes) else c for c in got] == [
            f"{row[i]:f}:{i}" for i in top
        ]


async def test_async_infer_gets_each_request_its_own_answer(server):
    """``async_infer`` with several requests in flight over the client's connection
    pool: each answer is its own request's (id and values), binary and JSON alike."""
    xs = np.arange(8 * 3, dtype=np.float32).reshape(8, 1, 3)

    def calls():
        client = tritonclient_http.InferenceServerClient(
            url="%s:%d" % server.addresses[0], concurrency=4
        )
        try:
            pending = []
            for i, x in enumerate(xs):
                inp = tritonclient_http.InferInput("x", [1, 3], "FP32")
                inp.set_data_from_numpy(x, binary_data=i % 2 == 0)
                out = tritonclient_http.InferRequestedOutput("x", binary_data=i % 3 == 0)
                pending.append(
                    client.async_infer("echo", [inp], outputs=[out], request_id=f"r{i}")
                )
            results = [p.get_result() for p in pending]
            return [(r.get_response()["id"], r.as_numpy("x")) for r in results]
        finally:
            client.close()

    answers = await trio.to_thread.run_sync(calls)
    assert [rid for rid, _ in answers] == [f"r{i}" for i in range(8)]
    for x, (_, got) in zip(xs, answers, strict=True):
        np.testing.assert_array_equal(got, x)


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


@pytest.mark.parametrize(("datatype", "x"), [
    ("FP32", np.zeros((1, 0), np.float32)),
    ("BYTES", np.zeros((2, 0), object)),
])
async def test_an_empty_tensor_sent_as_binary_data_is_taken(server, datatype, x):
    """An empty tensor as binary data (tritonclient's default) is a binary_data_size
    of 0 with an Inference-Header-Content-Length at the body's end: it was refused
    as "binary_data_size is given but the request has no binary data", as though
    the header were missing, while the server answers an empty output so itself."""

    def call():
        client = _client(server)
        try:
            inp = tritonclient_http.InferInput("x", list(x.shape), datatype)
            inp.set_data_from_numpy(x)
            out = tritonclient_http.InferRequestedOutput("x", binary_data=True)
            result = client.infer("echo", [inp], outputs=[out])
            return result.get_output("x"), result.as_numpy("x")
        finally:
            client.close()

    output, got = await trio.to_thread.run_sync(call)
    assert output == {"name": "x", "datatype": datatype, "shape": list(x.shape),
                      "parameters": {"binary_data_size": 0}}
    assert got.shape == x.shape


@pytest.mark.parametrize("binary", [False, True])
async def test_nan_and_infinities_go_both_ways_as_json_data(server, binary):
    """tritonclient writes non-finite floats as NaN / Infinity / -Infinity in JSON
    data and reads them back so, as Triton does; the server refused them as
    malformed JSON and answered them as null."""
    x = np.array([[1.5, np.nan, np.inf, -np.inf]], dtype=np.float32)

    def call():
        client = _client(server)
        try:
            inp = tritonclient_http.InferInput("x", [1, 4], "FP32")
            inp.set_data_from_numpy(x, binary_data=False)
            out = tritonclient_http.InferRequestedOutput("x", binary_data=binary)
            return client.infer("echo", [inp], outputs=[out]).as_numpy("x")
        finally:
            client.close()

    np.testing.assert_array_equal(await trio.to_thread.run_sync(call), x)


async def test_bytes_that_are_not_utf8_come_back_whole_as_binary_and_refused_as_json(server):
    """An output element that is not UTF-8 went out as JSON data with U+FFFD in place
    of its bytes; asked for as JSON it is now a 400 saying to ask for binary data,
    and as binary data it comes back exactly as the model gave it."""
    x = np.array([[b"ok", b"\xff\xfe\x00", "é".encode()]], dtype=object)

    def call(binary):
        client = _client(server)
        try:
            inp = tritonclient_http.InferInput("x", [1, 3], "BYTES")
            inp.set_data_from_numpy(x, binary_data=True)  # reaches echo as bytes
            out = tritonclient_http.InferRequestedOutput("x", binary_data=binary)
            if binary:
                return client.infer("echo", [inp], outputs=[out]).as_numpy("x")
            with pytest.raises(InferenceServerException) as refused:
                client.infer("echo", [inp], outputs=[out])
            return refused.value
        finally:
            client.close()

    got = await trio.to_thread.run_sync(call, True)
    assert got.tolist() == x.tolist()
    refused = await trio.to_thread.run_sync(call, False)
    assert refused.status() == "400"
    assert refused.message() == (
        "model 'echo': output 'x': element 1 is bytes that are not UTF-8 text, which "
        "JSON data cannot carry unaltered; ask for the output as binary data "
        '("binary_data": true in its parameters)'
    )


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


async def test_an_output_in_shared_memory_is_refused_not_answered_in_the_body(server):
    """``InferRequestedOutput.set_shared_memory``: the client then reads the output
    from its region. The parameter was ignored and the tensor answered in the body,
    so the client read a region nothing wrote; now a 400 names the parameter."""

    def call():
        client = _client(server)
        try:
            inp = tritonclient_http.InferInput("x", [1, 256], "FP32")
            inp.set_data_from_numpy(np.ones((1, 256), np.float32))
            out = tritonclient_http.InferRequestedOutput("y")
            out.set_shared_memory("outputs", 64)
            with pytest.raises(InferenceServerException) as refused:
                client.infer("mlp", [inp], outputs=[out])
            return refused.value
        finally:
            client.close()

    refused = await trio.to_thread.run_sync(call)
    assert refused.status() == "400"
    assert refused.message().startswith(
        "output 'y': parameters.shared_memory_region: this server has no shared memory"
    )


async def test_model_config_and_statistics_as_tritons_extensions():
    """``get_model_config`` and ``get_inference_statistics`` (Triton's model
    configuration and statistics extensions) get Triton's documents."""
    mlp = attrs.evolve(
        mlp_model(max_batch_size=32, replicas=2, versions=("1", "2")), max_wait_ms=1.5
    )
    async with serving(config(mlp, echo_model())) as gw:
        x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)

        def calls():
            client = _client(gw)
            try:
                before = client.get_inference_statistics("mlp")
                inp = tritonclient_http.InferInput("x", [3, 256], "FP32")
                inp.set_data_from_numpy(x)
                client.infer("mlp", [inp])
                bad = tritonclient_http.InferInput("x", [1, 3], "FP32")
                bad.set_data_from_numpy(np.zeros((1, 3), np.float32))
                with pytest.raises(InferenceServerException):
                    client.infer("mlp", [bad])
                with pytest.raises(InferenceServerException) as missing:
                    client.get_model_config("nope")
                with pytest.raises(InferenceServerException) as no_version:
                    client.get_inference_statistics("mlp", model_version="7")
                return (
                    client.get_server_metadata(),
                    client.get_model_config("mlp"),
                    client.get_model_config("mlp", model_version="1"),
                    before,
                    client.get_inference_statistics("mlp"),
                    client.get_inference_statistics(),
                    missing.value,
                    no_version.value,
                )
            finally:
                client.close()

        meta, cfg, cfg_v1, before, after, every, missing, no_version = (
            await trio.to_thread.run_sync(calls)
        )
    assert {"model_configuration", "statistics", "schedule_policy"} <= set(meta["extensions"])
    assert cfg == cfg_v1
    assert cfg["name"] == "mlp"
    assert cfg["platform"] == "pytorch"
    assert cfg["max_batch_size"] == 32
    assert cfg["version_policy"] == {"specific": {"versions": ["1", "2"]}}
    assert cfg["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [256],
                             "format": "FORMAT_NONE", "optional": False}]
    assert cfg["output"] == [{"name": "y", "data_type": "TYPE_FP32", "dims": [16]}]
    assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 1500
    assert cfg["dynamic_batching"]["priority_levels"] == 2  # realtime, batch
    assert cfg["instance_group"] == [{"name": "mlp_0", "count": 2, "kind": "KIND_CPU"}]
    assert missing.status() == "404"
    assert no_version.status() == "404"

    (zero,) = before["model_stats"]
    # its two versions share its figures: given once, naming no version
    assert (zero["name"], zero["version"]) == ("mlp", "")
    assert zero["inference_count"] == zero["execution_count"] == zero["last_inference"] == 0
    (stats,) = after["model_stats"]
    s = stats["inference_stats"]
    assert stats["inference_count"] == 3  # three rows, in one batch or more
    assert 1 <= stats["execution_count"] <= 3
    assert s["success"]["count"] == 1  # one request
    assert s["success"]["ns"] > 0
    assert s["fail"]["count"] == 0  # the 400 is the client's error, not the model's
    assert s["queue"]["count"] == 1  # per request, as success
    assert s["compute_infer"]["count"] == 1
    assert s["compute_infer"]["ns"] > 0
    assert stats["last_inference"] > 1.7e12  # ms since the epoch
    assert [m["name"] for m in every["model_stats"]] == ["echo", "mlp"]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
async def test_compressed_requests_from_tritonclient(server, algorithm):
    """``request_compression_algorithm`` compresses the whole body (JSON and binary
    tensors) and sends Content-Encoding; the header length counts the JSON before."""
    x = np.random.default_rng(9).standard_normal((2, 256)).astype(np.float32)
    want = np.stack([r["y"] for r in await server.runtime.infer_batch("mlp", list(x))])

    def call():
        client = _client(server)
        try:
            inp = tritonclient_http.InferInput("x", [2, 256], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            return client.infer(
                "mlp", [inp], request_compression_algorithm=algorithm,
                response_compression_algorithm=algorithm,
            ).as_numpy("y")
        finally:
            client.close()

    np.testing.assert_allclose(await trio.to_thread.run_sync(call), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
async def test_compressed_answers_to_tritonclient(server, monkeypatch, algorithm, binary):
    """``response_compression_algorithm`` sends Accept-Encoding: the answer comes
    compressed (gzip, or deflate in the zlib format, as tritonclient reads it) and
    tritonclient's values are the plain answer's; for binary outputs the
    Inference-Header-Content-Length counts the JSON before compression."""
    from trioserve.transport import _gateway

    codings: list[str | None] = []
    encode = _gateway.encode_answer

    async def spy(answer, accept):
        out = await encode(answer, accept)
        codings.append(dict(out[1]).get(b"content-encoding", b"").decode() or None)
        return out

    monkeypatch.setattr(_gateway, "encode_answer", spy)
    # an answer of ~8 KiB as float32 bytes, ~40 KiB as JSON: over MIN_COMPRESS
    x = np.random.default_rng(3).standard_normal((2, 1024)).astype(np.float32)

    def call(compression):
        client = _client(server)
        try:
            inp = tritonclient_http.InferInput("x", [2, 1024], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            out = tritonclient_http.InferRequestedOutput("x", binary_data=binary)
            result = client.infer(
                "echo", [inp], outputs=[out], request_id="z",
                response_compression_algorithm=compression,
            )
            return result.as_numpy("x"), result.get_response()
        finally:
            client.close()

    plain, plain_doc = await trio.to_thread.run_sync(call, None)
    assert codings == []  # no Accept-Encoding: never negotiated
    packed, packed_doc = await trio.to_thread.run_sync(call, algorithm)
    assert codings == [algorithm]
    np.testing.assert_array_equal(packed, plain)
    np.testing.assert_array_equal(packed, x)
    assert packed_doc == plain_doc


async def test_repository_index_load_and_unload_through_tritonclient(server):
    """``get_model_repository_index`` reads the index; ``load_model`` and
    ``unload_model`` get Triton's error document (model control is off)."""

    def calls():
        client = _client(server)
        try:
            index = client.get_model_repository_index()
            with pytest.raises(InferenceServerException) as load:
                client.load_model("mlp")
            with pytest.raises(InferenceServerException) as unload:
                client.unload_model("mlp", unload_dependents=True)
            return client.get_server_metadata(), index, load.value, unload.value
        finally:
            client.close()

    meta, index, load, unload = await trio.to_thread.run_sync(calls)
    assert "model_repository" in meta["extensions"]
    assert {(e["name"], e["state"]) for e in index} == {
        (name, "READY") for name in server.signatures
    }
    assert load.status() == unload.status() == "400"
    assert "cannot load model 'mlp': model control is off" in load.message()
    assert "cannot unload model 'mlp'" in unload.message()


async def test_a_load_with_a_config_through_tritonclient():
    """``load_model(name, config=...)`` sends the config as Triton's (a JSON string):
    the model's config then says what it runs; a refused key is Triton's error."""
    import json

    cfg = config(echo_model(max_batch_size=8), server={"model_control": "explicit"})

    def calls(gw):
        client = _client(gw)
        try:
            client.load_model("echo", config=json.dumps({"name": "echo", "max_batch_size": 32}))
            loaded = client.get_model_config("echo")
            with pytest.raises(InferenceServerException) as refused:
                client.load_model("echo", config=json.dumps({"backend": "mlp"}))
            client.load_model("echo")
            return loaded, refused.value, client.get_model_config("echo")
        finally:
            client.close()

    async with serving(cfg) as gw:
        loaded, refused, table = await trio.to_thread.run_sync(calls, gw)
    assert loaded["max_batch_size"] == 32
    assert refused.status() == "400"
    assert "models.echo.backend: a load's config cannot change it" in refused.message()
    assert table["max_batch_size"] == 8


async def test_a_models_config_edited_and_loaded_back_through_tritonclient():
    """Triton's flow: ``get_model_config``, change ``max_batch_size``, ``load_model(name,
    config=json.dumps(cfg))``. The model then batches at the new size (32 rows: four
    batches of 8 before, split as its oversize policy says; one of 32 after) and its
    config and the index say so; ``load_model`` without a config goes back."""
    import json

    explicit = {"model_control": "explicit"}
    cfg = config(echo_model(max_batch_size=8, oversize="split"), server=explicit)
    x = np.arange(32, dtype=np.float32).reshape(32, 1)

    def calls(gw):
        client = _client(gw)

        def thirty_two():
            before = client.get_inference_statistics("echo")["model_stats"][0]
            inp = tritonclient_http.InferInput("x", [32, 1], "FP32")
            inp.set_data_from_numpy(x)
            out = client.infer("echo", [inp]).as_numpy("x")
            after = client.get_inference_statistics("echo")["model_stats"][0]
            return (out.tolist(), after["execution_count"] - before["execution_count"],
                    after["inference_count"] - before["inference_count"])

        try:
            table = client.get_model_config("echo")
            first = thirty_two()
            edited = {**table, "max_batch_size": 32}
            client.load_model("echo", config=json.dumps(edited))
            loaded = client.get_model_config("echo")
            (entry,) = client.get_model_repository_index()
            second = thirty_two()
            client.load_model("echo")
            return table, first, edited, loaded, entry, second, client.get_model_config("echo")
        finally:
            client.close()

    async with serving(cfg) as gw:
        table, first, edited, loaded, entry, second, again = await trio.to_thread.run_sync(
            calls, gw
        )
    assert table["max_batch_size"] == 8
    assert first == (x.tolist(), 4, 32)
    assert loaded == edited
    assert (entry["state"], entry["reason"]) == (
        "READY", "runs the configuration its load gave (changed: max_batch_size)"
    )
    assert second == (x.tolist(), 1, 32)
    assert again == table


BUILTINS = [
    mlp_model(),
    echo_model(),
    ModelConfig(name="sleep", backend="sleep", max_wait_ms=0.5),
    *([ModelConfig(name="minilm", backend="minilm")] if minilm_available() else []),
]


async def test_each_built_in_models_config_loaded_back_unchanged_through_tritonclient():
    """The document ``get_model_config`` gives, sent back as a load's config, reloads
    the model as configured (no config of its own in the index) and says the same."""
    import json

    cfg = config(*BUILTINS, server={"model_control": "explicit"})

    def calls(gw):
        client = _client(gw)
        try:
            out = {}
            for m in BUILTINS:
                doc = client.get_model_config(m.name)
                client.load_model(m.name, config=json.dumps(doc))
                out[m.name] = doc, client.get_model_config(m.name)
            return out, client.get_model_repository_index()
        finally:
            client.close()

    async with serving(cfg) as gw:
        old = dict(gw.runtime.models)
        docs, index = await trio.to_thread.run_sync(calls, gw)
        assert all(gw.runtime.models[m.name] is not old[m.name] for m in BUILTINS)  # reloaded
        assert all(
            gw.runtime.models[m.name].config is gw.runtime.config.model(m.name)
            for m in BUILTINS
        )
    assert sorted(docs) == sorted(m.name for m in BUILTINS)
    assert all(before == after for before, after in docs.values())
    assert [(e["name"], e["state"], e["reason"]) for e in index] == [
        (m.name, "READY", "") for m in sorted(BUILTINS, key=lambda m: m.name)
    ]


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda d: d["input"][0].update(dims=[3]),
         "failed to load 'echo': models.echo.input: the model's inputs are its backend's "
         "(its options may change them): a load cannot change it (models.echo.input[0]."
         "dims[0]: the model's: -1, got 3)"),
        (lambda d: d.update(platform="onnxruntime_onnx"),
         "failed to load 'echo': models.echo.platform: the platform is the backend's"),
        (lambda d: d["parameters"].update(timeout_ms={"string_value": "a minute"}),
         "failed to load 'echo': models.echo.parameters.timeout_ms.string_value: must be "
         "a number (as a string), got 'a minute'"),
        (lambda d: d["parameters"].update(cache={"string_value": "false"}),
         "failed to load 'echo': models.echo.cache: a load's config cannot change it: the "
         "result cache's rules are set when the server starts"),
    ],
    ids=["input", "platform", "bad-parameter", "cache"],
)
async def test_a_config_edited_where_a_load_cannot_is_tritons_400(change, error):
    import json

    cfg = config(echo_model(), server={"model_control": "explicit"})

    def calls(gw):
        client = _client(gw)
        try:
            doc = client.get_model_config("echo")
            change(doc)
            with pytest.raises(InferenceServerException) as refused:
                client.load_model("echo", config=json.dumps(doc))
            return refused.value, client.get_model_repository_index()
        finally:
            client.close()

    async with serving(cfg) as gw:
        old = gw.runtime.models["echo"]
        refused, index = await trio.to_thread.run_sync(calls, gw)
        assert gw.runtime.models["echo"] is old  # nothing loaded
    assert refused.status() == "400"
    assert refused.message().startswith(error)
    assert [(e["state"], e["reason"]) for e in index] == [("READY", "")]
