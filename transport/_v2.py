"""The Open Inference Protocol v2 (KServe v2 / Triton) on the wire: model metadata,
infer requests (JSON and the binary tensor extension) and responses.

Sans-IO: bytes and dicts in, values out. :meth:`InferRequest.from_v2_json` validates a
request against the model's signature and splits a leading batch dimension into items
for the batcher; :func:`encode_response` stacks the items' outputs back.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import orjson
import simdjson
from trioserve import V2_DTYPES, InvalidInput, ModelError, TensorSpec, UnknownModel
from trioserve._model import described

#: Open Inference Protocol datatypes and their numpy dtypes (BYTES: object arrays).
DTYPES: Mapping[str, np.dtype] = V2_DTYPES
_DATATYPE_OF = {dt: name for name, dt in DTYPES.items() if name != "BYTES"}
# numpy kinds a JSON list may decode to, per target kind (ints are fine as floats).
_JSON_KINDS = {"b": "b", "u": "iu", "i": "iu", "f": "iuf"}
_DUMPS_OPTS = orjson.OPT_SERIALIZE_NUMPY
_LEN = struct.Struct("<I")
#: struct codes (native sizes, the same as numpy's here) of the datatypes whose JSON
#: data is packed straight into a buffer; FP16 packs slower than numpy converts, and
#: BOOL's code takes any value, so both take numpy's path.
_PACK_CODES = {
    np.dtype(np.float32): "f", np.dtype(np.float64): "d",
    np.dtype(np.int8): "b", np.dtype(np.int16): "h", np.dtype(np.int32): "i",
    np.dtype(np.int64): "q", np.dtype(np.uint8): "B", np.dtype(np.uint16): "H",
    np.dtype(np.uint32): "I", np.dtype(np.uint64): "Q",
}
_PACKERS: dict[tuple[str, int], struct.Struct] = {}
_NOTHING_DECLARED: Mapping[str, TensorSpec] = {}
#: The most classes an output may be asked for (the classification extension).
MAX_CLASSES = 65_536
_PACKERS_MAX = 256


def _tolist(obj: Any) -> Any:
    # orjson serialises C-contiguous native numeric arrays itself; anything else lands here.
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "O":
            return [_text(v) for v in obj.tolist()]
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, bytes):
        return _text(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


def _text(v: Any) -> Any:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def dumps(doc: Any) -> bytes:
    """JSON-encode a response document (numpy arrays allowed anywhere)."""
    return orjson.dumps(doc, default=_tolist, option=_DUMPS_OPTS)


_NON_FINITE = {"nan": b"NaN", "inf": b"Infinity", "-inf": b"-Infinity"}


def json_data(flat: np.ndarray) -> Any:
    """A flat numeric array as a tensor's JSON ``data``: the array itself (orjson
    writes it), or, when a float array holds NaN or an infinity, its JSON text with
    those written ``NaN``, ``Infinity`` and ``-Infinity``, as Triton writes and reads
    them (orjson would write ``null``, which no client reads back as the value)."""
    if flat.dtype.kind != "f" or np.isfinite(flat).all():
        return flat
    tokens = orjson.dumps(flat, option=_DUMPS_OPTS)[1:-1].split(b",")
    for i in np.flatnonzero(~np.isfinite(flat)).tolist():
        tokens[i] = _NON_FINITE[str(float(flat[i]))]
    return orjson.Fragment(b"[" + b",".join(tokens) + b"]")


def json_loads(body: bytes | bytearray | memoryview | str) -> Any:
    """Decode JSON as orjson does, and also the ``NaN``, ``Infinity`` and
    ``-Infinity`` Triton writes for non-finite floats (orjson refuses them; a body
    holding one is read again by the standard library's decoder, which takes them).
    Raises orjson.JSONDecodeError (orjson's) when neither reads it."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        text = bytes(body) if isinstance(body, bytearray | memoryview) else body
        marks = (b"NaN", b"Infinity") if isinstance(text, bytes) else ("NaN", "Infinity")
        if not any(m in text for m in marks):
            raise
        try:
            return json.loads(text)
        except ValueError:
            pass
        raise


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def datatype_of(arr: np.ndarray) -> str:
    """The v2 datatype of an array (object and string arrays are BYTES)."""
    name = _DATATYPE_OF.get(arr.dtype)
    if name is not None:
        return name
    if arr.dtype.kind in "OSU":
        return "BYTES"
    raise InvalidInput(f"output dtype {arr.dtype} has no Open Inference Protocol datatype")


# ---------------------------------------------------------------- model metadata
@attrs.frozen(kw_only=True)
class ModelSignature:
    """What the gateway knows of a served model: its tensors (per item) and versions,
    and its metadata document, encoded once."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    open_inputs: bool = False
    by_name: Mapping[str, TensorSpec] = attrs.field(eq=False, repr=False)
    outputs_by_name: Mapping[str, TensorSpec] = attrs.field(eq=False, repr=False)
    metadata_json: bytes = attrs.field(eq=False, repr=False)

    @classmethod
    def of(cls, served: Any) -> ModelSignature:
        """The signature of a ``Runtime.models[name]`` entry."""
        backend = served.backend
        cfg = served.config
        platform = "pytorch" if type(backend).__name__ == "TorchBackend" else "python"
        inputs, outputs = tuple(backend.inputs), tuple(backend.outputs)

        # Every served model batches, so (as Triton reports for max_batch_size > 0) each
        # tensor's shape starts with a dynamic batch dimension.
        def tensors(specs: tuple[TensorSpec, ...]) -> list[dict[str, Any]]:
            return [
                {"name": s.name, "datatype": s.datatype, "shape": [-1, *s.shape]}
                for s in specs
            ]

        doc = {
            "name": cfg.name,
            "versions": list(cfg.versions),
            "platform": platform,
            "inputs": tensors(inputs),
            "outputs": tensors(outputs),
            "parameters": {"max_batch_size": cfg.max_batch_size},
        }
        return cls(
            name=cfg.name,
            versions=tuple(cfg.versions),
            platform=platform,
            inputs=inputs,
            outputs=outputs,
            open_inputs=bool(getattr(backend, "open_inputs", False)),
            by_name={s.name: s for s in inputs},
            outputs_by_name={s.name: s for s in outputs},
            metadata_json=orjson.dumps(doc),
        )

    def check_version(self, version: str | None) -> None:
        """Raise UnknownModel (404) when ``version`` is not served."""
        if version is not None and version not in self.versions:
            raise UnknownModel(
                f"model {self.name!r} has no version {version!r}; versions: "
                f"{', '.join(self.versions)}"
            )


# ---------------------------------------------------------------- requests
@attrs.frozen(kw_only=True, slots=True)
class InferRequest:
    """A validated v2 infer request, split into items for the batcher.

    ``batched`` says whether the tensors carried a leading batch dimension (then the
    outputs get one back); ``items`` holds one mapping name -> array per item.
    """

    model: str
    version: str | None = None
    id: Any = None
    #: The items, or None while ``stacked`` holds them (built from it when asked for).
    _items: list[dict[str, np.ndarray]] | None = attrs.field(
        default=None, eq=False, repr=False, alias="items"
    )
    batched: bool = False
    #: With a batch dimension of N > 1: the tensors as sent, name -> [N, ...] array
    #: (``Runtime.infer_batch`` takes them stacked and checks them once).
    stacked: dict[str, np.ndarray] | None = attrs.field(default=None, eq=False, repr=False)
    #: How many items: N with a batch dimension, else 1.
    count: int = 1
    #: requested outputs (None: all): the name, whether it is sent as binary data, and
    #: the number of top classes asked for (0: the tensor itself; the classification
    #: extension).
    outputs: tuple[tuple[str, bool, int], ...] | None = None
    binary_outputs: bool = False
    priority: str | None = None
    timeout: float | None = None

    @property
    def items(self) -> list[dict[str, np.ndarray]]:
        """One mapping name -> array per item (rows of ``stacked`` when it is set)."""
        items = self._items
        if items is None:
            arrays = self.stacked or {}
            items = [{k: a[i] for k, a in arrays.items()} for i in range(self.count)]
            object.__setattr__(self, "_items", items)
        return items

    @classmethod
    def from_v2_json(
        cls,
        body: bytes | str,
        signature: ModelSignature,
        *,
        version: str | None = None,
        header_length: int | None = None,
        doc: Mapping[str, Any] | None = None,
        classes: Sequence[str] | None = None,
    ) -> InferRequest:
        """Parse and validate a v2 infer request body for ``signature``'s model.

        ``header_length`` (the ``Inference-Header-Content-Length`` header) says where
        the JSON ends and binary tensor data begins. ``doc`` is the body already
        decoded (the WebSocket stream decodes it to find the model; ``body`` is then
        its text, or empty when unknown). ``classes`` are the request classes'
        names, highest first: with them an integer ``parameters.priority`` sent along
        with ``parameters.class`` is compared as the class it names. Raises
        InvalidInput with a message naming what is wrong and what was expected.
        """
        binary = b""
        if doc is None:
            if header_length is not None:
                if not 0 <= header_length <= len(body):
                    raise InvalidInput(
                        f"Inference-Header-Content-Length {header_length} is outside the "
                        f"body ({len(body)} bytes)"
                    )
                body, binary = body[:header_length], memoryview(body)[header_length:]
            doc = loads_request(body)
        # Whether the JSON may hold a boolean among numbers: scanned for only once an
        # input's data is JSON values (a binary or a simdjson-decoded input needs no scan)
        bools: bool | None = None if body else True
        if type(doc) is not dict:
            raise InvalidInput("the request body must be a JSON object with 'inputs'")
        tensors = doc.get("inputs")
        if type(tensors) is not list or not tensors:
            raise InvalidInput("'inputs' must be a non-empty list of tensors")
        name = signature.name
        params = doc.get("parameters")
        if params is not None and type(params) is not dict:
            raise InvalidInput("'parameters' must be a JSON object")

        arrays: dict[str, np.ndarray] = {}
        batch: int | None = None  # the batch dimension, or -1 for "no batch dimension"
        offset = 0
        for t in tensors:
            if type(t) is not dict:
                raise InvalidInput("each input must be a JSON object with name, shape, datatype")
            if bools is None:
                data = t.get("data")
                if data is not None and type(data) is not np.ndarray:
                    bools = _may_hold_bool(body)
            arr, offset, spec_rank = _decode_tensor(
                t, signature, binary, offset, True if bools is None else bools
            )
            n = arr.shape[0] if arr.ndim == spec_rank + 1 else -1
            if batch is None:
                batch = n
            elif n != batch:
                raise InvalidInput(
                    f"model {name!r}: inputs disagree on the batch dimension "
                    f"({_batch_text(batch)} vs {_batch_text(n)} for input {t['name']!r})"
                )
            if t["name"] in arrays:
                raise InvalidInput(f"model {name!r}: input {t['name']!r} given twice")
            arrays[t["name"]] = arr
        if offset != len(binary):
            raise InvalidInput(
                f"the body has {len(binary) - offset} bytes of binary data that no input claims"
            )
        if not signature.open_inputs and len(arrays) != len(signature.inputs):
            missing = [s.name for s in signature.inputs if s.name not in arrays]
            raise InvalidInput(
                f"model {name!r}: missing input {', '.join(map(repr, missing))}; expected "
                f"{', '.join(s.name for s in signature.inputs)}"
            )
        items: list[dict[str, np.ndarray]] | None = None  # rows of ``arrays``, when asked
        if batch == -1:
            items = [arrays]
        elif batch == 0:
            raise InvalidInput(f"model {name!r}: the batch dimension is 0 (no items)")
        elif batch == 1:
            items = [{k: a[0] for k, a in arrays.items()}]

        if params:
            binary_all = params.get("binary_data_output", False)
            if type(binary_all) is not bool:
                raise InvalidInput(
                    f"parameters.binary_data_output must be true or false, got {binary_all!r}"
                )
            priority, timeout = _classify(params, classes)
        else:
            binary_all, priority, timeout = False, None, None
        outputs = None
        requested = doc.get("outputs")
        if requested is not None and requested != []:  # none named: all (as Triton)
            outputs = _requested_outputs(requested, signature, binary_all)
        rid = doc.get("id")
        if rid is not None and type(rid) not in (str, int):
            raise InvalidInput(f"'id' must be a string or an integer, got {rid!r}")
        return cls(
            model=name,
            version=version,
            id=rid,
            items=items,
            stacked=arrays if batch is not None and batch > 1 else None,
            batched=batch != -1,
            count=batch if batch is not None and batch > 1 else 1,
            outputs=outputs,
            binary_outputs=binary_all,
            priority=priority,
            timeout=timeout,
        )


def loads(body: bytes | str) -> Any:
    """Decode JSON (:func:`json_loads`); malformed JSON is InvalidInput (400)."""
    try:
        return json_loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"malformed JSON body: {exc}") from None


def loads_request(body: bytes | str) -> Any:
    """Decode a v2 request's JSON: one of ``NUMERIC_PARSE_MIN`` bytes or more by
    :func:`_loads_numeric` when it can, anything else (or when it cannot) by
    :func:`loads`."""
    if len(body) >= NUMERIC_PARSE_MIN:
        try:
            doc = _loads_numeric(body.encode() if type(body) is str else body)
        except UnicodeEncodeError:  # a lone surrogate: orjson says what is wrong
            doc = None
        if doc is not None:
            return doc
    return loads(body)


#: JSON bodies at least this large are decoded by :func:`_loads_numeric` first.
NUMERIC_PARSE_MIN = 16 * 1024
_FLOAT_TYPES = {"FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64)}
_SObject = simdjson.Object
_SArray = simdjson.Array


def _loads_numeric(body: bytes) -> dict[str, Any] | None:
    """A request body decoded as :func:`loads` would, except that the ``data`` of each
    FP32 or FP64 input is already an array of that dtype (its values flattened, read
    by simdjson straight into a buffer, never as Python floats); None when the body
    is anything but such a plain request, for :func:`loads` and the checks after it
    to handle and explain.

    For 8,192 numbers: ~140 µs against ~345 µs for orjson's floats packed by struct.
    The result is the same as that path's, by construction:

    - the same document: a duplicate key (simdjson's lookup would take the first, orjson
      the last), a byte order mark (simdjson skips it, orjson refuses it), a number
      simdjson cannot hold (orjson makes an integer past 64 bits a float), or malformed
      JSON returns None;
    - the same data: flat, or rows of equal length, all numbers (``as_buffer`` refuses
      bools, null and strings), every value finite as the dtype (else None, so the
      other path words the refusal);
    - nothing hidden: ``as_buffer`` flattens any nesting, so the ``[`` in the body are
      counted against the arrays accounted for; a deeper or ragged nesting (or a ``[``
      in a string) does not match, and the body takes the other path.
    """
    if type(body) is not bytes or body.startswith(b"\xef\xbb\xbf"):
        return None  # simdjson skips a UTF-8 byte order mark; orjson refuses it
    try:
        return _decode_numeric(body)
    except (ValueError, RuntimeError, TypeError, KeyError):  # simdjson's errors, which
        return None  # may come as a value is read: the other path says what is wrong


def _decode_numeric(body: bytes) -> dict[str, Any] | None:
    doc = simdjson.Parser().parse(body)
    if type(doc) is not _SObject:
        return None
    out = _fields(doc)
    if out is None:
        return None
    brackets = 0
    inputs = out.get("inputs")
    if type(inputs) is _SArray:
        decoded: list[Any] = []
        brackets += 1
        for t in inputs:
            if type(t) is not _SObject:
                return None
            fields = _fields(t)
            if fields is None:
                return None
            data = fields.get("data")
            dtype = _FLOAT_TYPES.get(fields.get("datatype"))  # type: ignore[arg-type]
            if type(data) is _SArray and dtype is not None:
                packed = _numbers(data, dtype)
                if packed is None:
                    return None
                fields["data"], n = packed
                brackets += n
            brackets += _to_python(fields)
            decoded.append(fields)
        out["inputs"] = decoded
    brackets += _to_python(out)
    return out if body.count(b"[") == brackets else None


def _to_python(fields: dict[str, Any]) -> int:
    """Turn the simdjson objects and arrays among ``fields``' values into dicts and
    lists, in place; return how many lists that made."""
    lists = 0
    for k, v in fields.items():
        if type(v) is _SObject:
            fields[k] = v = v.as_dict()
        elif type(v) is _SArray:
            fields[k] = v = v.as_list()
        else:
            continue
        lists += _lists(v)
    return lists


def _fields(obj: Any) -> dict[str, Any] | None:
    """An object's fields, values as simdjson gives them; None for a duplicate key."""
    keys = list(obj.keys())
    if len(set(keys)) != len(keys):
        return None
    return {k: obj[k] for k in keys}


def _numbers(data: Any, dtype: np.dtype) -> tuple[np.ndarray, int] | None:
    """``data`` (flat, or rows of equal length, all numbers) as a flat array of
    ``dtype`` and its count of JSON arrays; None for anything else or a value that
    overflows the dtype."""
    n = len(data)
    if not n:
        return None
    try:
        flat = np.frombuffer(data.as_buffer(of_type="d"), dtype=np.float64)
    except (TypeError, ValueError):  # a bool, null, string or object among the numbers
        return None
    first = data[0]
    if type(first) is _SArray:
        width = len(first)
        if not width or flat.size != n * width:
            return None
        for row in data:
            if type(row) is not _SArray or len(row) != width:
                return None
        arrays = 1 + n
    else:
        if flat.size != n:
            return None
        arrays = 1
    with np.errstate(over="ignore"):
        arr = flat.astype(dtype)  # a new, writable array
    if dtype.itemsize < 8 and not np.isfinite(arr).all():
        return None
    return arr, arrays


def _lists(v: Any) -> int:
    """How many lists ``v`` holds, itself included."""
    if type(v) is list:
        return 1 + sum(_lists(x) for x in v)
    if type(v) is dict:
        return sum(_lists(x) for x in v.values())
    return 0


def _batch_text(n: int) -> str:
    return "no batch dimension" if n == -1 else f"batch of {n}"


def _decode_tensor(
    t: dict[str, Any],
    signature: ModelSignature,
    binary: Any,
    offset: int,
    bools: bool = True,
) -> tuple[np.ndarray, int, int]:
    """One input tensor as an array of its declared shape; returns (array, new binary
    offset, rank of one item). ``bools``: whether the JSON may hold a boolean (False
    only when :func:`_may_hold_bool` found none)."""
    name = t.get("name")
    datatype = t.get("datatype")
    shape = t.get("shape")
    spec = signature.by_name.get(name) if type(name) is str else None
    dtype = DTYPES.get(datatype) if type(datatype) is str else None
    if spec is None or dtype is None or (datatype != spec.datatype and not signature.open_inputs):
        _check_name_and_datatype(signature, name, datatype, spec)
    if type(shape) is not list:
        raise InvalidInput(f"input {name!r}: 'shape' must be a list of integers, got {shape!r}")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise InvalidInput(
                f"input {name!r}: 'shape' must be a list of non-negative integers, got {shape!r}"
            )
        count *= d
    # The item rank: the spec's; for an open model's unnamed inputs, a leading
    # dimension of a tensor of rank >= 2 is the batch dimension.
    item_shape = spec.shape if spec is not None else (-1,) * max(len(shape) - 1, 1)
    rank = len(item_shape)
    skip = len(shape) - rank
    ok = skip in (0, 1)
    if ok:
        for i, want in enumerate(item_shape):
            if want != -1 and want != shape[i + skip]:
                ok = False
                break
    if not ok:
        want_text = ", ".join(map(str, item_shape))
        raise InvalidInput(
            f"input {name!r} of model {signature.name!r}: expected shape [{want_text}] or "
            f"[N, {want_text}] with a batch dimension, got {shape}"
        )
    params = t.get("parameters")
    size = None
    if params is not None:
        if type(params) is not dict:
            raise InvalidInput(f"input {name!r}: 'parameters' must be a JSON object")
        size = params.get("binary_data_size")
        if "shared_memory_region" in params:
            raise InvalidInput(_no_shared_memory(
                f"input {name!r}", "send the tensor as 'data' or as binary data"
            ))
    if size is None:
        data = t.get("data")
        if data is None:
            raise InvalidInput(f"input {name!r}: no 'data' (and no binary_data_size)")
        arr = _from_json(name, data, datatype, dtype, count, shape, bools)
    else:
        if "data" in t:
            # Triton refuses the two together too: which one holds the tensor?
            raise InvalidInput(
                f"input {name!r}: both 'data' and parameters.binary_data_size are given; "
                "send the tensor one way"
            )
        if type(size) is not int or size < 0 or offset + size > len(binary):
            raise InvalidInput(
                f"input {name!r}: binary_data_size {size!r} does not fit the "
                f"{len(binary) - offset} bytes of binary data left in the body"
            )
        arr = _from_binary(name, binary[offset : offset + size], dtype, count)
        offset += size
    try:
        return arr.reshape(shape), offset, rank
    except (ValueError, OverflowError) as exc:  # more dimensions than numpy holds, or
        raise InvalidInput(  # one too large for it
            f"input {name!r}: shape {shape} is not a valid array shape ({exc})"
        ) from None


def _check_name_and_datatype(
    signature: ModelSignature, name: Any, datatype: Any, spec: TensorSpec | None
) -> None:
    """Raise InvalidInput for a bad input name or datatype (the slow path)."""
    model = signature.name
    if type(name) is not str:
        raise InvalidInput(f"model {model!r}: each input needs a string 'name'")
    if spec is None and not signature.open_inputs:
        raise InvalidInput(
            f"model {model!r}: unknown input {name!r}; expected "
            f"{', '.join(s.name for s in signature.inputs)}"
        )
    if datatype not in DTYPES:
        raise InvalidInput(
            f"input {name!r}: datatype {datatype!r} is not one of {', '.join(DTYPES)}"
        )
    if spec is not None and not signature.open_inputs and datatype != spec.datatype:
        raise InvalidInput(
            f"input {name!r} of model {model!r}: expected datatype {spec.datatype}, "
            f"got {datatype}"
        )


def _from_json(
    name: str,
    data: Any,
    datatype: str,
    dtype: np.dtype,
    count: int,
    shape: list[int],
    bools: bool = True,
) -> np.ndarray:
    if type(data) is not list and type(data) is not np.ndarray:
        data = [data]
    if type(data) is np.ndarray:  # decoded straight to the dtype (_loads_numeric)
        arr = data
    elif dtype.kind == "O":
        flat = _flatten(data)
        if not all(isinstance(v, str) for v in flat):
            raise InvalidInput(f"input {name!r}: BYTES data must be strings")
        arr = np.empty(len(flat), dtype=object)
        arr[:] = flat
    else:
        if bools and dtype.kind != "b" and _holds_bool(data):
            raise InvalidInput(
                f"input {name!r}: expected {datatype} values, got a boolean in 'data'"
            )
        # A narrowing cast (1e300 as FP32) makes inf; so do NaN and Infinity, which
        # are the caller's own values (json_loads reads them, as Triton does).
        arr = _pack(data, dtype, count)
        if arr is not None:
            in_range = dtype.kind != "f" or bool(np.isfinite(arr).all())
        else:
            arr, in_range = _convert(name, data, datatype, dtype)
        if not in_range and dtype.kind == "f":
            given = np.asarray(data, dtype=np.float64).reshape(-1)
            in_range = not (np.isfinite(given) & ~np.isfinite(arr.reshape(-1))).any()
        if not in_range:
            raise InvalidInput(f"input {name!r}: a value is out of range for {datatype}")
    if arr.size != count:
        raise InvalidInput(
            f"input {name!r}: shape {shape} holds {count} values, 'data' has {arr.size}"
        )
    return arr


def _convert(
    name: str, data: list[Any], datatype: str, dtype: np.dtype
) -> tuple[np.ndarray, bool]:
    """numpy's path for JSON data: the array as ``dtype``, and whether every value was
    within its range. Raises InvalidInput for ragged nesting or values of a wrong kind."""
    try:
        arr = np.asarray(data)
    except ValueError as exc:  # ragged nesting
        raise InvalidInput(f"input {name!r}: data is not a regular array ({exc})") from None
    if arr.dtype.kind not in _JSON_KINDS[dtype.kind] and arr.size:
        if dtype.kind in "iu" and arr.dtype.kind in "fO" and _past_int64(data):
            # numpy makes floats (or objects) of integers past INT64's range, and the
            # JSON parser floats of those past 64 bits: not the caller's floats
            return arr, False
        raise InvalidInput(
            f"input {name!r}: expected {datatype} values, got {_json_kind(arr)} in 'data'"
        )
    if arr.dtype == dtype:
        return arr, True
    if dtype.kind == "f":
        with np.errstate(over="ignore"):
            cast = arr.astype(dtype)
        return cast, bool(np.isfinite(cast).all())
    cast = arr.astype(dtype)
    return cast, dtype.kind not in "iu" or bool(np.array_equal(cast, arr))


def _past_int64(data: list[Any]) -> bool:
    """Whether ``data`` holds only integers (or integral floats) and one of them at
    least 2**63 in magnitude: a value out of an integer datatype's range."""
    past = False
    for v in _flatten(data):
        kind = type(v)
        if kind is float:
            if not v.is_integer():
                return False
        elif kind is not int:
            return False
        past = past or abs(v) >= 2**63
    return past


def _pack(data: list[Any], dtype: np.dtype, count: int) -> np.ndarray | None:
    """``data`` — ``count`` numbers, flat or as equal rows — packed into a new array of
    ``dtype``; None when it is anything else (other nesting, a string, null, a number
    out of the integer type's range), for numpy's path to convert or explain.

    Four times faster than numpy's conversion, which first looks at every element to
    find a common type; the struct codes check each element as they pack it (a float
    code takes ints and floats, an integer code ints only). Both take a bool among
    numbers as 0 or 1 (:func:`_from_json` refuses those before), and numpy refuses
    only all bools: data that starts with a bool takes its path, so the two agree on
    every input.
    """
    code = _PACK_CODES.get(dtype)
    if code is None or not count or not data:
        return None
    first = data[0]
    if type(first) is list:
        width = len(first)
        if width * len(data) != count or not width or type(first[0]) is bool:
            return None
        for row in data:
            if type(row) is not list:
                return None
    else:
        width = count
        if len(data) != count or type(first) is bool:
            return None
    packer = _PACKERS.get((code, width))
    if packer is None:
        if len(_PACKERS) >= _PACKERS_MAX:
            _PACKERS.clear()
        packer = _PACKERS[code, width] = struct.Struct(f"{width}{code}")
    buf = bytearray(count * dtype.itemsize)
    try:
        if width == count:
            packer.pack_into(buf, 0, *data)
        else:
            step = packer.size
            for i, row in enumerate(data):
                packer.pack_into(buf, i * step, *row)
    except (struct.error, OverflowError):  # a non-number, a row of another length, an
        return None  # int out of range
    return np.frombuffer(buf, dtype=dtype)


def _may_hold_bool(text: bytes | bytearray | str) -> bool:
    """Whether JSON ``text`` may hold ``true`` or ``false`` as an array element:
    False only when neither word appears where one could (after ``[`` or ``,``, and
    whitespace). Python's bool is an int, so the numeric conversions take a boolean
    among numbers as 1 or 0; this spares the exact check (:func:`_holds_bool`, ~7 µs
    per 256 values here) for the bodies that cannot hold one, including those with
    a boolean only as an object's value (``"binary_data": true``, which tritonclient
    sends with every requested output).

    Each candidate first letter is found by ``find`` (memchr); a numeric body has
    only its keys' few ``t``s and ``f``s, so 5 KiB cost ~1.4 µs and 158 KiB ~4 µs,
    where ``b"true" in text`` is ~3.4 µs for 5 KiB (the exponents' ``e`` match its
    last letter). After 16 other hits of one letter it gives up: maybe.
    """
    find = text.find
    if type(text) is str:
        words, opening, space = ("true", "false"), "[,", " \t\r\n"
    else:
        words, opening, space = (b"true", b"false"), b"[,", b" \t\r\n"
    for word in words:
        first = word[:1]
        i = find(first)
        tries = 0
        while i != -1:
            if text.startswith(word, i):  # type: ignore[arg-type]
                j = i - 1
                while j >= 0 and text[j : j + 1] in space:  # type: ignore[operator]
                    j -= 1
                if j < 0 or text[j : j + 1] in opening:  # type: ignore[operator]
                    return True  # in an array (or a string: the exact check decides)
            elif tries == 16:
                return True
            tries += 1
            i = find(first, i + 1)
    return False


def _holds_bool(data: list[Any]) -> bool:
    """Whether a boolean is among ``data``'s values (nested lists included, however
    deep: a stack, not recursion)."""
    stack = [data]
    while stack:
        values = stack.pop()
        kinds = set(map(type, values))
        if bool in kinds:
            return True
        if list in kinds:
            stack.extend(v for v in values if type(v) is list)
    return False


def _json_kind(arr: np.ndarray) -> str:
    return {"b": "booleans", "i": "integers", "u": "integers", "f": "floats",
            "U": "strings"}.get(arr.dtype.kind, "mixed values")


def _flatten(data: list[Any]) -> list[Any]:
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if type(v) is list:
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


def _from_binary(name: str, chunk: Any, dtype: np.dtype, count: int) -> np.ndarray:
    if dtype.kind != "O":
        if len(chunk) != count * dtype.itemsize:
            raise InvalidInput(
                f"input {name!r}: binary data is {len(chunk)} bytes, shape and datatype "
                f"need {count * dtype.itemsize}"
            )
        if dtype.kind == "b" and count and np.frombuffer(chunk, dtype=np.uint8).max() > 1:
            # a bool array would hold the byte as it came (and send it back out)
            raise InvalidInput(
                f"input {name!r}: BOOL binary data holds a byte other than 0 (false) "
                f"and 1 (true)"
            )
        return np.frombuffer(chunk, dtype=dtype)
    # BYTES: each element is a 4-byte little-endian length, then the bytes.
    values: list[bytes] = []
    pos, end = 0, len(chunk)
    while pos < end:
        if pos + 4 > end:
            raise InvalidInput(f"input {name!r}: truncated BYTES element length")
        (n,) = _LEN.unpack_from(chunk, pos)
        pos += 4
        if pos + n > end:
            raise InvalidInput(f"input {name!r}: BYTES element overruns the binary data")
        values.append(bytes(chunk[pos : pos + n]))
        pos += n
    if len(values) != count:
        raise InvalidInput(
            f"input {name!r}: binary data holds {len(values)} BYTES elements, shape needs {count}"
        )
    arr = np.empty(count, dtype=object)
    arr[:] = values
    return arr


def _requested_outputs(
    requested: Any, signature: ModelSignature, binary_all: bool
) -> tuple[tuple[str, bool, int], ...]:
    if type(requested) is not list:
        raise InvalidInput("'outputs' must be a list of {name} objects")
    known = {s.name for s in signature.outputs}
    out = []
    seen: set[str] = set()
    for o in requested:
        name = o.get("name") if type(o) is dict else None
        if type(name) is not str:
            raise InvalidInput("each requested output needs a string 'name'")
        if name in seen:
            # as Triton: one answer per output, so asking twice is the caller's error
            raise InvalidInput(f"model {signature.name!r}: output {name!r} requested twice")
        seen.add(name)
        if not signature.open_inputs and name not in known:
            raise InvalidInput(
                f"model {signature.name!r}: unknown output {name!r}; expected "
                f"{', '.join(sorted(known))}"
            )
        params = o.get("parameters")
        binary = binary_all
        classes = 0
        if params is not None:
            if type(params) is not dict:
                raise InvalidInput(f"output {name!r}: 'parameters' must be a JSON object")
            if "shared_memory_region" in params:
                # ignored, the answer would carry the tensor while the client reads
                # its region, which nothing wrote
                raise InvalidInput(_no_shared_memory(
                    f"output {name!r}", "leave it out to get the tensor in the answer"
                ))
            binary = params.get("binary_data", binary_all)
            if type(binary) is not bool:
                raise InvalidInput(
                    f"output {name!r}: parameters.binary_data must be true or false, "
                    f"got {binary!r}"
                )
            classes = params.get("classification", 0)
            if type(classes) is not int or not 0 <= classes <= MAX_CLASSES:
                raise InvalidInput(
                    f"output {name!r}: parameters.classification must be a count of "
                    f"classes, 1 to {MAX_CLASSES}, got {classes!r}"
                )
        out.append((name, binary, classes))
    return tuple(out)


def _no_shared_memory(tensor: str, advice: str) -> str:
    """The refusal of a tensor in shared memory (Triton's extensions, not served)."""
    return (
        f"{tensor}: parameters.shared_memory_region: this server has no shared memory "
        f"(Triton's system_shared_memory and cuda_shared_memory are not served); {advice}"
    )


def _classify(
    params: dict[str, Any], classes: Sequence[str] | None = None
) -> tuple[str | None, float | None]:
    """The request class and the timeout (seconds) of ``parameters``.

    The class is ``class`` (a name) or ``priority`` (a name, or Triton's integer
    level: 1 is the top class; 0 or a level past the last, the default). Sent
    together they must name the same class: a level is read against ``classes``
    (the names, highest first) before they are compared, and a level that names no
    class (0, Triton's "unset", or one past the last) leaves ``class`` to decide.
    ``timeout_ms`` is ours; ``timeout`` (microseconds) is what Triton clients send,
    where 0 means no timeout of the request's own, as in Triton. A ``tenant``
    parameter is ignored: over HTTP the tenant is the API key's, never the body's.
    """
    priority = params.get("priority")
    if priority is not None:
        if type(priority) is int and priority >= 0:
            priority = str(priority)
        elif type(priority) is not str or not priority:
            raise InvalidInput(
                f"parameters.priority must be a class name or a level >= 0, got {priority!r}"
            )
    cls = params.get("class")
    if cls is not None:
        if type(cls) is not str or not cls:
            raise InvalidInput(f"parameters.class must be a class name, got {cls!r}")
        if priority is not None and priority != cls:
            named = _class_of_level(priority, classes)
            if named is not None and named != cls:
                raise InvalidInput(
                    f"parameters.class {cls!r} and parameters.priority {priority!r}"
                    + ("" if named == priority else f" (class {named!r})")
                    + " disagree; send one of them"
                )
        priority = cls
    timeout = None
    for key, scale in (("timeout_ms", 1e-3), ("timeout", 1e-6)):
        v = params.get(key)
        if v is None:
            continue
        kind = type(v)  # not isinstance: a bool is not a number here
        if kind is int or kind is float:
            if key == "timeout" and v == 0:
                continue  # Triton's timeout 0 (or 0.0): none (its default, as if not sent)
            if v > 0:
                try:
                    timeout = v * scale
                except OverflowError:  # an int past a float's range (the stdlib decoder's)
                    timeout = math.inf
                if math.isfinite(timeout):
                    break
        raise InvalidInput(f"parameters.{key} must be a positive number, got {v!r}")
    return priority, timeout


def _class_of_level(priority: str, classes: Sequence[str] | None) -> str | None:
    """The class ``priority`` names: itself unless it is an integer level; for a
    level, the class at that level in ``classes`` (1 = the first), None for a level
    that names none (0, or past the last), or the level itself when ``classes`` is
    unknown."""
    if classes is None or priority in classes or not (priority.isascii() and priority.isdigit()):
        return priority
    digits = priority.lstrip("0")
    if not digits or len(digits) > 18 or int(digits) > len(classes):
        return None
    return classes[int(digits) - 1]


# ---------------------------------------------------------------- responses
def encode_response(
    request: InferRequest,
    results: list[Mapping[str, Any]],
    signature: ModelSignature,
    *,
    binary: bool = True,
) -> tuple[bytes, int | None]:
    """The v2 response for ``request``'s items' ``results``: (body, JSON header length
    when binary output data follows the JSON, else None). With ``binary`` False every
    output is sent as JSON data, whatever the request asked (WebSocket text frames).
    An empty id is left out over HTTP, as Triton leaves it out; on the stream (``binary``
    False) it is echoed, since the id tags the answer."""
    if request.outputs is not None:
        wanted = request.outputs
    elif signature.open_inputs:
        wanted = tuple((n, request.binary_outputs, 0) for n in results[0])
    else:
        wanted = tuple((s.name, request.binary_outputs, 0) for s in signature.outputs)
    outs = []
    blobs: list[bytes] = []
    first = results[0]
    # An open model (echo) answers what it was given: its declared outputs describe
    # only its default input.
    declared = _NOTHING_DECLARED if signature.open_inputs else signature.outputs_by_name
    model = request.model
    for name, as_binary, classes in wanted:
        spec = declared.get(name)
        if name not in first:
            produced = ", ".join(map(repr, first)) or "none"
            if spec is None:  # asked of an open model (echo): the caller's mistake
                raise InvalidInput(f"model {model!r}: no output {name!r}; it produced {produced}")
            raise ModelError(
                f"model {model!r} returned no output {name!r}, which it declares "
                f"(it returned {produced})"
            )
        try:
            if len(results) == 1:
                arr = np.asarray(first[name])
                if request.batched:
                    arr = arr.reshape((1, *arr.shape))
            else:
                arr = np.stack([r[name] for r in results])
        except KeyError:
            raise ModelError(
                f"model {model!r} returned output {name!r} for some items only"
            ) from None
        except ValueError as exc:  # items whose outputs differ in shape
            raise ModelError(
                f"model {model!r}: output {name!r} cannot be stacked across the "
                f"request's items ({exc})"
            ) from None
        if spec is not None:
            shape = arr.shape[1:] if request.batched or len(results) > 1 else arr.shape
            # (the usual case, the declared dtype and shape, in two comparisons)
            if arr.dtype is not spec.dtype or shape != spec.shape:
                arr = spec.conform(arr, model, shape)
        if classes:
            arr = _top_classes(arr, classes, request.batched or len(results) > 1, model, name)
        try:
            datatype = datatype_of(arr)
        except InvalidInput as exc:
            raise ModelError(f"model {model!r}: output {name!r}: {exc}") from None
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": arr.shape}
        try:
            if as_binary and binary:
                raw = _to_binary(arr)
                entry["parameters"] = {"binary_data_size": len(raw)}
                blobs.append(raw)
            else:
                entry["data"] = (
                    json_data(np.ascontiguousarray(arr).reshape(-1))
                    if datatype != "BYTES"
                    else [_element(v) for v in arr.reshape(-1).tolist()]
                )
        except TypeError as exc:
            raise ModelError(f"model {model!r}: output {name!r}: {exc}") from None
        except UnicodeDecodeError:
            raise InvalidInput(_not_text(arr, model, name, binary)) from None
        outs.append(entry)
    doc: dict[str, Any] = {
        "model_name": request.model,
        "model_version": request.version or signature.versions[-1],
    }
    rid = request.id
    if rid is not None and (rid != "" or not binary):
        doc["id"] = rid
    doc["outputs"] = outs
    head = dumps(doc)
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)


def _to_binary(arr: np.ndarray) -> bytes:
    if arr.dtype.kind != "O" and arr.dtype.kind not in "SU":
        return np.ascontiguousarray(arr).tobytes()
    parts = []
    for v in arr.reshape(-1).tolist():
        if isinstance(v, bytes):
            b = v
        elif isinstance(v, str):
            b = v.encode()
        else:
            raise TypeError(f"a BYTES element is {_shown(v)}, not a string or bytes")
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def _element(v: Any) -> str:
    """A BYTES element as JSON data: text (bytes decoded as UTF-8; UnicodeDecodeError
    when they are not, since a replaced byte would reach the client as the model's)."""
    if isinstance(v, str):
        return v
    if isinstance(v, bytes):
        return v.decode("utf-8")
    raise TypeError(f"a BYTES element is {_shown(v)}, not a string or bytes")


def _is_text(v: Any) -> bool:
    try:
        _element(v)
    except UnicodeDecodeError:
        return False
    return True


def _not_text(arr: np.ndarray, model: str, name: str, binary: bool) -> str:
    """The refusal of a BYTES output asked for as JSON data that holds bytes that are
    not UTF-8 (JSON strings are text), naming the first such element."""
    index = next(i for i, v in enumerate(arr.reshape(-1).tolist()) if not _is_text(v))
    how = (
        'ask for the output as binary data ("binary_data": true in its parameters)'
        if binary else
        "the stream sends JSON only: ask for the output over HTTP as binary data"
    )
    return (
        f"model {model!r}: output {name!r}: element {index} is bytes that are not UTF-8 "
        f"text, which JSON data cannot carry unaltered; {how}"
    )


def _shown(v: Any) -> str:
    return "None" if v is None else f"a value of type {type(v).__qualname__}"


def _top_classes(
    arr: np.ndarray, count: int, stacked: bool, model: str, name: str
) -> np.ndarray:
    """Triton's classification extension: for each item, its output's ``count``
    highest values (all of them when it has fewer), highest first (the lower index
    first among equals), as BYTES strings ``"<value>:<index>"``; the value printed as
    C++'s ``std::to_string`` does (six decimals for a float). Shape ``[count]`` per
    item."""
    if arr.dtype.kind not in "biuf":
        raise ModelError(
            f"model {model!r}: output {name!r} {described(arr)}: it has no classes "
            f"to rank (parameters.classification)"
        )
    rows = arr.reshape(arr.shape[0] if stacked else 1, -1)
    n = min(count, rows.shape[1])
    fmt = "{:f}:{}" if arr.dtype.kind == "f" else "{}:{}"
    out = np.empty((rows.shape[0], n), dtype=object)
    for r, row in enumerate(rows):
        # a stable sort of the negated values: ties keep the lower index first
        order = np.argsort(-row.astype(np.float64), kind="stable")[:n]
        values = row[order].tolist()
        out[r] = [fmt.format(v, int(i)) for v, i in zip(values, order, strict=True)]
    return out if stacked else out[0]


def encode_inputs(inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[Any]:
    """v2 input tensors from a mapping name -> array-like (or v2 tensors as they are)."""
    if not isinstance(inputs, Mapping):
        return list(inputs)
    out = []
    for name, value in inputs.items():
        arr = np.asarray(value)
        datatype = datatype_of(arr)
        data = arr.reshape(-1)
        if datatype == "BYTES":
            data = [v.decode() if isinstance(v, bytes) else str(v) for v in data.tolist()]
        else:
            data = json_data(np.ascontiguousarray(data))
        out.append({"name": name, "shape": list(arr.shape), "datatype": datatype, "data": data})
    return out


def decode_outputs(doc: Mapping[str, Any], binary: bytes = b"") -> dict[str, np.ndarray]:
    """The outputs of a v2 response document as arrays (``binary``: the bytes after
    its JSON, for outputs sent as binary data)."""
    outputs = {}
    offset = 0
    for o in doc.get("outputs", ()):
        dtype = DTYPES.get(o["datatype"], np.dtype(object))
        params = o.get("parameters") or {}
        size = params.get("binary_data_size")
        if size is not None:
            arr = _from_binary(o["name"], memoryview(binary)[offset : offset + size], dtype,
                               math.prod(o["shape"]))
            offset += size
        else:
            arr = np.asarray(o["data"], dtype=dtype)
        outputs[o["name"]] = arr.reshape(o["shape"])
    return outputs


def sample_inputs(
    model: str, specs: Sequence[TensorSpec], batch: int, *, literal: bool = False
) -> list[dict[str, Any]]:
    """v2 input tensors holding ``batch`` items for a model's input specs (dynamic
    dimensions: 8; zeros for ``sleep``, whose x[0] is a delay)."""
    rng = np.random.default_rng(0)
    tensors = []
    for spec in specs:
        shape = [batch, *(d if d > 0 else 8 for d in spec.shape)]
        if spec.datatype == "BYTES":
            data: Any = ["the quick brown fox jumps over the lazy dog"] * math.prod(shape)
        elif model == "sleep" or spec.dtype.kind != "f":
            data = np.zeros(math.prod(shape), DTYPES[spec.datatype])
        else:
            data = rng.standard_normal(math.prod(shape)).astype(spec.dtype)
        if literal and isinstance(data, np.ndarray):
            data = [round(float(v), 3) for v in data]
        tensors.append(
            {"name": spec.name, "shape": shape, "datatype": spec.datatype, "data": data}
        )
    return tensors


def server_metadata(version: str) -> bytes:
    return orjson.dumps(
        {
            "name": "trioserve",
            "version": version,
            "extensions": [
                "binary_tensor_data", "classification", "parameters", "schedule_policy",
                "model_configuration", "model_repository", "statistics", "stream",
            ],
        }
    )


__all__ = [
    "DTYPES",
    "InferRequest",
    "ModelSignature",
    "datatype_of",
    "decode_outputs",
    "dumps",
    "encode_inputs",
    "encode_response",
    "error_body",
    "loads",
    "sample_inputs",
    "server_metadata",
]
