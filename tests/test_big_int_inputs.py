"""Integers past 64 bits among floats in an input's values, in process and over the
v2 JSON path alike: numbers, read as floats for a float input (out of range where the
datatype cannot hold them), floats for an integer input; never "mixed values" or
"got objects"."""

from __future__ import annotations

import math

import numpy as np
import pytest
import trioserve
from http_helpers import signature
from runtime_helpers import callable_model, config
from trioserve import InvalidInput, TensorSpec
from trioserve.transport import InferRequest

BIG = 10**30  # past 64 bits: numpy keeps it as an object, json (not orjson) as an int


def spec(datatype: str) -> tuple[TensorSpec, ...]:
    return (TensorSpec(name="x", datatype=datatype, shape=(-1,)),)


def over_http(datatype: str, data: str) -> np.ndarray:
    n = data.count(",") + 1
    body = ('{"inputs": [{"name": "x", "shape": [%d], "datatype": "%s", "data": %s}]}'
            % (n, datatype, data)).encode()
    return InferRequest.from_v2_json(body, signature(spec(datatype))).items[0]["x"]


@pytest.fixture
async def rt():
    models = [
        callable_model(dt.lower(), lambda items: [{"y": it["x"]} for it in items],
                       inputs=spec(dt), outputs=(TensorSpec(name="y", datatype=dt, shape=(-1,)),),
                       max_wait_ms=0)
        for dt in ("FP16", "FP32", "INT32")
    ]
    async with trioserve.open_runtime(config(*models)) as runtime:
        yield runtime


# Regression: [10**30, 1.5] for FP16 was "expected FP16, got objects" in process, and
# over HTTP (a body holding NaN is read by the standard library's decoder, which keeps
# the integer) "expected FP16 values, got mixed values in 'data'"; ragged rows for FP32
# with such an integer were "mixed values" too, where flat ones were read.
@pytest.mark.parametrize("nan", [False, True], ids=["orjson", "with-nan"])
async def test_a_big_integer_among_floats_is_a_number(rt, nan):
    tail = ", NaN" if nan else ""
    # FP16: out of range, both ways
    with pytest.raises(InvalidInput, match=r"^input 'x' of model 'fp16': a value is out of "
                                           r"range for FP16$"):
        await rt.infer("fp16", [BIG, 1.5] + ([math.nan] if nan else []))
    for data in (f"[{BIG}, 1.5{tail}]", f"[[{BIG}, 1.5], [2.0{tail}]]"):
        with pytest.raises(InvalidInput, match=r"^input 'x': a value is out of range for FP16$"):
            over_http("FP16", data)
    # FP32: read as the number it is, flat or in ragged rows (read depth first)
    got = (await rt.infer("fp32", [BIG, 1.5] + ([math.nan] if nan else [])))["y"]
    assert got.dtype == np.float32
    assert got[:2].tolist() == [float(np.float32(1e30)), 1.5]
    for data in (f"[{BIG}, 1.5{tail}]", f"[[{BIG}, 1.5], [2.0{tail}]]"):
        x = over_http("FP32", data)
        assert x.dtype == np.float32
        assert x[:2].tolist() == [float(np.float32(1e30)), 1.5]
        assert np.isnan(x[-1]) == nan
    # INT32: a float among them is a float, as without the big integer
    with pytest.raises(InvalidInput, match=r"^input 'x' of model 'int32': expected INT32, "
                                           r"got FP64$"):
        await rt.infer("int32", [BIG, 1.5])
    for data in (f"[{BIG}, 1.5{tail}]", f"[[{BIG}, 1], [2{tail or ', 2.5'}]]"):
        with pytest.raises(InvalidInput, match=r"^input 'x': expected INT32 values, got "
                                               r"floats in 'data'$"):
            over_http("INT32", data)


async def test_a_big_integer_past_fp64_among_floats_is_out_of_range(rt):
    with pytest.raises(InvalidInput, match=r"a value is out of range for FP32$"):
        await rt.infer("fp32", [10**400, 1.5])
    with pytest.raises(InvalidInput, match=r"^input 'x': a value is out of range for FP32$"):
        over_http("FP32", f"[[{10**400}, 1.5], [NaN]]")  # the standard library reads it
