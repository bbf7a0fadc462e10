"""The v2 wire format's JSON tensor data, sans IO: large float tensors, packed data
against numpy's conversion, the scan for booleans, simdjson's decoding of large bodies
against orjson's, and NaN and infinities as Triton writes them."""

from __future__ import annotations

import attrs
import numpy as np
import orjson
import pytest
import trioserve
from http_helpers import OPEN, VEC, parse, signature
from hypothesis import given
from hypothesis import strategies as st
from trioserve import InvalidInput, TensorSpec
from trioserve.transport import InferRequest, encode_response
from trioserve.transport._request import encode_inputs
from trioserve.transport._response import decode_outputs
from trioserve.transport._v2 import dumps, json_loads

# ------------------------------------------------- large float tensors
WIDE = signature([TensorSpec(name="x", datatype="FP32", shape=(256,))])


def _decode(rows) -> np.ndarray:
    doc = {"inputs": [{"name": "x", "shape": [len(rows), 256], "datatype": "FP32",
                       "data": rows}]}
    req = InferRequest.from_v2_json(orjson.dumps(doc), WIDE)
    assert req.stacked["x"].shape == (len(rows), 256)
    return np.stack([it["x"] for it in req.items])


@pytest.mark.parametrize(("bad", "message"), [
    (None, r"expected FP32 values, got null \(element 1297\)"),  # 5 * 256 + 17
    ("1.5", "expected FP32 values, got"),
    ({}, r"expected FP32 values, got \{\} \(element 1297\)"),
    ([1.0, 2.0], r"shape \[8, 256\] holds 2048 values, 'data' has 2049"),
])
def test_a_large_float_tensor_with_one_bad_value_is_refused(bad, message):
    rows = [[0.5] * 256 for _ in range(8)]
    rows[5][17] = bad
    with pytest.raises(InvalidInput, match=message):
        _decode(rows)
    rows[5][17] = 7
    assert _decode(rows)[5, 17] == 7.0


# ---------------------------------------- packed JSON data agrees with numpy's path
_NUMERIC = ["FP32", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT32", "UINT64"]


_ELEMENTS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(min_value=-300, max_value=300),
    st.booleans(), st.none(), st.text(max_size=3), st.just([]), st.just({}),
)


@st.composite
def _json_data(draw):
    rows = draw(st.integers(min_value=1, max_value=4))
    width = draw(st.integers(min_value=1, max_value=5))
    # mostly one kind of number, sometimes with an odd element planted anywhere
    base = draw(st.sampled_from([
        st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
        st.integers(min_value=-300, max_value=300), st.booleans(), _ELEMENTS,
    ]))
    values = [[draw(base) for _ in range(width)] for _ in range(rows)]
    if draw(st.booleans()):
        values[draw(st.integers(0, rows - 1))][draw(st.integers(0, width - 1))] = draw(_ELEMENTS)
    shape = [rows, width]
    match draw(st.sampled_from(["rows", "flat", "ragged", "regrouped", "deeper", "short"])):
        case "flat":
            data = [v for row in values for v in row]
        case "ragged":  # one value short, or one too many
            data = values
            data[-1] = data[-1][:-1] + ([] if width > 1 else [0.5, 0.5])
        case "regrouped":  # the same values in rows of other lengths (empty ones too)
            flat = [v for row in values for v in row]
            cuts = sorted(draw(st.lists(st.integers(0, len(flat)), max_size=3)))
            data = [flat[a:b] for a, b in zip([0, *cuts], [*cuts, len(flat)], strict=True)]
        case "deeper":  # one value nested further down
            data = values
            i, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, width - 1))
            data[i][j] = [[data[i][j]]] if draw(st.booleans()) else [data[i][j]]
        case "short":
            data = [v for row in values for v in row][:-1]
        case _:
            data = values
    return data, shape


@given(data_shape=_json_data(), datatype=st.sampled_from(_NUMERIC))
def test_packed_json_data_agrees_with_numpys_conversion(monkeypatch_module, data_shape,
                                                        datatype):
    """The struct fast path gives the same array, or the same refusal, as numpy's
    conversion alone, for numbers, bools, null, strings and bad nesting."""
    from trioserve.transport import _tensors

    data, shape = data_shape
    sig = signature([TensorSpec(name="x", datatype=datatype, shape=(-1,))])
    doc = dumps({"inputs": [{"name": "x", "shape": shape, "datatype": datatype,
                             "data": data}]})

    def outcome():
        try:
            req = InferRequest.from_v2_json(doc, sig)
        except InvalidInput as exc:
            return "refused", str(exc)
        return [(it["x"].dtype.str, it["x"].shape, it["x"].tobytes()) for it in req.items]

    fast = outcome()
    monkeypatch_module.setattr(_tensors, "_pack", lambda data, dtype, count: None)
    try:
        slow = outcome()
    finally:
        monkeypatch_module.undo()
    assert fast == slow


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_packed_json_data_refuses_what_numpy_refuses():
    sig = signature([TensorSpec(name="x", datatype="FP32", shape=(-1,))])

    def refusal(data, datatype="FP32", shape=(2, 2)):
        sig_ = sig if datatype == "FP32" else signature(
            [TensorSpec(name="x", datatype=datatype, shape=(-1,))])
        with pytest.raises(InvalidInput) as info:
            parse({"inputs": [{"name": "x", "shape": list(shape), "datatype": datatype,
                               "data": data}]}, sig_)
        return str(info.value)

    assert "got strings" in refusal([[1.0, "2"], [3.0, 4.0]])
    assert "got null (element 1) in 'data'" in refusal([1.0, None, 3.0, 4.0])
    assert "got a boolean" in refusal([[True, False], [True, True]])
    assert "out of range for FP32" in refusal([[1e300, 1.0], [3.0, 4.0]])
    assert "out of range for INT8" in refusal([1, 2, 300, 4], "INT8")
    assert "expected INT32 values, got floats" in refusal([1, 2, 3.5, 4], "INT32")
    assert "holds 4 values" in refusal([1.0, 2.0, 3.0])
    assert "holds 4 values, 'data' has 3" in refusal([[1.0, 2.0], [3.0]])
    assert "got strings" in refusal([[1.0], [2.0, "3", 4.0]])
    assert "got null (element 2)" in refusal([[1.0], [2.0, None, 4.0]])
    assert "out of range for INT8" in refusal([[1], [2, 300, 4]], "INT8")
    ok = parse({"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32",
                            "data": [[1, 2.5], [3, 4]]}]}, sig)
    assert [it["x"].tolist() for it in ok.items] == [[1.0, 2.5], [3.0, 4.0]]
    assert ok.items[0]["x"].flags.writeable


@pytest.mark.parametrize("datatype", ["FP32", "FP64", "FP16", "INT32", "INT64", "UINT8"])
@pytest.mark.parametrize(
    "data",
    [[[1, 2], [True, 4]], [1, 2, 3, False], [[1, 2], [3, [True][0]]], [False, 1, 2, 3]],
    ids=["row", "flat-last", "nested", "flat-first"],
)
def test_a_boolean_among_numbers_is_refused(datatype, data):
    """JSON true/false are not numbers (Triton refuses them too), though Python's bool
    is an int and both conversions would take it as 1 or 0."""
    sig = signature([TensorSpec(name="x", datatype=datatype, shape=(-1,))])
    doc = {"inputs": [{"name": "x", "shape": [2, 2], "datatype": datatype, "data": data}]}
    with pytest.raises(InvalidInput, match=f"expected {datatype} values, got a boolean"):
        parse(doc, sig)
    # the same with the words elsewhere in the body, and one value as bare data
    doc["parameters"] = {"binary_data_output": False, "note": "true"}
    with pytest.raises(InvalidInput, match="got a boolean"):
        parse(doc, sig)
    one = {"inputs": [{"name": "x", "shape": [1], "datatype": datatype, "data": True}]}
    with pytest.raises(InvalidInput, match=r"got (a boolean|booleans)"):
        parse(one, sig)
    # numbers alone, with or without the words elsewhere, go through
    doc["inputs"][0]["data"] = [[1, 0], [0, 1]]
    assert [it["x"].tolist() for it in parse(doc, sig).items] == [[1, 0], [0, 1]]
    del doc["parameters"]
    assert [it["x"].tolist() for it in parse(doc, sig).items] == [[1, 0], [0, 1]]


def test_bool_data_is_still_bools():
    sig = signature([TensorSpec(name="x", datatype="BOOL", shape=(-1,))])
    req = parse({"inputs": [{"name": "x", "shape": [3], "datatype": "BOOL",
                             "data": [True, False, True]}]}, sig)
    assert req.items[0]["x"].tolist() == [True, False, True]
    with pytest.raises(InvalidInput, match="expected BOOL values, got integers"):
        parse({"inputs": [{"name": "x", "shape": [2], "datatype": "BOOL",
                           "data": [True, 1]}]}, sig)


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(-(2**63), 2**63 - 1) | st.text(alphabet="tfrueals\\ \"x", max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(alphabet="tfrueals", max_size=6), inner, max_size=4),
    max_leaves=30,
)


def _holds_a_bool(v, *, in_list: bool = False) -> bool:
    """Whether a boolean is an element of a list anywhere in ``v``."""
    if type(v) is bool:
        return in_list
    if type(v) is list:
        return any(_holds_a_bool(x, in_list=True) for x in v)
    if type(v) is dict:
        return any(_holds_a_bool(x) for x in v.values())
    return False


@given(value=_JSON_VALUES, text=st.booleans(), indent=st.booleans())
def test_the_scan_for_booleans_never_misses_one(value, text, indent):
    """The body scan that spares the exact check says "maybe" for every JSON text
    that holds a boolean as an array element (as bytes and as str, compact or
    indented); it may say so for others too: always after 16 other hits of a word's
    first letter, and never when neither word appears before that."""
    from trioserve.transport._tensors import _may_hold_bool

    body = orjson.dumps(value, option=orjson.OPT_INDENT_2 if indent else 0)
    if _holds_a_bool(value):
        assert _may_hold_bool(body.decode() if text else body)
    if b"true" not in body and b"false" not in body:
        gives_up = body.count(b"t") > 16 or body.count(b"f") > 16
        assert _may_hold_bool(body.decode() if text else bytearray(body)) is gives_up


# ------------------------------- large bodies: simdjson's decoding agrees with orjson's
@st.composite
def _v2_body(draw):
    """A v2 request as JSON text: plain most of the time, sometimes with what the
    numeric decoder must hand back (deep nesting, duplicate keys, '[' in strings,
    numbers a 64-bit double or an FP32 cannot hold)."""
    data, shape = draw(_json_data())
    datatype = draw(st.sampled_from(["FP32", "FP32", "FP64", "INT32", "BOOL", "FP16"]))
    twist = draw(st.sampled_from(
        ["none", "none", "none", "deep", "dup_data", "dup_type", "bracket", "big", "id",
         "outputs", "spaces", "bom", "huge_int"]))
    fields = [("name", '"x"'), ("shape", orjson.dumps(shape).decode()),
              ("datatype", f'"{datatype}"'), ("data", orjson.dumps(data).decode())]
    top = []
    if twist == "deep" and data and type(data[0]) is list and data[0]:
        data[0][0] = [data[0][0]]
        fields[3] = ("data", orjson.dumps(data).decode())
    elif twist == "dup_data":
        fields.insert(0, ("data", "[1.0]"))
    elif twist == "dup_type":
        fields.append(("datatype", '"FP64"'))
    elif twist == "bracket":
        top.append(("id", '"a[b"'))
    elif twist == "big":
        fields[3] = ("data", draw(st.sampled_from(
            ["[1e39, 2.0]", "[3.5e38, 1]", "[1e309]", "[18446744073709551616]",
             "[9007199254740993, 0.1]", "[-0.0, 0]", "[1.00000001, 16777217]"])))
    elif twist == "id":
        top.append(("id", '"req-7"'))
    elif twist == "outputs":
        top.append(("outputs", '[{"name": "x", "parameters": {"binary_data": false}}]'))
        top.append(("parameters", '{"priority": 1, "tags": [1, [2]]}'))
    elif twist == "huge_int":
        top.append(("id", "123456789012345678901234567890"))
    sep = ", " if twist == "spaces" else ","
    tensor = "{" + sep.join(f'"{k}":{v}' for k, v in fields) + "}"
    body = "{" + sep.join([f'"inputs":[{tensor}]'] + [f'"{k}":{v}' for k, v in top]) + "}"
    return (b"\xef\xbb\xbf" if twist == "bom" else b"") + body.encode(), datatype


@given(body_type=_v2_body())
def test_large_bodies_decode_as_orjson_decodes_them(monkeypatch_module, body_type):
    """The numeric decoder (used for bodies of NUMERIC_PARSE_MIN bytes and more) gives
    the same request, or the same refusal, as orjson and the checks after it."""
    from trioserve.transport import _request_json

    body, datatype = body_type
    sig = signature([TensorSpec(name="x", datatype=datatype, shape=(-1,))])

    def outcome():
        try:
            req = InferRequest.from_v2_json(body, sig)
        except InvalidInput as exc:
            return "refused", str(exc)
        rows = [(it["x"].dtype.str, it["x"].shape, it["x"].tobytes(), it["x"].flags.writeable)
                for it in req.items]
        return rows, req.id, req.outputs, req.priority, req.binary_outputs

    monkeypatch_module.setattr(_request_json, "NUMERIC_PARSE_MIN", 0)
    try:
        fast = outcome()
    finally:
        monkeypatch_module.undo()
    assert fast == outcome()


def test_a_large_float_request_is_decoded_without_python_floats():
    from trioserve.transport._request_json import NUMERIC_PARSE_MIN, _loads_numeric

    x = np.random.default_rng(3).standard_normal((32, 256)).astype(np.float32)
    for data in (x.tolist(), x.reshape(-1).tolist()):
        body = orjson.dumps({"id": "r1", "inputs": [
            {"name": "x", "shape": [32, 256], "datatype": "FP32", "data": data}]})
        assert len(body) >= NUMERIC_PARSE_MIN
        doc = _loads_numeric(body)
        assert doc is not None
        assert doc["id"] == "r1"
        got = doc["inputs"][0]["data"]
        assert type(got) is np.ndarray
        assert got.dtype == np.float32
        assert np.array_equal(got.reshape(32, 256), x)
    sig = signature([TensorSpec(name="x", datatype="FP32", shape=(256,))])
    req = InferRequest.from_v2_json(body, sig)
    assert np.array_equal(req.stacked["x"], x)
    # what it hands back: a value nested deeper than a row, a bool, a '[' in a string,
    # a duplicate key
    for bad in (b'{"inputs":[{"name":"x","shape":[2,2],"datatype":"FP32","data":[[1,2,[3]],[4]]}]}',
                b'{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[true,2]}]}',
                b'{"id":"[","inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}',
                b'{"inputs":[],"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}'):
        assert _loads_numeric(bad) is None
    # a text message (the WebSocket stream's) takes the same way; one that cannot be
    # UTF-8 gets orjson's refusal
    from trioserve.transport._request_json import loads_request

    assert type(loads_request(body.decode())["inputs"][0]["data"]) is np.ndarray
    with pytest.raises(InvalidInput, match="malformed JSON body"):
        loads_request('{"id": "\ud800", "pad": "' + " " * NUMERIC_PARSE_MIN + '"}')


def test_deeply_nested_data_with_a_boolean_elsewhere_is_a_400_not_a_recursion():
    deep = "[" * 900 + "1.0" + "]" * 900
    body = ('{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":' + deep
            + '}],"parameters":{"a":[true]}}')
    sig = signature([TensorSpec(name="x", datatype="FP32", shape=(-1,))])
    with pytest.raises(InvalidInput, match="'data' nests a value in 100 arrays or more"):
        InferRequest.from_v2_json(body.encode(), sig)


def test_a_boolean_only_as_an_objects_value_costs_no_exact_check(monkeypatch):
    """tritonclient sends "binary_data": true with each requested output: the data
    is not walked for it."""
    from trioserve.transport import _tensors

    walked = []
    monkeypatch.setattr(_tensors, "_holds_bool", lambda data: walked.append(1) or False)
    parse({"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
           "outputs": [{"name": "y", "parameters": {"binary_data": True}}]})
    assert walked == []
    parse({"inputs": [{"name": "x", "shape": [4], "datatype": "FP32",
                       "data": [1, 2, 3, 4]}], "parameters": {"tags": [True]}})
    assert walked == [1]  # a boolean in some array: the data is checked


def test_only_json_data_has_its_body_scanned_for_booleans(monkeypatch):
    """A binary input's JSON head (with tritonclient's "binary_data": true) is never
    scanned; once an input carries JSON data the body is scanned once, and a boolean
    among its numbers is still refused, whatever comes before it."""
    from trioserve.transport import _request

    scans = []
    scan = _request._may_hold_bool
    monkeypatch.setattr(_request, "_may_hold_bool", lambda text: scans.append(1) or scan(text))
    x = np.arange(4, dtype=np.float32)
    header = orjson.dumps({
        "inputs": [{"name": "x", "shape": [4], "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    })
    req = InferRequest.from_v2_json(header + x.tobytes(), VEC, header_length=len(header))
    np.testing.assert_array_equal(req.items[0]["x"], x)
    assert scans == []

    two = signature([TensorSpec(name="a", datatype="FP32", shape=(2,)),
                     TensorSpec(name="b", datatype="FP32", shape=(2,)),
                     TensorSpec(name="c", datatype="FP32", shape=(2,))])
    a = np.ones(2, dtype=np.float32)
    header = orjson.dumps({"inputs": [
        {"name": "a", "shape": [2], "datatype": "FP32",
         "parameters": {"binary_data_size": a.nbytes}},
        {"name": "b", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]},
        {"name": "c", "shape": [2], "datatype": "FP32", "data": [3.0, True]},
    ]})
    with pytest.raises(InvalidInput, match="input 'c': expected FP32 values, got a boolean"):
        InferRequest.from_v2_json(header + a.tobytes(), two, header_length=len(header))
    assert scans == [1]


NON_FINITE = np.array([1.5, np.nan, np.inf, -np.inf], dtype=np.float32)


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_nan_and_infinities_are_read_as_triton_writes_them(datatype):
    """Triton reads and writes NaN, Infinity and -Infinity in JSON data (rapidjson's
    NaN-and-Inf flags); orjson refuses them, so they were a 400 "malformed JSON"."""
    sig = signature([TensorSpec(name="x", datatype=datatype, shape=(-1,))])
    body = (b'{"inputs": [{"name": "x", "shape": [4], "datatype": "%s", '
            b'"data": [1.5, NaN, Infinity, -Infinity]}]}' % datatype.encode())
    req = InferRequest.from_v2_json(body, sig)
    x = req.items[0]["x"]
    assert x.dtype == trioserve.V2_DTYPES[datatype]
    np.testing.assert_array_equal(x, NON_FINITE.astype(x.dtype))


def test_a_large_body_with_nan_takes_the_general_path_and_keeps_its_values():
    values = np.linspace(-1, 1, 5000)
    text = ", ".join([*map(repr, values.tolist()), "NaN"])
    body = (
        '{"inputs": [{"name": "x", "shape": [5001], "datatype": "FP64", "data": [%s]}]}'
        % text
    ).encode()
    assert len(body) > 16 * 1024
    sig = signature([TensorSpec(name="x", datatype="FP64", shape=(-1,))])
    x = InferRequest.from_v2_json(body, sig).items[0]["x"]
    np.testing.assert_array_equal(x[:-1], values)
    assert np.isnan(x[-1])


def test_non_finite_json_is_refused_where_it_does_not_belong():
    int_sig = signature([TensorSpec(name="x", datatype="INT32", shape=(-1,))])
    with pytest.raises(InvalidInput, match="expected INT32 values, got floats"):
        InferRequest.from_v2_json(
            b'{"inputs": [{"name": "x", "shape": [2], "datatype": "INT32", '
            b'"data": [1, NaN]}]}', int_sig)
    # A finite value too large for FP32 is still out of range beside a NaN of the caller's.
    with pytest.raises(InvalidInput, match="out of range for FP32"):
        InferRequest.from_v2_json(
            b'{"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", '
            b'"data": [NaN, 1e300, 1, 2]}]}', VEC)
    # The words, not any text holding them, and still malformed JSON after all.
    for body in (b'{"inputs": [NaNa]}', b'{"x": Infinity', b'{"NaN": nan}'):
        with pytest.raises(InvalidInput, match="malformed JSON"):
            InferRequest.from_v2_json(body, VEC)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_non_finite_outputs_are_written_nan_and_infinity_not_null(dtype):
    sig = signature([TensorSpec(name="x", datatype="FP32", shape=(-1,))], open_inputs=True)
    req = parse({"inputs": [{"name": "x", "shape": [4], "datatype": "FP32",
                             "data": [1, 2, 3, 4]}]}, sig)
    req = attrs.evolve(req, binary_outputs=False)
    body, hlen = encode_response(req, [{"x": NON_FINITE.astype(dtype)}], sig)
    assert hlen is None
    assert b"[1.5,NaN,Infinity,-Infinity]" in body
    got = decode_outputs(json_loads(body))["x"]
    np.testing.assert_array_equal(got, NON_FINITE.astype(dtype))
    # Finite outputs are still written by orjson as they were.
    body, _ = encode_response(req, [{"x": np.array([0.1, 2.0], dtype=dtype)}], sig)
    data = orjson.loads(body)["outputs"][0]["data"]
    np.testing.assert_array_equal(np.asarray(data, dtype), np.array([0.1, 2.0], dtype))


def test_the_client_sends_and_reads_non_finite_values():
    (tensor,) = encode_inputs({"x": NON_FINITE})
    body = dumps({"inputs": [tensor]})
    assert b"[1.5,NaN,Infinity,-Infinity]" in body
    x = InferRequest.from_v2_json(body, OPEN).items[0]["x"]
    np.testing.assert_array_equal(x, NON_FINITE)


# ------------------------------------------- nested data is read row-major, as Triton's
@pytest.mark.parametrize("datatype", ["FP32", "INT64", "BYTES"])
@pytest.mark.parametrize(
    ("shape", "data"),
    [([2, 3], [[1, 2], [3, 4], [5, 6]]), ([6], [[1, 2, 3], [4, 5, 6]]),
     ([2, 3], [[[1, 2, 3]], [[4, 5, 6]]]), ([2, 3], [1, 2, 3, 4, 5, 6])],
    ids=["rows-of-two", "nested-for-flat", "deeper", "flat"],
)
def test_nested_data_is_its_values_in_row_major_order_whatever_its_nesting(
    datatype, shape, data
):
    """Triton's JSON reader walks ``data`` depth first and checks only the count of
    values against ``shape`` (KServe's reshapes numpy's array): a client written for
    them may nest its data otherwise than the shape and be served the same."""
    sig = signature([TensorSpec(name="x", datatype=datatype, shape=(-1,))])
    if datatype == "BYTES":
        data = _as_text(data)
    req = parse({"inputs": [{"name": "x", "shape": shape, "datatype": datatype,
                             "data": data}]}, sig)
    got = np.concatenate([np.asarray(it["x"]).reshape(-1) for it in req.items]).tolist()
    want = [1, 2, 3, 4, 5, 6]
    assert got == ([str(v) for v in want] if datatype == "BYTES" else want)


def _as_text(data):
    return [_as_text(v) for v in data] if isinstance(data, list) else str(data)


# ------------------------ ragged nesting: only the count of values is the shape's
_ALL_JSON_TYPES = [*_NUMERIC, "UINT16", "FP16", "BOOL", "BYTES"]


def _values(datatype: str, n: int) -> list:
    """``n`` values of ``datatype`` as JSON data holds them."""
    if datatype == "BOOL":
        return [i % 3 == 0 for i in range(n)]
    if datatype == "BYTES":
        return [f"s{i % 90}" for i in range(n)]
    if datatype.startswith("FP"):
        return [(i % 90) / 4 for i in range(n)]
    return [i % 90 for i in range(n)]


def _ragged_body(datatype: str, data: list, shape: list[int], large: bool) -> bytes:
    """A request with ``data`` as JSON text, padded to the numeric decoder's size when
    ``large`` (with an id: no value of the tensor changes)."""
    from trioserve.transport._request_json import NUMERIC_PARSE_MIN

    doc = {"inputs": [{"name": "x", "shape": shape, "datatype": datatype, "data": data}]}
    body = orjson.dumps(doc)
    if large and len(body) < NUMERIC_PARSE_MIN:
        doc["id"] = "p" * (NUMERIC_PARSE_MIN - len(body))
        body = orjson.dumps(doc)
    assert (len(body) >= NUMERIC_PARSE_MIN) is large
    return body


def _flat_of(req: InferRequest) -> list:
    return np.concatenate([np.asarray(it["x"]).reshape(-1) for it in req.items]).tolist()


@pytest.mark.parametrize("large", [False, True], ids=["small-body", "16KiB-body"])
@pytest.mark.parametrize("datatype", _ALL_JSON_TYPES)
@pytest.mark.parametrize(
    ("shape", "cut"),
    [([2, 3], [[0, 2], [2, 6]]),  # [[a, b], [c, d, e, f]]
     ([2, 3], [[0, 0], [0, 6]]),  # an empty row first
     ([3, 2], [[0, 5], [5, 6], [6, 6]]),  # an empty row last
     ([2, 4096], [[0, 4095], [4095, 8192]])],  # a large tensor, one value moved
    ids=["2+4", "0+6", "5+1+0", "large"],
)
def test_ragged_rows_are_read_depth_first_when_their_count_is_the_shapes(
    large, datatype, shape, cut
):
    """Triton's JSON reader walks ``data`` depth first and checks only the count of
    values against ``shape``: rows of unequal lengths are served as the values in
    that order (they were a 400, "data is not a regular array"). Numbers, BOOL and
    BYTES alike, decoded by orjson (small bodies) or simdjson first (16 KiB and
    more)."""
    count = shape[0] * shape[1]
    want = _values(datatype, count)
    data = [want[a:b] for a, b in cut]
    big = count > 6
    body = _ragged_body(datatype, data, shape, large or big)
    sig = signature([TensorSpec(name="x", datatype=datatype, shape=(-1,))])
    req = InferRequest.from_v2_json(body, sig)
    assert [it["x"].shape for it in req.items] == [(shape[1],)] * shape[0]
    got = _flat_of(req)
    if datatype == "FP16":
        want = np.asarray(want, np.float16).tolist()
    assert got == want


@pytest.mark.parametrize("large", [False, True], ids=["small-body", "16KiB-body"])
def test_the_numeric_decoder_reads_ragged_rows_itself(large):
    """A large FP32 body in rows of unequal length is still read straight into an
    array (no Python floats), and gives the array the other decoder gives."""
    from trioserve.transport._request_json import _loads_numeric

    want = _values("FP32", 8192)
    body = _ragged_body("FP32", [want[:100], [], want[100:]], [2, 4096], True)
    doc = _loads_numeric(body)
    assert doc is not None
    got = doc["inputs"][0]["data"]
    assert type(got) is np.ndarray
    assert got.tolist() == want
    sig = signature([TensorSpec(name="x", datatype="FP32", shape=(4096,))])
    assert _flat_of(InferRequest.from_v2_json(body, sig)) == want


@pytest.mark.parametrize("large", [False, True], ids=["small-body", "16KiB-body"])
@pytest.mark.parametrize("datatype", _ALL_JSON_TYPES)
def test_ragged_data_of_another_count_or_kind_is_still_refused(large, datatype):
    """What Triton refuses stays a 400 with its reason, whatever the nesting: a count
    of values other than the shape's, and a value not of the datatype."""
    sig = signature([TensorSpec(name="x", datatype=datatype, shape=(-1,))])
    values = _values(datatype, 6)

    def refusal(data):
        body = _ragged_body(datatype, data, [2, 3], large)
        with pytest.raises(InvalidInput) as info:
            InferRequest.from_v2_json(body, sig)
        return str(info.value)

    assert refusal([values[:2], values[2:5]]) == (
        "input 'x': shape [2, 3] holds 6 values, 'data' has 5")
    assert refusal([values[:2], values[2:], values[:1]]) == (
        "input 'x': shape [2, 3] holds 6 values, 'data' has 7")
    if datatype == "BYTES":
        assert refusal([values[:2], [*values[2:5], 7]]) == (
            "input 'x': BYTES data must be strings")
        return
    assert "got null (element 4)" in refusal([values[:2], [*values[2:4], None, values[5]]])
    assert "got strings" in refusal([values[:2], [*values[2:4], "7", values[5]]])
    if datatype == "BOOL":
        assert "expected BOOL values, got integers" in refusal([[True], [1, 0, 1, 0, 1]])
    else:
        assert "got a boolean" in refusal([values[:2], [*values[2:4], True, values[5]]])


@pytest.mark.parametrize("large", [False, True], ids=["small-body", "16KiB-body"])
@pytest.mark.parametrize("datatype", ["FP32", "INT64", "BYTES"])
def test_data_is_read_99_arrays_deep_and_refused_100_deep_as_triton_does(large, datatype):
    """Triton's reader refuses a value inside 100 arrays (its JSON nesting limit)."""
    sig = signature([TensorSpec(name="x", datatype=datatype, shape=(-1,))])
    value = _values(datatype, 2)[1]

    def nested(levels, innermost=None):
        v = innermost or value
        for _ in range(levels - 1):
            v = [v]
        return [v, value]  # ``levels`` arrays around the first value

    req = InferRequest.from_v2_json(_ragged_body(datatype, nested(99), [2], large), sig)
    assert _flat_of(req) == [value, value]
    with pytest.raises(InvalidInput, match=(
        "input 'x': 'data' nests a value in 100 arrays or more; at most 99 levels are read"
    )):
        InferRequest.from_v2_json(_ragged_body(datatype, nested(100), [2], large), sig)
    # an empty array as the 100th holds no value: read, as Triton reads it
    empty = nested(98, innermost=[value, []])  # the value inside 99 arrays, [] beside it
    assert _flat_of(InferRequest.from_v2_json(
        _ragged_body(datatype, empty, [2], large), sig)) == [value, value]
