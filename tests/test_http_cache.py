"""The result cache over HTTP: the gateway keeps whole encoded answers, keyed by the
raw body and the tenant; the rows of a batch request are cached one by one; errors
are never kept; invalidation reaches both."""

from __future__ import annotations

import inspect
import struct
import tracemalloc

import numpy as np
import orjson
import pytest
import trio
import trioserve
from http_helpers import Gate, held_model, serving, settle
from runtime_helpers import Recorder, callable_model
from trioserve import CacheConfig, TenantConfig, TensorSpec
from trioserve.transport import _v2, open_http

TENANTS = (
    TenantConfig(name="A", api_keys=("key-a",)),
    TenantConfig(name="B", api_keys=("key-b",)),
)


def cfg(*models: trioserve.ModelConfig) -> trioserve.Config:
    return trioserve.Config(
        models=models, tenants=TENANTS, cache=CacheConfig(capacity_bytes=1 << 20)
    )


def body(*rows: float, request_id: str | None = None) -> bytes:
    """One item [x] per row; a batch [N, 1] when there are several rows."""
    shape = [1] if len(rows) == 1 else [len(rows), 1]
    doc: dict = {"inputs": [{"name": "x", "shape": shape, "datatype": "FP32",
                             "data": list(rows)}]}
    if request_id is not None:
        doc["id"] = request_id
    return orjson.dumps(doc)


async def post(gw, data: bytes, key: str = "key-a", model: str = "m"):
    async with open_http(gw.url) as http:
        return await http.request(
            "POST", f"/v2/models/{model}/infer", data,
            headers=[("authorization", f"Bearer {key}"), ("content-type", "application/json")],
        )


def ys(res) -> list[float]:
    assert res.status == 200, res.body
    return orjson.loads(res.body)["outputs"][0]["data"]


async def test_a_repeated_request_gets_the_same_answer_without_running_the_model():
    model = Recorder(timed=False)
    async with serving(cfg(callable_model("m", model))) as gw:
        first = await post(gw, body(2.0, request_id="r1"))
        again = await post(gw, body(2.0, request_id="r1"))
        other_id = await post(gw, body(2.0, request_id="r2"))
        stats = gw.runtime.cache_statistics()
    assert ys(first) == [5.0]
    assert again.body == first.body  # the same encoded answer
    assert orjson.loads(other_id.body)["id"] == "r2"  # another body: its own answer
    # the third request missed the whole-answer cache but hit the item cache
    assert model.seen == [2.0]
    # r1: an item miss; its repeat: an edge hit; r2: an item hit. The edge's own
    # misses are not counted (each new request counted as two misses).
    assert (stats["hits"], stats["misses"]) == (2, 1)


async def test_tenants_never_get_each_others_cached_answers_unless_shareable():
    private, shared = Recorder(timed=False), Recorder(timed=False)
    models = (callable_model("m", private), callable_model("s", shared, cache_shared=True))
    async with serving(cfg(*models)) as gw:
        for key in ("key-a", "key-b", "key-a", "key-b"):
            assert ys(await post(gw, body(3.0), key=key)) == [7.0]
            assert ys(await post(gw, body(3.0), key=key, model="s")) == [7.0]
    assert private.seen == [3.0, 3.0]  # once per tenant
    assert shared.seen == [3.0]


async def test_the_rows_of_batch_requests_are_cached_one_by_one():
    model = Recorder(timed=False)
    async with serving(cfg(callable_model("m", model))) as gw:
        assert ys(await post(gw, body(1.0, 2.0))) == [3.0, 5.0]
        assert ys(await post(gw, body(2.0, 3.0, 2.0))) == [5.0, 7.0, 5.0]
        assert ys(await post(gw, body(3.0))) == [7.0]
    assert model.seen == [1.0, 2.0, 3.0]


async def test_a_failed_request_is_not_kept():
    model = Recorder(fail_on=13.0, timed=False)
    async with serving(cfg(callable_model("m", model))) as gw:
        first = await post(gw, body(13.0))
        runs = model.seen.count(13.0)
        again = await post(gw, body(13.0))
    assert first.status == again.status == 500
    assert "poison item 13" in orjson.loads(again.body)["error"]
    assert model.seen.count(13.0) > runs  # run again: the error was not cached


@pytest.mark.parametrize("version", [None, "1"])
async def test_invalidation_drops_cached_answers(version):
    model = Recorder(timed=False)
    async with serving(cfg(callable_model("m", model))) as gw:
        await post(gw, body(4.0))
        await post(gw, body(4.0, 5.0))
        assert gw.runtime.invalidate_cache("m", version) >= 3  # an answer and two rows
        assert ys(await post(gw, body(4.0))) == [9.0]
        assert ys(await post(gw, body(4.0, 5.0))) == [9.0, 11.0]
    assert model.seen == [4.0, 5.0, 4.0, 5.0]


async def test_binary_requests_are_kept_by_their_bytes_and_their_header_length():
    model = Recorder(timed=False)
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 4}}]})
    raw = header + struct.pack("<f", 6.0)

    async def send(gw, header_length: int | None):
        headers = [("authorization", "Bearer key-a")]
        if header_length is not None:
            headers.append(("inference-header-content-length", str(header_length)))
        async with open_http(gw.url) as http:
            return await http.request("POST", "/v2/models/m/infer", raw, headers=headers)

    async with serving(cfg(callable_model("m", model))) as gw:
        first = await send(gw, len(header))
        again = await send(gw, len(header))
        # the same bytes split elsewhere, or read as JSON, are other requests
        shifted = await send(gw, len(header) - 1)
        as_json = await send(gw, None)
    assert ys(first) == [13.0]
    assert again.body == first.body
    assert model.seen == [6.0]  # the repeat came from the cache
    assert shifted.status == as_json.status == 400


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_body_that_arrives_after_its_head_is_answered_and_kept(chunked):
    """Such a body is read through h11's events (a bytearray there): it once made the
    edge cache's key unhashable, a 500."""
    import trio
    import trio.testing

    model = Recorder(timed=False)
    data = body(3.0)
    framing = b"transfer-encoding: chunked" if chunked else b"content-length: %d" % len(data)
    payload = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if chunked else data
    head = (b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-a\r\n"
            b"%b\r\n\r\n" % framing)
    async with serving(cfg(callable_model("m", model))) as gw:
        answers = []
        for _ in range(2):
            sock = await trio.open_tcp_stream(*gw.addresses[0])
            await sock.send_all(head)
            await trio.testing.wait_all_tasks_blocked()  # the server waits for the body
            await sock.send_all(payload)
            raw = b""
            while b"\r\n\r\n" not in raw or not raw.endswith(b"}"):
                raw += await sock.receive_some(65536)
            await sock.aclose()
            answers.append(raw)
    for raw in answers:
        assert raw.startswith(b"HTTP/1.1 200 "), raw
        assert raw.endswith(b'"data":[7.0]}]}')
    assert model.seen == [3.0]  # the second was a hit


async def test_a_shared_models_edge_answer_still_checks_each_tenants_class():
    """Identical bytes naming a class one tenant may not use: a 403 for it, whoever
    had the answer kept (the edge key is the tenant's even for a shared model)."""
    tenants = (
        TenantConfig(name="A", api_keys=("key-a",)),
        TenantConfig(name="B", api_keys=("key-b",), classes=("realtime",)),
    )
    shared = Recorder(timed=False)
    config = trioserve.Config(
        models=(callable_model("s", shared, cache_shared=True),), tenants=tenants,
        cache=CacheConfig(capacity_bytes=1 << 20),
    )
    data = orjson.dumps({"parameters": {"priority": "batch"},
                         "inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                     "data": [4.0]}]})
    async with serving(config) as gw:
        assert (await post(gw, data, key="key-b", model="s")).status == 403
        assert ys(await post(gw, data, key="key-a", model="s")) == [9.0]
        assert (await post(gw, data, key="key-b", model="s")).status == 403
    assert shared.seen == [4.0]


async def test_a_connection_close_leaves_the_kept_answer_as_it_was():
    """The answer kept at the edge is written for every later hit: closing one
    connection once added "Connection: close" (and a second Content-Length) to it."""
    import trio

    model = Recorder(timed=False)
    data = body(5.0)

    async def raw(close: bool) -> bytes:
        sock = await trio.open_tcp_stream(*gw.addresses[0])
        extra = b"connection: close\r\n" if close else b""
        await sock.send_all(
            b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-a\r\n"
            b"content-length: %d\r\n%b\r\n%b" % (len(data), extra, data)
        )
        got = b""
        while not got.endswith(b"}"):
            got += await sock.receive_some(65536)
        await sock.aclose()
        return got.split(b"\r\n\r\n")[0].lower()

    async with serving(cfg(callable_model("m", model))) as gw:
        first = await raw(close=True)
        assert first.count(b"connection: close") == 1
        for close in (True, False, False):
            head = await raw(close)
            assert head.count(b"connection: close") == (1 if close else 0)
            assert head.count(b"content-length:") == 1
    assert model.seen == [5.0]


async def test_a_bytes_tensor_sent_as_json_then_as_binary_data_is_computed_once():
    """JSON gives a BYTES tensor's elements as strings, the binary tensor data
    extension (tritonclient's default) as bytes: the same tensor, one computation,
    and the second request is a hit of the item cache."""
    seen: list[list] = []

    def lengths(items):
        seen.append([it["s"].tolist() for it in items])
        return [{"n": np.array([len(v.encode() if isinstance(v, str) else v)
                                for v in it["s"]], dtype=np.int32)} for it in items]

    model = callable_model(
        "t", lengths, inputs=(TensorSpec(name="s", datatype="BYTES", shape=(-1,)),),
        outputs=(TensorSpec(name="n", datatype="INT32", shape=(-1,)),),
    )
    words = ["caf\u00e9", "", "spam"]
    as_json = orjson.dumps({"inputs": [{"name": "s", "shape": [3], "datatype": "BYTES",
                                        "data": words}]})
    data = b"".join(struct.pack("<I", len(w.encode())) + w.encode() for w in words)
    header = orjson.dumps({"inputs": [{"name": "s", "shape": [3], "datatype": "BYTES",
                                       "parameters": {"binary_data_size": len(data)}}]})
    async with serving(cfg(model)) as gw:
        first = await post(gw, as_json, model="t")
        async with open_http(gw.url) as http:
            second = await http.request(
                "POST", "/v2/models/t/infer", header + data,
                headers=[("authorization", "Bearer key-a"),
                         ("inference-header-content-length", str(len(header)))],
            )
        stats = gw.runtime.cache_statistics()
    assert first.status == second.status == 200, (first.body, second.body)
    assert second.body == first.body
    assert orjson.loads(first.body)["outputs"][0]["data"] == [5, 0, 4]  # UTF-8 bytes
    assert seen == [[["caf\u00e9", "", "spam"]]]  # one computation, from the JSON
    assert (stats["hits"], stats["misses"]) == (1, 1)


async def test_a_kept_answer_holds_a_block_of_its_own_length():
    """The cache counts a kept answer by its length, and holds no more: orjson's
    output keeps the 4 KiB buffer it was written into (a ~150-byte answer here), so
    64 answers kept as encoded held 256 KiB counted as ~25 KiB."""
    n = 64
    tracemalloc.start()
    try:
        async with serving(cfg(callable_model("m", Recorder(timed=False)))) as gw:
            for i in range(n):
                status, _, out = await gw.infer(
                    "m", None, body(float(i)), authorization=b"Bearer key-a"
                )
                assert status == 200, out
            del out
            stats = gw.runtime.cache_statistics()
            snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # each request's item and its encoded answer kept
    assert (stats["misses"], stats["entries"]) == (n, 2 * n)
    # the blocks orjson wrote answers into (one line of transport/_v2.py)
    source, first = inspect.getsourcelines(_v2.dumps)
    line = first + next(i for i, text in enumerate(source) if "orjson.dumps" in text)
    held = sum(
        t.size for t in snapshot.traces
        if t.traceback[0].filename == _v2.__file__ and t.traceback[0].lineno == line
    )
    assert held < 4096, f"{held} bytes of encoder buffers held after {n} answers"


async def test_answers_the_model_did_not_run_for_are_not_in_the_stats_success_count():
    """docs/gateway.md, Statistics: ``success`` counts the requests the model's queue
    answered; a cache hit (whole answer or item) and a request that joined an identical
    one in flight are counted by /metrics instead (hits, coalesced)."""
    gate = Gate()
    async with serving(cfg(held_model(gate, name="m"))) as gw:

        async def success() -> int:
            async with open_http(gw.url) as http:
                res = await http.get("/v2/models/m/stats")
            return orjson.loads(res.body)["model_stats"][0]["inference_stats"]["success"]["count"]

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(post, gw, body(4.0, request_id=f"r{i}"))
            await trio.to_thread.run_sync(gate.holding.wait)
            await settle()
            gate.release()
        stats = gw.runtime.cache_statistics()
        assert (stats["computations"], stats["coalesced"]) == (1, 2)
        assert await success() == 1  # one run answered three callers
        assert ys(await post(gw, body(4.0, request_id="r0"))) == [4.0]  # edge hit
        assert ys(await post(gw, body(4.0, request_id="r9"))) == [4.0]  # item hit
        assert gw.runtime.cache_statistics()["hits"] == 2
        assert await success() == 1
