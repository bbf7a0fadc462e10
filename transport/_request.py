"""A v2 infer request: decoded and validated by the server into an
:class:`InferRequest` (its tensors, the outputs asked for, its class and timeout from
``parameters``), and built by a client (:func:`encode_inputs`, :func:`sample_inputs`).

Sans-IO: bytes and dicts in, values out. :meth:`InferRequest.from_v2_json` validates a
request against the model's signature and splits a leading batch dimension into items
for the batcher; :func:`encode_response` (``._response``) stacks the items' outputs back.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
from trioserve import InvalidInput, TensorSpec

from ._request_json import loads_request
from ._signature import ModelSignature
from ._tensors import _decode_tensor, _may_hold_bool, _no_shared_memory
from ._v2 import DTYPES, datatype_of, id_problem, id_type_problem, json_data, shown

#: The most classes an output may be asked for (the classification extension).
MAX_CLASSES = 65_536


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
        # The binary part: None without Inference-Header-Content-Length (and on the
        # stream), which is not the same as a header that ends the body at the JSON:
        # that one holds tensors of 0 bytes (tritonclient sends an empty tensor so).
        binary: memoryview | None = None
        if doc is None:
            if header_length is not None:
                if not 0 <= header_length <= len(body):
                    raise InvalidInput(
                        f"Inference-Header-Content-Length {header_length} is outside the "
                        f"body ({len(body)} bytes)"
                    )
                body, binary = body[:header_length], memoryview(body)[header_length:]
                doc = loads_request(body)
            else:
                try:
                    doc = loads_request(body)
                except InvalidInput as exc:
                    raise _binary_without_header(exc, body) from None
        # Whether the JSON may hold a boolean among numbers: scanned for only once an
        # input's data is JSON values (a binary or a simdjson-decoded input needs no scan)
        bools: bool | None = None if body else True
        if type(doc) is not dict:
            raise InvalidInput("the request body must be a JSON object with 'inputs'")
        tensors = doc.get("inputs")
        if type(tensors) is not list or not tensors:
            raise InvalidInput(_no_inputs(doc, tensors))
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
                t, signature, binary, offset, True if bools is None else bools, body
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
        if binary is not None and offset != len(binary):
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
                    "parameters.binary_data_output must be true or false, "
                    f"got {shown(binary_all, body)}"
                )
            priority, timeout = _classify(params, classes, body)
            _check_sequence(params, body)
        else:
            binary_all, priority, timeout = False, None, None
        outputs = None
        requested = doc.get("outputs")
        if requested is not None and requested != []:  # none named: all (as Triton)
            outputs = _requested_outputs(requested, signature, binary_all, body)
        rid = doc.get("id")
        if rid is not None:
            if type(rid) not in (str, int):
                raise InvalidInput(f"'id' {id_type_problem(rid, body)}")
            why = id_problem(rid)
            if why is not None:
                raise InvalidInput(f"'id': {why}")
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


def _batch_text(n: int) -> str:
    return "no batch dimension" if n == -1 else f"batch of {n}"


def _requested_outputs(
    requested: Any, signature: ModelSignature, binary_all: bool, text: bytes | str = b""
) -> tuple[tuple[str, bool, int], ...]:
    """The outputs asked for; ``text`` is the request's JSON (for messages)."""
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
                    f"got {shown(binary, text)}"
                )
            classes = params.get("classification", 0)
            if type(classes) is not int or not 0 <= classes <= MAX_CLASSES:
                raise InvalidInput(
                    f"output {name!r}: parameters.classification must be a count of "
                    f"classes, 1 to {MAX_CLASSES}, got {shown(classes, text)}"
                )
        out.append((name, binary, classes))
    return tuple(out)


def _classify(
    params: dict[str, Any], classes: Sequence[str] | None = None, text: bytes | str = b""
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
    ``text`` is the request's JSON, for the messages.
    """
    priority = sent = params.get("priority")
    if priority is not None:
        if type(priority) is int and priority >= 0:
            priority = str(priority)
        elif type(priority) is not str or not priority:
            raise InvalidInput(
                "parameters.priority must be a class name or a level >= 0, "
                f"got {shown(priority, text)}"
            )
    cls = params.get("class")
    if cls is not None:
        if type(cls) is not str or not cls:
            raise InvalidInput(
                f"parameters.class must be a class name, got {shown(cls, text)}"
            )
        if priority is not None and priority != cls:
            named = _class_of_level(priority, classes)
            if named is not None and named != cls:
                raise InvalidInput(
                    f"parameters.class {shown(cls)} and parameters.priority {shown(sent)}"
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
            if (key == "timeout" and kind is float and math.isfinite(v) and v > 0
                    and not v.is_integer()):
                # Triton's timeout is an unsigned integer of µs: it refuses 1.5 (400).
                raise InvalidInput(
                    "parameters.timeout must be a whole number of microseconds, "
                    f"got {shown(v, text)}"
                )
            if v > 0:
                try:
                    timeout = v * scale
                except OverflowError:  # an int past a float's range (the stdlib decoder's)
                    timeout = math.inf
                if math.isfinite(timeout):
                    break
        raise InvalidInput(
            f"parameters.{key} must be a positive number, got {shown(v, text)}"
        )
    return priority, timeout


def _check_sequence(params: dict[str, Any], text: bytes | str = b"") -> None:
    """Refuse a malformed ``sequence_id`` (Triton: an unsigned 64-bit integer or a
    string), ``sequence_start`` or ``sequence_end`` (booleans), as Triton does (400)
    whatever the model. Well-formed, they are ignored: no model here has a sequence
    batcher."""
    v = params.get("sequence_id")
    if v is not None and type(v) is not str and not (type(v) is int and 0 <= v < 2**64):
        raise InvalidInput(
            "parameters.sequence_id must be an unsigned 64-bit integer or a string, "
            f"got {shown(v, text)}"
        )
    for key in ("sequence_start", "sequence_end"):
        v = params.get(key)
        if v is not None and type(v) is not bool:
            raise InvalidInput(f"parameters.{key} must be true or false, got {shown(v, text)}")


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
            # each datatype's own kind: BOOL's false, an integer's 0 (a float among
            # them is refused)
            data = (
                [round(float(v), 3) for v in data] if data.dtype.kind == "f" else data.tolist()
            )
        tensors.append(
            {"name": spec.name, "shape": shape, "datatype": spec.datatype, "data": data}
        )
    return tensors



def _binary_without_header(exc: InvalidInput, body: bytes | str) -> InvalidInput:
    """``exc`` (the body is not JSON), with a hint when the body looks like a JSON
    header followed by binary tensor data sent without the header that says where
    the JSON ends (tritonclient sends it; a hand-made client may forget it)."""
    if isinstance(body, (bytes, bytearray)) and b'"binary_data_size"' in body[:65536]:
        return InvalidInput(
            f"{exc}; a body with binary tensor data (binary_data_size) needs the "
            "Inference-Header-Content-Length header: the length of its JSON part"
        )
    return exc

__all__ = [
    "MAX_CLASSES",
    "InferRequest",
    "encode_inputs",
    "sample_inputs",
]


def _no_inputs(doc: dict[str, Any], tensors: Any) -> str:
    """Why a request has no input tensors: 'inputs' missing (naming the keys that were
    sent, and the near miss, as 'input'), of another type, or empty."""
    base = "'inputs' must be a non-empty list of tensors"
    if "inputs" in doc:
        got = "an empty list" if tensors == [] else _kind_of(tensors)
        return f"{base}, got {got}"
    sent = [k for k in doc if isinstance(k, str)]
    close = difflib.get_close_matches("inputs", sent, n=1, cutoff=0.7)
    hint = f"; did you mean 'inputs' for {close[0]!r}?" if close else ""
    keys = ", ".join(map(repr, sent[:8])) or "none"
    return f"{base}: the request has no 'inputs' (its keys: {keys}){hint}"


def _kind_of(v: Any) -> str:
    return "null" if v is None else f"a JSON {_JSON_TYPES.get(type(v), type(v).__name__)}"


_JSON_TYPES = {dict: "object", str: "string", int: "number", float: "number", bool: "boolean"}
