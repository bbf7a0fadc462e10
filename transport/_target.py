"""The request target (RFC 9112 §3.2) as the HTTP front end reads it before routing.

Sans-IO. Paths are not normalised (Triton does not either): a path is split at its
``/`` before its segments are decoded, and a segment that is empty (``//``, a trailing
``/``), ``.``, ``..`` or holds an encoded ``/`` (``%2F``) names no endpoint, 404, on
the data plane and the control plane alike. ``OPTIONS *`` is answered here; the
absolute-form (``http://host/path``, which a server must accept) is read as its path.
"""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

from ._answers import JSON, Answer
from ._v2 import error_body

#: The longest request target (path and query) taken; a longer one is 414.
MAX_TARGET = 8 * 1024
#: The methods some endpoint of this server takes (``OPTIONS *``'s ``Allow``).
SERVER_METHODS = b"GET, HEAD, OPTIONS, POST"


def unusual(target: bytes) -> bool:
    """Whether ``target`` needs :func:`check_target`: a few ``in`` tests, so the usual
    target (``/v2/models/mlp/infer``) costs next to nothing."""
    return (
        target[:1] != b"/" or b"//" in target or b"/." in target or b"%" in target
        or len(target) > MAX_TARGET
    )


def check_target(method: bytes, target: bytes) -> tuple[bytes, Answer | None]:
    """``target`` in origin-form (``/path?query``), and the answer when it is to be
    answered here: 204 for ``OPTIONS *``, 400 for ``*`` with another method or a
    target of no known form, 414 past :data:`MAX_TARGET`, 404 for a path that names
    nothing (see the module's docstring); None when it is to be routed."""
    if target == b"*":
        if method == b"OPTIONS":
            return target, (204, [(b"allow", SERVER_METHODS)], b"")
        return target, _error(400, "bad request target: '*' is for OPTIONS only")
    if len(target) > MAX_TARGET:
        return target, _error(
            414, f"request target too long: over {MAX_TARGET} bytes (path and query)"
        )
    if target[:1] != b"/":
        scheme, sep, rest = target.partition(b"://")
        if not sep or scheme.lower() not in (b"http", b"https"):
            shown = target[:100].decode("latin-1")
            return target, _error(
                400, f"bad request target {shown!r}: expected a path ('/...'), '*' "
                "or an absolute URL"
            )
        # RFC 9112 3.2.2: the absolute-form is to be accepted; its host is not checked
        # (one server, one port)
        cut = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=-1)
        tail = rest[cut:] if cut >= 0 else b""
        target = tail if tail[:1] == b"/" else b"/" + tail
    path = target.partition(b"?")[0]
    for segment in path.split(b"/")[1:] if path != b"/" else ():
        if b"%" in segment:
            segment = unquote_to_bytes(segment)
        if not segment or segment == b"." or segment == b".." or b"/" in segment:
            shown = path.decode("latin-1")
            return target, _error(
                404, f"no such endpoint: {method.decode('latin-1')} {shown} (paths are "
                "not normalised: an empty segment, '.', '..' or an encoded '/' names "
                "nothing)"
            )
    return target, None


def _error(status: int, message: str) -> Answer:
    return status, [JSON], error_body(message)
