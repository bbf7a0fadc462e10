"""The result cache's key: (namespace, model, version, digest of what changes the output).

Sans-IO. The digest is a canonical blake2b hash (16 bytes) of the inputs and of the
parameters that change the output: equal values give equal keys whatever their memory
layout or byte order, and values of different types, dtypes or shapes never collide by
construction (every item is tagged and length-prefixed before it is hashed).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

#: The namespace of entries any tenant may receive (models marked shareable). Tenant
#: names are non-empty (the config refuses ""), so it never equals a tenant's namespace.
SHARED_NAMESPACE = ""

_pack_len = struct.Struct("<Q").pack


class CacheKey(NamedTuple):
    """A cache key. A tuple, not an attrs class: it is hashed and compared on every
    lookup, and a tuple of interned strings and bytes does both in C."""

    namespace: str
    model: str
    version: str
    #: The canonical digest (``cache_key``); for a raw key (``Cache.raw_key``), a
    #: tagged tuple of the body or its digest.
    digest: bytes | tuple[str, bytes]


def namespace_for(tenant: str, *, shareable: bool) -> str:
    """The namespace a tenant's request is cached under: its own unless the model's
    results may be shared between tenants."""
    return SHARED_NAMESPACE if shareable else tenant


def cache_key(
    model: str,
    version: str,
    namespace: str,
    inputs: Any,
    params: Mapping[str, Any] | None = None,
) -> CacheKey:
    """The key of one request's result.

    ``inputs`` is an array, a string, bytes, a number, or a mapping / sequence of those
    (typically ``{input name: numpy array}``); ``params`` are the request parameters that
    change the output (the caller leaves out those that do not, e.g. a priority). No
    params and empty params give the same key. Raises TypeError for a value it cannot
    hash canonically (a mapping with non-string keys, an arbitrary object).
    """
    h = hashlib.blake2b(digest_size=16)
    _feed(h, inputs)
    h.update(b"\x00params")
    _feed(h, params if params else {})
    return CacheKey(namespace, model, str(version), h.digest())


def _feed(h: Any, obj: Any) -> None:
    """Hash one value with its type tag and length, recursively."""
    if isinstance(obj, np.ndarray | np.generic):
        _feed_array(h, np.asarray(obj))
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        h.update(b"s" + _pack_len(len(data)))
        h.update(data)
    elif isinstance(obj, bytes | bytearray | memoryview):
        data = bytes(obj)
        h.update(b"b" + _pack_len(len(data)))
        h.update(data)
    elif isinstance(obj, bool):  # before int: bool is an int
        h.update(b"?1" if obj else b"?0")
    elif isinstance(obj, int):
        h.update(b"i" + str(obj).encode() + b";")
    elif isinstance(obj, float):
        h.update(b"f" + obj.hex().encode() + b";")
    elif obj is None:
        h.update(b"N")
    elif isinstance(obj, Mapping):
        items = list(obj.items())
        if not all(isinstance(k, str) for k, _ in items):
            raise TypeError(
                f"cache key: mapping keys must be strings, got "
                f"{sorted({type(k).__name__ for k, _ in items})}"
            )
        h.update(b"{" + _pack_len(len(items)))
        for k, v in sorted(items, key=lambda kv: kv[0]):
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, list | tuple):
        h.update(b"[" + _pack_len(len(obj)))
        for v in obj:
            _feed(h, v)
    else:
        raise TypeError(
            f"cache key: cannot hash a {type(obj).__name__} canonically; expected an array, "
            "str, bytes, number, None, or a dict / list of those"
        )


def _feed_array(h: Any, a: np.ndarray) -> None:
    dt = a.dtype
    header = b"A" + _pack_len(a.ndim) + b"".join(_pack_len(n) for n in a.shape)
    if dt.kind == "O":  # BYTES tensors: hash the elements, not the pointers
        h.update(header + b"O")
        for v in a.ravel(order="C").tolist():
            if isinstance(v, str):
                # A BYTES element is bytes: v2 JSON gives it as a string, the binary
                # extension as bytes, for the same tensor. A string is hashed as its
                # UTF-8 bytes; one with a lone surrogate has no UTF-8 form (no body
                # can carry it) and keeps the string tag, so it equals no bytes.
                try:
                    v = v.encode("utf-8")
                except UnicodeEncodeError:
                    pass
            _feed(h, v)
        return
    if dt.byteorder == ">" or (dt.byteorder == "=" and not _LITTLE):
        dt = dt.newbyteorder("<")
        a = a.astype(dt)
    # Structured dtypes print as '|V<n>' in .str: name their fields instead.
    name = repr(dt.descr) if dt.fields else dt.str
    h.update(header + b"d" + name.encode() + b";")
    h.update(a.tobytes(order="C"))  # C order whatever the layout: equal values, equal bytes


_LITTLE = np.little_endian
