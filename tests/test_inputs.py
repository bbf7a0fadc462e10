"""Inputs: what ``Runtime.infer`` accepts, and the precise InvalidInput / UnknownModel
errors for what it does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trioserve
from runtime_helpers import callable_model, config
from trioserve import InvalidInput, ModelConfig, TensorSpec, UnknownModel


class Seen:
    """An inline model returning, per item, the sum of each input as ``y`` and
    recording the inputs it was given (to check their coerced dtype and shape)."""

    def __init__(self) -> None:
        self.items: list[dict[str, np.ndarray]] = []

    def __call__(self, items):
        self.items.extend(items)
        return [
            {"y": np.array([sum(float(np.sum(v)) for v in it.values())], np.float32)}
            for it in items
        ]


ONE = (TensorSpec(name="x", datatype="FP32", shape=(4,)),)
TWO = (
    TensorSpec(name="a", datatype="FP32", shape=(3,)),
    TensorSpec(name="b", datatype="INT64", shape=(-1,)),
)
TEXT = (TensorSpec(name="text", datatype="BYTES", shape=(1,)),)
OUT = (TensorSpec(name="y", datatype="FP32", shape=(1,)),)


@pytest.fixture
def seen():
    return {"one": Seen(), "two": Seen(), "text": Seen()}


@pytest.fixture
async def rt(seen):
    cfg = config(
        callable_model("one", seen["one"], inputs=ONE, outputs=OUT, max_wait_ms=0),
        callable_model(
            "two", seen["two"], inputs=TWO, outputs=OUT, max_wait_ms=0, versions=["1", "2"]
        ),
        callable_model(
            "text",
            lambda items: [{"y": it["text"]} for it in items],
            inputs=TEXT,
            outputs=(TensorSpec(name="y", datatype="BYTES", shape=(1,)),),
            max_wait_ms=0,
        ),
        ModelConfig(name="echo", backend="echo", max_wait_ms=0),
    )
    async with trioserve.open_runtime(cfg) as runtime:
        yield runtime


# ---------------------------------------------------------------- accepted forms
@pytest.mark.parametrize(
    "value",
    [
        pytest.param(np.array([1, 2, 3, 4], dtype=np.float32), id="numpy"),
        pytest.param(np.array([1, 2, 3, 4], dtype=np.float64), id="numpy-fp64"),
        pytest.param(np.array([1, 2, 3, 4], dtype=np.int32), id="numpy-int"),
        pytest.param(torch.tensor([1.0, 2.0, 3.0, 4.0]), id="torch"),
        pytest.param(torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True), id="torch-grad"),
        # numpy has no bfloat16: "not an array (Got unsupported ScalarType BFloat16)"
        pytest.param(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16), id="torch-bf16"),
        pytest.param(np.array([[1, 9], [2, 9], [3, 9], [4, 9]], np.float32)[:, 0], id="strided"),
        pytest.param(torch.tensor([[1.0, 9.0], [2.0, 9.0], [3.0, 9.0], [4.0, 9.0]])[:, 0],
                     id="torch-strided"),
        pytest.param([1, 2, 3, 4], id="list-int"),
        pytest.param([1.0, 2.0, 3.0, 4.0], id="list-float"),
    ],
)
@pytest.mark.parametrize("bare", [True, False], ids=["bare", "mapping"])
async def test_single_input_model_takes_arrays_tensors_lists_bare_or_named(rt, seen, value, bare):
    out = await rt.infer("one", value if bare else {"x": value})
    assert out["y"].tolist() == [10.0]
    (it,) = seen["one"].items
    assert set(it) == {"x"}
    assert it["x"].dtype == np.float32
    assert it["x"].tolist() == [1.0, 2.0, 3.0, 4.0]


async def test_multi_input_model_takes_a_mapping_of_mixed_forms(rt, seen):
    out = await rt.infer("two", {"a": torch.tensor([1.0, 2.0, 3.0]), "b": [10, 20]})
    assert out["y"].tolist() == [36.0]
    (it,) = seen["two"].items
    assert it["a"].dtype == np.float32
    assert it["b"].dtype == np.int64
    assert it["b"].tolist() == [10, 20]


async def test_integers_past_64_bits_are_numbers_for_a_float_input(rt, seen):
    # numpy keeps integers too large for int64 and uint64 as Python objects
    out = await rt.infer("one", {"x": [2**70, 1, 2, -(2**64)]})
    (it,) = seen["one"].items
    assert it["x"].dtype == np.float32
    assert it["x"].tolist() == [float(np.float32(2.0**70)), 1.0, 2.0, -(2.0**64)]
    assert out["y"].tolist() == [float(np.float32(2.0**70 - 2.0**64 + 3))]


async def test_nested_lists_keep_their_shape(rt, seen):
    spec = TensorSpec(name="m", datatype="FP32", shape=(2, -1))
    cfg = config(callable_model("grid", seen["one"], inputs=(spec,), outputs=OUT, max_wait_ms=0))
    async with trioserve.open_runtime(cfg) as grid_rt:
        out = await grid_rt.infer("grid", [[1, 2, 3], [4, 5, 6]])
    assert out["y"].tolist() == [21.0]
    assert seen["one"].items[0]["m"].shape == (2, 3)


async def test_strings_for_a_bytes_input(rt):
    out = await rt.infer("text", {"text": ["hello"]})
    assert out["y"].dtype == object
    assert out["y"].tolist() == ["hello"]
    out = await rt.infer("text", [b"raw"])
    assert out["y"].tolist() == [b"raw"]


async def test_echo_takes_any_names_and_dtypes(rt):
    out = await rt.infer("echo", {"ints": [1, 2], "text": ["a"], "m": [[1.5], [2.5]]})
    assert out["ints"].tolist() == [1, 2]
    assert out["ints"].dtype.kind == "i"
    assert out["text"].tolist() == ["a"]
    assert out["m"].shape == (2, 1)


# Regression: a bare array given to echo was coerced to its placeholder input's FP32
# (int64 2**40 + 1 came back as 1099511627776.0; a string array was refused).
@pytest.mark.parametrize(
    "value", [np.array([2**40 + 1, 3], np.int64), np.array(["a", "bc"]), [1, 2]]
)
async def test_echo_returns_a_bare_array_unchanged(rt, value):
    out = await rt.infer("echo", value)
    (name,) = out
    expected = np.asarray(value)
    assert out[name].dtype == expected.dtype
    assert out[name].tolist() == expected.tolist()


async def test_a_known_version_is_served(rt):
    out = await rt.infer("two", {"a": [1, 1, 1], "b": [1]}, version="2")
    assert out["y"].tolist() == [4.0]


# ---------------------------------------------------------------- errors
async def test_wrong_shape_names_the_expected_shape(rt, seen):
    with pytest.raises(
        InvalidInput, match=r"^input 'x' of model 'one': expected shape \[4\], got \[3\]$"
    ):
        await rt.infer("one", {"x": [1, 2, 3]})
    with pytest.raises(
        InvalidInput,
        match=r"^input 'x' of model 'one': expected shape \[4\] \(one item: no batch "
        r"dimension\), got \[2, 4\]$",
    ):
        await rt.infer("one", np.ones((2, 4), np.float32))
    with pytest.raises(InvalidInput, match=r"input 'a' of model 'two': expected shape \[3\]"):
        await rt.infer("two", {"a": 1.0, "b": [1]})
    assert seen["one"].items == []
    assert seen["two"].items == []


async def test_unknown_input_name_is_named(rt, seen):
    with pytest.raises(InvalidInput, match=r"^model 'two': unknown input 'c'; expected a, b$"):
        await rt.infer("two", {"a": [1, 2, 3], "b": [1], "c": [0]})
    assert seen["two"].items == []


async def test_missing_input_is_named(rt):
    with pytest.raises(InvalidInput, match=r"^model 'two': missing input 'b'; expected a, b$"):
        await rt.infer("two", {"a": [1, 2, 3]})
    with pytest.raises(InvalidInput, match=r"^model 'one': missing input 'x'; expected x$"):
        await rt.infer("one", {"y": [1, 2, 3, 4]})


# Regression: in process, values were narrowed silently (the v2 decoder refuses them).
@pytest.mark.parametrize(
    ("model", "value"),
    [
        ("one", np.array([1e300, 0, 0, 0])),  # FP64 -> FP32 would be inf
        ("one", [1.0, 2.0, 3.0, 1e39]),
        ("two", {"a": [1, 1, 1], "b": np.array([2**64 - 1], np.uint64)}),  # not an INT64
    ],
)
async def test_values_the_input_datatype_cannot_hold_are_invalid(rt, seen, model, value):
    with pytest.raises(InvalidInput, match=r"a value is out of range for (FP32|INT64)$"):
        await rt.infer(model, value)
    assert seen[model].items == []


async def test_infinities_and_nans_given_as_such_pass(rt, seen):
    await rt.infer("one", np.array([np.inf, np.nan, 1.0, 2.0]))
    (it,) = seen["one"].items
    assert it["x"].dtype == np.float32
    assert np.isinf(it["x"][0])
    assert np.isnan(it["x"][1])


async def test_a_bare_array_for_a_multi_input_model_is_refused(rt):
    with pytest.raises(
        InvalidInput,
        match=r"^model 'two' takes 2 inputs \(a, b\): pass a mapping name -> array$",
    ):
        await rt.infer("two", [1.0, 2.0, 3.0])


@pytest.mark.parametrize(
    ("model", "inputs", "message"),
    [
        ("one", {"x": ["a", "b", "c", "d"]}, r"input 'x' of model 'one': expected FP32, got BYTES"),
        ("one", ["a", "b", "c", "d"], r"input 'x' of model 'one': expected FP32, got BYTES"),
        (
            "two",
            {"a": [1, 2, 3], "b": [1.5]},
            r"input 'b' of model 'two': expected INT64, got FP64",
        ),
        (
            "one",
            {"x": [{"k": 1}] * 4},
            r"input 'x' of model 'one': expected FP32, got objects",
        ),
        (
            "two",
            {"a": [1, 2, 3], "b": [2**64, 1]},  # past uint64's range: numpy keeps objects
            r"input 'b' of model 'two': a value is out of range for INT64",
        ),
        (
            "one",
            {"x": [10**400, 1, 2, 3]},
            r"input 'x' of model 'one': a value is out of range for FP32",
        ),
        (
            "text",
            {"text": [1]},
            r"input 'text' of model 'text': expected BYTES \(strings or bytes\), got int64",
        ),
        ("one", {"x": [[1, 2], [3]]}, r"input 'x' of model 'one': not an array"),
    ],
)
async def test_wrong_dtype_is_refused_with_the_expected_datatype(rt, model, inputs, message):
    with pytest.raises(InvalidInput, match="^" + message):
        await rt.infer(model, inputs)


async def test_unknown_model_and_unknown_version(rt):
    with pytest.raises(
        UnknownModel, match=r"^unknown model 'nope'; serving: echo, one, text, two$"
    ) as excinfo:
        await rt.infer("nope", [1.0])
    assert isinstance(excinfo.value, LookupError)
    assert excinfo.value.status == 404
    with pytest.raises(UnknownModel, match=r"^model 'two' has no version '3'; versions: 1, 2$"):
        await rt.infer("two", {"a": [1, 2, 3], "b": [1]}, version="3")
    with pytest.raises(UnknownModel, match="has no version"):
        await rt.infer_batch("two", [{"a": [1, 2, 3], "b": [1]}] * 2, version="3")


async def test_an_unknown_keyword_is_a_type_error_before_anything_is_submitted(rt, seen):
    # No ``timeout=`` on the async calls: a cancel scope bounds them (embedding.md).
    with pytest.raises(TypeError, match="unexpected keyword argument 'timeout'"):
        rt.infer("one", [1.0] * 4, timeout=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'timeout'"):
        rt.infer_batch("one", [[1.0] * 4], timeout=1.0)
    assert seen["one"].items == []


async def test_one_bad_item_fails_infer_batch_before_anything_runs(rt, seen):
    with pytest.raises(InvalidInput, match=r"expected shape \[4\]"):
        await rt.infer_batch("one", [[1, 2, 3, 4], [1, 2]])
    assert seen["one"].items == []
    assert InvalidInput.status == 400


# ---------------------------------------------------------------- stacked items
async def test_stacked_items_are_checked_once_and_answered_in_order(rt, seen):
    x = np.arange(12, dtype=np.float64).reshape(3, 4)  # float64: coerced to FP32
    outs = await rt.infer_batch("one", {"x": x})
    assert [o["y"].tolist() for o in outs] == [[6.0], [22.0], [38.0]]
    assert [it["x"].dtype for it in seen["one"].items] == [np.float32] * 3
    np.testing.assert_array_equal(np.stack([it["x"] for it in seen["one"].items]), x)
    two = await rt.infer_batch(
        "two", {"a": np.ones((2, 3), np.float32), "b": np.array([[1, 2], [3, 4]])})
    assert [o["y"].tolist() for o in two] == [[6.0], [10.0]]
    assert seen["two"].items[0]["b"].dtype == np.int64
    assert await rt.infer_batch("one", {"x": np.zeros((0, 4), np.float32)}) == []


@pytest.mark.parametrize(("model", "stacked", "message"), [
    ("one", {"x": np.ones((2, 5), np.float32)},
     r"input 'x' of model 'one': expected shape \[N, 4\] \(N items\), got \[2, 5\]"),
    ("one", {"x": np.ones(4, np.float32)}, r"expected shape \[N, 4\] \(N items\), got \[4\]"),
    ("one", {"x": np.array([["a"] * 4])}, r"input 'x' of model 'one': expected FP32"),
    ("one", {"y": np.ones((2, 4))}, r"model 'one': missing input 'x'; expected x"),
    ("one", {"x": np.ones((2, 4)), "z": np.ones((2, 4))}, r"unknown input 'z'; expected x"),
    ("two", {"a": np.ones((2, 3)), "b": np.ones((3, 1), np.int64)},
     r"model 'two': the inputs disagree on the number of items \(a: 2, b: 3\)"),
])
async def test_bad_stacked_items_fail_before_anything_runs(rt, seen, model, stacked, message):
    with pytest.raises(InvalidInput, match=message):
        await rt.infer_batch(model, stacked)
    assert seen[model].items == []


async def test_stacked_items_of_an_open_model_are_prepared_one_by_one(rt):
    outs = await rt.infer_batch("echo", {"x": np.arange(6, dtype=np.float32).reshape(3, 2)})
    assert [o["x"].tolist() for o in outs] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(InvalidInput, match="one leading item dimension of the same length"):
        await rt.infer_batch("echo", {"x": np.ones((3, 2)), "w": np.ones((2, 2))})


async def test_one_item_of_a_list_keeps_its_version(rt, seen):
    out = await rt.infer_batch("two", [{"a": [1, 2, 3], "b": [1]}], version="1")
    assert out[0]["y"].tolist() == [7.0]
    with pytest.raises(UnknownModel, match="has no version '9'"):
        await rt.infer_batch("two", [{"a": [1, 2, 3], "b": [1]}], version="9")


# ---------------------------------------------------------------- never a raw exception
# Regression: a dtype without a v2 datatype (complex, datetime) was refused with a
# message naming neither the model nor the input; a tensor torch cannot copy to numpy
# (a meta tensor) escaped as torch's NotImplementedError.
@pytest.mark.parametrize(
    ("value", "got"),
    [
        (np.ones(4, np.complex128), "complex128"),
        (np.arange(4).astype("datetime64[s]"), r"datetime64\[s\]"),
        (torch.ones(4, dtype=torch.complex64), "complex64"),
    ],
)
async def test_a_dtype_with_no_v2_datatype_names_the_model_and_input(rt, seen, value, got):
    with pytest.raises(
        InvalidInput, match=rf"^input 'x' of model 'one': expected FP32, got {got}$"
    ):
        await rt.infer("one", {"x": value})
    with pytest.raises(InvalidInput, match=rf"^input 'x' of model 'one': expected FP32, got {got}"):
        await rt.infer_batch("one", {"x": value[None]})
    assert seen["one"].items == []


async def test_a_tensor_without_data_is_invalid_input_naming_the_model(rt, seen):
    meta = torch.ones(4, device="meta")
    with pytest.raises(InvalidInput, match=r"^input 'x' of model 'one': not an array \("):
        await rt.infer("one", meta)
    with pytest.raises(InvalidInput, match=r"^input 'x' of model 'one': not an array \("):
        await rt.infer_batch("one", {"x": meta[None]})
    with pytest.raises(InvalidInput, match=r"^model 'echo': inputs are not arrays \("):
        await rt.infer("echo", {"x": meta})
    assert seen["one"].items == []


# Regression: a model name that cannot be a dict key raised TypeError.
@pytest.mark.parametrize("name", [["one"], {"one": 1}])
async def test_a_model_name_that_is_not_a_string_is_an_unknown_model(rt, name):
    with pytest.raises(UnknownModel, match=r"^unknown model .*; serving: echo, one, text, two$"):
        await rt.infer(name, [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(UnknownModel, match=r"^unknown model "):
        await rt.infer_batch(name, [[1.0, 2.0, 3.0, 4.0]])


# Regression: infer_batch of something that holds no items (None, a number, a 0-d
# array or tensor) raised TypeError from len() or iter().
@pytest.mark.parametrize(
    "items",
    [None, 5, np.float32(3.0), np.array(3.0), torch.tensor(3.0)],
    ids=["none", "int", "numpy-scalar", "numpy-0d", "torch-0d"],
)
async def test_infer_batch_of_no_sequence_of_items_is_invalid_input(rt, seen, items):
    with pytest.raises(
        InvalidInput,
        match=r"^model 'one': infer_batch takes a sequence of items or a mapping input "
        r"name -> stacked array, got ",
    ):
        await rt.infer_batch("one", items)
    assert seen["one"].items == []
    assert (await rt.infer_batch("one", [[1, 2, 3, 4]]))[0]["y"].tolist() == [10.0]


# Regression: a str was taken as a sequence of its characters, one item each.
@pytest.mark.parametrize("items", ["abcd", b"abcd", bytearray(b"abcd")])
async def test_infer_batch_of_a_str_or_bytes_is_refused_saying_it_wants_a_list(
    rt, seen, items
):
    with pytest.raises(InvalidInput) as caught:
        await rt.infer_batch("one", items)
    assert str(caught.value) == (
        "model 'one': infer_batch takes a sequence of items or a mapping input name -> "
        f"stacked array, got a {type(items).__name__} (one value, not a list of items: "
        "pass [value] for one item)"
    )
    assert seen["one"].items == []


# Regression: an item refused in infer_batch was not named: which of a thousand?
async def test_infer_batch_names_the_item_refused(rt, seen):
    good = np.zeros(4, np.float32)
    with pytest.raises(InvalidInput) as caught:
        await rt.infer_batch("one", [good, good, np.zeros(3, np.float32), good])
    assert str(caught.value) == (
        "item 2 of 4: input 'x' of model 'one': expected shape [4], got [3]"
    )
    assert seen["one"].items == []  # nothing submitted


async def test_infer_batch_of_a_1d_array_says_it_is_read_as_its_values(rt, seen):
    # np.zeros(4) meant as one item is four items of one value each
    with pytest.raises(InvalidInput) as caught:
        await rt.infer_batch("one", np.zeros(4, np.float32))
    assert str(caught.value) == (
        "item 0 of 4: input 'x' of model 'one': expected shape [4], got [] (a 1-D array "
        "is read as its 4 values, one item each: pass [array] for one item, or the "
        "items stacked)"
    )
    assert seen["one"].items == []
    # the same array as one item, or stacked, is served
    assert len(await rt.infer_batch("one", [np.zeros(4, np.float32)])) == 1
    assert len(await rt.infer_batch("one", np.zeros((2, 4), np.float32))) == 2


# Regression: a set of items was taken, its answers in the set's order, which is no
# order of the caller's: nothing told which answer was whose.
@pytest.mark.parametrize("kind", [set, frozenset])
async def test_infer_batch_of_a_set_is_refused_saying_to_pass_a_list(rt, seen, kind):
    items = kind([(1, 2, 3, 4), (2, 2, 3, 4)])
    for error in (InvalidInput, TypeError):  # the wrong kind of collection: both
        with pytest.raises(error) as caught:
            await rt.infer_batch("one", items)
    assert str(caught.value) == (
        "model 'one': infer_batch takes a sequence of items or a mapping input name -> "
        f"stacked array, got a {kind.__name__}, which has no order: the answers come in "
        "the items' order, so pass a list"
    )
    assert seen["one"].items == []
    # Ordered collections are taken as before: a tuple, a dict's views, an iterator.
    rows = {(1, 2, 3, 4): "a", (2, 2, 3, 4): "b"}
    named = dict(zip("ab", rows, strict=True))
    for ordered in (tuple(rows), rows.keys(), named.values(), iter(list(rows))):
        outs = await rt.infer_batch("one", ordered)
        assert [o["y"].tolist() for o in outs] == [[10.0], [11.0]]


# Regression: an empty mapping of stacked inputs was refused naming "got shapes " and
# nothing after it.
async def test_infer_batch_of_no_stacked_inputs_says_so(rt):
    with pytest.raises(InvalidInput, match=r"^model 'echo': no stacked inputs \(a mapping"):
        await rt.infer_batch("echo", {})
    with pytest.raises(InvalidInput, match=r"^model 'one': missing input 'x'"):
        await rt.infer_batch("one", {})


def test_a_declaration_is_named_by_its_name_datatype_and_shape():
    """The one text the messages name a declaration by (``TensorSpec.text``), and
    several listed (``TensorSpec.listed``)."""
    x = TensorSpec(name="x", datatype="FP32", shape=(3,))
    mask = TensorSpec(name="mask", datatype="BOOL", shape=(-1, 2))
    scalar = TensorSpec(name="s", datatype="INT64", shape=())
    assert x.text() == "x FP32 [3]"
    assert TensorSpec.listed([x, mask, scalar]) == "x FP32 [3], mask BOOL [-1, 2], s INT64 []"
    assert TensorSpec.listed([]) == ""
