"""A request body's Content-Encoding: :func:`decode_body` inflates gzip or deflate in
steps, checkpointing between them, within the body size limit (413 past it, 415 for a
coding it does not take)."""

from __future__ import annotations

import zlib

import trio
from trioserve import InvalidInput, TrioserveError


class UnsupportedEncoding(TrioserveError):
    """The request body's Content-Encoding is not one the server decodes."""

    status = 415


class BodyTooLarge(TrioserveError):
    """The request body is over the size limit once decompressed."""

    status = 413


#: Output one step of a request body's inflate produces: the size limit is checked
#: after each step, and the loop checkpoints between steps. A 16 MiB inflate takes
#: ~50 ms here (48 ms for a JSON body of floats compressed to 7.3 MiB, 53 ms for
#: 16 MiB of spaces in 16 KiB): in one call it stalled every other connection that
#: long; a step of 256 KiB takes ~0.3-0.5 ms. (A worker thread was tried: with the loop
#: busy the two contend for the GIL, and the loop's longest stall was 5-25 ms.)
INFLATE_STEP = 256 * 1024
_checkpoint = trio.lowlevel.checkpoint


async def decode_body(body: bytes, coding: bytes | str, limit: int) -> bytes:
    """``body`` decoded from its Content-Encoding ``coding`` (gzip, x-gzip, deflate,
    identity, or a list of them in the order applied), at most ``limit`` bytes of it:
    BodyTooLarge as soon as the output passes it (a small body may inflate a
    thousandfold), UnsupportedEncoding for another coding, InvalidInput for corrupt data.

    Inflates in steps of :data:`INFLATE_STEP` bytes of output with a checkpoint
    between them, so only a body that inflates past one step is a checkpoint.
    Cancelling it abandons the inflate.
    """
    if isinstance(coding, bytes):
        coding = coding.decode("latin-1")
    for c in reversed([c.strip().lower() for c in coding.split(",") if c.strip()]):
        if c == "identity":
            continue
        if c in ("gzip", "x-gzip"):
            body = await _inflate(body, 31, c, limit)
        elif c == "deflate":
            try:  # RFC 9110's deflate is zlib-wrapped; some clients send it raw
                body = await _inflate(body, 15, c, limit)
            except InvalidInput:
                body = await _inflate(body, -15, c, limit)
        else:
            raise UnsupportedEncoding(
                f"Content-Encoding {c!r} is not supported; send gzip, deflate or identity"
            )
    return body


async def _inflate(body: bytes, wbits: int, coding: str, limit: int) -> bytes:
    inflater = _Inflater(body, wbits, coding, limit)
    while not inflater.step():
        await _checkpoint()
    return inflater.result()


class _Inflater:
    """One body's inflate, a step of at most :data:`INFLATE_STEP` bytes of output at a
    time, the size limit checked after each (never more than ``limit + 1`` bytes held)."""

    __slots__ = ("_coding", "_d", "_input", "_limit", "_out", "_size")

    def __init__(self, body: bytes, wbits: int, coding: str, limit: int) -> None:
        self._d = zlib.decompressobj(wbits)
        self._input = body
        self._coding = coding
        self._limit = limit
        self._out: list[bytes] = []
        self._size = 0

    def step(self) -> bool:
        """Inflate the next step; returns whether the inflate is over. Raises
        BodyTooLarge or InvalidInput."""
        d = self._d
        step = min(INFLATE_STEP, self._limit + 1 - self._size)
        try:
            part = d.decompress(self._input, step)
        except zlib.error as exc:
            raise InvalidInput(f"the body is not valid {self._coding} data: {exc}") from None
        self._out.append(part)
        self._size += len(part)
        if self._size > self._limit:
            raise BodyTooLarge(f"request body over {self._limit} bytes once decompressed")
        self._input = d.unconsumed_tail
        # output short of the step with no input left: nothing is pending in zlib
        return d.eof or (not self._input and len(part) < step)

    def result(self) -> bytes:
        d = self._d
        if not d.eof or d.unused_data:
            raise InvalidInput(
                f"the body is not valid {self._coding} data: it ends early or late"
            )
        return self._out[0] if len(self._out) == 1 else b"".join(self._out)
