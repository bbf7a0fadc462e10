"""What the runtime needs of a model: its signature, how to prepare one item, and a
runner per device that maps a list of items to a list of outputs.

Items are prepared on the event loop (validation, coercion, cost); runners execute
in a worker thread (or inline) and must not touch trio.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, ItemsView, Iterable, KeysView, Mapping, Sequence, Set
from typing import Any

import attrs
import numpy as np

from ._errors import InvalidInput, ModelError

#: Open Inference Protocol v2 datatypes and their numpy dtypes.
V2_DTYPES: dict[str, Any] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
_NUMERIC_KINDS = {"b": "b", "u": "biu", "i": "biu", "f": "biuf"}

Item = dict[str, np.ndarray]
Runner = Callable[[list[Any]], Sequence[Mapping[str, Any]]]


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 item", "2 items"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def check_outputs(outputs: Any, n: int) -> Sequence[Mapping[str, Any]]:
    """Return a runner's ``outputs`` for a batch of ``n`` items when they are what the
    runtime expects, a sequence of ``n`` mappings (output name -> array), one per item
    in order; otherwise raise TypeError or ValueError saying what the model returned
    and what was expected."""
    mappings = "mapping" if n == 1 else "mappings"
    want = f"expected a list of {n} output {mappings} (name -> array), one per item"
    if not isinstance(outputs, Sequence) or isinstance(outputs, str | bytes):
        if inspect.iscoroutine(outputs):
            outputs.close()  # never to run: no "never awaited" warning
            raise TypeError(f"returned a coroutine; {_NOT_ASYNC}")
        raise TypeError(f"returned {_kind(outputs)}; {want}")
    if len(outputs) != n:
        got = _count(len(outputs), "output")
        raise ValueError(f"returned {got} for {_count(n, 'item')}; {want}")
    for i, out in enumerate(outputs):
        if type(out) is not dict and not isinstance(out, Mapping):
            raise TypeError(f"returned {_kind(out)} as the output of item {i}; {want}")
    return outputs


#: Models run off the event loop, in a thread or a worker process, and are called.
_NOT_ASYNC = (
    "a model is called, not awaited (it runs in a thread or a worker process, off "
    "the event loop): define it with def, not async def"
)


def _kind(value: Any) -> str:
    return "None" if value is None else f"a value of type {type(value).__qualname__}"


#: numpy dtype -> v2 datatype, BYTES left out (it takes strings and objects alike).
_DATATYPE_OF = {dt: name for name, dt in V2_DTYPES.items() if name != "BYTES"}


def described(arr: np.ndarray) -> str:
    """What an array holds, for an error: "is FP64", "holds strings", ..."""
    name = _DATATYPE_OF.get(arr.dtype)
    if name is not None:
        return f"is {name}"
    if arr.dtype.kind in "SU":
        return "holds strings"
    if arr.dtype.kind == "O":
        return "holds Python objects"
    return f"is of numpy dtype {arr.dtype}"


def _conformed_output(
    spec: TensorSpec, value: Any, model: str, *, rows: bool = False
) -> np.ndarray:
    """One item's output ``value`` as its ``spec`` declares it: a numpy array of its
    datatype (a numeric value converted within its kind, float64 to FP32 say; to an
    integer type only when every value fits; strings kept for BYTES) and its per-item
    shape (``rows``: the items' outputs stacked, a leading dimension first). Raises
    ModelError naming the model and the output, in the words the v2 encoder uses for
    the same answer."""
    try:
        arr = to_numpy(value)
    except NOT_AN_ARRAY as exc:
        raise ModelError(f"model {model!r}: output {spec.name!r} is not an array ({exc})") from None
    return spec.conform(arr, model, arr.shape[1:] if rows else arr.shape)


def _fast_check(
    spec: TensorSpec,
) -> tuple[str, np.dtype, tuple[int, ...] | None, int, tuple[tuple[int, int], ...]]:
    """What :meth:`ModelBackend.conform_outputs` compares an output with: its name,
    dtype, shape when it has no free dimension (else None), rank, fixed dimensions."""
    fixed = tuple((i, d) for i, d in enumerate(spec.shape) if d != -1)
    exact = spec.shape if len(fixed) == len(spec.shape) else None
    return spec.name, spec.dtype, exact, len(spec.shape), fixed


def _fits(shape: tuple[int, ...], fixed: tuple[tuple[int, int], ...]) -> bool:
    for i, d in fixed:
        if shape[i] != d:
            return False
    return True


def _conformed_item(
    specs: tuple[TensorSpec, ...], out: Mapping[str, Any], model: str
) -> dict[str, Any] | ModelError:
    """A copy of one item's outputs with each declared one conformed (others kept as
    they are), or the ModelError that says why one cannot be."""
    conformed = dict(out)
    try:
        for spec in specs:
            if spec.name not in out:
                produced = ", ".join(map(repr, out)) or "none"
                raise ModelError(
                    f"model {model!r} returned no output {spec.name!r}, which it "
                    f"declares (it returned {produced})"
                )
            conformed[spec.name] = _conformed_output(spec, out[spec.name], model)
    except ModelError as exc:
        return exc
    return conformed


def v2_datatype(dtype: np.dtype) -> str:
    """The v2 datatype name of a numpy dtype."""
    for name, dt in V2_DTYPES.items():
        if dt == dtype:
            return name
    if dtype.kind in "USO":
        return "BYTES"
    raise InvalidInput(f"numpy dtype {dtype} has no Open Inference Protocol datatype")


@attrs.frozen(kw_only=True)
class TensorSpec:
    """One input or output of a model, per item (no batch dimension); -1 is dynamic."""

    name: str
    datatype: str = attrs.field(validator=attrs.validators.in_(tuple(V2_DTYPES)))
    shape: tuple[int, ...] = attrs.field(converter=tuple)

    @property
    def dtype(self) -> np.dtype:
        return V2_DTYPES[self.datatype]

    def text(self) -> str:
        """The declaration as messages name it: ``name DATATYPE [shape]``
        (``x FP32 [3]``; -1 for a dynamic dimension)."""
        return f"{self.name} {self.datatype} {list(self.shape)}"

    @staticmethod
    def listed(specs: Iterable[TensorSpec]) -> str:
        """Declarations as messages list them: each one's :meth:`text`, joined by
        ", " (``x FP32 [3], mask BOOL [-1]``)."""
        return ", ".join(spec.text() for spec in specs)

    def accepts_shape(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(
            want == -1 or want == got for want, got in zip(self.shape, shape, strict=True)
        )

    def conform(self, arr: np.ndarray, model: str, shape: tuple[int, ...]) -> np.ndarray:
        """An output ``arr`` of ``model`` as this declaration says it is: of its
        datatype (a numeric value converted within its kind, float64 to FP32 say; to
        an integer type only when every value fits; strings or objects for BYTES), and
        ``shape`` (its per-item shape) accepted. Raises ModelError naming the model
        and the output: an answer otherwise would contradict the model's metadata."""
        dtype = self.dtype
        if arr.dtype != dtype:
            kind = arr.dtype.kind
            if dtype.kind == "O":
                if kind not in "OSU":
                    raise ModelError(
                        f"model {model!r}: output {self.name!r} {described(arr)}, "
                        f"the model declares BYTES"
                    )
            elif kind in "biuf" and np.can_cast(arr.dtype, dtype, "same_kind"):
                if dtype.kind in "iu" and arr.size:
                    info = np.iinfo(dtype)
                    if arr.min() < info.min or arr.max() > info.max:
                        raise ModelError(
                            f"model {model!r}: output {self.name!r} holds values out of "
                            f"the range of {self.datatype}, which the model declares"
                        )
                arr = arr.astype(dtype)
            else:
                raise ModelError(
                    f"model {model!r}: output {self.name!r} {described(arr)}, the "
                    f"model declares {self.datatype}"
                )
        if not self.accepts_shape(shape):
            raise ModelError(
                f"model {model!r}: output {self.name!r} has shape {list(shape)} per "
                f"item, the model declares {list(self.shape)}"
            )
        return arr


def to_numpy(value: Any) -> np.ndarray:
    """An array-like (numpy array, torch tensor, nested list, scalar) as a numpy array.
    A torch tensor may be on any device; a bfloat16 one (numpy has no such dtype)
    comes as float32, which holds each of its values exactly."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, any device
        tensor = value.detach().cpu()
        if tensor.dtype is getattr(sys.modules.get("torch"), "bfloat16", None):
            tensor = tensor.float()
        return tensor.numpy()
    return np.asarray(value)


def coerce(spec: TensorSpec, value: Any, model: str) -> np.ndarray:
    """Check one input against its spec and return it with the spec's dtype."""
    arr = _with_dtype(spec, value, model)
    if not spec.accepts_shape(arr.shape):
        extra = " (one item: no batch dimension)" if arr.ndim == len(spec.shape) + 1 else ""
        raise InvalidInput(
            f"input {spec.name!r} of model {model!r}: expected shape "
            f"{list(spec.shape)}{extra}, got {list(arr.shape)}"
        )
    return arr


def coerce_rows(spec: TensorSpec, value: Any, model: str) -> np.ndarray:
    """As :func:`coerce` for a stack of items: a leading dimension, then the spec's."""
    arr = _with_dtype(spec, value, model)
    if arr.ndim != len(spec.shape) + 1 or not spec.accepts_shape(arr.shape[1:]):
        want = ", ".join(map(str, spec.shape))
        raise InvalidInput(
            f"input {spec.name!r} of model {model!r}: expected shape [N, {want}] "
            f"(N items), got {list(arr.shape)}"
        )
    return arr


#: What converting an array-like to numpy may raise for a value that is not one: numpy's
#: TypeError and ValueError, and torch's RuntimeError (NotImplementedError for a meta
#: tensor, which holds no data).
NOT_AN_ARRAY = (TypeError, ValueError, RuntimeError)


def _dtype_name(dtype: np.dtype) -> str:
    """A dtype as an error message names it: its v2 datatype, else numpy's name."""
    if dtype.kind == "O":
        return "objects"
    for name, dt in V2_DTYPES.items():
        if dt == dtype:
            return name
    return "BYTES" if dtype.kind in "US" else str(dtype)


def _with_dtype(spec: TensorSpec, value: Any, model: str) -> np.ndarray:
    try:
        arr = to_numpy(value)
    except NOT_AN_ARRAY as exc:
        raise InvalidInput(
            f"input {spec.name!r} of model {model!r}: not an array ({exc})"
        ) from None
    want = spec.dtype
    if arr.dtype != want:
        if want.kind == "O":
            if arr.dtype.kind not in "USO":
                raise InvalidInput(
                    f"input {spec.name!r} of model {model!r}: expected {spec.datatype} "
                    f"(strings or bytes), got {arr.dtype}"
                )
            arr = arr.astype(object)
        elif arr.dtype.kind == "O" and want.kind in "iuf" and (kinds := _big_ints(arr)):
            # integers past 64 bits (among integers or floats), which numpy keeps as
            # objects: numbers all the same. With a float among them they are the
            # floats numpy makes of the same numbers without the big integer.
            try:
                wide = (
                    arr.astype(np.float64) if want.kind == "f" or float in kinds else None
                )
            except OverflowError:  # past 1e308
                wide = None
            if wide is None:
                raise InvalidInput(
                    f"input {spec.name!r} of model {model!r}: a value is out of range "
                    f"for {spec.datatype}"
                )
            if want.kind != "f":
                raise InvalidInput(
                    f"input {spec.name!r} of model {model!r}: expected {spec.datatype}, "
                    f"got {_dtype_name(wide.dtype)}"
                )
            arr = _narrowed(wide, want, spec, model)
        elif arr.dtype.kind not in _NUMERIC_KINDS.get(want.kind, want.kind):
            raise InvalidInput(
                f"input {spec.name!r} of model {model!r}: expected {spec.datatype}, "
                f"got {_dtype_name(arr.dtype)}"
            )
        else:
            arr = _narrowed(arr, want, spec, model)
    return arr


def _big_ints(arr: np.ndarray) -> set[type]:
    """The kinds of number (``int``, ``float``) an object array holds when it holds
    Python integers and floats only (no bool), one an integer at least 2**63 in
    magnitude: what numpy makes of numbers with an integer too large for int64 and
    uint64 among them. Empty for anything else."""
    values = arr.ravel().tolist()
    kinds = set(map(type, values))
    if not values or not kinds <= {int, float} or not any(
        type(v) is int and abs(v) >= 2**63 for v in values
    ):
        return set()
    return kinds


def _narrowed(arr: np.ndarray, want: np.dtype, spec: TensorSpec, model: str) -> np.ndarray:
    """``arr`` as ``want``, refusing values it cannot hold (300 as INT8, 1e300 as FP32)
    rather than wrapping them or making them inf, as the v2 decoder does."""
    with np.errstate(all="ignore"):  # what does not fit is refused below
        out = arr.astype(want)
    if arr.size and arr.dtype.kind != "b":
        if want.kind in "iu":
            info = np.iinfo(want)
            lo, hi = arr.min(), arr.max()
            bad = lo < info.min or hi > info.max
        elif want.kind == "f" and (
            arr.dtype.kind != "f" or arr.dtype.itemsize > want.itemsize
        ):
            bad = bool((~np.isfinite(out) & np.isfinite(arr)).any())
        else:
            bad = False
        if bad:
            raise InvalidInput(
                f"input {spec.name!r} of model {model!r}: a value is out of range for "
                f"{spec.datatype}"
            )
    return out


class UnorderedItems(InvalidInput, TypeError):
    """Items in a collection with no order (a set): the answers, in its order, would
    match the items by chance. A TypeError too: the wrong kind of collection."""


def item_list(model: str, items: Any, call: str, *, stacked: bool = True) -> Any:
    """``items`` of an ``infer_batch`` (``stacked``: a mapping of stacked inputs is
    taken too) or ``infer_many`` call: a mapping or a sized sequence as it is, any
    other iterable as a list; InvalidInput, naming the model, for a value that holds
    no items (None, a number, a 0-d array) or is one value though iterable (a str,
    bytes or bytearray), and UnorderedItems (InvalidInput and
    TypeError) for a set or frozenset (a dict's keys or items view keeps its order)."""
    takes = "a sequence of items" + (
        " or a mapping input name -> stacked array" if stacked else ""
    )
    if isinstance(items, Set) and not isinstance(items, (KeysView, ItemsView)):
        raise UnorderedItems(
            f"model {model!r}: {call} takes {takes}, got a {type(items).__qualname__}, "
            "which has no order: the answers come in the items' order, so pass a list"
        )
    if isinstance(items, (str, bytes, bytearray)):
        # iterable, each character (or byte) would be taken for an item: "abc" was
        # three items, refused as "expected FP32, got BYTES" for the first of them
        raise InvalidInput(
            f"model {model!r}: {call} takes {takes}, got a {type(items).__qualname__} "
            "(one value, not a list of items: pass [value] for one item)"
        )
    if isinstance(items, Mapping):
        if stacked:
            return items
        raise InvalidInput(
            f"model {model!r}: {call} takes {takes}, got a mapping (one item's inputs, "
            "or stacked ones: Runtime.infer_batch takes those)"
        )
    try:
        if hasattr(items, "__len__"):
            len(items)  # a 0-d array or tensor has the method, and refuses
            return items
        it = iter(items)
    except TypeError:
        shape = getattr(items, "shape", None)
        kind = type(items).__qualname__ + ("" if shape is None else f" of shape {list(shape)}")
        raise InvalidInput(f"model {model!r}: {call} takes {takes}, got {kind}") from None
    return list(it)


def _unstack(model: str, arrays: Any) -> list[Any]:
    """Per-item inputs from stacked ones (name -> array with a leading item dimension)."""
    if not isinstance(arrays, Mapping):
        arrays = {None: arrays}
    try:
        stacked = {k: to_numpy(v) for k, v in arrays.items()}
    except NOT_AN_ARRAY as exc:
        raise InvalidInput(f"model {model!r}: inputs are not arrays ({exc})") from None
    if not stacked:
        raise InvalidInput(
            f"model {model!r}: no stacked inputs (a mapping input name -> array whose "
            "leading dimension indexes the items)"
        )
    counts = {a.shape[0] if a.ndim else -1 for a in stacked.values()}
    if len(counts) != 1 or -1 in counts:
        raise InvalidInput(
            f"model {model!r}: stacked inputs need one leading item dimension of the same "
            f"length, got shapes {', '.join(str(list(a.shape)) for a in stacked.values())}"
        )
    n = counts.pop()
    if None in stacked:
        return list(stacked[None])
    return [{k: a[i] for k, a in stacked.items()} for i in range(n)]


class ModelBackend:
    """Base class of model backends. Subclasses set the signature and ``load``.

    Attributes:
        inputs, outputs: the per-item signature.
        padded: True when a batch is padded to its longest item, so the cost of a batch
            is items × longest item (token budgets count the padding).
        open_inputs: accept any input names and dtypes (``echo``).
        default_execution: "thread" (a worker thread per batch) or "inline".
        supports_split: ``split``/``merge`` are implemented (oversize policy "split").
    """

    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    padded: bool = False
    open_inputs: bool = False
    default_execution: str = "thread"
    supports_split: bool = False

    def prepare(self, name: str, inputs: Any) -> tuple[Item, int]:
        """Validate and coerce one item's inputs; return (item, cost).

        Runs on the event loop: keep it cheap. Raises InvalidInput.
        """
        specs = self.inputs
        if self.open_inputs:  # anything, unchanged (a bare array as the first input)
            if not isinstance(inputs, Mapping):
                inputs = {specs[0].name: inputs}
            try:
                return {str(k): to_numpy(v) for k, v in inputs.items()}, 1
            except NOT_AN_ARRAY as exc:  # ragged nesting, say
                raise InvalidInput(f"model {name!r}: inputs are not arrays ({exc})") from None
        if not isinstance(inputs, Mapping):
            if len(specs) != 1:
                raise InvalidInput(
                    f"model {name!r} takes {len(specs)} inputs "
                    f"({', '.join(s.name for s in specs)}): pass a mapping name -> array"
                )
            return {specs[0].name: coerce(specs[0], inputs, name)}, 1
        item: Item = {}
        for spec in specs:
            try:
                value = inputs[spec.name]
            except KeyError:
                raise InvalidInput(
                    f"model {name!r}: missing input {spec.name!r}; expected "
                    f"{', '.join(s.name for s in specs)}"
                ) from None
            item[spec.name] = coerce(spec, value, name)
        if len(inputs) != len(specs):
            unknown = sorted(set(map(str, inputs)) - {s.name for s in specs})
            raise InvalidInput(
                f"model {name!r}: unknown input {', '.join(map(repr, unknown))}; expected "
                f"{', '.join(s.name for s in specs)}"
            )
        return item, 1

    def prepare_rows(self, name: str, arrays: Mapping[str, Any]) -> list[tuple[Item, int]]:
        """Validate and coerce items given stacked: input name -> array whose leading
        dimension indexes the items (the v2 batch dimension). Returns (item, cost) per
        item, in order; each item's arrays are views of the stacked ones.

        Checks dtype and shape once per input, not once per item. A backend that
        overrides :meth:`prepare` (its own checks or costs), a padded or an open one,
        has each item prepared by :meth:`prepare` instead. Raises InvalidInput.
        """
        specs = self.inputs
        if (
            type(self).prepare is not ModelBackend.prepare
            or self.padded
            or self.open_inputs
            or not isinstance(arrays, Mapping)
        ):
            return [self.prepare(name, item) for item in _unstack(name, arrays)]
        stacked: dict[str, np.ndarray] = {}
        for spec in specs:
            try:
                value = arrays[spec.name]
            except KeyError:
                raise InvalidInput(
                    f"model {name!r}: missing input {spec.name!r}; expected "
                    f"{', '.join(s.name for s in specs)}"
                ) from None
            stacked[spec.name] = coerce_rows(spec, value, name)
        if len(arrays) != len(specs):
            unknown = sorted(set(map(str, arrays)) - {s.name for s in specs})
            raise InvalidInput(
                f"model {name!r}: unknown input {', '.join(map(repr, unknown))}; expected "
                f"{', '.join(s.name for s in specs)}"
            )
        counts = {len(a) for a in stacked.values()}
        if len(counts) > 1:
            raise InvalidInput(
                f"model {name!r}: the inputs disagree on the number of items "
                f"({', '.join(f'{k}: {len(a)}' for k, a in stacked.items())})"
            )
        if len(stacked) == 1:
            (key, arr), = stacked.items()
            return [({key: row}, 1) for row in arr]
        n = counts.pop() if counts else 0
        return [({k: a[i] for k, a in stacked.items()}, 1) for i in range(n)]

    def load(self, device: str, *, torch_threads: int = 1) -> Runner:
        """Load the model on ``device`` and return its runner. Runs in a worker thread."""
        raise NotImplementedError

    def conform_outputs(
        self, name: str, outputs: Sequence[Mapping[str, Any]]
    ) -> Sequence[Mapping[str, Any] | ModelError]:
        """Each item's outputs as the signature declares them: every declared output
        present, a numpy array of its datatype and per-item shape (a numeric value
        converted within its kind, float64 to FP32 say; to an integer type only when
        every value fits). ``outputs`` is what :func:`check_outputs` passed (one
        mapping per item); an output the signature does not declare is kept as it
        is, and an open backend's outputs (``echo``) are not checked.

        Returns ``outputs`` itself when every item conforms already (the usual case:
        a few comparisons per item); else a list in which an item that could be
        converted is a converted copy, and one that could not is the ModelError
        (naming the model and the output) its caller is to get. Runs where the
        model runs (a worker thread, a worker process, or inline); never raises.
        """
        specs = self.outputs
        if self.open_inputs or not specs:
            return outputs
        plan = self.__dict__.get("_output_plan")
        if plan is None or plan[0] is not specs:
            self._output_plan = plan = (specs, tuple(_fast_check(s) for s in specs))
        checks = plan[1]
        for i, out in enumerate(outputs):
            for key, dtype, exact, ndim, fixed in checks:
                v = out.get(key)
                if type(v) is not np.ndarray or v.dtype is not dtype:
                    break
                shape = v.shape
                if exact is not None:
                    if shape != exact:
                        break
                elif len(shape) != ndim or (fixed and not _fits(shape, fixed)):
                    break
            else:
                continue
            # item i (at least) needs converting, or cannot be
            return [*outputs[:i], *(
                _conformed_item(specs, out, name) for out in outputs[i:]
            )]
        return outputs

    def conform_rows(
        self, name: str, outputs: Mapping[str, Any], n: int
    ) -> Mapping[str, Any] | list[ModelError]:
        """As :meth:`conform_outputs` for the outputs of ``n`` items stacked (name ->
        array with one row per item, as a runner's ``stacked`` returns them): checked
        once for the batch, ``outputs`` itself when they conform, else a converted
        copy. When they cannot be (another number of rows among them), one ModelError
        per item (each its own instance: each caller raises its own)."""
        specs = self.outputs
        if self.open_inputs or not specs:
            return outputs
        conformed = None
        try:
            for spec in specs:
                if spec.name not in outputs:
                    produced = ", ".join(map(repr, outputs)) or "none"
                    raise ModelError(
                        f"model {name!r} returned no output {spec.name!r}, which it "
                        f"declares (it returned {produced})"
                    )
                arr = outputs[spec.name]
                if type(arr) is np.ndarray and arr.dtype is spec.dtype and arr.ndim and (
                    len(arr) == n and spec.accepts_shape(arr.shape[1:])
                ):
                    continue
                arr = _conformed_output(spec, arr, name, rows=True)
                if arr.ndim == 0 or len(arr) != n:
                    rows = "no batch dimension" if arr.ndim == 0 else _count(len(arr), "row")
                    raise ModelError(
                        f"model {name!r} returned output {spec.name!r} with {rows} for "
                        f"{_count(n, 'item')}; expected one row per item"
                    )
                if conformed is None:
                    conformed = dict(outputs)
                conformed[spec.name] = arr
        except ModelError as exc:
            return [ModelError(str(exc)) for _ in range(n)]
        return outputs if conformed is None else conformed

    def split(self, item: Item, budget: int) -> list[tuple[Item, int]]:
        """Split an oversize item into parts of cost <= budget (for ``oversize="split"``)."""
        raise NotImplementedError

    def merge(self, parts: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Merge the outputs of the parts of a split item into one output."""
        raise NotImplementedError


class CallableBackend(ModelBackend):
    """A plain Python callable over a list of items (each a dict name -> array),
    returning one output mapping per item."""

    def __init__(
        self,
        fn: Callable[[list[Item]], Sequence[Mapping[str, Any]]],
        *,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        open_inputs: bool = False,
        execution: str = "thread",
    ) -> None:
        # (a callable object's own __call__ too)
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
            raise ValueError(f"{fn!r} is an async function; {_NOT_ASYNC}")
        self._fn = fn
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.open_inputs = open_inputs
        self.default_execution = execution

    def load(self, device: str, *, torch_threads: int = 1) -> Runner:
        return self._fn


_thread_state = threading.local()


def _set_torch_threads(torch: Any, n: int) -> None:
    # torch's intra-op thread count is per OS thread under OpenMP: set it once per
    # worker thread, cheaply checked on every batch.
    if getattr(_thread_state, "torch_threads", None) != n:
        torch.set_num_threads(n)
        _thread_state.torch_threads = n


class TorchBackend(ModelBackend):
    """A torch ``nn.Module`` built by ``factory()``; batched tensors in input order,
    a tensor (or tuple/list/dict of tensors) out, under ``inference_mode``."""

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
    ) -> None:
        self._factory = factory
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)

    def load(self, device: str, *, torch_threads: int = 1) -> Runner:
        import torch

        _set_torch_threads(torch, torch_threads)
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r}: torch sees no CUDA device")
        module = self._factory().to(dev).eval()
        in_names = [s.name for s in self.inputs]
        out_names = [s.name for s in self.outputs]
        on_cpu = dev.type == "cpu"

        def run_stacked(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            # Inputs already stacked (the worker-process path): no per-item work at all.
            _set_torch_threads(torch, torch_threads)
            with torch.inference_mode():
                args = [torch.from_numpy(np.asarray(arrays[n])) for n in in_names]
                if not on_cpu:
                    args = [a.to(dev, non_blocking=True) for a in args]
                out = module(*args)
                if isinstance(out, Mapping):
                    missing = [n for n in out_names if n not in out]
                    if missing:
                        raise RuntimeError(
                            f"module returned a mapping without output "
                            f"{', '.join(map(repr, missing))} (it returned "
                            f"{', '.join(map(repr, out)) or 'none'}); the signature has "
                            f"{', '.join(out_names)}"
                        )
                    outs = [out[n] for n in out_names]
                elif isinstance(out, tuple | list):
                    outs = list(out)
                else:
                    outs = [out]
                if len(outs) != len(out_names):
                    raise RuntimeError(
                        f"module returned {len(outs)} outputs, signature has {len(out_names)}"
                    )
                # One row per item: any other count would be cut to the items (or
                # fall short of them) with no error.
                n = len(args[0]) if args else 0
                for name, o in zip(out_names, outs, strict=True):
                    if not isinstance(o, torch.Tensor):
                        raise RuntimeError(
                            f"module returned output {name!r} as {_kind(o)}; expected "
                            "a tensor with one row per item"
                        )
                    if o.dim() == 0 or len(o) != n:
                        rows = "no batch dimension" if o.dim() == 0 else _count(len(o), "row")
                        raise RuntimeError(
                            f"module returned output {name!r} with {rows} for "
                            f"{_count(n, 'item')}; "
                            "expected one row per item"
                        )
                # to_numpy: a bfloat16 output (numpy has none) comes as float32. On
                # the CPU a tensor's array shares its memory: one the module keeps (a
                # buffer it answers from) would be written by the next batch while
                # this one's answers wait to be sent, so each is copied (once per
                # output a batch; bfloat16's conversion, or the copy from another
                # device, made a new array already). The output's device, not the
                # model's: a module on a GPU may answer from a CPU buffer.
                answers = {}
                for name, o in zip(out_names, outs, strict=True):
                    arr = to_numpy(o)
                    answers[name] = (
                        arr.copy()
                        if o.device.type == "cpu" and o.dtype is not torch.bfloat16
                        else arr
                    )
                return answers

        def run(items: list[Item]) -> list[dict[str, np.ndarray]]:
            stacked = run_stacked({n: np.stack([it[n] for it in items]) for n in in_names})
            if len(out_names) == 1:
                name = out_names[0]
                arr = stacked[name]
                return [{name: arr[i]} for i in range(len(items))]
            return [{n: stacked[n][i] for n in out_names} for i in range(len(items))]

        run.stacked = run_stacked  # type: ignore[attr-defined]
        return run


def load_runner(backend: ModelBackend, device: str, torch_threads: int) -> Runner:
    """``backend.load(device, ...)``, checked: a runner is callable. A load that
    returns anything else (None, say) raises TypeError here, so the replica fails its
    start instead of every batch failing on it later."""
    runner = backend.load(device, torch_threads=torch_threads)
    if not callable(runner):
        raise TypeError(
            f"{type(backend).__qualname__}.load returned {_kind(runner)}; expected the "
            "runner: a callable over a list of items, returning one output mapping each"
        )
    return runner


def device_lost(device: str) -> bool:
    """Whether ``device`` is unusable for the rest of this process, asked after a model
    raised on it: on a CUDA device, a synchronize raises again. A device-side assert
    (an index out of range in a kernel) or an illegal memory access is sticky: every
    later CUDA call in the process fails with it. An error that is not (out of
    memory, a bad argument refused before launch) leaves the device usable. False
    for any other device, or when this process has not used CUDA."""
    if not device.startswith("cuda"):
        return False
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.synchronize(torch.device(device))
    except Exception:
        return True
    return False
