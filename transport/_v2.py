"""The Open Inference Protocol v2 (KServe v2 / Triton) on the wire: what requests and
answers share. Its datatypes, and its JSON: numpy arrays written, and the ``NaN``,
``Infinity`` and ``-Infinity`` Triton writes for non-finite floats read back.

Requests are decoded in ``._request`` (their tensors in ``._tensors``, large numeric
bodies in ``._request_json``), answers encoded in ``._response``, and model metadata
kept in ``._signature``.
"""

from __future__ import annotations

import json
import math
import re
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


def compact(data: bytes) -> bytes:
    """A copy of ``data`` in a block of its own length, for bytes kept past their
    request (an answer in the result cache or the idempotency store). A copy; not a
    checkpoint.

    orjson's output keeps the buffer it was written into (orjson 3.13): a 150-byte
    answer holds a 4 KiB block, a 2-20 KB one 15 to 22 times its length. Kept as it
    is, each answer held many times the bytes it is counted as: under a flood of
    unique requests the ~1,200 answers of a 1 MiB result cache took ~4 MiB, and the
    idempotency store's ~5,000 another 20 MiB (docs/architecture.md, Memory under a
    flood).
    """
    return bytes(memoryview(data))


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
            doc = json.loads(text)
        except ValueError:
            pass
        else:
            if _maybe_past_fp64.search(text if isinstance(text, str) else str(text, "latin-1")):
                _refuse_past_fp64(text)
            return doc
        raise


#: A float that may be past FP64's range: an exponent of 3 digits or more. The
#: standard library's reader makes inf of it, silently: only a body with one is read
#: again, with a check of each float in the inputs' data (:func:`_refuse_past_fp64`).
#: (An integer past it stays an int, which the tensor's conversion refuses.)
_maybe_past_fp64 = re.compile(r"[0-9][eE]\+?0*[1-9][0-9]{2}")


def _refuse_past_fp64(text: bytes | str) -> None:
    """Raise orjson's error for a float past FP64's range in an input's data, as
    orjson raises it for a body without NaN or Infinity (so that :func:`loads` words
    it alike), when ``text`` (JSON the standard library reads) holds one; a string's
    content is no number, and one elsewhere (``parameters``) is left to their checks."""
    doc = json.loads(text, parse_float=_infinite_float)
    inputs = doc.get("inputs") if type(doc) is dict else None
    if not any(
        type(t) is dict and _holds_infinite(t.get("data"))
        for t in (inputs if type(inputs) is list else ())
    ):
        return
    body = text if isinstance(text, str) else str(text, "utf-8", "replace")
    at = body.find('"inputs"')
    pos = 0
    for m in _NUMBER.finditer(body, max(at, 0)):
        if any(c in m.group() for c in ".eE") and math.isinf(float(m.group())):
            pos = m.start()
            break
    raise orjson.JSONDecodeError(_INFINITE, body, pos)


def loads(body: bytes | str) -> Any:
    """Decode JSON (:func:`json_loads`); malformed JSON is InvalidInput (400), and
    bytes that are not UTF-8 are named with their offset."""
    try:
        return json_loads(body)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith(_INFINITE):
            raise InvalidInput(_past_fp64(body, exc)) from None
        raise InvalidInput(f"malformed JSON body: {_not_utf8(body) or exc}") from None


#: A refused body of at most this many bytes is read again to name the input whose
#: number is past FP64's range: the standard library's reader with a Python call a
#: number takes ~1 µs a number (~60 ms for 1 MiB of floats), and a larger body's
#: refusal would cost more than its decode would have.
_NAMED_MAX = 1024 * 1024
#: orjson's words for a number past FP64's range (``1e309``, 309 digits or more)
_INFINITE = "number is infinity when parsed as double"
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


class _Infinite:
    """A number of the request's JSON past FP64's range, as :func:`_past_fp64` reads it."""

    __slots__ = ()


def _infinite_float(text: str) -> Any:
    # the standard library's reader makes inf of a float past FP64's range
    value = float(text)
    return _Infinite() if math.isinf(value) else value


def _infinite_int(text: str) -> Any:
    # and keeps an integer past it (309 digits or more), which orjson reads as a float
    return _Infinite() if len(text) > 300 and math.isinf(float(text)) else int(text)


def _past_fp64(body: bytes | str, exc: orjson.JSONDecodeError) -> str:
    """Why a body is refused whose number ``exc`` found past FP64's range: in our
    words, naming the input whose data holds it and its datatype when the body reads
    otherwise (read again by the standard library's reader, only for the refusal, and
    only when it is at most ``_NAMED_MAX`` bytes), else by its line and column."""
    text = body if isinstance(body, str) else str(body, "utf-8", "replace")
    m = _NUMBER.match(text, exc.pos)
    token = m.group() if m else "a number"
    if len(token) > SHOWN_MAX:
        token = token[:SHOWN_MAX] + "..."
    where = (f"the number {token} (line {exc.lineno} column {exc.colno}) is past the "
             "range of a 64-bit float, which JSON numbers are read as")
    if len(text) > _NAMED_MAX:
        return where
    try:
        doc = json.loads(text, parse_float=_infinite_float, parse_int=_infinite_int)
    except (ValueError, RecursionError):
        return where
    inputs = doc.get("inputs") if type(doc) is dict else None
    for t in inputs if type(inputs) is list else ():
        if type(t) is dict and _holds_infinite(t.get("data")):
            name, datatype = t.get("name"), t.get("datatype")
            if type(name) is str and datatype in DTYPES and datatype not in _NOT_NUMBERS:
                return f"input {name!r}: a value is out of range for {datatype} (got {token})"
            break
    return where


_NOT_NUMBERS = frozenset(("BYTES", "BOOL"))


def _holds_infinite(data: Any) -> bool:
    """Whether ``data`` (an input's JSON data, nested lists) holds an :class:`_Infinite`."""
    todo = [data]
    while todo:
        v = todo.pop()
        if type(v) is list:
            todo.extend(v)
        elif type(v) is _Infinite:
            return True
    return False


def _not_utf8(body: bytes | str) -> str | None:
    """Why ``body`` is not JSON text when its bytes are not UTF-8 (the first bad byte
    and its offset), else None. orjson's own words for any such bytes are "str is not
    valid UTF-8: surrogates not allowed" at char 0. Only a refusal pays for it."""
    if isinstance(body, str):
        return None
    try:
        str(body, "utf-8")
    except UnicodeDecodeError as exc:
        return (f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                f"{exc.start}); JSON is UTF-8")
    return None


#: A value echoed in an error message is cut to this many characters (and "...").
SHOWN_MAX = 80
#: An integer token of 19 digits or more (2**63 has 19), not part of a fraction.
_LONG_INT = re.compile(rb"(?<![0-9.eE+-])-?[0-9]{19,}(?![0-9.eE])")


def shown(value: Any, text: bytes | str = b"") -> str:
    """A value of a request's JSON as an error message echoes it: as JSON writes it
    (``null``, ``true``, ``"abc"``, ``[1, null]``, ``{"a": 1}``; ``NaN``,
    ``Infinity`` and ``-Infinity`` as Triton writes them), cut to ``SHOWN_MAX``
    characters and "..." when longer. An integer past 64 bits, which the JSON parser
    read as a float, is shown with the digits the JSON ``text`` holds for it (when
    it holds one such integer of that value). Messages about Python calls keep
    Python's spelling (``repr``): this is for what a JSON client sent."""
    out: list[str] = []
    size = 0
    for piece in _pieces(value, text):
        out.append(piece)
        size += len(piece)
        if size > SHOWN_MAX:
            return "".join(out)[:SHOWN_MAX] + "..."
    return "".join(out)


def _pieces(value: Any, text: bytes | str) -> Any:
    """The JSON text of ``value`` in pieces (so a long one is cut without being
    written whole)."""
    kind = type(value)
    if value is None:
        yield "null"
    elif kind is bool:
        yield "true" if value else "false"
    elif kind is int:
        try:
            yield str(value)
        except ValueError:  # past Python's limit on an integer's digits
            yield f"(an integer of {value.bit_length()} bits)"
    elif kind is float:
        yield _float_text(value, text)
    elif kind is str:
        head = value[: SHOWN_MAX + 1]  # enough to know it is cut
        try:
            yield orjson.dumps(head).decode()
        except orjson.JSONEncodeError:  # a lone surrogate (the stdlib's decoder keeps it)
            yield json.dumps(head)
    elif kind is list:
        yield "["
        for i, v in enumerate(value):
            if i:
                yield ", "
            yield from _pieces(v, text)
        yield "]"
    elif kind is dict:
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            if i:
                yield ", "
            yield from _pieces(k, text)
            yield ": "
            yield from _pieces(v, text)
        yield "}"
    else:  # not a JSON value (a decoded array): as Python shows it
        yield repr(value)


def _float_text(value: float, text: bytes | str) -> str:
    if not math.isfinite(value):
        return "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"
    if value.is_integer() and abs(value) >= 2**63 and text:
        raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
        sent = {m for m in _LONG_INT.findall(raw) if float(m) == value}
        if len(sent) == 1:
            return sent.pop().decode()
    return orjson.dumps(value).decode()


#: JSON's string escaping in C (the standard library's), writing what orjson writes:
#: ``"``, ``\`` and the control characters escaped (``\n`` or ``\u001f``), all else
#: as UTF-8 (checked for every code point but the surrogates).
_json_string = json.encoder.c_encode_basestring or json.encoder.py_encode_basestring


#: Why an integer id is refused past 64 bits: orjson neither reads (it makes it a
#: float) nor writes one, so no answer could echo it.
_ID_BITS = "an integer id must be within 64 bits (-2**63 to 2**64-1): use a string"


def id_type_problem(rid: Any, text: bytes | str) -> str:
    """What is wrong with a request's id that is neither a string nor an integer (nor
    absent), as the refusal of ``'id'`` ends: "must be a string or an integer, got"
    what was sent, or for an integer past 64 bits, which the JSON parser read as a
    float, the bound. The same words over HTTP and on a stream. Only a refusal pays
    for it; not a checkpoint."""
    # -2**63 as a float: an integer just below it, rounded up (the least id itself
    # is read as an int)
    if type(rid) is float and rid.is_integer() and not -(2**63) < rid < 2**64:
        return f"must be a string or an integer; {_ID_BITS}"
    return f"must be a string or an integer, got {shown(rid, text)}"


def id_problem(rid: str | int) -> str | None:
    """Why a request's id (a str or an int) cannot be echoed in a JSON answer, or
    None. An integer past 64 bits or a string with a lone surrogate only comes from
    the standard library's reader (a body with NaN or Infinity, ``loads_request``):
    orjson writes neither, and the answer echoing it failed (a 500 over HTTP; the
    stream's connection ended, the requests in flight on it unanswered). Not a
    checkpoint; an ASCII string costs one ``isascii``."""
    if type(rid) is int:
        if -(2**63) <= rid < 2**64:
            return None
        return _ID_BITS
    if rid.isascii():
        return None
    try:
        rid.encode()
    except UnicodeEncodeError:
        return "an id must be Unicode text: it holds a lone surrogate (\\ud800-\\udfff)"
    return None


def _writable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape (``\\ud800``): orjson
    refuses those, and an error answer must still be written."""
    return text.encode("utf-8", "backslashreplace").decode()


def error_body(message: str) -> bytes:
    """``{"error": message}`` as orjson writes it, byte for byte, in a block of its own
    length. Not a checkpoint.

    orjson writes into a 4 KiB buffer it keeps: under a flood of refusals (429, 503)
    each answer allocated and freed one (``tests/test_http_errors.py``). A message
    with a lone surrogate (no UTF-8) is written with it escaped (``\\ud800``)."""
    try:
        return b'{"error":%b}' % _json_string(message).encode()
    except UnicodeEncodeError:
        return orjson.dumps({"error": _writable(message)})


def error_frame(rid: Any, message: str, status: int, retry_after: int | None = None) -> bytes:
    """A stream's error frame, ``{"id": rid, "error": message, "status": status}``
    (and ``"retry_after"`` when given), as orjson writes it, byte for byte, in a block
    of its own length (see :func:`error_body`). Not a checkpoint.

    An id other than a string or an integer of 64 bits (a bad message's, echoed as
    it came), and a message or id with a lone surrogate, go to orjson; what it
    cannot write (see :func:`id_problem`) is written as ``null`` (the id) or with
    its surrogates escaped (the message), so that the frame is always written."""
    kind = type(rid)
    try:
        if kind is str:
            ident: bytes | None = _json_string(rid).encode()
        elif rid is None:
            ident = b"null"
        elif kind is int and -(2**63) <= rid < 2**64:
            ident = b"%d" % rid
        else:
            ident = None
        text = _json_string(message).encode()
    except UnicodeEncodeError:
        ident = None
    if ident is None:
        doc = {"id": rid, "error": message, "status": status}
        if retry_after is not None:
            doc["retry_after"] = retry_after
        try:
            return orjson.dumps(doc)
        except TypeError:  # what it cannot write (see id_problem): null, the escapes
            doc["error"] = _writable(message)
            try:
                orjson.dumps(rid)
            except TypeError:  # past 64 bits or a lone surrogate, in a bad id too
                doc["id"] = None
            return orjson.dumps(doc)
    if retry_after is None:
        return b'{"id":%b,"error":%b,"status":%d}' % (ident, text, status)
    return b'{"id":%b,"error":%b,"status":%d,"retry_after":%d}' % (
        ident, text, status, retry_after
    )


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
    "error_frame",
    "id_type_problem",
    "json_data",
    "json_loads",
    "loads",
    "shown",
]
