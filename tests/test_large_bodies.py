"""Large request bodies: a BYTES tensor's element count checked against its shape
before the elements past it are read, decoders that visit a million values in C
rather than one Python call each, and bodies of ``DECODE_IN_THREAD_MIN`` bytes or
more decoded in a worker thread (the same answers as on the event loop; a client
leaving meanwhile lets the thread finish and its result go)."""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np
import orjson
import pytest
import trio
from http_helpers import GATE_LIMIT_S, config, echo_model, serving, settle, signature
from hypothesis import given
from hypothesis import strategies as st
from trioserve import InvalidInput, TensorSpec
from trioserve.transport import (
    InferRequest,
    _gateway,
    _request_json,
    _tensors,
    open_http,
    open_stream,
)
from trioserve.transport._decode import DECODE_IN_THREAD_MIN, Decoder

TEXT = signature([TensorSpec(name="x", datatype="BYTES", shape=(-1,))])
FLAGS = signature([TensorSpec(name="x", datatype="BOOL", shape=(-1,))])


def elements(values: list[bytes]) -> bytes:
    """BYTES binary data: each value's 4-byte little-endian length, then the value."""
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def binary_body(data: bytes, shape: list[int], datatype: str = "BYTES") -> tuple[bytes, int]:
    head = orjson.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": shape,
                                     "parameters": {"binary_data_size": len(data)}}]})
    return head + data, len(head)


class CountingLength:
    """Stands for ``_tensors._LEN``, counting the element lengths read."""

    def __init__(self) -> None:
        self.reads = 0
        self._len = struct.Struct("<I")

    def unpack_from(self, data: Any, pos: int) -> tuple[int]:
        self.reads += 1
        return self._len.unpack_from(data, pos)


# ------------------------------------------------------------------ the count, early
def test_bytes_past_the_shape_s_count_are_refused_at_the_first_extra_element(monkeypatch):
    """A shape of 2 elements with a body of 1,000: the decoder stops after the 2nd
    (it read all 1,000 first, then compared), with a 400 saying so."""
    counting = CountingLength()
    monkeypatch.setattr(_tensors, "_LEN", counting)
    values = [b"a" * (i % 7) for i in range(1000)]
    body, hlen = binary_body(elements(values), [2])
    with pytest.raises(InvalidInput) as err:
        InferRequest.from_v2_json(body, TEXT, header_length=hlen)
    rest = len(elements(values[2:]))
    assert str(err.value) == (
        f"input 'x': binary data goes on past the 2 BYTES elements the shape needs "
        f"({rest} bytes more)"
    )
    assert counting.reads <= 3  # the first length (all alike?), then the two


def test_a_bytes_count_the_data_cannot_hold_is_refused_before_any_element(monkeypatch):
    counting = CountingLength()
    monkeypatch.setattr(_tensors, "_LEN", counting)
    body, hlen = binary_body(elements([b"", b"", b""]), [1_000_000])
    with pytest.raises(InvalidInput) as err:
        InferRequest.from_v2_json(body, TEXT, header_length=hlen)
    assert str(err.value) == (
        "input 'x': binary data of 12 bytes holds at most 3 BYTES elements (each is a "
        "4-byte length and its bytes), shape needs 1000000"
    )
    assert counting.reads == 0


@pytest.mark.parametrize(
    ("data", "count", "message"),
    [
        (elements([b"ab"]), 2, "binary data of 6 bytes holds at most 1 BYTES elements"),
        (elements([b"a", b"b"]), 3, "binary data of 10 bytes holds at most 2 BYTES"),
        (elements([b"a", b"bc", b"d"]) + b"\0", 4, "truncated BYTES element length"),
        (elements([b"", b"", b"", b"", b""]), 4,
         "binary data goes on past the 4 BYTES elements the shape needs (4 bytes more)"),
        (elements([b"a"]) + struct.pack("<I", 50) + b"xyz" + b"\0\0\0\0", 3,
         "BYTES element overruns the binary data"),
        (elements([b"abcd", b"ef"]), 3, "binary data holds 2 BYTES elements, shape needs 3"),
        (elements([b"abc", b"d"]) + elements([b""] * 2)[:4], 4,
         "binary data holds 3 BYTES elements, shape needs 4"),
        (b"\0\0\0\0", 0,
         "binary data goes on past the 0 BYTES elements the shape needs (4 bytes more)"),
    ],
)
def test_bad_bytes_binary_data_gets_a_precise_400(data, count, message):
    body, hlen = binary_body(data, [count])
    with pytest.raises(InvalidInput, match=r"^input 'x': ") as err:
        InferRequest.from_v2_json(body, TEXT, header_length=hlen)
    assert message in str(err.value)


@given(
    values=st.lists(st.binary(max_size=6), max_size=12)
    | st.integers(0, 5).flatmap(
        lambda n: st.lists(st.binary(min_size=n, max_size=n), max_size=12)
    ),
    extra=st.integers(-2, 2),
)
def test_bytes_binary_data_reads_as_its_elements_or_is_refused(values, extra):
    """Elements of one length (numpy's read) and of several (one by one) decode to
    the values sent, NUL bytes kept; a count that disagrees is refused either way."""
    count = len(values) + extra
    if count < 0:
        return
    body, hlen = binary_body(elements(values), [count])
    if extra:
        with pytest.raises(InvalidInput):
            InferRequest.from_v2_json(body, TEXT, header_length=hlen)
        return
    arr = InferRequest.from_v2_json(body, TEXT, header_length=hlen).items[0]["x"]
    assert arr.dtype == object
    assert arr.tolist() == values
    assert all(type(v) is bytes for v in arr.tolist())


# -------------------------------------------------------------- values visited in C
def test_a_long_flat_list_s_values_are_not_visited_one_call_each(monkeypatch):
    """Counting the JSON arrays (``_lists``) recursed into each of a BOOL or BYTES
    input's values: a million calls, 1.3 s. Only lists and dicts are visited now."""
    calls = 0
    lists = _request_json._lists

    def counted(v: Any) -> int:
        nonlocal calls
        calls += 1
        return lists(v)

    monkeypatch.setattr(_request_json, "_lists", counted)
    n = 20_000  # past NUMERIC_PARSE_MIN: the numeric decoder reads the body
    for sig, data in ((FLAGS, [True, False] * (n // 2)), (TEXT, ["ab"] * n)):
        calls = 0
        doc = {"inputs": [{"name": "x", "datatype": sig.inputs[0].datatype,
                           "shape": [n], "data": data}]}
        req = InferRequest.from_v2_json(orjson.dumps(doc), sig)
        assert req.items[0]["x"].tolist() == data
        assert calls < 10


def test_flat_json_strings_are_bytes_data_without_a_walk(monkeypatch):
    """A flat list of strings is BYTES data as it is: no depth-first walk (a Python
    loop over every value); nested data still takes it, and a count that disagrees
    is refused before the array is made, with the same message."""
    def no_walk(data: Any, name: str = "") -> list[Any]:
        raise AssertionError("walked")

    monkeypatch.setattr(_tensors, "_flatten", no_walk)
    doc = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [3], "data": ["a", "b", "c"]}]}
    assert InferRequest.from_v2_json(orjson.dumps(doc), TEXT).items[0]["x"].tolist() == [
        "a", "b", "c"
    ]
    doc["inputs"][0]["shape"] = [4]
    with pytest.raises(InvalidInput, match=r"shape \[4\] holds 4 values, 'data' has 3"):
        InferRequest.from_v2_json(orjson.dumps(doc), TEXT)
    monkeypatch.undo()
    doc["inputs"][0].update(shape=[2, 2], data=[["a", "b"], ["c", 1]])
    with pytest.raises(InvalidInput, match="BYTES data must be strings"):
        InferRequest.from_v2_json(orjson.dumps(doc), TEXT)


# ------------------------------------------------------------- decoded in a thread
def _bodies() -> list[tuple[bytes, str | None]]:
    """(body, Inference-Header-Content-Length) pairs, good and bad, for ``echo``."""
    out: list[tuple[bytes, str | None]] = []
    for values, shape in (([b"ab", b"", b"\0c"], [3]), ([b"xy"] * 4, [2, 2]),
                          ([b"a", b"b", b"c"], [2])):
        body, hlen = binary_body(elements(values), shape)
        out.append((body, str(hlen)))
    for doc in (
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]},
        {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}]},
        {"inputs": [{"name": "x", "datatype": "BOOL", "shape": [2], "data": [True, 3]}]},
        {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [3], "data": ["a"]}]},
    ):
        out.append((orjson.dumps(doc), None))
    out.append((b'{"inputs": [', None))
    return out


async def _answers(gw: Any) -> list[tuple[int, bytes]]:
    out = []
    async with open_http(gw.url) as http:
        for body, hlen in _bodies():
            headers = [] if hlen is None else [("Inference-Header-Content-Length", hlen)]
            res = await http.request("POST", "/v2/models/echo/infer", body, headers=headers)
            out.append((res.status, res.body))
    return out


async def test_a_body_decoded_in_a_thread_is_answered_as_on_the_event_loop():
    async with serving(config(echo_model())) as gw:
        assert gw.decoder.threshold == DECODE_IN_THREAD_MIN
        on_loop = await _answers(gw)
        assert gw.decoder.in_thread == 0
        gw.decoder.threshold = 0  # every body to a thread
        in_thread = await _answers(gw)
        # each body decoded there, and each of the four answers encoded there
        assert gw.decoder.in_thread == len(_bodies()) + 4
    assert in_thread == on_loop
    assert [status for status, _ in on_loop] == [200, 200, 400, 200, 200, 400, 400, 400]


async def test_a_stream_message_decoded_in_a_thread_is_answered_as_on_the_event_loop():
    docs = [
        {"id": "1", "model": "echo", "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]},
        {"id": "2", "model": "echo", "inputs": [
            {"name": "x", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}]},
        {"id": "3", "model": "echo", "inputs": [
            {"name": "x", "datatype": "BYTES", "shape": [3], "data": ["a"]}]},
    ]

    async def answers(gw: Any) -> list[Any]:
        async with open_stream(gw.url) as stream:
            out = []
            for doc in docs:
                await stream.send_raw(orjson.dumps(doc))
                out.append(await stream.receive())
            return out

    async with serving(config(echo_model())) as gw:
        on_loop = await answers(gw)
        gw.decoder.threshold = 0
        in_thread = await answers(gw)
        # the JSON, then the tensors; and the two answers
        assert gw.decoder.in_thread == 2 * len(docs) + 2
    assert repr(in_thread) == repr(on_loop)
    assert "'data' has 1" in repr(on_loop[2])


class HeldDecode:
    """Stands for ``InferRequest.from_v2_json``: waits in its thread until released,
    then decodes; records what it returned."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned: list[InferRequest] = []
        self._decode = InferRequest.from_v2_json

    def __call__(self, *args: Any, **kwargs: Any) -> InferRequest:
        self.entered.set()
        self.release.wait(GATE_LIMIT_S)
        request = self._decode(*args, **kwargs)
        self.returned.append(request)
        return request


async def test_a_client_leaving_while_its_body_decodes_drops_the_result(monkeypatch):
    """The hang-up cancels the request; the thread is not abandoned: it finishes,
    its request is dropped (never run, never answered), and its thread is given back."""
    held = HeldDecode()
    monkeypatch.setattr(InferRequest, "from_v2_json", staticmethod(held))
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2],
                                     "data": [1, 2]}]})
    request = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d"
               b"\r\n\r\n%b" % (len(body), body))
    try:
        async with serving(config(echo_model())) as gw:
            gw.decoder.threshold = 0
            gw.decoder.limiter.total_tokens = 1  # to wait below for its thread
            stream = await trio.open_tcp_stream(*gw.addresses[0])
            await stream.send_all(request)
            await trio.to_thread.run_sync(held.entered.wait, GATE_LIMIT_S)
            await stream.aclose()
            await settle()
            # cancelled, and waiting for its thread
            assert [c.gone for c in gw._conns] == [True]
            assert gw.decoder.limiter.borrowed_tokens == 1
            held.release.set()
            async with gw.decoder.limiter:  # its thread has finished
                await settle()
            stats = gw.statistics()
            assert (stats.clients_gone, stats.requests_in_flight, stats.connections) == (1, 0, 0)
            assert len(held.returned) == 1  # decoded, then dropped
            assert gw.decoder.limiter.borrowed_tokens == 0
            assert gw.runtime.statistics()["echo"]["batches"] == 0
            assert dict(gw.requests) == {}
            # the thread given back: the next large body is decoded and served
            async with open_http(gw.url) as http:
                res = await http.request("POST", "/v2/models/echo/infer", body)
            assert res.status == 200
            assert gw.decoder.limiter.borrowed_tokens == 0
    finally:
        held.release.set()


async def test_a_decode_waiting_for_a_thread_runs_nothing_when_cancelled():
    decoder = Decoder(limiter=trio.CapacityLimiter(1))
    release = threading.Event()
    ran: list[str] = []

    def first() -> str:
        release.wait(GATE_LIMIT_S)
        ran.append("first")
        return "first"

    def second() -> str:
        ran.append("second")
        return "second"

    results: list[str] = []
    try:
        async with trio.open_nursery() as nursery:
            async def one() -> None:
                results.append(await decoder.run(first))

            nursery.start_soon(one)
            await settle()
            with trio.CancelScope() as scope:
                nursery.start_soon(lambda: _cancel_when_blocked(scope))
                await decoder.run(second)
            assert scope.cancelled_caught
            assert decoder.limiter.borrowed_tokens == 1  # the first's thread
            release.set()
    finally:
        release.set()
    assert results == ["first"]
    assert ran == ["first"]
    assert decoder.limiter.borrowed_tokens == 0


async def _cancel_when_blocked(scope: trio.CancelScope) -> None:
    await settle()
    scope.cancel("test: the caller left")


def test_large_bodies_are_those_of_the_threshold_and_more():
    decoder = Decoder(limiter=None)  # type: ignore[arg-type]
    assert not decoder.large(DECODE_IN_THREAD_MIN - 1)
    assert decoder.large(DECODE_IN_THREAD_MIN)
    # the gateway bench's [32, 256] FP32 body (~70 KB) stays on the event loop
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [32, 256],
                       "data": np.round(np.random.default_rng(0).standard_normal(8192), 5)
                       .tolist()}]}
    assert not decoder.large(len(orjson.dumps(doc)))


# ------------------------------------------------------------- encoded in a thread
def _outputs_bodies() -> list[tuple[bytes, str | None]]:
    """Bodies for ``echo`` asking its output as binary or JSON data: BYTES (text, and
    bytes that are not UTF-8, which JSON data refuses), FP32, BOOL."""
    out: list[tuple[bytes, str | None]] = []
    for values in ([b"ab", b"", b"c"], [b"\xff\xfe", b"a"]):
        for as_binary in (True, False):
            data = elements(values)
            head = orjson.dumps({
                "inputs": [{"name": "x", "datatype": "BYTES", "shape": [len(values)],
                            "parameters": {"binary_data_size": len(data)}}],
                "outputs": [{"name": "x", "parameters": {"binary_data": as_binary}}],
            })
            out.append((head + data, str(len(head))))
    for datatype, data in (("FP32", [1.5, -2, 3]), ("BOOL", [True, False, True])):
        for as_binary in (True, False):
            out.append((orjson.dumps({
                "id": "r",
                "inputs": [{"name": "x", "datatype": datatype, "shape": [1, 3], "data": data}],
                "outputs": [{"name": "x", "parameters": {"binary_data": as_binary}}],
            }), None))
    return out


async def test_an_answer_encoded_in_a_thread_is_the_one_encoded_on_the_event_loop():
    async def answers(gw: Any) -> list[tuple[int, Any, bytes]]:
        out = []
        async with open_http(gw.url) as http:
            for body, hlen in _outputs_bodies():
                headers = [] if hlen is None else [("Inference-Header-Content-Length", hlen)]
                res = await http.request("POST", "/v2/models/echo/infer", body, headers=headers)
                out.append((res.status, res.headers.get("inference-header-content-length"),
                            res.body))
        return out

    async with serving(config(echo_model())) as gw:
        on_loop = await answers(gw)
        assert gw.decoder.in_thread == 0
        gw.decoder.threshold = 0
        in_thread = await answers(gw)
        # every body decoded there, and every answer encoded there (also the refused)
        assert gw.decoder.in_thread == 2 * len(_outputs_bodies())
    assert in_thread == on_loop
    assert [status for status, _, _ in on_loop] == [200, 200, 200, 400, 200, 200, 200, 200]
    assert b"not UTF-8" in on_loop[3][2]


async def test_a_stream_answer_encoded_in_a_thread_is_the_one_encoded_on_the_event_loop():
    docs = [
        {"id": "1", "model": "echo", "inputs": [
            {"name": "x", "datatype": "BYTES", "shape": [2], "data": ["a", ""]}]},
        {"id": 2, "model": "echo", "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2]}]},
    ]

    async def answers(gw: Any) -> list[Any]:
        async with open_stream(gw.url) as stream:
            out = []
            for doc in docs:
                await stream.send_raw(orjson.dumps(doc))
                out.append(await stream.receive())
            return out

    async with serving(config(echo_model())) as gw:
        on_loop = await answers(gw)
        gw.decoder.threshold = 0
        in_thread = await answers(gw)
        assert gw.decoder.in_thread == 3 * len(docs)  # the JSON, the tensors, the answer
    assert repr(in_thread) == repr(on_loop)


def test_large_answers_are_those_whose_bytes_outputs_hold_the_threshold_and_more():
    decoder = Decoder(limiter=None)  # type: ignore[arg-type]
    # an object array counts 8 bytes an element: a Python call each to encode
    texts = np.full(DECODE_IN_THREAD_MIN // 8, b"", dtype=object)
    assert decoder.large_results([{"x": texts}])
    assert not decoder.large_results([{"x": texts[1:]}])
    # the items' outputs together: stacked, they are alike
    assert decoder.large_results([{"x": texts[: len(texts) // 2]}] * 2)
    assert decoder.large_results([{"x": texts[:4096], "y": texts[:4096]}] * 4)
    assert decoder.large_results([{"x": np.zeros(DECODE_IN_THREAD_MIN // 4, dtype="S4")}])
    assert decoder.large_results([{"x": np.zeros(DECODE_IN_THREAD_MIN // 4, dtype="U1")}])
    # numbers are written in one C call, in a thread or not: on the loop
    for dtype in (np.float32, np.float64, np.int64, np.bool_):
        assert not decoder.large_results([{"x": np.zeros(10**6, dtype=dtype)}])
    assert not decoder.large_results([{"x": [b""] * 10**6}])  # not an array: nothing
    assert not decoder.large_results([])
    # the answer to the gateway bench's [32, 256] request of mlp ([32, 10]) too
    assert not decoder.large_results([{"y": np.zeros(10, dtype=np.float32)}] * 32)


async def test_a_client_leaving_while_its_answer_encodes_drops_it(monkeypatch):
    """As for a decode: the thread is waited for, its answer dropped (never sent,
    never counted), and its thread given back."""
    entered, release = threading.Event(), threading.Event()
    encoded: list[Any] = []
    encode = _gateway.encode_response

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(GATE_LIMIT_S)
        encoded.append(encode(*args, **kwargs))
        return encoded[-1]

    monkeypatch.setattr(_gateway, "encode_response", held)
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2],
                                     "data": ["a", "b"]}]})
    request = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d"
               b"\r\n\r\n%b" % (len(body), body))
    try:
        async with serving(config(echo_model())) as gw:
            gw.decoder.threshold = 2 * 8  # the answer's 2 BYTES elements (and the body)
            gw.decoder.limiter.total_tokens = 1
            stream = await trio.open_tcp_stream(*gw.addresses[0])
            await stream.send_all(request)
            await trio.to_thread.run_sync(entered.wait, GATE_LIMIT_S)
            await stream.aclose()
            await settle()
            assert [c.gone for c in gw._conns] == [True]
            assert gw.decoder.limiter.borrowed_tokens == 1
            release.set()
            async with gw.decoder.limiter:  # its thread has finished
                await settle()
            stats = gw.statistics()
            assert (stats.clients_gone, stats.requests_in_flight, stats.connections) == (1, 0, 0)
            assert len(encoded) == 1  # encoded, then dropped
            assert gw.decoder.in_thread == 2  # the body, then the answer
            assert gw.runtime.statistics()["echo"]["batches"] == 1
            assert dict(gw.requests) == {}
            async with open_http(gw.url) as http:
                res = await http.request("POST", "/v2/models/echo/infer", body)
            assert res.status == 200
            assert gw.decoder.limiter.borrowed_tokens == 0
    finally:
        release.set()
