"""The v2 wire format, sans IO: parsing, validation, batch splitting, encoding."""

from __future__ import annotations

import attrs
import numpy as np
import orjson
import pytest
import trioserve
from hypothesis import given
from hypothesis import strategies as st
from trioserve import InvalidInput, TensorSpec
from trioserve.transport import InferRequest, ModelSignature, encode_response
from trioserve.transport._request import encode_inputs
from trioserve.transport._response import decode_outputs
from trioserve.transport._v2 import dumps, json_loads


class _Served:
    def __init__(self, backend, **cfg):
        self.backend = backend
        self.config = trioserve.ModelConfig(name=cfg.pop("name", "m"), backend=backend, **cfg)


def signature(inputs, outputs=None, *, open_inputs=False, **cfg) -> ModelSignature:
    backend = trioserve.CallableBackend(
        lambda items: items, inputs=inputs, outputs=outputs or inputs, open_inputs=open_inputs
    )
    return ModelSignature.of(_Served(backend, **cfg))


VEC = signature([TensorSpec(name="x", datatype="FP32", shape=(4,))],
                [TensorSpec(name="y", datatype="FP32", shape=(2,))], versions=("1", "3"))
TWO = signature([TensorSpec(name="a", datatype="INT64", shape=(-1,)),
                 TensorSpec(name="b", datatype="FP16", shape=(2, 2))])
OPEN = signature([TensorSpec(name="x", datatype="FP32", shape=(-1,))], open_inputs=True)


def parse(doc, sig=VEC, **kw) -> InferRequest:
    return InferRequest.from_v2_json(dumps(doc), sig, **kw)


def test_metadata_has_a_leading_batch_dimension_and_the_latest_version_answers():
    meta = orjson.loads(VEC.metadata_json)
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["versions"] == ["1", "3"]
    req = parse({"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
    body, _ = encode_response(req, [{"y": np.zeros(2, np.float32)}], VEC)
    assert orjson.loads(body)["model_version"] == "3"


def test_a_batch_dimension_splits_into_views_one_per_item():
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    req = parse({"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32",
                             "data": data.tolist()}]})
    assert req.batched
    assert len(req.items) == 3
    for i, item in enumerate(req.items):
        assert item["x"].dtype == np.float32
        np.testing.assert_array_equal(item["x"], data[i])


def test_several_inputs_must_agree_on_the_batch_dimension():
    ok = parse({"inputs": [
        {"name": "a", "shape": [2, 3], "datatype": "INT64", "data": list(range(6))},
        {"name": "b", "shape": [2, 2, 2], "datatype": "FP16", "data": [0.5] * 8},
    ]}, TWO)
    assert len(ok.items) == 2
    assert ok.items[1]["a"].tolist() == [3, 4, 5]
    with pytest.raises(InvalidInput, match="disagree on the batch dimension"):
        parse({"inputs": [
            {"name": "a", "shape": [2, 3], "datatype": "INT64", "data": list(range(6))},
            {"name": "b", "shape": [2, 2], "datatype": "FP16", "data": [0.5] * 4},
        ]}, TWO)
    with pytest.raises(InvalidInput, match="missing input 'b'"):
        parse({"inputs": [{"name": "a", "shape": [3], "datatype": "INT64", "data": [1, 2, 3]}]},
              TWO)
    with pytest.raises(InvalidInput, match="given twice"):
        parse({"inputs": [{"name": "a", "shape": [1], "datatype": "INT64", "data": [1]}] * 2},
              TWO)


def test_an_open_model_takes_any_names_and_datatypes():
    req = parse({"inputs": [
        {"name": "q", "shape": [2, 1], "datatype": "BOOL", "data": [True, False]},
        {"name": "r", "shape": [2, 3], "datatype": "UINT8", "data": [1, 2, 3, 4, 5, 6]},
    ]}, OPEN)
    assert req.items[1]["q"].tolist() == [False]
    assert req.items[1]["r"].dtype == np.uint8
    with pytest.raises(InvalidInput, match="expected BOOL values, got integers"):
        parse({"inputs": [{"name": "q", "shape": [1], "datatype": "BOOL", "data": [3]}]}, OPEN)


def test_parameters_set_priority_and_timeout():
    base = {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}]}
    req = parse({**base, "parameters": {"priority": "batch", "timeout_ms": 250}})
    assert (req.priority, req.timeout) == ("batch", 0.25)
    triton = parse({**base, "parameters": {"priority": 2, "timeout": 1500}})
    assert (triton.priority, triton.timeout) == ("2", 0.0015)
    with pytest.raises(InvalidInput, match=r"parameters\.timeout_ms must be a positive number"):
        parse({**base, "parameters": {"timeout_ms": "soon"}})


@pytest.mark.parametrize(
    ("params", "timeout"),
    [
        ({"timeout": 0}, None),  # Triton's default: no timeout of the request's own
        ({"timeout": 0, "priority": 1}, None),
        # 0.0 is the same number: it was a 400 while 1.5 was taken
        ({"timeout": 0.0}, None),
        ({"timeout": -0.0}, None),
        ({"timeout_ms": 1e308}, 1e305),
        ({"timeout": 2**64 - 1}, (2**64 - 1) * 1e-6),
        ({"timeout": 1.5e300}, 1.5e300 * 1e-6),
        ({"timeout_ms": 250, "timeout": 0}, 0.25),
        ({"timeout_ms": 250, "timeout": 0.0}, 0.25),
        # a fraction of the unit is taken, for both
        ({"timeout": 1500.5}, 1500.5 * 1e-6),
        ({"timeout_ms": 0.5}, 0.5 * 1e-3),
        ({"timeout": 0.5}, 0.5 * 1e-6),
    ],
)
def test_timeout_parameters_that_are_taken(params, timeout):
    base = {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}]}
    assert parse({**base, "parameters": params}).timeout == timeout


@pytest.mark.parametrize(
    "params",
    [
        {"timeout_ms": 0}, {"timeout_ms": -1}, {"timeout_ms": 0.0}, {"timeout_ms": "5"},
        {"timeout_ms": True}, {"timeout_ms": -0.5}, {"timeout": -1}, {"timeout": -0.5},
        {"timeout": "0"}, {"timeout": False}, {"timeout": True},
        {"timeout": [1]},
    ],
)
def test_timeout_parameters_that_are_refused(params):
    base = {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}]}
    (key,) = params
    with pytest.raises(InvalidInput, match=rf"parameters\.{key} must be a positive number"):
        parse({**base, "parameters": params})


@pytest.mark.parametrize("key", ["timeout", "timeout_ms"])
@pytest.mark.parametrize("value", ["1" + "0" * 400, "1e400", "-1e400", "NaN", "Infinity"])
def test_a_timeout_past_a_floats_range_is_a_400(key, value):
    """orjson refuses such numbers as malformed JSON; a body it cannot read (one with
    NaN in its data) is read again by the standard library's decoder, which makes a
    Python int of 10**400 and inf of 1e400: the int raised OverflowError (a 500)."""
    body = ('{"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", '
            '"data": [NaN, 0, 0, 0]}], "parameters": {"%s": %s}}' % (key, value)).encode()
    with pytest.raises(InvalidInput) as info:
        InferRequest.from_v2_json(body, VEC)
    assert str(info.value).startswith(f"parameters.{key} must be a positive number")


def test_binary_inputs_and_outputs_follow_the_json_header():
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    header = orjson.dumps({
        "inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes}}],
        "parameters": {"binary_data_output": True},
    })
    req = InferRequest.from_v2_json(header + x.tobytes(), VEC, header_length=len(header))
    np.testing.assert_array_equal(req.items[1]["x"], x[1])
    results = [{"y": np.array([i, -i], np.float32)} for i in range(2)]
    body, hlen = encode_response(req, results, VEC)
    doc = orjson.loads(body[:hlen])
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 16}
    np.testing.assert_array_equal(decode_outputs(doc, body[hlen:])["y"], [[0, 0], [1, -1]])
    # Text-only transports (the WebSocket) always get JSON data.
    text, none = encode_response(req, results, VEC, binary=False)
    assert none is None
    assert orjson.loads(text)["outputs"][0]["data"] == [0, 0, 1, -1]


def test_bytes_tensors_in_binary_are_length_prefixed():
    values = [b"ab", b"", "é".encode()]
    raw = b"".join(len(v).to_bytes(4, "little") + v for v in values)
    header = orjson.dumps({"inputs": [{"name": "s", "shape": [3], "datatype": "BYTES",
                                       "parameters": {"binary_data_size": len(raw)}}]})
    req = InferRequest.from_v2_json(header + raw, OPEN, header_length=len(header))
    assert req.items[0]["s"].tolist() == values


def test_bytes_output_that_is_not_utf8_is_refused_as_json_and_sent_whole_as_binary():
    """JSON data is text: an output element that is not UTF-8 was decoded with
    replacement characters (b"\\xff" went out as "\\ufffd"), so the client got bytes the
    model never produced. Asked for as JSON it is now a 400 that names the output and
    says how to ask for it; as binary data its bytes go out as they are."""
    values = [b"ok", b"\xff\xfe", "é".encode()]
    bad = np.array(values, dtype=object)
    tensor = {"name": "s", "shape": [3], "datatype": "BYTES", "data": ["a", "b", "c"]}
    as_json = parse({"inputs": [tensor], "outputs": [{"name": "s"}]}, OPEN)
    with pytest.raises(InvalidInput) as info:
        encode_response(as_json, [{"s": bad}], OPEN)
    assert str(info.value) == (
        "model 'm': output 's': element 1 is bytes that are not UTF-8 text, which JSON "
        "data cannot carry unaltered; ask for the output as binary data "
        "(\"binary_data\": true in its parameters)"
    )
    # the stream's text frames carry JSON only
    with pytest.raises(InvalidInput) as info:
        encode_response(as_json, [{"s": bad}], OPEN, binary=False)
    assert str(info.value).endswith(
        "which JSON data cannot carry unaltered; the stream sends JSON only: ask for "
        "the output over HTTP as binary data"
    )
    # as binary data (either way of asking), the bytes exactly
    for doc in ({"outputs": [{"name": "s", "parameters": {"binary_data": True}}]},
                {"parameters": {"binary_data_output": True}}):
        req = parse({"inputs": [tensor], **doc}, OPEN)
        body, hlen = encode_response(req, [{"s": bad}], OPEN)
        assert body[hlen:] == b"".join(len(v).to_bytes(4, "little") + v for v in values)
        got = decode_outputs(orjson.loads(body[:hlen]), body[hlen:])["s"]
        assert got.tolist() == values
    # UTF-8 bytes are still their text in JSON
    body, _ = encode_response(as_json, [{"s": np.array([b"ok", "é".encode()], object)}], OPEN)
    assert orjson.loads(body)["outputs"][0]["data"] == ["ok", "é"]


@given(
    rows=st.integers(min_value=1, max_value=5),
    values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False),
                    min_size=4, max_size=4),
    batched=st.booleans(),
)
def test_json_round_trip_keeps_values_and_shape(rows, values, batched):
    x = np.tile(np.asarray(values, np.float32), (rows, 1))
    tensor = encode_inputs({"x": x if batched else x[0]})[0]
    req = parse({"inputs": [tensor]})
    assert req.batched is batched
    assert len(req.items) == (rows if batched else 1)
    results = [{"y": it["x"][:2]} for it in req.items]
    body, _ = encode_response(req, results, VEC)
    out = decode_outputs(orjson.loads(body))["y"]
    want = x[:, :2] if batched else x[0, :2]
    np.testing.assert_array_equal(out, want)


# ------------------------------------------------- large float tensors
WIDE = signature([TensorSpec(name="x", datatype="FP32", shape=(256,))])


def _decode(rows) -> np.ndarray:
    doc = {"inputs": [{"name": "x", "shape": [len(rows), 256], "datatype": "FP32",
                       "data": rows}]}
    req = InferRequest.from_v2_json(orjson.dumps(doc), WIDE)
    assert req.stacked["x"].shape == (len(rows), 256)
    return np.stack([it["x"] for it in req.items])


@pytest.mark.parametrize(("bad", "message"), [
    (None, "expected FP32 values, got mixed values"),
    ("1.5", "expected FP32 values, got"),
    ({}, "expected FP32 values, got mixed values"),
    ([1.0], "data is not a regular array"),
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
    match draw(st.sampled_from(["rows", "flat", "ragged", "short"])):
        case "flat":
            data = [v for row in values for v in row]
        case "ragged":
            data = values
            data[-1] = data[-1][:-1] + ([] if width > 1 else [0.5, 0.5])
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
    assert "mixed values" in refusal([1.0, None, 3.0, 4.0])
    assert "got a boolean" in refusal([[True, False], [True, True]])
    assert "out of range for FP32" in refusal([[1e300, 1.0], [3.0, 4.0]])
    assert "out of range for INT8" in refusal([1, 2, 300, 4], "INT8")
    assert "expected INT32 values, got floats" in refusal([1, 2, 3.5, 4], "INT32")
    assert "holds 4 values" in refusal([1.0, 2.0, 3.0])
    assert "not a regular array" in refusal([[1.0, 2.0], [3.0]], shape=(3,))
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
    # what it hands back: a ragged row, a bool, a '[' in a string, a duplicate key
    for bad in (b'{"inputs":[{"name":"x","shape":[2,2],"datatype":"FP32","data":[[1,2,3],[4]]}]}',
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


def test_an_empty_list_of_outputs_asks_for_all_of_them():
    """As Triton: no output named is every output (not none)."""
    req = parse({"inputs": [{"name": "x", "shape": [4], "datatype": "FP32",
                             "data": [1, 2, 3, 4]}], "outputs": []})
    assert req.outputs is None
    body, _ = encode_response(req, [{"y": np.zeros(2, np.float32)}], VEC)
    assert [o["name"] for o in orjson.loads(body)["outputs"]] == ["y"]


def test_deeply_nested_data_with_a_boolean_elsewhere_is_a_400_not_a_recursion():
    deep = "[" * 900 + "1.0" + "]" * 900
    body = ('{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":' + deep
            + '}],"parameters":{"a":[true]}}')
    sig = signature([TensorSpec(name="x", datatype="FP32", shape=(-1,))])
    with pytest.raises(InvalidInput):
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


def test_an_output_requested_twice_is_refused():
    """Triton answers each output once and refuses a request naming one twice."""
    doc = {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}],
           "outputs": [{"name": "y"}, {"name": "y", "parameters": {"binary_data": True}}]}
    with pytest.raises(InvalidInput) as info:
        parse(doc)
    assert str(info.value) == "model 'm': output 'y' requested twice"


@pytest.mark.parametrize("value", ["yes", 1, 0, None, "true"])
def test_binary_data_parameters_must_be_booleans(value):
    """A binary_data or binary_data_output that is not true or false is a 400 (Triton
    refuses it too); it used to be read as false, so the answer silently came as JSON."""
    x = {"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}
    with pytest.raises(InvalidInput) as info:
        parse({"inputs": [x], "outputs": [{"name": "y", "parameters": {"binary_data": value}}]})
    assert str(info.value) == (
        f"output 'y': parameters.binary_data must be true or false, got {value!r}"
    )
    with pytest.raises(InvalidInput) as info:
        parse({"inputs": [x], "parameters": {"binary_data_output": value}})
    assert str(info.value) == (
        f"parameters.binary_data_output must be true or false, got {value!r}"
    )
    req = parse({"inputs": [x], "parameters": {"binary_data_output": True},
                 "outputs": [{"name": "y", "parameters": {"binary_data": False}}]})
    assert (req.binary_outputs, req.outputs) == (True, (("y", False, 0),))


def test_an_input_with_both_data_and_binary_data_is_refused():
    """Which of the two holds the tensor? Triton refuses the pair; the binary data was
    taken and the JSON data silently dropped."""
    x = np.arange(4, dtype=np.float32)
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [4], "datatype": "FP32",
                                       "data": [9, 9, 9, 9],
                                       "parameters": {"binary_data_size": x.nbytes}}]})
    with pytest.raises(InvalidInput) as info:
        InferRequest.from_v2_json(header + x.tobytes(), VEC, header_length=len(header))
    assert str(info.value) == (
        "input 'x': both 'data' and parameters.binary_data_size are given; "
        "send the tensor one way"
    )


@pytest.mark.parametrize("rid", [1.5, [1], {"a": 1}, True])
def test_an_id_that_is_not_a_string_or_an_integer_says_what_is_taken(rid):
    """An integer id is taken and echoed; the refusal said "must be a string"."""
    x = {"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}
    assert parse({"inputs": [x], "id": 7}).id == 7
    with pytest.raises(InvalidInput) as info:
        parse({"inputs": [x], "id": rid})
    assert str(info.value) == f"'id' must be a string or an integer, got {rid!r}"


def test_an_empty_id_is_left_out_of_the_answer_as_triton_does():
    """Triton's answer has an "id" only when the request's is not empty; ``"id": ""``
    was echoed. On the stream the id tags the answer, so it is echoed as sent."""
    x = {"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}
    results = [{"y": np.zeros(2, np.float32)}]
    for rid, echoed in (("", "absent"), ("r", "r"), (0, 0), (None, "absent")):
        req = parse({"inputs": [x], "id": rid})
        answer = orjson.loads(encode_response(req, results, VEC)[0])
        assert answer.get("id", "absent") == echoed
        streamed = orjson.loads(encode_response(req, results, VEC, binary=False)[0])
        assert streamed.get("id", "absent") == ("absent" if rid is None else rid)


def test_a_tensor_in_shared_memory_is_refused_naming_the_parameter():
    """This server has no shared memory. An output asked for in a region was answered
    in the body, the region left unwritten for the client to read; an input in one
    was refused for having "no 'data'"."""
    x = {"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}
    region = {"shared_memory_region": "r0", "shared_memory_byte_size": 8}
    with pytest.raises(InvalidInput) as info:
        parse({"inputs": [x], "outputs": [{"name": "y", "parameters": region}]})
    assert str(info.value) == (
        "output 'y': parameters.shared_memory_region: this server has no shared memory "
        "(Triton's system_shared_memory and cuda_shared_memory are not served); "
        "leave it out to get the tensor in the answer"
    )
    shm = {"name": "x", "shape": [4], "datatype": "FP32", "parameters": region}
    with pytest.raises(InvalidInput) as info:
        parse({"inputs": [shm]})
    assert str(info.value) == (
        "input 'x': parameters.shared_memory_region: this server has no shared memory "
        "(Triton's system_shared_memory and cuda_shared_memory are not served); "
        "send the tensor as 'data' or as binary data"
    )


@pytest.mark.parametrize("params", [[1], "binary_data", 1])
def test_parameters_of_an_input_or_output_must_be_an_object(params):
    """As the request's own ``parameters``: they were ignored, so a malformed
    ``binary_data`` or ``classification`` went unseen."""
    x = {"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}
    with pytest.raises(InvalidInput) as info:
        parse({"inputs": [{**x, "parameters": params}]})
    assert str(info.value) == "input 'x': 'parameters' must be a JSON object"
    with pytest.raises(InvalidInput) as info:
        parse({"inputs": [x], "outputs": [{"name": "y", "parameters": params}]})
    assert str(info.value) == "output 'y': 'parameters' must be a JSON object"
    # null is no parameters, as for the request's
    assert parse({"inputs": [{**x, "parameters": None}],
                  "outputs": [{"name": "y", "parameters": None}]}).outputs == (("y", False, 0),)


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("INT64", "[9223372036854775808, 1]", "a value is out of range for INT64"),
        ("INT64", "[-9223372036854775809, 1]", "a value is out of range for INT64"),
        ("INT64", "[1, 1e19]", "a value is out of range for INT64"),
        ("UINT64", "[18446744073709551616, 1]", "a value is out of range for UINT64"),
        ("UINT64", "[-1, 18446744073709551615]", "a value is out of range for UINT64"),
        ("INT32", "[9223372036854775808, 1]", "a value is out of range for INT32"),
        # floats are still floats
        ("INT64", "[1.5, 9223372036854775808]", "expected INT64 values, got floats in 'data'"),
        ("INT64", "[2.0, 1]", "expected INT64 values, got floats in 'data'"),
    ],
)
def test_an_integer_past_64_bits_is_out_of_range_not_a_float(datatype, data, message):
    """numpy makes floats of integers past INT64's range (and orjson of those past 64
    bits), so such an integer was refused as "got floats in 'data'"."""
    body = ('{"inputs": [{"name": "x", "shape": [2], "datatype": "%s", "data": %s}]}'
            % (datatype, data)).encode()
    with pytest.raises(InvalidInput) as info:
        InferRequest.from_v2_json(body, OPEN)
    assert str(info.value) == f"input 'x': {message}"
    edge = "18446744073709551615" if datatype == "UINT64" else "-9223372036854775808"
    ok = body.replace(data.encode(), f"[{edge}, 1]".encode())
    if datatype != "INT32":
        assert InferRequest.from_v2_json(ok, OPEN).items[0]["x"][0] == int(edge)


def test_sequence_and_unknown_parameters_are_ignored_as_triton_does_without_a_sequence_batcher():
    """No model here has a sequence batcher; Triton ignores a correlation id for such
    a model, and so does this server (docs/gateway.md): the request is the same."""
    x = {"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}
    plain = parse({"inputs": [x], "id": "s"})
    for params in (
        {"sequence_id": 7, "sequence_start": True, "sequence_end": False},
        {"sequence_id": "abc", "sequence_start": "yes", "custom": {"a": 1}},
        {"triton_enable_empty_final_response": True},  # reserved in Triton: a 400 there
    ):
        req = parse({"inputs": [x], "id": "s", "parameters": params})
        assert (req.id, req.outputs, req.priority, req.timeout, req.count) == (
            plain.id, plain.outputs, plain.priority, plain.timeout, plain.count
        )
