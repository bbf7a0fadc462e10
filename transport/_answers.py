"""HTTP answers as values: the :data:`Answer` triple and its common headers, and the
error answer of an exception (:func:`error_answer`: its status, a JSON body, and
Retry-After on a 429 or 503, the body written once per message under a flood)."""

from __future__ import annotations

import math

from trioserve import Overloaded, TrioserveError

from ._v2 import error_body

JSON = (b"content-type", b"application/json")
OCTETS = (b"content-type", b"application/octet-stream")

Headers = list[tuple[bytes, bytes]]
#: An HTTP answer: (status, headers without content-length, body).
Answer = tuple[int, Headers, bytes]


WWW_AUTHENTICATE = (b"www-authenticate", b'Bearer realm="trioserve"')
#: The content codings a request body may come in (RFC 9110 §8.4.1).
ACCEPT_ENCODING = (b"accept-encoding", b"gzip, deflate")

#: The longest Retry-After sent, in seconds (a day): a refill slower than that (a tiny
#: ``credit_rate``; an infinite wait) is told to come back then, not in 10**300 s,
#: which neither a header parser nor a stream frame's 64-bit integer would take.
RETRY_AFTER_MAX = 86_400


def retry_after_seconds(retry_after: float) -> int:
    """``retry_after`` as HTTP's Retry-After (RFC 9110 §10.2.3): whole seconds,
    rounded up, at least 1 and at most :data:`RETRY_AFTER_MAX` (also for inf or NaN)."""
    if not retry_after <= RETRY_AFTER_MAX:  # inf and NaN too
        return RETRY_AFTER_MAX
    return max(1, math.ceil(retry_after))


#: The bodies of the last refusals (429, 503) by message, at most ``REFUSAL_BODIES``.
_refusal_bodies: dict[str, bytes] = {}
REFUSAL_BODIES = 64


def _refusal_body(message: str) -> bytes:
    """A 429's or 503's body, written once per message: under a flood the same few
    messages repeat (a full queue, a tenant's share), and each answer wrote its own.
    Messages that vary (a wait in ms) fill the table, which then starts over, so it
    holds at most ``REFUSAL_BODIES``. Not a checkpoint."""
    body = _refusal_bodies.get(message)
    if body is None:
        body = error_body(message)
        if len(_refusal_bodies) >= REFUSAL_BODIES:
            _refusal_bodies.clear()
        _refusal_bodies[message] = body
    return body


def retry_after_of(exc: TrioserveError) -> int:
    """A 429's or 503's Retry-After in whole seconds (:func:`retry_after_seconds`):
    Overloaded's ``retry_after``, 1 s for any other refusal."""
    return retry_after_seconds(exc.retry_after if isinstance(exc, Overloaded) else 1.0)


def error_answer(exc: BaseException) -> Answer:
    """The JSON error answer of an exception: its ``status`` (500 for foreign ones),
    ``{"error": message}`` and, with 429 and 503, a Retry-After header (whole seconds,
    from Overloaded's ``retry_after``, 1 to a day); with 401, WWW-Authenticate (a
    bearer key)."""
    if isinstance(exc, TrioserveError):
        headers = [JSON]
        if exc.status == 401:  # RFC 9110 §15.5.2: how to authenticate
            headers.append(WWW_AUTHENTICATE)
        elif exc.status == 415:  # RFC 9110 §15.5.16: the codings it takes
            headers.append(ACCEPT_ENCODING)
        elif exc.status in (429, 503):
            headers.append((b"retry-after", b"%d" % retry_after_of(exc)))
            return exc.status, headers, _refusal_body(str(exc))
        return exc.status, headers, error_body(str(exc))
    return 500, [JSON], error_body(f"internal error: {type(exc).__name__}: {exc}")
