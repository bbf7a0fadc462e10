"""The body of a control-plane request (a repository index, load or unload, a
rollout's action), decoded from its Content-Encoding as an infer body is."""

from __future__ import annotations

from quart import request
from trioserve import TrioserveError

from ._answers import Answer, error_answer
from ._inflate import decode_body


class BodyRefused(Exception):
    """The body cannot be read: its answer (415 for a coding the server does not
    decode, 413 over ``server.max_body_bytes`` once decompressed, 400 for corrupt
    data), which the app's error handler sends."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer)
        self.answer = answer


async def control_body(limit: int) -> bytes:
    """The current request's body, decoded from its ``Content-Encoding`` (gzip,
    deflate, identity, or a list of them), at most ``limit`` bytes once decoded.

    The coding was ignored: a compressed body was parsed as JSON and refused as
    "invalid JSON" (not UTF-8), and one in a coding no one decodes was read as if
    plain. A checkpoint (it reads the body). Raises BodyRefused.
    """
    body = await request.get_data(cache=False)
    coding = request.headers.get("Content-Encoding")
    if coding is None:
        return body
    try:
        return await decode_body(body, coding, limit)
    except TrioserveError as exc:
        raise BodyRefused(error_answer(exc)) from None
