"""Decoding a v2 request's input tensors, as JSON data or binary data (the binary
tensor extension), into arrays checked against the model's signature: name,
datatype, shape, and every value within its datatype's range."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from trioserve import InvalidInput, TensorSpec

from ._signature import ModelSignature
from ._v2 import _LEN, DTYPES, shown

# numpy kinds a JSON list may decode to, per target kind (ints are fine as floats).
_JSON_KINDS = {"b": "b", "u": "iu", "i": "iu", "f": "iuf"}
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
_PACKERS_MAX = 256
#: A value of an input's JSON ``data`` inside this many arrays or more is refused, as
#: Triton's reader refuses it (its HTTP_MAX_JSON_NESTING_DEPTH): at most 99 levels.
MAX_DATA_DEPTH = 100


def _decode_tensor(
    t: dict[str, Any],
    signature: ModelSignature,
    binary: memoryview | None,
    offset: int,
    bools: bool = True,
    text: bytes | str = b"",
) -> tuple[np.ndarray, int, int]:
    """One input tensor as an array of its declared shape; returns (array, new binary
    offset, rank of one item). ``bools``: whether the JSON may hold a boolean (False
    only when :func:`_may_hold_bool` found none); ``text``: the request's JSON, for
    the messages."""
    name = t.get("name")
    datatype = t.get("datatype")
    shape = t.get("shape")
    spec = signature.by_name.get(name) if type(name) is str else None
    dtype = DTYPES.get(datatype) if type(datatype) is str else None
    if spec is None or dtype is None or (datatype != spec.datatype and not signature.open_inputs):
        _check_name_and_datatype(signature, name, datatype, spec)
    if type(shape) is not list:
        raise InvalidInput(
            f"input {name!r}: 'shape' must be a list of integers, got {shown(shape, text)}"
        )
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise InvalidInput(
                f"input {name!r}: 'shape' must be a list of non-negative integers, "
                f"got {shown(shape, text)}"
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
        if type(size) is not int or size < 0:
            raise InvalidInput(
                f"input {name!r}: parameters.binary_data_size must be a count of bytes "
                f"(an integer, 0 or more), got {shown(size, text)}"
            )
        if binary is None:
            # no binary part at all: the header is missing (or this is the stream); a
            # header at the body's end is a binary part of 0 bytes, for empty tensors
            raise InvalidInput(
                f"input {name!r}: parameters.binary_data_size is given but the request "
                "has no binary data: over HTTP, send the tensors' bytes after the JSON "
                "with the JSON's length in Inference-Header-Content-Length; a "
                "/v2/stream message takes tensors as 'data' only"
            )
        if offset + size > len(binary):
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
    if type(datatype) is not str or datatype not in DTYPES:  # a list is unhashable
        raise InvalidInput(
            f"input {name!r}: datatype {shown(datatype)} is not one of {', '.join(DTYPES)}"
        )
    if spec is not None and not signature.open_inputs and datatype != spec.datatype:
        raise InvalidInput(
            f"input {name!r} of model {model!r}: expected datatype {spec.datatype}, "
            f"got {datatype}"
        )


def _no_shared_memory(tensor: str, advice: str) -> str:
    """The refusal of a tensor in shared memory (Triton's extensions, not served)."""
    return (
        f"{tensor}: parameters.shared_memory_region: this server has no shared memory "
        f"(Triton's system_shared_memory and cuda_shared_memory are not served); {advice}"
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
        kinds = set(map(type, data))  # one pass in C: flat strings need no other
        if kinds == {str}:
            flat = data
        else:
            flat = _flatten(data, name)
            if not all(isinstance(v, str) for v in flat):
                raise InvalidInput(f"input {name!r}: BYTES data must be strings")
        if len(flat) != count:  # before the array is made
            raise InvalidInput(
                f"input {name!r}: shape {shape} holds {count} values, 'data' has {len(flat)}"
            )
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
        if arr is None:
            arr, in_range = _convert(name, data, datatype, dtype)
        elif dtype.kind != "f" or np.isfinite(arr).all():
            in_range = True
        else:  # packed: flat, or rows of equal length
            given = np.asarray(data, dtype=np.float64).reshape(-1)
            in_range = not (np.isfinite(given) & ~np.isfinite(arr)).any()
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
    within its range (a NaN or an infinity sent is the caller's own). Data nested
    otherwise than in rows of equal length (ragged, mixed, deeper than numpy's 64
    dimensions) is its values depth first, as Triton's reader takes it: the count is
    checked after. Raises InvalidInput for values of a wrong kind, or nested in
    ``MAX_DATA_DEPTH`` arrays or more."""
    try:
        arr = np.asarray(data)
    except ValueError:  # not a regular array: read depth first
        arr = np.asarray(_flatten(data, name))
    if arr.dtype.kind == "O" and dtype.kind == "f" and arr.size and _numbers(arr):
        # integers past 64 bits among floats (the standard library's decoder, which
        # reads a body holding NaN or Infinity, keeps them as integers): numbers,
        # read as floats, as orjson reads them; past FP64's range they are out of range
        try:
            arr = arr.astype(np.float64)
        except OverflowError:
            return arr, False
    if arr.dtype.kind not in _JSON_KINDS[dtype.kind] and arr.size:
        if dtype.kind in "iu" and arr.dtype.kind in "fO" and _past_int64(data):
            # numpy makes floats (or objects) of integers past INT64's range, and the
            # JSON parser floats of those past 64 bits: not the caller's floats
            return arr, False
        raise InvalidInput(
            f"input {name!r}: expected {datatype} values, got {_json_kind(arr, data)} "
            "in 'data'"
        )
    if arr.dtype == dtype:
        return arr, True
    if dtype.kind == "f":
        with np.errstate(over="ignore"):
            cast = arr.astype(dtype)
        return cast, not (np.isfinite(arr) & ~np.isfinite(cast)).any()
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


def _json_kind(arr: np.ndarray, data: list[Any]) -> str:
    """What ``data`` (read by numpy as ``arr``) holds, for a message: its values' kind,
    or the first null or object among them, with its place in the flat order."""
    kind = {"b": "booleans", "i": "integers", "u": "integers", "f": "floats",
            "U": "strings"}.get(arr.dtype.kind)
    if kind is not None:
        return kind
    flat = _flatten(data)
    for i, v in enumerate(flat):
        if v is None or type(v) is dict:
            return f"{shown(v)} (element {i})"
    kinds = set(map(type, flat))
    if kinds <= {int, float}:  # integers past 64 bits among floats: numbers
        return "floats" if float in kinds else "integers"
    return "mixed values"


def _numbers(arr: np.ndarray) -> bool:
    """Whether an object array holds only integers and floats (no bool, which is an
    int to Python): what numpy makes of numbers with an integer past 64 bits."""
    return set(map(type, arr.ravel().tolist())) <= {int, float}


def _flatten(data: list[Any], name: str = "") -> list[Any]:
    """``data``'s values depth first (row-major), however it nests them (a stack, not
    recursion). Raises InvalidInput for a value inside ``MAX_DATA_DEPTH`` arrays or
    more (``name``: the input's, for the message)."""
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if type(v) is list:
                if v and len(stack) + 1 >= MAX_DATA_DEPTH:  # v's values: that deep
                    raise InvalidInput(
                        f"input {name!r}: 'data' nests a value in {MAX_DATA_DEPTH} arrays "
                        f"or more; at most {MAX_DATA_DEPTH - 1} levels are read"
                    )
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
    return _bytes_elements(name, chunk, count)


def _bytes_elements(name: str, chunk: Any, count: int) -> np.ndarray:
    """BYTES binary data — each element a 4-byte little-endian length, then its bytes —
    as an object array of ``count`` bytes. The count is checked against the data as
    early as it can be: first against the fewest elements the data may hold (4 bytes
    each at least), then as the elements are read, so a body holding more elements
    than its shape is refused at the element past the count, never read to its end.

    Elements all of one length (empty strings, fixed-width ids) are read by numpy at
    ~0.03 µs each; others one by one at ~0.3 µs (a million: ~0.3 s, which is why a large
    body is decoded off the event loop: ``_decode.py``)."""
    end = len(chunk)
    if count * 4 > end:
        raise InvalidInput(
            f"input {name!r}: binary data of {end} bytes holds at most {end // 4} BYTES "
            f"elements (each is a 4-byte length and its bytes), shape needs {count}"
        )
    data = chunk if type(chunk) is bytes else bytes(chunk)  # bytes slice fastest
    arr = np.empty(count, dtype=object)
    if count and _same_length(data, count, arr):
        return arr
    values = [b""] * count
    unpack = _LEN.unpack_from
    pos = 0
    for i in range(count):
        if pos + 4 > end:
            raise InvalidInput(
                f"input {name!r}: truncated BYTES element length"
                if pos < end else
                f"input {name!r}: binary data holds {i} BYTES elements, shape needs {count}"
            )
        (n,) = unpack(data, pos)
        pos += 4
        stop = pos + n
        if stop > end:
            raise InvalidInput(f"input {name!r}: BYTES element overruns the binary data")
        values[i] = data[pos:stop]
        pos = stop
    if pos != end:
        raise InvalidInput(
            f"input {name!r}: binary data goes on past the {count} BYTES elements the "
            f"shape needs ({end - pos} bytes more)"
        )
    arr[:] = values
    return arr


def _same_length(data: bytes, count: int, out: np.ndarray) -> bool:
    """Fill ``out`` with ``data``'s ``count`` BYTES elements if they all have the first
    one's length and fill ``data`` exactly (numpy reads them at once); else False."""
    (size,) = _LEN.unpack_from(data, 0)
    step = 4 + size
    if count * step != len(data):
        return False
    lengths = np.ndarray((count,), dtype="<u4", buffer=data, strides=(step,))
    if not (lengths == size).all():
        return False
    if size:  # a void element reads as bytes, its NULs kept (numpy's S would strip)
        out[:] = np.ndarray(
            (count,), dtype=f"V{size}", buffer=data, offset=4, strides=(step,)
        ).tolist()
    else:
        out[:] = b""
    return True
