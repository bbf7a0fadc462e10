"""Large request bodies: a BYTES tensor's element count checked against its shape
before the elements past it are read, and decoders that visit a million values in C
rather than one Python call each."""

from __future__ import annotations

import struct
from typing import Any

import orjson
import pytest
from http_helpers import signature
from hypothesis import given
from hypothesis import strategies as st
from trioserve import InvalidInput, TensorSpec
from trioserve.transport import InferRequest, _request_json, _tensors

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
