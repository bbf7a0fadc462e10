"""The v2 wire format, sans IO: parsing, validation, batch splitting, encoding. How
JSON tensor data is decoded is in test_v2_json_data.py."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from http_helpers import OPEN, VEC, parse, signature
from hypothesis import given
from hypothesis import strategies as st
from trioserve import InvalidInput, TensorSpec
from trioserve.transport import InferRequest, encode_response
from trioserve.transport._request import encode_inputs
from trioserve.transport._response import decode_outputs

TWO = signature([TensorSpec(name="a", datatype="INT64", shape=(-1,)),
                 TensorSpec(name="b", datatype="FP16", shape=(2, 2))])


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
        # a fraction of a millisecond is taken; Triton's timeout is whole µs, 2.0 is 2
        ({"timeout_ms": 0.5}, 0.5 * 1e-3),
        ({"timeout": 2.0}, 2 * 1e-6),
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


@pytest.mark.parametrize("value", [1500.5, 0.5, 1e-300])
def test_a_fraction_of_a_microsecond_in_tritons_timeout_is_refused(value):
    """Triton's ``timeout`` is an unsigned integer of microseconds (Triton answers
    1.5 with 400): it was taken as 1.5 µs."""
    base = {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}]}
    with pytest.raises(InvalidInput, match=(
        r"^parameters\.timeout must be a whole number of microseconds, got "
    )):
        parse({**base, "parameters": {"timeout": value}})


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


def test_a_binary_part_of_0_bytes_holds_empty_tensors():
    """A header that ends the body at the JSON is a binary part of 0 bytes: inputs
    of 0 bytes are read from it; without the header binary data is still refused."""
    header = orjson.dumps({"inputs": [
        {"name": "x", "shape": [1, 0], "datatype": "FP32", "parameters": {"binary_data_size": 0}},
        {"name": "s", "shape": [1, 0], "datatype": "BYTES", "parameters": {"binary_data_size": 0}},
    ]})
    req = InferRequest.from_v2_json(header, OPEN, header_length=len(header))
    assert req.items[0]["x"].shape == (0,)
    assert req.items[0]["x"].dtype == np.float32
    assert req.items[0]["s"].shape == (0,)
    with pytest.raises(InvalidInput, match="x': binary data is 0 bytes, shape and datatype need 8"):
        InferRequest.from_v2_json(
            header.replace(b"[1,0]", b"[1,2]", 1), OPEN, header_length=len(header)
        )
    with pytest.raises(InvalidInput, match="given but the request has no binary data"):
        InferRequest.from_v2_json(header, OPEN)


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


def test_an_empty_list_of_outputs_asks_for_all_of_them():
    """As Triton: no output named is every output (not none)."""
    req = parse({"inputs": [{"name": "x", "shape": [4], "datatype": "FP32",
                             "data": [1, 2, 3, 4]}], "outputs": []})
    assert req.outputs is None
    body, _ = encode_response(req, [{"y": np.zeros(2, np.float32)}], VEC)
    assert [o["name"] for o in orjson.loads(body)["outputs"]] == ["y"]


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
    sent = orjson.dumps(value).decode()  # echoed as JSON writes it: "yes", null
    assert str(info.value) == (
        f"output 'y': parameters.binary_data must be true or false, got {sent}"
    )
    with pytest.raises(InvalidInput) as info:
        parse({"inputs": [x], "parameters": {"binary_data_output": value}})
    assert str(info.value) == (
        f"parameters.binary_data_output must be true or false, got {sent}"
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


@pytest.mark.parametrize(
    ("rid", "sent"), [(1.5, "1.5"), ([1], "[1]"), ({"a": 1}, '{"a": 1}'), (True, "true")]
)
def test_an_id_that_is_not_a_string_or_an_integer_says_what_is_taken(rid, sent):
    """An integer id is taken and echoed; the refusal said "must be a string"."""
    x = {"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}
    assert parse({"inputs": [x], "id": 7}).id == 7
    with pytest.raises(InvalidInput) as info:
        parse({"inputs": [x], "id": rid})
    assert str(info.value) == f"'id' must be a string or an integer, got {sent}"


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
        {"sequence_id": "abc", "sequence_start": False, "custom": {"a": 1}},
        {"sequence_id": 0, "sequence_end": True},
        {"sequence_id": 2**64 - 1},
        {"triton_enable_empty_final_response": True},  # reserved in Triton: a 400 there
    ):
        req = parse({"inputs": [x], "id": "s", "parameters": params})
        assert (req.id, req.outputs, req.priority, req.timeout, req.count) == (
            plain.id, plain.outputs, plain.priority, plain.timeout, plain.count
        )


@pytest.mark.parametrize(("params", "message"), [
    ({"sequence_id": 1.5}, "sequence_id must be an unsigned 64-bit integer or a string, got 1.5"),
    ({"sequence_id": -1}, "sequence_id must be an unsigned 64-bit integer or a string, got -1"),
    ({"sequence_id": True},
     "sequence_id must be an unsigned 64-bit integer or a string, got true"),
    ({"sequence_id": [7]}, "sequence_id must be an unsigned 64-bit integer or a string, got [7]"),
    ({"sequence_start": "yes"}, 'sequence_start must be true or false, got "yes"'),
    ({"sequence_start": 1}, "sequence_start must be true or false, got 1"),
    ({"sequence_end": 0}, "sequence_end must be true or false, got 0"),
])
def test_malformed_sequence_parameters_are_refused_as_triton_does(params, message):
    """Triton refuses them (400) whatever the model; they were ignored here, as
    well-formed ones still are."""
    x = {"name": "x", "shape": [4], "datatype": "FP32", "data": [0] * 4}
    with pytest.raises(InvalidInput) as info:
        parse({"inputs": [x], "parameters": params})
    assert str(info.value) == f"parameters.{message}"


_X = '{"name": "x", "shape": [4], "datatype": "FP32", "data": [0, 0, 0, 0]}'
_BIG = "99999999999999999999"  # past 64 bits: the JSON parser reads it as 1e20


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"inputs": [X], "id": null, "parameters": {"binary_data_output": null}}',
         "parameters.binary_data_output must be true or false, got null"),
        ('{"inputs": [X], "parameters": {"timeout_ms": true}}',
         "parameters.timeout_ms must be a positive number, got true"),
        ('{"inputs": [X], "parameters": {"timeout_ms": NaN}}',
         "parameters.timeout_ms must be a positive number, got NaN"),
        ('{"inputs": [X], "parameters": {"timeout": -Infinity}}',
         "parameters.timeout must be a positive number, got -Infinity"),
        ('{"inputs": [X], "parameters": {"priority": -BIG}}',
         "parameters.priority must be a class name or a level >= 0, got -BIG"),
        ('{"inputs": [X], "parameters": {"class": "batch", "priority": 1}}',
         'parameters.class "batch" and parameters.priority 1 (class \'realtime\') '
         "disagree; send one of them"),
        ('{"inputs": [X], "id": BIG}', "'id' must be a string or an integer; an integer id "
         "must be within 64 bits (-2**63 to 2**64-1): use a string"),
        ('{"inputs": [X], "id": 1.5}', "'id' must be a string or an integer, got 1.5"),
        ('{"inputs": [X], "id": {"a": [1, false]}}',
         "'id' must be a string or an integer, got {\"a\": [1, false]}"),
        ('{"inputs": [X], "outputs": [{"name": "y", "parameters": {"binary_data": "abc"}}]}',
         'output \'y\': parameters.binary_data must be true or false, got "abc"'),
        ('{"inputs": [X], "outputs": [{"name": "y", "parameters": {"classification": BIG}}]}',
         "output 'y': parameters.classification must be a count of classes, 1 to 65536, "
         "got BIG"),
        ('{"inputs": [{"name": "x", "shape": "4", "datatype": "FP32", "data": [0]}]}',
         "input 'x': 'shape' must be a list of integers, got \"4\""),
        ('{"inputs": [{"name": "x", "shape": [null], "datatype": "FP32", "data": [0]}]}',
         "input 'x': 'shape' must be a list of non-negative integers, got [null]"),
        ('{"inputs": [{"name": "x", "shape": [4], "datatype": null, "data": [0]}]}',
         "input 'x': datatype null is not one of "),
        ('{"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", '
         '"parameters": {"binary_data_size": BIG}}]}',
         "input 'x': parameters.binary_data_size must be a count of bytes "
         "(an integer, 0 or more), got BIG"),
        # a string with quotes and a backslash is escaped as JSON writes it; a long
        # one is cut
        ('{"inputs": [X], "id": ["say \\"hi\\" \\\\", 1]}',
         "'id' must be a string or an integer, got [\"say \\\"hi\\\" \\\\\", 1]"),
        ('{"inputs": [X], "parameters": {"class": "' + "c" * 500 + '", "priority": 9.5}}',
         "parameters.priority must be a class name or a level >= 0, got 9.5"),
        ('{"inputs": [X], "parameters": {"timeout_ms": "' + "t" * 500 + '"}}',
         'parameters.timeout_ms must be a positive number, got "' + "t" * 79 + "..."),
    ],
)
def test_refusals_echo_json_values_as_json_writes_them(body, message):
    """The values a refusal echoes were written as Python writes them: None, True,
    'abc', 1e+20 for an integer sent as 99999999999999999999. A JSON client sent
    null, true, "abc" and the integer's digits, and reads them back so."""
    raw = body.replace("X", _X).replace("BIG", _BIG).encode()
    with pytest.raises(InvalidInput) as info:
        InferRequest.from_v2_json(raw, VEC, classes=("realtime", "batch"))
    expected = message.replace("BIG", _BIG)
    assert str(info.value).startswith(expected), str(info.value)
    if not expected.endswith(" "):
        assert str(info.value) == expected


@pytest.mark.parametrize(("datatype", "sent"), [([1], "[1]"), ({"a": "FP32"}, '{"a": "FP32"}')])
def test_a_datatype_that_is_a_list_or_an_object_is_400_not_500(datatype, sent):
    """A list or an object as an input's datatype was looked up among the datatypes
    as it was, and being unhashable raised TypeError: a 500 "internal error" for the
    client's mistake."""
    doc = {"inputs": [{"name": "x", "shape": [4], "datatype": datatype, "data": [0] * 4}]}
    with pytest.raises(InvalidInput) as info:
        parse(doc)
    assert str(info.value).startswith(f"input 'x': datatype {sent} is not one of BOOL, ")


def test_binary_data_without_its_header_length_is_refused_with_a_hint():
    """A JSON header followed by binary tensor data, sent without
    Inference-Header-Content-Length: the body is not JSON, and the refusal says which
    header was missing rather than only that the bytes are not UTF-8 text."""
    x = np.array([[1.5, -2.0, 3.25, 0.0]], np.float32)
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                       "parameters": {"binary_data_size": x.nbytes}}]})
    with pytest.raises(InvalidInput) as info:
        InferRequest.from_v2_json(header + x.tobytes(), VEC)
    message = str(info.value)
    assert message.startswith("malformed JSON body: ")
    assert message.endswith(
        "; a body with binary tensor data (binary_data_size) needs the "
        "Inference-Header-Content-Length header: the length of its JSON part"
    )
    # malformed JSON with no binary data gets no such hint
    with pytest.raises(InvalidInput) as info:
        InferRequest.from_v2_json(b'{"inputs": [', VEC)
    assert "Inference-Header-Content-Length" not in str(info.value)
