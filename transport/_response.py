"""A v2 infer response: encoded by the server from a request's items' outputs (as JSON
data or binary data, and the classification extension's top classes), and read back
by a client (:func:`decode_outputs`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from trioserve import InvalidInput, ModelError, TensorSpec
from trioserve._model import described

from ._request import InferRequest
from ._signature import ModelSignature
from ._tensors import _from_binary
from ._v2 import _LEN, DTYPES, datatype_of, dumps, json_data

_NOTHING_DECLARED: Mapping[str, TensorSpec] = {}


def encode_response(
    request: InferRequest,
    results: list[Mapping[str, Any]],
    signature: ModelSignature,
    *,
    binary: bool = True,
    answered: Sequence[str] = (),
) -> tuple[bytes, int | None]:
    """The v2 response for ``request``'s items' ``results``: (body, JSON header length
    when binary output data follows the JSON, else None). With ``binary`` False every
    output is sent as JSON data, whatever the request asked (WebSocket text frames).
    An empty id is left out over HTTP, as Triton leaves it out; on the stream (``binary``
    False) it is echoed, since the id tags the answer.
    ``answered``: the versions an unversioned request's items were routed to (a
    model with a rollout): the answer names the one version that answered them, and
    no version when several did (the field is optional in the v2 protocol)."""
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
    doc: dict[str, Any] = {"model_name": request.model}
    if request.version is not None:
        doc["model_version"] = request.version
    elif answered:
        if len(set(answered)) == 1:
            doc["model_version"] = answered[0]
    else:
        doc["model_version"] = signature.versions[-1]
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
    if arr.dtype.kind == "b":
        arr = arr.view(np.uint8)  # std::to_string(true) is "1"
    rows = arr.reshape(arr.shape[0] if stacked else 1, -1)
    width = rows.shape[1]
    n = min(count, width)
    fmt = "{:f}:{}" if arr.dtype.kind == "f" else "{}:{}"
    out = np.empty((rows.shape[0], n), dtype=object)
    for r, row in enumerate(rows):
        if arr.dtype.kind == "f":
            # a stable sort of the negated values: ties keep the lower index first
            order = np.argsort(-row, kind="stable")[:n]
        else:
            # integers compared as they are (as float64, 2**53 + 1 was 2**53, and an
            # unsigned value cannot be negated): a stable sort of the row reversed,
            # read backwards, is highest first with the lower index first among equals
            order = (width - 1 - np.argsort(row[::-1], kind="stable"))[::-1][:n]
        values = row[order].tolist()
        out[r] = [fmt.format(v, int(i)) for v, i in zip(values, order, strict=True)]
    return out if stacked else out[0]


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


__all__ = [
    "decode_outputs",
    "encode_response",
]
