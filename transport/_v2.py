"""The Open Inference Protocol v2 (KServe v2 / Triton) on the wire: what requests and
answers share. Its datatypes, and its JSON: numpy arrays written, and the ``NaN``,
``Infinity`` and ``-Infinity`` Triton writes for non-finite floats read back.

Requests are decoded in ``._request`` (their tensors in ``._tensors``, large numeric
bodies in ``._request_json``), answers encoded in ``._response``, and model metadata
kept in ``._signature``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson
from trioserve import V2_DTYPES, InvalidInput

#: Open Inference Protocol datatypes and their numpy dtypes (BYTES: object arrays).
DTYPES: Mapping[str, np.dtype] = V2_DTYPES
_DATATYPE_OF = {dt: name for name, dt in DTYPES.items() if name != "BYTES"}
_DUMPS_OPTS = orjson.OPT_SERIALIZE_NUMPY
_LEN = struct.Struct("<I")


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


def loads(body: bytes | str) -> Any:
    """Decode JSON (:func:`json_loads`); malformed JSON is InvalidInput (400)."""
    try:
        return json_loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"malformed JSON body: {exc}") from None


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


__all__ = [
    "DTYPES",
    "datatype_of",
    "dumps",
    "error_body",
    "json_data",
    "json_loads",
    "loads",
]
